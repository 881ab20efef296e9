"""The same seeded fleet on the local multi-process back-end and on the Ray back-end of ``fedrec loadtest``:
wall time of each, and whether both committed the same rounds and the same final model.

For each back-end a fresh ``python -m agg_server`` starts on loopback with an ML-100K-shaped model
(1,682 items x 64 bits by default), ``rounds.cohort_size = --cohort`` and a fixed ``rounds.seed``, without
DP; the fleet (`fedsim.fleets.demo.run_loadtest`, real `DeviceClient`s over HTTP) picks each round's cohort from
its seed (``FleetConfig.cohort``) and derives its devices' generators and noise streams from it (the
``insecure_reproducible`` test hook), with announced drops.  The Ray back-end starts a local Ray for the
run unless ``RAY_ADDRESS`` names a cluster; its start-up is inside its wall time.

Run: ``python benchmarks/fleet_backends.py --devices 2000 --cohort 500 --rounds 2 --workers 2``.
Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedsim.data.synthetic import synthetic
from fedsim.fleets.demo import run_loadtest
from fedsim.fleets.loadtest_report import loadtest_record
from fedsim.fleets.local import FleetConfig
from fedsim.fleets.server_process import ServerProcess, write_server_config


def _run(args: argparse.Namespace, backend: str, users: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"fedrec-backends-{backend}-") as tmp:
        root = Path(tmp)
        cfg = root / "server.toml"
        write_server_config(
            cfg,
            {
                "server": {"host": "127.0.0.1", "port": 0, "data_dir": str(root / "data")},
                "model": {"n_items": args.n_items, "bits": args.bits, "unobserved_weight": 0.0},
                "rounds": {
                    "cohort_size": args.cohort,
                    "min_cohort": args.cohort,
                    "seed": 7,
                    "advertise_timeout": 600.0,
                    "share_keys_timeout": 300.0,
                    "masked_input_timeout": 600.0,
                    "unmask_timeout": 300.0,
                    "round_interval": 0.5,
                },
                "log": {"level": "warning"},
            },
        )
        with ServerProcess(cfg, root / "server.log") as server:
            fleet = FleetConfig(
                url=server.url,
                store_root=root / "devices",
                n_items=args.n_items,
                bits=args.bits,
                rounds=args.rounds,
                dropout=args.dropout,
                announce_drops=True,
                seed=args.seed,
                cohort=args.cohort,
                insecure_reproducible=True,
                time_limit=args.time_limit,
            )
            t0 = time.perf_counter()
            report = run_loadtest(
                fleet, users, args.workers, backend=backend, keep_store=False, worker_nice=args.fleet_nice
            )
            wall = time.perf_counter() - t0
        record = loadtest_record(report, args.rounds, report.failure(args.rounds), url=server.url, backend=backend)
        record["wall_seconds"] = round(wall, 1)
        return record


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2000)
    p.add_argument("--cohort", type=int, default=500)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=2, help="worker processes / Ray actors")
    p.add_argument("--n-items", type=int, default=1682)
    p.add_argument("--bits", type=int, default=64)
    p.add_argument("--ratings-per-user", type=int, default=60)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--fleet-nice", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=3000.0)
    p.add_argument("--backends", default="local,ray")
    args = p.parse_args()
    data = synthetic(n_users=args.devices, n_items=args.n_items, ratings_per_user=args.ratings_per_user, seed=0)
    idx = data.by_user()
    users = [
        (
            np.asarray(idx.items[idx.indptr[u] : idx.indptr[u + 1]]),
            np.asarray(idx.ratings[idx.indptr[u] : idx.indptr[u + 1]]),
        )
        for u in range(data.n_users)
    ]
    runs = {b: _run(args, b, users) for b in args.backends.split(",")}
    out: dict[str, Any] = {"settings": vars(args)}
    for b, rec in runs.items():
        out[b] = {
            "wall_seconds": rec["wall_seconds"],
            "ok": rec["ok"],
            "failure": rec["failure"],
            "rounds": [(r["round_id"], r["status"], r["cohort"], r["survivors"]) for r in rec["server_rounds"]],
            "final_model": rec["final_model"],
            "round_seconds_max": rec["round_seconds_max"],
            "server_cpu_ms_per_device_round": rec["server_cpu_ms_per_device_round"],
            "device_errors": rec["device_errors"],
        }
    if len(runs) == 2:
        a, b = runs.values()
        out["same_rounds"] = out[next(iter(runs))]["rounds"] == out[list(runs)[1]]["rounds"]
        out["same_model"] = a["final_model"] == b["final_model"] and a["final_model"] is not None
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
