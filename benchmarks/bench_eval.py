"""Speed of the published full-ranking protocol on amazon-book: 70,591 users x 24,915 items, one core.

    python benchmarks/bench_eval.py

Times `fedsim.evaluation.ranking.evaluate_all_items` (Recall@20 / NDCG@20, seeded random ties) for item
popularity, float32 factors (f = 64), 64-bit codes ranked by Hamming distance (int16 scores, many
ties) and random scores.  The factors and codes are random: this measures speed, not quality
(benchmarks/quality_amazon.py measures quality).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core

import time  # noqa: E402

import numpy as np  # noqa: E402

from fedsim.data.datasets import load_amazon_book  # noqa: E402
from fedsim.evaluation.ranking import (  # noqa: E402
    Scorer,
    evaluate_all_items,
    hamming_scorer,
    popularity_scorer,
    random_scorer,
)
from protocol.codes import pack_signs  # noqa: E402


def main() -> None:
    t = time.perf_counter()
    data = load_amazon_book()
    print(f"load amazon-book (train.txt + test.txt): {time.perf_counter() - t:.2f} s")
    rng = np.random.default_rng(0)
    X = rng.normal(size=(data.train.n_users, 64))
    Y = rng.normal(size=(data.train.n_items, 64))
    codes = hamming_scorer(pack_signs(np.where(X > 0, 1, -1)), pack_signs(np.where(Y > 0, 1, -1)), 64)
    cases: list[tuple[str, Scorer]] = [
        ("popularity", popularity_scorer(data.train)),
        ("float32 factors, f = 64", (X, Y)),
        ("64-bit codes, Hamming (int16)", codes),
        ("random (uint16)", random_scorer(data.train.n_items, 0)),
    ]
    for name, scorer in cases:
        t = time.perf_counter()
        res = evaluate_all_items(scorer, data.train, data.test, k=20, seed=0)
        print(f"{name:<32}{time.perf_counter() - t:7.1f} s   {res}")


if __name__ == "__main__":
    main()
