"""A small load test: ``fedrec loadtest`` with 50 simulated devices against a server on loopback.

1. Act as the operator: create an enrollment authority (``fedrec enroll-ca init --key ca.key``), and
   start ``python -m agg_server`` (= ``fedrec-server``) on a free loopback port with its public key
   (``[enrollment] authority_key``), a small model (m = 500 items, f = 32 bits) and short phase
   deadlines, so that devices that drop silently cost seconds, not minutes.
2. Run the command a person load-testing the server would type (printed first)::

       fedrec loadtest --url URL --devices 50 --rounds 1 --dropout 0.1 --n-items 500 --bits 32 \\
           --ratings-per-user 20 --authority-key ca.key --credential-sources 2

   The fleet certifies each device's identity key with the authority, as the operator's enrollment
   service would; the devices register with their certificates and every round runs signed.

   Every simulated device is a real `DeviceClient` over HTTP; 10% of them drop at a random phase
   (some in the middle of the masked-input upload).  The command prints per-phase latency
   percentiles, rounds completed, server CPU and memory per round, bytes per device and errors by
   type, and exits 0 only if the requested rounds finished.
3. Stop the server with SIGTERM.

Run: ``python examples/loadtest.py [--devices N] [--rounds R] [--dropout P]``.  Exits with the load
test's status (0 = the rounds finished), or 1 if the server did not start or did not stop cleanly.

Invariants:
- Traffic goes only to the server this script started on 127.0.0.1; the server is always stopped.
- The server's ``[model]`` matches the load test's ``--n-items`` / ``--bits`` (a mismatch would make
  every device fail its first round).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from fedsim.cli import main as fedrec
from fedsim.fleets.server_process import ServerProcess, write_server_config
from protocol.enrollment import EnrollmentAuthority
from protocol.errors import FedRecError

N_ITEMS = 500
BITS = 32


def server_settings(data_dir: Path, devices: int, authority_key: str) -> dict[str, dict[str, object]]:
    """A server sized for the load test: one round takes the whole fleet (dropouts tolerated: 33%)."""
    return {
        "enrollment": {"authority_key": authority_key},
        "server": {"host": "127.0.0.1", "port": 0, "data_dir": str(data_dir)},
        "model": {"n_items": N_ITEMS, "bits": BITS},
        "rounds": {
            "cohort_size": devices,
            "min_cohort": max(3, devices // 2),
            "dropout_rate": 0.33,
            # Silent drops hold a phase open until its deadline; keep the deadlines short.
            "advertise_timeout": 6.0,
            "share_keys_timeout": 3.0,
            "masked_input_timeout": 4.0,
            "unmask_timeout": 3.0,
            "round_interval": 0.2,
        },
        "log": {"level": "warning"},
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Start a server, run ``fedrec loadtest`` against it, stop the server; returns the exit status."""
    parser = argparse.ArgumentParser(description="a small fedrec load test on loopback")
    parser.add_argument("--devices", type=int, default=50, help="simulated devices (default: 50)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds to finish (default: 1)")
    parser.add_argument("--dropout", type=float, default=0.1, help="chance a device drops per round (default: 0.1)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fedrec-loadtest-example-") as tmp:
        root = Path(tmp)
        config = root / "server.toml"
        ca_key = root / "ca.key"
        authority = EnrollmentAuthority.generate()  # what `fedrec enroll-ca init --key ca.key` does
        authority.save(ca_key)
        write_server_config(config, server_settings(root / "server-data", args.devices, authority.public_key.hex()))
        log = root / "server.log"
        try:
            with ServerProcess(config, log) as server:  # waits for "fedrec-server listening on URL"
                print(f"server: {server.url} (m={N_ITEMS}, f={BITS}, cohort {args.devices})", flush=True)
                command = [
                    "loadtest",
                    "--url",
                    server.url,
                    "--devices",
                    str(args.devices),
                    "--rounds",
                    str(args.rounds),
                    "--dropout",
                    str(args.dropout),
                    "--n-items",
                    str(N_ITEMS),
                    "--bits",
                    str(BITS),
                    "--ratings-per-user",
                    "20",
                    "--time-limit",
                    "300",
                    "--authority-key",
                    str(ca_key),
                    "--credential-sources",
                    "2",
                ]
                print("$ fedrec " + shlex.join(command), flush=True)
                status = fedrec(command)  # the `fedrec` console script's entry point, in this process
                exit_code = server.stop()  # SIGTERM, then SIGKILL after a grace period
        except FedRecError as exc:  # the server did not start (the message quotes its error line)
            print(f"FAILED: {exc}\n{log.read_text()}", file=sys.stderr)
            return 1
        print(f"server: stopped with SIGTERM (exit {exit_code})")
        if exit_code != 0:
            print(f"FAILED: the server exited with {exit_code}\n{log.read_text()}", file=sys.stderr)
            return 1
        print(f"loadtest: fedrec loadtest exited with status {status}")
        return status


if __name__ == "__main__":
    raise SystemExit(main())
