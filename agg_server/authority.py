"""The operator's enrollment authority tool (``fedrec enroll-ca``): create it, certify devices, revoke them.

It runs on the operator's machine: the authority key file it creates and signs with never goes to the
aggregation server, whose configuration holds only the public key (``enrollment.authority_key``).  It
lives beside the server's command line as operator tooling; the server itself never imports it.  The
``fedrec`` command line adds it as its ``enroll-ca`` sub-command and turns its `ConfigError` into one line
on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, TextIO

from protocol.errors import ConfigError
from protocol.spec import DEFAULT_VALID_DAYS

__all__ = ["DESCRIPTION", "HELP", "NAME", "add_options", "run"]

# What `fedsim.cli.build_parser` adds this tool as (it builds a `fedsim.cli.args.Command` of them; the server's
# packages never import fedsim).
NAME = "enroll-ca"
HELP = "the operator's enrollment authority: create it, certify devices"
DESCRIPTION = (
    "The enrollment authority (CA) certifies devices' long-term Ed25519 identity keys (protocol "
    "1.4).  Keep its key file away from the aggregation server: the server's configuration holds only the "
    "public key (enrollment.authority_key), and devices pin it."
)


def add_options(ca: argparse.ArgumentParser) -> None:
    """Add the actions of ``fedrec enroll-ca`` (init, issue, revoke) and their options to ``ca``."""
    ca_sub = ca.add_subparsers(dest="ca_command", required=True, metavar="ACTION")
    ca_init = ca_sub.add_parser("init", help="create the authority key file and print its public key")
    ca_init.add_argument("--key", type=Path, required=True, metavar="FILE", help="key file to create (mode 0600)")
    ca_issue = ca_sub.add_parser("issue", help="certify a device's public key; prints the certificate as hex")
    ca_issue.add_argument("--key", type=Path, required=True, metavar="FILE", help="the authority key file")
    ca_issue.add_argument(
        "--device-key", required=True, metavar="HEX", help="the device's 32-byte Ed25519 public key, as 64 hex digits"
    )
    ca_issue.add_argument(
        "--batch",
        default="default",
        help="the batch (credential source) to issue under: the server rate-limits and caps each round's share "
        "per batch (default: 'default')",
    )
    ca_issue.add_argument(
        "--valid-days",
        type=float,
        default=DEFAULT_VALID_DAYS,
        metavar="DAYS",
        help=f"how long the certificate is valid from now (default {DEFAULT_VALID_DAYS}); the server refuses it "
        "at registration and devices refuse it in signed rounds outside that period",
    )
    ca_issue.add_argument(
        "--device-id",
        type=int,
        default=None,
        metavar="ID",
        help="issue the certificate for this device id only (>= 1): the server registers the device under it and "
        "devices refuse the certificate for any other id (default: any id the server assigns)",
    )
    ca_revoke = ca_sub.add_parser(
        "revoke",
        help="add device keys to the authority's signed revocation list (the file enrollment.revocation_list names)",
        description="Writes the next revocation list: the keys of the existing FILE (checked against the authority) "
        "plus the given ones (none: an empty first list), numbered one higher, signed by the authority, "
        "replacing FILE atomically.  The server reloads it when the file changes, refuses revoked devices at "
        "registration, in cohort draws and on every authenticated route, and serves it to devices "
        "(GET /v1/enrollment/revocations), which enforce it in signed rounds.",
    )
    ca_revoke.add_argument("--key", type=Path, required=True, metavar="FILE", help="the authority key file")
    ca_revoke.add_argument(
        "--crl", type=Path, required=True, metavar="FILE", help="the revocation list to update or create"
    )
    ca_revoke.add_argument(
        "--device-key", action="append", default=[], metavar="HEX", help="a device's Ed25519 public key (repeatable)"
    )
    ca_revoke.add_argument(
        "--certificate",
        action="append",
        default=[],
        metavar="HEX",
        help="a certificate whose key to revoke (repeatable)",
    )


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run ``fedrec enroll-ca``; returns the exit status."""
    from protocol.enrollment import EnrollmentAuthority

    if args.ca_command == "init":
        authority = EnrollmentAuthority.generate()
        authority.save(args.key)
        out.write(f"enrollment authority key written to {args.key} (keep it away from the aggregation server)\n")
        out.write("server configuration ([enrollment] table):\n")
        out.write(f'authority_key = "{authority.public_key.hex()}"\n')
        return 0
    if args.ca_command == "issue":
        from protocol.enrollment import MAX_VALID_DAYS

        if not (math.isfinite(args.valid_days) and 0 < args.valid_days <= MAX_VALID_DAYS):
            raise ConfigError(
                f"--valid-days must be a number of days in (0, {MAX_VALID_DAYS}], got {args.valid_days:g}"
            )
    authority = EnrollmentAuthority.load(args.key)
    if args.ca_command == "revoke":
        return _revoke(authority, args, out)
    device_key = _hex_key("--device-key", args.device_key)
    certificate = authority.issue(device_key, args.batch, valid_days=args.valid_days, device_id=args.device_id)
    out.write(certificate.hex() + "\n")
    return 0


def _hex_key(flag: str, text: str) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"{flag} must be 64 hex digits, got {text!r}") from None
    if len(key) != 32:
        raise ConfigError(f"{flag} must be 64 hex digits (32 bytes), got {len(key)} bytes")
    return key


def _revoke(authority: Any, args: argparse.Namespace, out: TextIO) -> int:
    from protocol.enrollment import read_revocation_list, write_revocation_list
    from protocol.identity import read_certificate, verify_revocation_list

    keys = [_hex_key("--device-key", k) for k in args.device_key]
    for text in args.certificate:
        try:
            cert = bytes.fromhex(text)
        except ValueError:
            raise ConfigError(f"--certificate must be hex, got {text[:20]!r}...") from None
        # revoking an expired certificate's key is fine: only the signature matters here
        keys.append(read_certificate(cert, authority.public_key, check_period=False).subject)
    if not keys and args.crl.exists():
        raise ConfigError("enroll-ca revoke: name at least one --device-key or --certificate to add")
    previous = None
    if args.crl.exists():
        read_revocation_list(args.crl, authority.public_key)  # refuses a tampered or foreign list by name
        previous = args.crl.read_bytes()
    data = authority.revoke(previous, keys)
    write_revocation_list(args.crl, data)
    crl = verify_revocation_list(data, authority.public_key)
    out.write(f"revocation list #{crl.number} written to {args.crl}: {len(crl.device_keys)} device keys revoked\n")
    return 0
