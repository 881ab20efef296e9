"""The enrollment authority (protocol 1.3/1.4): the operator's Ed25519 key that certifies devices'
long-term identity keys.  It is kept apart from the aggregation server, which only ever holds the
authority's public key (``enrollment.authority_key``) and the certificates devices present.

Invariants:
- The authority key is generated from the OS CSPRNG and stored in a file of its own (mode 0600,
  written atomically, never overwritten); nothing in the server reads that file.
- A certificate names the batch it was issued under (the credential source the server rate-limits and
  caps per round): the first 8 serial bytes, SHA-256 of the batch name, signed with the rest.
- Every certificate `EnrollmentAuthority.issue` writes has a validity period (certificate format 2).
- A revocation list is cumulative and numbered: each `EnrollmentAuthority.revoke` re-signs the previous
  list's keys plus the new ones under the next number; verifiers never accept a lower number than the
  list they hold.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Sequence
from pathlib import Path

from protocol.atomic import write_atomic
from protocol.errors import ConfigError, CryptoError, RevocationListInvalid
from protocol.identity import (
    BATCH_BYTES,
    RevocationList,
    SigningKey,
    issue_certificate,
    issue_revocation_list,
    verify_revocation_list,
)
from protocol.spec import DEFAULT_VALID_DAYS

__all__ = [
    "EnrollmentAuthority",
    "batch_id",
    "BATCH_NAME",
    "DEFAULT_VALID_DAYS",
    "MAX_VALID_DAYS",
    "load_revocation_list",
    "read_revocation_list",
    "write_revocation_list",
]

#: The longest validity period it accepts (days, 10 years).
MAX_VALID_DAYS = 3653

_KEY_FILE_HEADER = "fedrec-enrollment-authority-v1"
#: What a certificate batch may be called.
BATCH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def batch_id(name: str) -> bytes:
    """The 8-byte batch id a certificate carries for the batch called ``name``.

    Raises
    ------
    ConfigError
        ``name`` is not 1-64 characters of ``[A-Za-z0-9._-]``.
    """
    if not isinstance(name, str) or BATCH_NAME.fullmatch(name) is None:
        raise ConfigError(f"a certificate batch name is 1-64 characters of [A-Za-z0-9._-], got {name!r}")
    return hashlib.sha256(b"fedrec/enrollment/batch/" + name.encode("ascii")).digest()[:BATCH_BYTES]


class EnrollmentAuthority:
    """The operator's enrollment authority (CA).

    Parameters
    ----------
    key : SigningKey
        The authority's Ed25519 key.
    """

    def __init__(self, key: SigningKey) -> None:
        self.key = key

    @classmethod
    def generate(cls) -> EnrollmentAuthority:
        """A new authority with a key from the OS CSPRNG."""
        return cls(SigningKey.generate())

    @property
    def public_key(self) -> bytes:
        """The 32-byte public key devices pin and the server's ``enrollment.authority_key`` holds (as hex)."""
        return self.key.public_key

    def issue(
        self,
        device_public_key: bytes,
        batch: str = "default",
        *,
        valid_days: float = DEFAULT_VALID_DAYS,
        not_before: float | None = None,
        device_id: int | None = None,
    ) -> bytes:
        """Certify a device's 32-byte Ed25519 public key under the batch called ``batch``, valid from
        ``not_before`` (Unix seconds, default now) for ``valid_days`` days (certificate format 2), and with
        ``device_id`` for that device id only (format 3, protocol 1.8: the server registers the device
        under it; ids >= 1).

        Raises
        ------
        CryptoError
            The public key is not 32 bytes.
        ConfigError
            A malformed batch name, a validity period outside (0, `MAX_VALID_DAYS`] days, or a bad start.
        """
        if (
            isinstance(valid_days, bool)
            or not isinstance(valid_days, int | float)
            or not 0 < valid_days <= MAX_VALID_DAYS
        ):
            raise ConfigError(f"valid_days must be a number of days in (0, {MAX_VALID_DAYS}], got {valid_days!r}")
        start = time.time() if not_before is None else not_before
        if isinstance(start, bool) or not isinstance(start, int | float) or not 0 <= start < 1 << 40:
            raise ConfigError(f"not_before must be Unix seconds, got {not_before!r}")
        first = math.floor(start)
        if device_id is not None and (isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 1):
            raise ConfigError(f"a certificate's device id must be an integer >= 1, got {device_id!r}")
        return issue_certificate(
            self.key,
            device_public_key,
            batch=batch_id(batch),
            not_before=first,
            not_after=first + math.ceil(valid_days * 86400),
            device_id=device_id,
        )

    def revoke(self, previous: bytes | None, device_keys: Sequence[bytes], now: float | None = None) -> bytes:
        """The next revocation list: ``previous``'s device keys (checked against this authority) plus
        ``device_keys``, numbered one above ``previous`` (1 without one).

        Raises
        ------
        RevocationListInvalid
            ``previous`` is not a list of this authority.
        CryptoError
            A device key that is not 32 bytes.
        """
        old = verify_revocation_list(previous, self.public_key) if previous is not None else None
        keys = set(old.device_keys) if old is not None else set()
        keys.update(device_keys)
        number = old.number + 1 if old is not None else 1
        return issue_revocation_list(self.key, number, math.floor(time.time() if now is None else now), sorted(keys))

    def save(self, path: Path) -> None:
        """Write the key file (mode 0600; refuses to replace an existing file).

        Raises
        ------
        ConfigError
            The file exists or cannot be written.
        """
        path = Path(path)
        if path.exists():
            raise ConfigError(f"{path} exists; an enrollment authority key is never overwritten")
        text = f"{_KEY_FILE_HEADER}\n{self.key.private_bytes().hex()}\n".encode("ascii")
        try:
            write_atomic(path, text, mode=0o600)
        except OSError as exc:
            raise ConfigError(f"cannot write {path}: {exc}") from exc

    @classmethod
    def load(cls, path: Path) -> EnrollmentAuthority:
        """Read a key file written by `save`.

        Raises
        ------
        ConfigError
            Unreadable, or not an enrollment authority key file.
        """
        path = Path(path)
        try:
            lines = path.read_text(encoding="ascii").split()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the enrollment authority key {path}: {exc}") from exc
        if len(lines) != 2 or lines[0] != _KEY_FILE_HEADER:
            raise ConfigError(f"{path} is not a fedrec enrollment authority key file")
        try:
            return cls(SigningKey.from_private_bytes(bytes.fromhex(lines[1])))
        except (ValueError, CryptoError) as exc:
            raise ConfigError(f"{path} holds a malformed enrollment authority key: {exc}") from exc


