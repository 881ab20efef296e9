"""FNMF quality on planted non-negative data (`docs/design.md` §3.4), beside FedAvg and FedProx.

    python benchmarks/quality_fnmf.py                        # T ∈ {10, 100}, 3 seeds, 10 rounds
    python benchmarks/quality_fnmf.py --steps 100 --seeds 1 --rounds 4

Data: `fedsim.data.planted.planted_nonnegative` (10 clients × 100 rows, m = 100, k = 5, truncated Gaussian
noise 0.1), every client starting from its own random V (the paper's setting).  Rows: FEDAVG (local
projected gradient, plain mean), FEDPROX (pull towards the unaligned V̄; with the exact step-scaled
prox and with the paper's printed unscaled one), FNMF over sums with client-side LAP, LAP_ρ and
Sinkhorn alignment (anchored one-round aggregation after a round-0 fixed point over sums), and FNMF
with the paper's trusted barycenter over individual matrices.  Columns: mean ± standard deviation
over the seeds of Σ-RMSD = Σ_i RMSD(X_i, U_i V̄), of the matched cosine between V̄ and the planted
components, the orthogonality gap of the final alignments, the secure sums used (training rounds plus
align-only rounds) and seconds per run.  The last rows
use one shared seeded V̄ instead (the HTTP path: anchored aggregation from round 0, no extra rounds).
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import replace

import numpy as np
from own_settings import own_settings

from fedsim.data.planted import planted_nonnegative
from fedsim.federation.fnmf import FNMFRunConfig, Method, run_fnmf, sigma_rmsd

ROWS: list[tuple[str, FNMFRunConfig]] = [
    ("FEDAVG", FNMFRunConfig(method=Method.FEDAVG)),
    ("FEDPROX (prox tγ)", FNMFRunConfig(method=Method.FEDPROX)),
    ("FEDPROX (prox γ, paper's printed form)", FNMFRunConfig(method=Method.FEDPROX, scaled_prox=False)),
    ("FNMF secure, LAP", FNMFRunConfig(method=Method.FNMF, alignment="lap")),
    ("FNMF secure, LAP_ρ", FNMFRunConfig(method=Method.FNMF, alignment="lap_rho")),
    ("FNMF secure, Sinkhorn (ε=0.05)", FNMFRunConfig(method=Method.FNMF, alignment="sinkhorn")),
    ("FNMF secure, LAP, exact fixed point over sums every round", FNMFRunConfig(fixed_point_every_round=True)),
    ("FNMF trusted barycenter (LAP)", FNMFRunConfig(method=Method.FNMF_TRUSTED, alignment="lap")),
    # The path a server runs over HTTP: one shared version-1 V̄, anchored aggregation from round 0.
    ("FEDAVG, shared init", FNMFRunConfig(method=Method.FEDAVG, independent_init=False)),
    ("FNMF secure, LAP, shared init", FNMFRunConfig(method=Method.FNMF, independent_init=False)),
    ("FNMF secure, LAP_ρ, shared init", FNMFRunConfig(method=Method.FNMF, alignment="lap_rho", independent_init=False)),
]


def _cell(values: list[float], digits: int = 3) -> str:
    a = np.asarray(values)
    return f"{a.mean():.{digits}f} ± {a.std():.{digits}f}"


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, nargs="+", default=[10, 100], help="local steps T per round")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--gamma", type=float, default=1.0)
    args = p.parse_args()
    own_settings("FNMF on planted data with --steps / --rounds / --seeds as given, beside FedAvg and FedProx")
    logging.basicConfig(level=logging.ERROR)  # the trusted mode's warning is expected here
    start = time.perf_counter()
    data = [planted_nonnegative(rng=np.random.default_rng(seed)) for seed in range(args.seeds)]
    floors = [sigma_rmsd(pl.clients, np.split(pl.signal, len(pl.clients))) for pl in data]
    print(f"planted: 10 clients × 100 rows, m=100, k=5, noise 0.1; noise floor Σ-RMSD {_cell(floors)}")
    print(f"{args.rounds} rounds, γ={args.gamma}, independent init unless noted, seeds 0..{args.seeds - 1}\n")
    for steps in args.steps:
        print(f"### T = {steps} local steps\n")
        print("| method | Σ-RMSD | Σ-RMSD / floor | matched cosine | orth. gap | secure sums | s/run |")
        print("|---|---|---|---|---|---|---|")
        for name, base in ROWS:
            cfg = replace(base, rounds=args.rounds, local_steps=steps, proximity=args.gamma)
            rmsd, ratio, cos, gap, secs, sums = [], [], [], [], [], []
            for seed, (pl, floor) in enumerate(zip(data, floors, strict=True)):
                t0 = time.perf_counter()
                run = run_fnmf(pl.clients, 5, cfg, np.random.default_rng(1000 + seed), truth=pl.v)
                secs.append(time.perf_counter() - t0)
                rmsd.append(run.sigma_rmsd)
                ratio.append(run.sigma_rmsd / floor)
                cos.append(run.matched_cosine)
                gap.append(run.orthogonality_gap)
                sums.append(run.sync_rounds)
            trusted = cfg.method is Method.FNMF_TRUSTED
            cells = [_cell(rmsd), _cell(ratio, 2), _cell(cos), _cell(gap, 2)]
            cells += ["– (individual matrices)" if trusted else f"{np.mean(sums):.1f}", f"{np.mean(secs):.1f}"]
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        print()
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
