"""fedsim.evaluation.als: the batched normal-equation solve against a per-row reference, and a sanity check."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from fedsim.data.splits import carve_validation
from fedsim.data.synthetic import synthetic
from fedsim.evaluation.als import _half_step, implicit_als
from fedsim.evaluation.ranking import evaluate_all_items, popularity_scorer


def test_half_step_matches_per_row_reference() -> None:
    rng = np.random.default_rng(0)
    dense = (rng.random((300, 80)) < rng.random((300, 1)) * 0.3).astype(np.float64)
    dense[[4, 17]] = 0.0  # rows without ratings
    dense[9] = 1.0  # a row rating everything
    R = sp.csr_matrix(dense)
    Y = rng.normal(size=(80, 6))
    alpha, reg = 7.0, 0.3
    want = np.empty((300, 6))
    for u in range(300):  # Hu, Koren, Volinsky eq. 4, row by row
        c = 1.0 + alpha * dense[u]
        want[u] = np.linalg.solve(Y.T @ (c[:, None] * Y) + reg * np.eye(6), Y.T @ (c * dense[u]))
    for budget in (1 << 22, 600):  # one chunk per length class, and many tiny chunks
        np.testing.assert_allclose(_half_step(R, Y, alpha, reg, budget=budget), want, rtol=1e-9, atol=1e-12)


def test_beats_popularity_on_planted_clusters() -> None:
    data = synthetic(n_users=400, n_items=300, ratings_per_user=30, seed=2)
    fit, test = carve_validation(data, 0.2, seed=0)
    X, Y = implicit_als(fit, factors=16, iterations=8)
    als = evaluate_all_items((X, Y), fit, test, k=20)
    pop = evaluate_all_items(popularity_scorer(fit), fit, test, k=20)
    assert als.recall > 1.2 * pop.recall
