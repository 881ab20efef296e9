"""Shared pieces of the server tests: a small config, per-user data, and an HTTP fleet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from agg_server.config import ServerConfig, config_from_dict
from fedsim.data.synthetic import synthetic

N_ITEMS = 60
BITS = 16


def small_config(data_dir: Path, *, cohort: int, timeout: float = 3.0, **rounds: Any) -> ServerConfig:
    base = {
        "cohort_size": cohort,
        "min_cohort": 3,
        "seed": 5,
        "clip_norm": 64.0,
        "scale_bits": 12,
        "advertise_timeout": timeout,
        "share_keys_timeout": timeout,
        "masked_input_timeout": timeout,
        "unmask_timeout": timeout,
        "round_interval": 0.05,
    }
    base.update(rounds)
    return config_from_dict(
        {
            "server": {"data_dir": str(data_dir), "port": 0},
            "model": {"n_items": N_ITEMS, "bits": BITS},
            "rounds": base,
        },
        base_dir=data_dir,
    )


def users(n: int, seed: int = 1) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    data = synthetic(n_users=n, n_items=N_ITEMS, ratings_per_user=10, seed=seed)
    out = {}
    for u in range(data.n_users):
        mask = data.users == u
        out[u] = (np.asarray(data.items[mask]), np.asarray(data.ratings[mask]))
    return out
