"""Privacy–utility of LightFR through the real round coordinator: SecAgg+ alone vs. SecAgg+ with
distributed DP at several ε, beside item popularity.

    python benchmarks/privacy_utility.py --rounds 20 --epsilons 0 8 2

Every ML-100K user is one device (leave-one-out split; its test item ranked among 99 sampled
negatives; random ties).  Rounds run through `fedsim.private.run_private_lightfr`: the real
`RoundCoordinator` (cohort selection, SecAgg+ session with real crypto, Skellam noise with the
dropout correction, privacy ledger, Agg_grad) driven in-process — `tests/test_server_app.py` checks
that this path and the HTTP server give bit-identical models.  ε is over the whole run at δ = 1e-5,
noise sized for ω = 0.33 (t_min = ⌈0.67·n⌉ survivors).  Each device's contribution is bounded by L2
clipping to C (the sensitivity the accountant uses) after using at most θ ratings per round.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from agg_server.config import config_from_dict
from fedsim.demo import device_data, evaluate_devices
from fedsim.evaluation import TieMode
from fedsim.experiment import baselines, prepare
from fedsim.private import run_private_lightfr


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="ml-100k")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--fraction", type=float, default=0.6)
    p.add_argument("--epsilons", type=float, nargs="+", default=[0.0, 8.0, 2.0], help="0 = SecAgg+ without DP")
    p.add_argument("--clip", type=float, default=8.0)
    p.add_argument("--theta", type=int, default=50)
    p.add_argument("--flip-fraction", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    exp = prepare(args.dataset)
    users = dict(enumerate(device_data(exp)))
    cohort = int(round(args.fraction * len(users)))
    print(exp.describe())
    print(
        f"T={args.rounds}, cohort {cohort} of {len(users)} devices, f=64, Agg_grad ρ={args.flip_fraction}, "
        f"clip C={args.clip}, θ={args.theta} ratings per device per round\n"
    )
    print("| setting | HR@10 | NDCG@10 | ε spent | noise μ (quantized units) | seconds |")
    print("|---|---|---|---|---|---|")
    for eps in args.epsilons:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = config_from_dict(
                {
                    "server": {"data_dir": tmp},
                    "model": {"n_items": exp.train.n_items, "bits": 64, "flip_fraction": args.flip_fraction},
                    "rounds": {
                        "cohort_size": cohort,
                        "min_cohort": cohort,
                        "dropout_rate": 0.33,
                        "clip_norm": args.clip,
                        "scale_bits": 12,
                        "example_cap": args.theta,
                        "seed": args.seed,
                    },
                    "privacy": {
                        "enabled": eps > 0,
                        "epsilon": eps or 8.0,
                        "delta": 1e-5,
                        "planned_rounds": args.rounds,
                    },
                },
                base_dir=Path(tmp),
            )
            t = time.perf_counter()
            run = run_private_lightfr(cfg, users, rounds=args.rounds, seed=args.seed, rating_range=exp.rating_range)
            coord = run.coordinator
            devices = [run.devices[d] for d in sorted(run.devices)]
            res = evaluate_devices(exp, devices, coord.item_codes, coord.model_version)[TieMode.RANDOM]
            spent = coord.ledger.spent() if coord.ledger is not None else None
            label = f"SecAgg+ + DP ε={eps:g}" if eps else "SecAgg+ only"
            print(
                f"| {label} | {res.hr:.4f} | {res.ndcg:.4f} | {spent if spent is None else round(spent, 3)} | "
                f"{coord.mu:.3g} | {time.perf_counter() - t:.0f} |",
                flush=True,
            )
            coord.storage.close()
    b = baselines(exp)["popularity"]
    print(f"| item popularity | {b.hr:.4f} | {b.ndcg:.4f} | - | - | - |")


if __name__ == "__main__":
    main()
