"""One fedrec-server under a load-test fleet: round wall time, server CPU per device-round, and the
latency of ``/v1/health`` measured throughout (the aims: a round within 60 s, at most 10 ms of server CPU
per device-round, ``/v1/health`` within 100 ms at the 99th percentile).

Starts ``python -m agg_server`` on loopback with an ML-1M-shaped model (3,706 items x 64 bits by
default), runs ``fedrec loadtest``'s engine (`fedsim.fleets.demo.run_loadtest`, real `DeviceClient`s over
HTTP, silent drops at random phases) against it, and probes ``GET /v1/health`` every 50 ms from a
separate process (`fedsim.fleets.server_process.HealthProbe`).  Server CPU is the server process's own
(``getrusage``, as ``/v1/status`` reports it) between the fleet's start and each round's end.  The fleet's
worker processes run ``--fleet-nice`` levels below the server and the probe, so that on a machine shared
with the fleet the figures are the server's, not the scheduler's.

Run: ``python benchmarks/server_load.py --devices 1000 --rounds 2 --dropout 0.2 --workers 2``.
Prints the ``fedrec loadtest --json`` record (`fedsim.fleets.loadtest_report.loadtest_record`) as its last line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from fedsim.data.synthetic import synthetic
from fedsim.fleets.demo import run_loadtest
from fedsim.fleets.loadtest_report import loadtest_record
from fedsim.fleets.local import FleetConfig
from fedsim.fleets.server_process import ServerProcess, write_server_config


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--n-items", type=int, default=3706)
    p.add_argument("--bits", type=int, default=64)
    p.add_argument("--ratings-per-user", type=int, default=166)
    p.add_argument("--grace", type=float, default=3.0, help="rounds.disconnect_grace")
    p.add_argument(
        "--unobserved-weight",
        type=float,
        default=0.0,
        help="model.unobserved_weight (default 0: the sampled-negatives objective of the first measurements)",
    )
    p.add_argument("--time-limit", type=float, default=1800.0)
    p.add_argument("--fleet-nice", type=int, default=10, help="how much lower the fleet's priority is")
    p.add_argument("--backend", choices=("local", "ray"), default="local")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedrec-server-load-") as tmp:
        root = Path(tmp)
        cfg = root / "server.toml"
        write_server_config(
            cfg,
            {
                "server": {"host": "127.0.0.1", "port": 0, "data_dir": str(root / "data")},
                "model": {"n_items": args.n_items, "bits": args.bits, "unobserved_weight": args.unobserved_weight},
                "rounds": {
                    "cohort_size": args.devices,
                    "min_cohort": max(3, args.devices // 2),
                    "dropout_rate": 0.33,
                    # Deadlines summing to 390 s (a round's length before phases closed early): a round's upper bound.
                    "advertise_timeout": 120.0,
                    "share_keys_timeout": 60.0,
                    "masked_input_timeout": 150.0,
                    "unmask_timeout": 60.0,
                    "round_interval": 1.0,
                    "disconnect_grace": args.grace,
                },
                "log": {"level": "warning"},
            },
        )
        data = synthetic(n_users=args.devices, n_items=args.n_items, ratings_per_user=args.ratings_per_user, seed=0)
        users = []
        for u in range(data.n_users):
            mask = data.users == u
            users.append((np.asarray(data.items[mask]), np.asarray(data.ratings[mask], dtype=np.float64)))
        with ServerProcess(cfg, root / "server.log") as server:
            fleet = FleetConfig(
                url=server.url,
                store_root=root / "devices",
                n_items=args.n_items,
                bits=args.bits,
                rounds=args.rounds,
                dropout=args.dropout,
                time_limit=args.time_limit,
            )
            report = run_loadtest(
                fleet,
                users,
                args.workers,
                backend=args.backend,
                probe_health=True,
                worker_nice=args.fleet_nice,
            )
        record = loadtest_record(report, args.rounds, report.failure(args.rounds), url=server.url, settings=vars(args))
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
