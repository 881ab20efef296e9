"""A round's shape: which of the waiting devices form its cohort and which SecAgg+ graph (k, t) and DP
survivor floor t_min it runs with, and the SecAgg+ parameters built from that shape — the one rule for
the coordinator (`agg_server.coordinator`) and the private-round simulator (`fedsim.private.simulator`).

Invariants:
- The cohort is drawn with the round's own generator only, so a seeded run draws the same cohort on
  every replay; nothing here keeps state.
- Operator-fixed (k, t) are used only for the full cohort they were validated for.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agg_server.enrollment import capped_cohort
from protocol.graph import find_parameters, validate_parameters
from protocol.noise import colluding_devices, minimum_survivors
from protocol.quantization import QuantizationConfig
from protocol.round_params import RoundParameters

__all__ = ["round_parameters", "round_shape"]


def round_shape(
    cfg: Any,
    fresh: list[int],
    rng: np.random.Generator,
    *,
    dp: bool,
    sources: dict[int, str] | None = None,
    max_source_share: float = 1.0,
) -> tuple[tuple[int, ...], int, int, int, int] | None:
    """A round's cohort (drawn from ``fresh`` with the round generator), graph degree k, threshold t, DP
    survivor floor t_min and the colluders f = ⌊γ n⌋ the noise is sized against (both 0 without DP), by
    the `[rounds]` config ``cfg``; None when the operator fixed (k, t) and fewer
    devices than the full cohort are available (those values were validated for that cohort only), or
    when the per-source cap leaves fewer than ``cfg.min_cohort`` devices.
    The one rule for the coordinator and the private-round simulator (`fedsim.private.simulator`).

    With ``max_source_share`` < 1, no credential source (``sources[device]``) fills more than that share
    of the cohort (`agg_server.enrollment.capped_cohort`)."""
    n = min(cfg.cohort_size, len(fresh))
    if max_source_share < 1.0 and sources is not None:
        cohort = capped_cohort(fresh, n, sources, max_source_share, rng)
        n = len(cohort)
        if n < cfg.min_cohort:
            return None
    else:
        cohort = tuple(sorted(int(d) for d in rng.choice(np.array(fresh), size=n, replace=False)))
    if cfg.k is not None and cfg.t is not None:
        if n < cfg.cohort_size:
            return None
        k, t = cfg.k, cfg.t
        validate_parameters(n, k, t, cfg.dropout_rate, cfg.adversary_rate)
    else:
        gp = find_parameters(n, cfg.dropout_rate, cfg.adversary_rate)
        k, t = gp.k, gp.t
    if not dp:
        return cohort, k, t, 0, 0
    return cohort, k, t, minimum_survivors(n, cfg.dropout_rate), colluding_devices(n, cfg.adversary_rate)


def round_parameters(
    round_id: int,
    vector_length: int,
    shape: tuple[int, int, int, int],
    quantization: QuantizationConfig,
    mu: float,
    *,
    deadlines: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0),
    authority_key: bytes = b"",
) -> RoundParameters:
    """The SecAgg+ parameters of round ``round_id`` with graph ``shape`` = (k, t, t_min, f) (from `round_shape`),
    the round's quantization and per-device noise ``mu``: what the coordinator opens a session with and
    what the private-round simulator replays (without deadlines or an enrollment authority)."""
    k, t, t_min, colluders = shape
    return RoundParameters(
        round_id=round_id,
        vector_length=vector_length,
        k=k,
        t=t,
        clip_norm=float(quantization.clip_norm),
        scale_bits=quantization.scale_bits,
        dp_mu=float(mu),
        dp_t_min=t_min,
        dp_colluders=colluders,
        deadlines=deadlines,
        authority_key=authority_key,
    )