def read_revocation_list(path: Path, authority_public_key: bytes) -> RevocationList:
    """Read and check a revocation list file (`write_revocation_list`).

    Raises
    ------
    RevocationListInvalid
        Unreadable, malformed, or not signed by the authority (the message names which).
    """
    return load_revocation_list(path, authority_public_key)[0]


def load_revocation_list(
    path: Path, authority_public_key: bytes, *, interruptible: bool = False
) -> tuple[RevocationList, bytes]:
    """`read_revocation_list`, also returning the signed bytes it checked (one read: what a server relays
    to devices is exactly the list it enforces).  ``interruptible`` as `protocol.identity.verify_revocation_list`.

    Raises
    ------
    RevocationListInvalid
        As `read_revocation_list`.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RevocationListInvalid(f"cannot read the revocation list {path}: {exc}") from exc
    try:
        return verify_revocation_list(data, authority_public_key, interruptible=interruptible), data
    except RevocationListInvalid as exc:
        raise RevocationListInvalid(f"{path}: {exc}") from None


def write_revocation_list(path: Path, data: bytes) -> None:
    """Replace the revocation list file atomically (readers see the old list or the new one, never part).

    Raises
    ------
    ConfigError
        The file cannot be written.
    """
    try:
        write_atomic(Path(path), data)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc}") from exc
