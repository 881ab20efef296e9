"""Real-valued MF with embedding clipping on MovieLens-100K, beside simple baselines.

    python benchmarks/quality_mf.py                     # T = 100 rounds, seed 0
    python benchmarks/quality_mf.py --rounds 200 --seed 1
    python benchmarks/quality_mf.py --theta 20 --server-lr 1.0   # trimmed to θ = 20 ratings per round

Protocol: per-user chronological leave-one-out (latest rating → test, second latest → validation,
the rest train; `fedsim.evaluation.experiment.prepare`), each held-out item ranked among 99 sampled negatives
(seed 1 for test), HR@10 / NDCG@10 with random tie-breaking (exact expectation over tie orders), and
the RMSE of the predicted rating u·v on the held-out ratings (raw 1–5 scale, R = 5).

Rows: centralized MF (non-private reference: the same loss and clipping, mini-batch projected SGD
over all training ratings), federated MF in-process without SecAgg or noise (one device per user,
LFL-SGDMF stages 1–3, `fedsim.federation.mf.run_federated_mf`), each fitted on the ratings only and with one
sampled unobserved item per rating fitted as 0 ("+1 neg"), then item popularity, random scores and
the global-mean rating.  Hyper-parameters were chosen on the validation blocks, never on test; the
validation figures are printed beside the test ones.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from own_settings import own_settings

from agg_server.strategy.mf import MFStrategy
from fedsim.data.datasets import load_dataset
from fedsim.data.ratings import Ratings
from fedsim.data.splits import leave_one_out
from fedsim.evaluation.experiment import baselines, prepare
from fedsim.evaluation.ranking import TieMode
from fedsim.federation.mf import MFEvaluation, MFSchedule, centralized_mf, evaluate_mf, run_federated_mf

FACTORS = 32
R = 5.0
CENTRAL = {"learning_rate": 0.005, "epochs": 40, "init_scale": 0.3}
SERVER_LR = 0.3
FINE_TUNE = 50


def _cells(ev: MFEvaluation | None) -> str:
    if ev is None:
        return "— | — | —"
    assert ev.ranking is not None
    return f"{ev.rmse:.4f} | {ev.ranking.hr:.4f} | {ev.ranking.ndcg:.4f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=100, help="federated rounds T")
    p.add_argument("--seed", type=int, default=0, help="seed of the training runs (splits use seed 0)")
    p.add_argument("--fraction", type=float, default=1.0, help="share of devices per round")
    p.add_argument("--theta", type=int, default=0, help="ratings per user per round (0 = all)")
    p.add_argument(
        "--server-lr", type=float, default=SERVER_LR, help="server step γ (validation: 0.3 for θ=all, 1.0 for θ=20)"
    )
    args = p.parse_args()
    own_settings("real-valued MF with embedding clipping on ML-100K, --rounds and --seed as given")
    data = load_dataset("ml-100k")
    if not isinstance(data, Ratings):  # pragma: no cover - ml-100k is a rating log
        raise SystemExit("ml-100k did not load as a rating log")
    exp = prepare(data, seed=0)
    train, val, test = leave_one_out(data)  # the split `prepare` made, with the held-out rating values
    if len(train) != len(exp.train):
        raise SystemExit("leave_one_out and prepare disagree on the split")
    print(f"\n### {exp.describe()}")
    print(
        f"f={FACTORS}, R={R}; federated: T={args.rounds}, fraction {args.fraction}, θ={args.theta or 'all'}, "
        f"γ={args.server_lr}, device η=0.1, 50 pre-training and {FINE_TUNE} fine-tuning steps; seed {args.seed}; "
        "ties random\n"
    )
    print("| model | test RMSE | test HR@10 | test NDCG@10 | val RMSE | val HR@10 | val NDCG@10 | time |")
    print("|---|---|---|---|---|---|---|---|")
    runs: list[tuple[str, str, int]] = [
        ("centralized MF", "central", 0),
        ("federated MF (in-process, no noise)", "federated", 0),
        ("centralized MF +1 neg", "central", 1),
        ("federated MF +1 neg (in-process, no noise)", "federated", 1),
    ]
    for label, kind, negatives in runs:
        start = time.perf_counter()
        if kind == "central":
            rng = np.random.default_rng(args.seed)
            U, V = centralized_mf(train, factors=FACTORS, max_norm2=R, negatives=negatives, rng=rng, **CENTRAL)
        else:
            strategy = MFStrategy(
                train.n_items, rank=FACTORS, max_norm2=R, server_lr=args.server_lr, negatives=negatives
            )
            schedule = MFSchedule(
                rounds=args.rounds,
                fraction=args.fraction,
                example_cap=args.theta,
                fine_tune_epochs=FINE_TUNE,
                seed=args.seed,
            )
            state = run_federated_mf(train, strategy, schedule)
            U, V = state.user_factors, state.item_factors
        seconds = time.perf_counter() - start
        t_ev, v_ev = evaluate_mf(U, V, test, exp.test), evaluate_mf(U, V, val, exp.val)
        print(f"| {label} | {_cells(t_ev)} | {_cells(v_ev)} | {seconds:.0f} s |", flush=True)
    b = baselines(exp, TieMode.RANDOM)
    for k in ("popularity", "random"):
        print(f"| {k} | — | {b[k].hr:.4f} | {b[k].ndcg:.4f} | — | — | — | |")
    mean = float(np.mean(train.ratings))
    rmse_t = float(np.sqrt(np.mean((test.ratings - mean) ** 2)))
    rmse_v = float(np.sqrt(np.mean((val.ratings - mean) ** 2)))
    print(f"| global mean rating ({mean:.3f}) | {rmse_t:.4f} | — | — | {rmse_v:.4f} | — | — | |")


if __name__ == "__main__":
    main()
