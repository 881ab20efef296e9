"""What enrollment costs the server per registration (protocol 1.4): open, one-time token, certificate.

Runs `RoundCoordinator.register` in-process on a fresh SQLite data dir (no HTTP: the route adds the same
decode/encode to every kind) and prints registrations per second for each credential kind, plus the
device-side cost of proving possession (one Ed25519 signature).

    PYTHONPATH=. python benchmarks/bench_enrollment.py --n 500
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from agg_server.config import config_from_dict
from agg_server.coordinator import RoundCoordinator
from agg_server.storage import Storage
from protocol.enrollment import EnrollmentAuthority
from protocol.identity import SigningKey, registration_payload


def _coordinator(root: Path, enrollment: dict[str, object]) -> RoundCoordinator:
    cfg = config_from_dict(
        {
            "server": {"data_dir": str(root)},
            "model": {"n_items": 100, "bits": 16},
            "enrollment": {"registrations_per_second": 1e9, "registration_burst": 10**9, **enrollment},
        },
        base_dir=root,
    )
    return RoundCoordinator(cfg, Storage(root), now=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="registrations per kind")
    n = parser.parse_args().n
    ca = EnrollmentAuthority.generate()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = []
        coord = _coordinator(root / "open", {"open_registration": True})
        start = time.perf_counter()
        for _ in range(n):
            coord.register("bench", 1.0, peer=f"10.0.{_ // 250}.{_ % 250}")
        rows.append(("open", time.perf_counter() - start))
        coord.storage.close()

        coord = _coordinator(root / "token", {"open_registration": False})
        tokens = coord.enrollment.issue_tokens(n, "bench", 0.0)
        start = time.perf_counter()
        for token in tokens:
            coord.register("bench", 1.0, enrollment_token=token)
        rows.append(("token", time.perf_counter() - start))
        coord.storage.close()

        coord = _coordinator(root / "cert", {"authority_key": ca.public_key.hex()})
        keys = [SigningKey.generate() for _ in range(n)]
        certs = [ca.issue(k.public_key, "bench") for k in keys]
        start = time.perf_counter()
        proofs = [k.sign(registration_payload(c)) for k, c in zip(keys, certs, strict=True)]
        device_s = (time.perf_counter() - start) / n
        start = time.perf_counter()
        for cert, proof in zip(certs, proofs, strict=True):
            coord.register("bench", 1.0, certificate=cert, proof=proof)
        rows.append(("certificate", time.perf_counter() - start))
        coord.storage.close()
    print(f"{n} registrations per kind (SQLite, in-process coordinator)")
    for kind, seconds in rows:
        print(f"  {kind:<12} {n / seconds:8.0f} /s   {1e3 * seconds / n:6.3f} ms each")
    print(f"  device proof of possession: {1e3 * device_s:.3f} ms (one Ed25519 signature)")


if __name__ == "__main__":
    main()
