"""Colluding devices that skip their DP noise (protocol 1.12): the honest survivors alone still carry μ.

Real device and server sessions (`tests.support.secagg_harness`), zero inputs, so the released sum is the
noise the survivors kept.  The worst case the round admits: s = t_min survivors, f = ⌊γ n⌋ of them colluders
that add none.  Before 1.12 each survivor kept μ/s, so the honest ones carried (s − f)/s · μ (0.925 μ here);
now each keeps μ/(s − f).
"""

from __future__ import annotations

import numpy as np
import pytest

from protocol.noise import colluding_devices, minimum_survivors
from protocol.session import Phase
from tests.support.secagg_harness import run_secagg_round

N, OMEGA, GAMMA, MU, LENGTH = 100, 0.33, 0.05, 400.0, 20_000


def _released_noise_variance(dp_colluders: int | None) -> tuple[float, int, int]:
    t_min = minimum_survivors(N, OMEGA)
    f = colluding_devices(N, GAMMA)
    dropped = range(t_min, N)  # the most the round tolerates drop before their masked input
    result = run_secagg_round(
        [np.zeros(LENGTH, dtype=np.uint32)] * N,
        dropouts={Phase.MASKED_INPUT: dropped},
        dropout_rate=OMEGA,
        adversary_rate=GAMMA,
        dp_mu=MU,
        silent=range(f),  # colluders among the survivors
        dp_colluders=dp_colluders,
        seed=3,
    )
    assert result.total is not None, result.error
    assert len(result.survivors) == t_min
    released = result.total.view(np.int32).astype(np.int64)
    assert np.array_equal(released, result.kept_noise)  # the masks cancelled: only the kept noise is left
    return float(np.var(released)), t_min, f


def test_colluders_skipping_their_noise_leave_mu_from_the_honest_survivors() -> None:
    var, t_min, f = _released_noise_variance(None)
    assert (t_min, f) == (67, 5)
    # Sampling error of the variance over 20,000 coordinates is about 1%.
    assert var == pytest.approx(MU, rel=0.04)
    assert var >= 0.95 * MU


def test_without_the_colluder_calibration_the_noise_falls_short() -> None:
    # The control: a server stating f = 0 (what a 1.11 server does, and what the device floor now refuses)
    # leaves only (s − f)/s · μ once the colluders skip their noise.
    var, t_min, f = _released_noise_variance(0)
    assert var == pytest.approx((t_min - f) / t_min * MU, rel=0.04)
    assert var < 0.95 * MU
