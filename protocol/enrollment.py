"""The enrollment authority (protocol 1.3/1.4): the operator's Ed25519 key that certifies devices'
long-term identity keys.  It is kept apart from the aggregation server, which only ever holds the
authority's public key (``enrollment.authority_key``) and the certificates devices present.

Invariants:
- The authority key is generated from the OS CSPRNG and stored in a file of its own (mode 0600,
  written atomically, never overwritten); nothing in the server reads that file.
- A certificate names the batch it was issued under (the credential source the server rate-limits and
  caps per round): the first 8 serial bytes, SHA-256 of the batch name, signed with the rest.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from protocol import crypto
from protocol.atomic import write_atomic
from protocol.errors import ConfigError, CryptoError

__all__ = ["EnrollmentAuthority", "batch_id", "BATCH_NAME"]

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
    return hashlib.sha256(b"fedrec/enrollment/batch/" + name.encode("ascii")).digest()[: crypto.BATCH_BYTES]


class EnrollmentAuthority:
    """The operator's enrollment authority (CA).

    Parameters
    ----------
    key : SigningKey
        The authority's Ed25519 key.
    """

    def __init__(self, key: crypto.SigningKey) -> None:
        self.key = key

    @classmethod
    def generate(cls) -> EnrollmentAuthority:
        """A new authority with a key from the OS CSPRNG."""
        return cls(crypto.SigningKey.generate())

    @property
    def public_key(self) -> bytes:
        """The 32-byte public key devices pin and the server's ``enrollment.authority_key`` holds (as hex)."""
        return self.key.public_key

    def issue(self, device_public_key: bytes, batch: str = "default") -> bytes:
        """Certify a device's 32-byte Ed25519 public key under the batch called ``batch``.

        Raises
        ------
        CryptoError
            The public key is not 32 bytes.
        ConfigError
            A malformed batch name.
        """
        return crypto.issue_certificate(self.key, device_public_key, batch=batch_id(batch))

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
        old = os.umask(0o077)
        try:
            write_atomic(path, text)
        except OSError as exc:
            raise ConfigError(f"cannot write {path}: {exc}") from exc
        finally:
            os.umask(old)
        os.chmod(path, 0o600)

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
            return cls(crypto.SigningKey.from_private_bytes(bytes.fromhex(lines[1])))
        except (ValueError, CryptoError) as exc:
            raise ConfigError(f"{path} holds a malformed enrollment authority key: {exc}") from exc
