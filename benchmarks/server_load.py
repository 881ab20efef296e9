"""One fedrec-server under a load-test fleet: round wall time, server CPU per device-round, and the
latency of ``/v1/health`` measured throughout (issue 12's bars).

Starts ``python -m agg_server`` on loopback with an ML-1M-shaped model (3,706 items x 64 bits by
default), runs ``fedrec loadtest``'s engine (`fedsim.demo.run_loadtest`, real `DeviceClient`s over
HTTP, silent drops at random phases) against it, and probes ``GET /v1/health`` every 50 ms from a
separate process.  Server CPU comes from ``/proc/<pid>/stat`` of the server process around each round
(via the rounds' ``process.cpu_seconds`` in ``/v1/status``).

Run: ``python benchmarks/server_load.py --devices 1000 --rounds 2 --dropout 0.2 --workers 2``.
Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fedsim.datasets import synthetic
from fedsim.demo import ServerProcess, run_loadtest, write_server_config
from fedsim.fleet import FleetConfig

_PROBE = r"""
import sys, time, urllib.request
url, out = sys.argv[1], sys.argv[2]
with open(out, "w") as f:
    while True:
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                state = r.read().decode()
            ok = "1"
        except Exception as exc:
            state, ok = type(exc).__name__, "0"
        f.write(f"{time.time():.3f} {time.perf_counter() - t0:.4f} {ok} {state}\n")
        f.flush()
        time.sleep(0.05)
"""


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
        help="model.unobserved_weight (default 0: the sampled-negatives objective of issue 12's measurement)",
    )
    p.add_argument("--time-limit", type=float, default=1800.0)
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
                    # The deadlines of the 390 s measurement in issue 12: the upper bound of a round.
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
            probe_out = root / "health.txt"
            probe = subprocess.Popen([sys.executable, "-c", _PROBE, f"{server.url}/v1/health", str(probe_out)])
            try:
                fleet = FleetConfig(
                    url=server.url,
                    store_root=root / "devices",
                    n_items=args.n_items,
                    bits=args.bits,
                    rounds=args.rounds,
                    dropout=args.dropout,
                    time_limit=args.time_limit,
                )
                t0 = time.time()
                report = run_loadtest(fleet, users, args.workers)
                t1 = time.time()
            finally:
                probe.terminate()
                probe.wait()
            lines = [ln.split(" ", 3) for ln in probe_out.read_text().splitlines() if ln.count(" ") >= 3]
        rounds = sorted(report.server_rounds, key=lambda r: r["round_id"])
        per_round = []
        cpu_prev = None
        for r in rounds:
            cpu = r["process"]["cpu_seconds"] if r.get("process") else None
            per_round.append(
                {
                    "round_id": r["round_id"],
                    "status": r["status"],
                    "seconds": r.get("seconds"),
                    "cohort": r.get("cohort_size"),
                    "survivors": r.get("survivors"),
                    "phases": {ph["phase"]: round(ph["seconds"], 2) for ph in r.get("phases", [])},
                    "server_cpu_s": None if cpu is None or cpu_prev is None else round(cpu - cpu_prev, 2),
                }
            )
            cpu_prev = cpu
        during = [(float(ts), float(lat), ok == "1", st) for ts, lat, ok, st in lines if t0 <= float(ts) <= t1]
        lat = np.array([x[1] for x in during]) if during else np.zeros(1)
        finishing = np.array([x[1] for x in during if "finishing" in x[3]]) if during else np.zeros(0)
        out = {
            "devices": args.devices,
            "rounds_finished": report.rounds_finished,
            "outcomes": dict(report.outcomes),
            "errors": dict(report.errors),
            "rounds": per_round,
            "device_step_seconds": {
                step: {
                    "n": len(v),
                    "p50": round(float(np.percentile(v, 50)), 3),
                    "p95": round(float(np.percentile(v, 95)), 3),
                    "max": round(float(np.max(v)), 3),
                }
                for step, v in report.latencies.items()
                if v
            },
            "health_probes": len(during),
            "health_failures": sum(1 for x in during if not x[2]),
            "health_p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 1),
            "health_p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 1),
            "health_max_ms": round(float(lat.max()) * 1e3, 1),
            "health_probes_while_finishing": int(finishing.size),
            "health_p99_ms_while_finishing": round(float(np.percentile(finishing, 99)) * 1e3, 1)
            if finishing.size
            else None,
        }
        for r in per_round:
            if r["server_cpu_s"] is not None:
                r["server_cpu_ms_per_device"] = round(r["server_cpu_s"] * 1e3 / max(1, r["cohort"] or 1), 1)
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
