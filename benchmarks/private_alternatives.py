"""Two private mechanisms fedrec does not ship, measured on validation to decide whether to build them.

Neither goes through the private-round simulator: each release is a sum with Gaussian noise of the σ the RDP
accountant (`protocol.rdp`, Gaussian curve α/(2σ²) per release, sensitivity 1) gives the same split of ε at
δ = 1e-5, times ``--inflation`` (1.06: what the shipped rounds add for colluders and rounding).  The output says
so on its first line.  Validation only: neither reads a test split.

``item-item`` (amazon-book, validation Recall@20 on the carve `fedrec simulate` validates on, 5,000 users):
one release of the private popularity (share ``--pop-share``), then one release of the item-item Gram
Σ_u x̃_u x̃_uᵀ restricted to the K items of highest private count (x̃_u the user's indicator over those items
at L2 norm 1 before restriction, so ‖x̃_u x̃_uᵀ‖_F <= 1), and EASE (ridge λ) on the noisy Gram, the rest of
the catalogue ranked below by the private count.  Without noise, the same EASE for reference.

``head-split`` (a rating file, leave-one-out, HR@10 among 100 on the validation blocks): the shipped
one release of every device's indicator at L2 norm 1, against two releases: the first (share a) finds the
head (noisy count >= τ·σ₁), the second spreads every device's unit norm over its items outside the head;
the head ranks first by the first release, the rest by the second.  Mean of 5 noise draws.

    python benchmarks/private_alternatives.py item-item                      # FEDREC_DATA or --data-dir
    python benchmarks/private_alternatives.py head-split --dataset ratings.csv --sigma 0.655
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from numpy.typing import NDArray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedsim.data.datasets import find_data_dir, load_amazon_book  # noqa: E402
from fedsim.evaluation.experiment import prepare  # noqa: E402
from fedsim.evaluation.ranking import TieMode, evaluate_all_items, evaluate_candidates  # noqa: E402
from fedsim.private.served import carve_validation  # noqa: E402
from protocol.rdp import ORDERS, rdp_to_epsilon  # noqa: E402

DELTA = 1e-5


def gaussian_epsilon(sigmas: list[float]) -> float:
    """ε at `DELTA` of Gaussian releases of sensitivity 1 and noise ``sigmas``, composed by RDP."""
    orders = np.asarray(ORDERS, dtype=np.float64)
    return rdp_to_epsilon(orders * sum(1.0 / (2.0 * s * s) for s in sigmas), DELTA)


def _smallest_sigma(too_small: Callable[[float], bool]) -> float:
    lo, hi = 1e-3, 1e3
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if too_small(mid) else (lo, mid)
    return hi


def split_sigmas(epsilon: float, pop_share: float) -> tuple[float, float]:
    """(σ of the popularity release at pop_share·ε alone, σ of one more release meeting ε composed)."""
    s_pop = _smallest_sigma(lambda s: gaussian_epsilon([s]) > pop_share * epsilon)
    s_rest = _smallest_sigma(lambda s: gaussian_epsilon([s_pop, s]) > epsilon)
    return s_pop, s_rest


def item_item(args: argparse.Namespace) -> None:
    data_dir = args.data_dir or find_data_dir()
    split = load_amazon_book(data_dir)
    fit, val = carve_validation(split.train, 0)
    n, m = fit.n_users, fit.n_items
    X = sp.csr_matrix((np.ones(len(fit)), (fit.users, fit.items)), shape=(n, m))
    X.sum_duplicates()
    X.data[:] = 1.0
    k = np.asarray(X.sum(axis=1)).ravel()
    Xn = sp.diags(1.0 / np.sqrt(np.maximum(k, 1.0))) @ X
    s_pop, s_gram = (s * args.inflation for s in split_sigmas(args.epsilon, args.pop_share))
    rng = np.random.default_rng(args.seed)
    counts = np.asarray(Xn.sum(axis=0)).ravel() + rng.normal(0.0, s_pop, m)
    users = np.random.default_rng(0).choice(n, min(5000, n), replace=False)

    def recall(score: Callable[[NDArray[np.int64]], NDArray[np.float64]]) -> float:
        return evaluate_all_items(score, fit, val, k=20, users=users, seed=0).recall

    print(f"ε = {args.epsilon:g}: σ popularity {s_pop:.3f}, σ Gram {s_gram:.3f} (devices per entry)")
    print(f"private popularity: {recall(lambda u: np.broadcast_to(counts, (len(u), m)).copy()):.4f}")
    for K in args.items:
        top = np.argsort(-counts)[:K]
        G = (Xn[:, top].T @ Xn[:, top]).toarray()
        noise = np.triu(rng.normal(0.0, s_gram, (K, K)))
        noisy = G + noise + np.triu(noise, 1).T
        rows = X[:, top]
        for lam, gram, label in [(lam, noisy, "noisy") for lam in args.ridge] + [(10.0, G, "no noise")]:
            P = np.linalg.inv(gram + lam * np.eye(K))
            B = -P / np.diag(P)[None, :]
            np.fill_diagonal(B, 0.0)

            def score(u: NDArray[np.int64], B: NDArray = B, top: NDArray = top, rows: sp.csr_matrix = rows) -> NDArray:
                s = np.full((len(u), m), -1e9) + counts[None, :] * 1e-6  # the rest, by the private count
                s[:, top] = rows[u] @ B + counts[top][None, :] * 1e-6
                return s

            print(f"K = {K}, λ = {lam:g}, {label}: EASE validation Recall@20 {recall(score):.4f}", flush=True)


def head_split(args: argparse.Namespace) -> None:
    exp = prepare(args.dataset, seed=0)
    tr = exp.train
    n, m = tr.n_users, tr.n_items
    k = np.bincount(tr.users, minlength=n).astype(np.float64)
    sigma = args.sigma

    def hr(score: NDArray[np.float64], blocks: object) -> float:
        return evaluate_candidates(score[blocks.items], 10, TieMode.RANDOM).hr  # type: ignore[attr-defined]

    def draws(make: Callable[[np.random.Generator], NDArray[np.float64]]) -> str:
        got = [hr(make(np.random.default_rng(100 + r)), exp.val) for r in range(5)]
        return f"validation {np.mean(got):.4f} (draws {min(got):.4f}–{max(got):.4f})"

    pop = np.bincount(tr.items, minlength=m).astype(np.float64)
    print(f"{args.dataset}: {n} devices, {m} items; σ of one release at the whole ε: {sigma:g}")
    print(f"popularity (no DP): validation {hr(pop, exp.val):.4f}")
    once = np.bincount(tr.items, weights=1.0 / np.sqrt(np.maximum(k, 1.0))[tr.users], minlength=m)
    print(f"one release (shipped): {draws(lambda g: once + g.normal(0.0, sigma, m))}")
    for a in args.shares:
        s1, s2 = sigma / math.sqrt(a), sigma / math.sqrt(1.0 - a)  # Gaussian composition: 1/σ² adds
        for tau in args.tau:

            def two(g: np.random.Generator, s1: float = s1, s2: float = s2, tau: float = tau) -> NDArray[np.float64]:
                first = once + g.normal(0.0, s1, m)
                head = first >= tau * s1
                rest = ~head[tr.items]
                kr = np.bincount(tr.users[rest], minlength=n).astype(np.float64)
                w = np.where(rest, 1.0 / np.sqrt(np.maximum(kr[tr.users], 1.0)), 0.0)
                second = np.bincount(tr.items, weights=w, minlength=m) + g.normal(0.0, s2, m)
                return np.where(head, 1e6 + first, second)

            print(f"two releases, share {a:g} to the first, head at {tau:g}σ₁: {draws(two)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    ii = sub.add_parser("item-item")
    ii.add_argument("--data-dir", type=Path)
    ii.add_argument("--epsilon", type=float, default=8.0)
    ii.add_argument("--pop-share", type=float, default=0.05)
    ii.add_argument("--items", type=int, nargs="+", default=[1000, 2000, 3000])
    ii.add_argument("--ridge", type=float, nargs="+", default=[150, 300, 600, 1200])
    ii.add_argument("--seed", type=int, default=1)
    hs = sub.add_parser("head-split")
    hs.add_argument("--dataset", required=True)
    hs.add_argument("--sigma", type=float, required=True, help="σ of one release at the whole ε (the plan's)")
    hs.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5])
    hs.add_argument("--tau", type=float, nargs="+", default=[3, 4, 5, 6])
    ii.add_argument("--inflation", type=float, default=1.06)
    args = p.parse_args()
    print(
        f"not the shipped path: Gaussian releases at the RDP accountant's σ for the same split (× {args.inflation:g} "
        "for colluders and rounding), no Skellam noise, no secure sum; validation only"
        if args.what == "item-item"
        else "not the shipped path: Gaussian releases of the given σ split by Gaussian composition; mean of 5 draws"
    )
    (item_item if args.what == "item-item" else head_split)(args)


if __name__ == "__main__":
    main()
