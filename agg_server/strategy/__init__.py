"""Server strategies: pure numpy aggregation of the cohort's secure sum, one per model family, all
behind the `agg_server.strategy.base.Strategy` contract."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agg_server.strategy.base import Strategy
from agg_server.strategy.lightfr import (
    Aggregation,
    LightFRServerStrategy,
    LightFRStrategy,
    agg_grad,
    agg_para,
    cold_start_items,
)

if TYPE_CHECKING:
    from agg_server.config import ServerConfig

__all__ = [
    "Aggregation",
    "LightFRServerStrategy",
    "LightFRStrategy",
    "Strategy",
    "agg_grad",
    "agg_para",
    "build_strategy",
    "cold_start_items",
]


def build_strategy(config: ServerConfig) -> Strategy:
    """The strategy ``config.model.kind`` names, with the configured hyper-parameters."""
    m = config.model
    if m.kind == "lightfr":
        rule = LightFRStrategy(
            bits=m.bits, lam=m.lam, aggregation=Aggregation(m.aggregation), flip_fraction=m.flip_fraction
        )
        return LightFRServerStrategy(
            rule, m.n_items, negatives=m.negatives, local_epochs=m.local_epochs, max_sweeps=m.max_sweeps
        )
    raise ValueError(f"model.kind {m.kind!r} has no server strategy")
