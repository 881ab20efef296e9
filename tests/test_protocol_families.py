"""protocol.families: the family logic both sides import.  The linear-assignment solver (the device's
FNMF alignment and the server's trusted barycenter) is checked against scipy's, the reference solver,
on square, rectangular and tie-heavy costs; the upload layout round-trips."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from protocol.families.fnmf import linear_assignment, split_upload, upload_length, upload_vector
from protocol.spec import Alignment


@pytest.mark.parametrize("seed", range(6))
def test_linear_assignment_is_optimal_like_scipy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(60):
        n, m = int(rng.integers(1, 13)), int(rng.integers(1, 13))
        C = rng.random((n, m))
        if rng.random() < 0.4:
            C = np.round(C * 3)  # many ties: the optimum cost, not the pairs, is unique
        rows, cols = linear_assignment(C)
        r_ref, c_ref = linear_sum_assignment(C)
        assert rows.size == cols.size == min(n, m)
        assert np.all(np.diff(rows) > 0) and np.unique(cols).size == cols.size
        assert C[rows, cols].sum() == pytest.approx(C[r_ref, c_ref].sum(), abs=1e-12)
        if not np.any(np.round(C * 3) == C):  # continuous costs: the optimum is unique
            np.testing.assert_array_equal(cols, c_ref)


def test_linear_assignment_refuses_bad_costs() -> None:
    with pytest.raises(ValueError, match="2-D"):
        linear_assignment(np.zeros(3))
    with pytest.raises(ValueError, match="NaN or infinity"):
        linear_assignment(np.array([[0.0, np.inf], [1.0, 2.0]]))


@pytest.mark.parametrize("alignment", list(Alignment))
def test_upload_layout_round_trips(alignment: Alignment) -> None:
    rng = np.random.default_rng(1)
    k, m = 3, 7
    V, V_bar = rng.random((k, m)), rng.random((k, m))
    P = np.eye(k)[[2, 0, 1]]
    up = upload_vector(V, V_bar, P, alignment)
    assert up.shape == (upload_length(k, m, alignment),)
    delta, counts = split_upload(up, k, m, alignment)
    np.testing.assert_array_equal(delta, P @ V - V_bar)
    if alignment == Alignment.LAP_RHO:
        np.testing.assert_array_equal(counts, np.ones(k))
    else:
        assert counts is None
    with pytest.raises(ValueError, match="entries"):
        split_upload(up[:-1], k, m, alignment)
