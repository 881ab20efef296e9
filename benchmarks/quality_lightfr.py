"""LightFR quality on real data, beside simple baselines, in both tie modes.

    python benchmarks/quality_lightfr.py                       # both datasets, the default model
    python benchmarks/quality_lightfr.py --datasets ml-100k --rounds 100 --variants

Rows: federated LightFR with Agg_grad (the default model), LightFR_para (Agg_para, the paper's
ablation), random codes (the same model after 0 rounds), item popularity and random scores.
Protocols: FilmTrust — the LightFR authors' split (1 test positive + 49 negatives per user);
MovieLens-100K — per-user chronological leave-one-out, 99 sampled negatives (seed 1).  HR@10 and
NDCG@10 with random ties (exact expectation over tie orders) and optimistic ties (the paper's mode).
``--variants`` adds the ablations behind the defaults (targets, negatives, λ, flip fraction, bits).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np

from device_sdk.models import LightFRConfig
from fedsim.evaluation import TieMode, evaluate_candidates
from fedsim.experiment import baselines, prepare
from fedsim.federation import FederationConfig, run_lightfr, user_data
from protocol.spec import Aggregation


def _row(name: str, scores: np.ndarray) -> str:
    r = evaluate_candidates(scores, 10, TieMode.RANDOM)
    o = evaluate_candidates(scores, 10, TieMode.OPTIMISTIC)
    return f"| {name} | {r.hr:.4f} | {r.ndcg:.4f} | {o.hr:.4f} | {o.ndcg:.4f} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=["filmtrust-lightfr", "ml-100k"])
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", action="store_true")
    args = p.parse_args()
    for name in args.datasets:
        exp = prepare(name, seed=0)
        base_cfg = LightFRConfig(bits=64, lam=0.0, negatives=4, rating_range=exp.rating_range, binary_positives=True)
        fed = FederationConfig(rounds=args.rounds, fraction=0.6, seed=args.seed, flip_fraction=0.1)
        print(f"\n### {exp.describe()}\nT={args.rounds}, p=0.6, E=1, f=64, λ=0, 4 negatives/rating, seed {args.seed}\n")
        print("| model | HR@10 random | NDCG@10 random | HR@10 optimistic | NDCG@10 optimistic |")
        print("|---|---|---|---|---|")
        runs = [
            ("LightFR (Agg_grad, ρ=0.1)", base_cfg, fed),
            ("LightFR_para (Agg_para)", base_cfg, replace(fed, aggregation=Aggregation.PARA)),
            ("random codes (0 rounds)", base_cfg, replace(fed, rounds=0)),
        ]
        if args.variants:
            runs += [
                ("Agg_grad, paper rule ρ=1", base_cfg, replace(fed, flip_fraction=1.0)),
                ("Agg_grad, ρ=0.3", base_cfg, replace(fed, flip_fraction=0.3)),
                ("ratings as targets", replace(base_cfg, binary_positives=False), fed),
                ("explicit only (no negatives)", replace(base_cfg, negatives=0, binary_positives=False), fed),
                ("8 negatives/rating", replace(base_cfg, negatives=8), fed),
                ("λ = 0.01", replace(base_cfg, lam=0.01), fed),
                ("λ = 0.6 (paper)", replace(base_cfg, lam=0.6), fed),
                ("f = 128", replace(base_cfg, bits=128), fed),
                ("E = 3 local epochs", replace(base_cfg, local_epochs=3), fed),
            ]
        for label, cfg, fcfg in runs:
            t = time.perf_counter()
            state = run_lightfr(user_data(exp.train, cfg), cfg, fcfg)
            line = _row(label, state.scores(exp.test.users, exp.test.items))
            print(f"{line} {time.perf_counter() - t:.0f} s", flush=True)
        b, bo = baselines(exp, TieMode.RANDOM), baselines(exp, TieMode.OPTIMISTIC)
        for k in ("popularity", "random"):
            print(f"| {k} | {b[k].hr:.4f} | {b[k].ndcg:.4f} | {bo[k].hr:.4f} | {bo[k].ndcg:.4f} |")


if __name__ == "__main__":
    main()
