"""FELB quality: the synthetic recipe of `docs/design.md` §3.4 and binarized
MovieLens-100K, for FELB (Lipschitz steps) and FELB^MU (multiplicative-update steps).

    python benchmarks/quality_felb.py                        # synthetic table + ML-100K
    python benchmarks/quality_felb.py --skip-ml              # synthetic only
    python benchmarks/quality_felb.py --ml-clients 50 --ml-rank 20 --ml-rounds 100

Synthetic: 10 clients × 100 rows, m = 100, k = 5 tiles ~90% dense, XOR noise p ∈ {0, 0.1, 0.2, 0.3};
κ = 1e-3, λ = 0.1·1.05^r per sync round, β = 1e-3, γ = 1, b = 10 local iterations, 100 rounds,
shared seeded initial V̂, unscaled server prox; means (± std) over seeds.  Columns: F1 (vs data),
F1* (vs the planted signal), factor-F1 (Hungarian-matched rows of round(V̂) vs the planted V),
Σ-RMSD and the all-zero model's Σ-RMSD.
ML-100K: rating ≥ 4 → 1, users split in index order over C clients; F1 and Σ-RMSD beside the
all-zero model, with the server prox unscaled (s = 1, the default) and scaled by s = 1/C (the exact
minimizer of the paper's eq. 10): on sparse data the unscaled prox, whose λ_r grows every round,
can shrink V̂ to all zeros before the Lipschitz steps (small on a wide matrix) move it.
Everything runs in process through `fedsim.federation.felb.run_felb` (device code `FELBModel.local_update`,
server `FELBStrategy.aggregate` on the plain sum).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from own_settings import own_settings

from agg_server.strategy.felb import FELBStrategy
from fedsim.data.datasets import find_data_dir
from fedsim.data.planted import planted_binary
from fedsim.federation.felb import FELBMetrics, evaluate_felb, load_ml100k_binary, run_felb

RULES = (("FELB", "lipschitz"), ("FELB^MU", "mu"))


def _fmt(values: list[float]) -> str:
    a = np.asarray(values)
    return f"{a.mean():.3f} ± {a.std():.3f}"


def synthetic(noises: list[float], seeds: int, rounds: int) -> None:
    print(f"\n### Synthetic (10 clients × 100 rows, m=100, k=5, b=10, {rounds} rounds, {seeds} seeds)\n")
    print("| XOR p | variant | F1 | F1* | factor-F1 | Σ-RMSD | all-zero Σ-RMSD | s/run |")
    print("|---|---|---|---|---|---|---|---|")
    for p in noises:
        for name, rule in RULES:
            mets: list[FELBMetrics] = []
            t0 = time.perf_counter()
            for seed in range(seeds):
                rng = np.random.default_rng(seed)
                planted = planted_binary(10, 100, 100, 5, xor_noise=p, rng=rng)
                st = FELBStrategy(rank=5, n_items=100, step_rule=rule)
                run = run_felb(planted.clients, st, rounds=rounds, rng=rng)
                mets.append(evaluate_felb(run, planted.clients, signal=planted.signal, planted_v=planted.v))
            per_run = (time.perf_counter() - t0) / seeds
            print(
                f"| {p} | {name} | {_fmt([m.f1 for m in mets])} | {_fmt([m.f1_star for m in mets])} | "
                f"{_fmt([m.factor_f1 for m in mets])} | {_fmt([m.rmsd for m in mets])} | "
                f"{_fmt([m.zero_rmsd for m in mets])} | {per_run:.1f} |",
                flush=True,
            )


def movielens(clients: int, rank: int, local_epochs: int, rounds: int, seed: int, scales: list[str]) -> None:
    base = find_data_dir()
    if base is None or not (base / "ml-100k" / "u.data").is_file():
        print("\nML-100K not found (set FEDREC_DATA); skipped")
        return
    blocks = load_ml100k_binary(base / "ml-100k", clients)
    n = sum(b.shape[0] for b in blocks)
    m = blocks[0].shape[1]
    density = sum(int(b.sum()) for b in blocks) / (n * m)
    print(
        f"\n### ML-100K binarized (rating ≥ 4 → 1): {n} × {m}, density {density:.4f}, C={clients}, k={rank}, "
        f"b={local_epochs}, {rounds} rounds, seed {seed}\n"
    )
    print(
        "| variant | server scale s | F1 | Σ-RMSD | all-zero Σ-RMSD | 1s in reconstruction | integrality gap | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for scale, label in ((1.0, "1"), (1.0 / clients, "1/C")):
        if label not in scales:
            continue
        for name, rule in RULES:
            t0 = time.perf_counter()
            st = FELBStrategy(rank=rank, n_items=m, local_epochs=local_epochs, step_rule=rule, server_scale=scale)
            run = run_felb(blocks, st, rounds=rounds, rng=np.random.default_rng(seed))
            met = evaluate_felb(run, blocks)
            ones = sum(int(r.sum()) for r in run.reconstructions())
            print(
                f"| {name} | {label} | {met.f1:.3f} | {met.rmsd:.3f} | {met.zero_rmsd:.3f} | {ones} | {met.gap:.4f} | "
                f"{time.perf_counter() - t0:.0f} |",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--noise", nargs="+", type=float, default=[0.0, 0.1, 0.2, 0.3])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--skip-synthetic", action="store_true")
    p.add_argument("--skip-ml", action="store_true")
    p.add_argument("--ml-clients", type=int, default=50)
    p.add_argument("--ml-rank", type=int, default=20)
    p.add_argument("--ml-local-epochs", type=int, default=10)
    p.add_argument("--ml-rounds", type=int, default=100)
    p.add_argument("--ml-seed", type=int, default=0)
    p.add_argument("--ml-scales", nargs="+", choices=["1", "1/C"], default=["1", "1/C"])
    args = p.parse_args()
    own_settings("FELB / FELB^MU on the planted recipe and binarized ML-100K, this script's step sizes and rounds")
    t0 = time.perf_counter()
    if not args.skip_synthetic:
        synthetic(args.noise, args.seeds, args.rounds)
    if not args.skip_ml:
        movielens(args.ml_clients, args.ml_rank, args.ml_local_epochs, args.ml_rounds, args.ml_seed, args.ml_scales)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
