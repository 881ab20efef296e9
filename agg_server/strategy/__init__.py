"""Server strategies: pure numpy aggregation of the cohort's secure sum, one per model family, all
behind the `agg_server.strategy.base.Strategy` contract."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
from protocol.errors import ConfigError

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
            bits=m.bits,
            lam=m.lam,
            aggregation=Aggregation(m.aggregation),
            flip_fraction=float(m.flip_fraction if m.flip_fraction is not None else 0.3),  # resolved by ModelSection
        )
        return LightFRServerStrategy(
            rule,
            m.n_items,
            negatives=m.negatives,
            local_epochs=m.local_epochs,
            max_sweeps=m.max_sweeps,
            unobserved_weight=m.first_unobserved_weight,
            unobserved_scale=m.unobserved_scale if m.unobserved_weight == "auto" else 0.0,
            confidence=m.confidence,
            hamming_weight=m.hamming_weight,
            counts_share=m.counts_share,
            popularity_span=m.popularity_span,
            mean_field=m.mean_field,
            code_sweeps=m.code_sweeps,
            query_planes=m.query_planes,
            user_reg=m.user_reg,
        )
    # The [mf], [felb] and [fnmf] tables name exactly their strategy's hyper-parameters.
    try:
        return _family(m.kind)(n_items=m.n_items, **dataclasses.asdict(getattr(config, m.kind)))
    except ValueError as exc:
        raise ConfigError(f"[{m.kind}] {exc}") from exc


def _family(kind: str) -> Callable[..., Strategy]:
    # Imported here: the family modules import `agg_server.strategy.base`, i.e. this package.
    if kind == "mf":
        from agg_server.strategy.mf import MFStrategy

        return MFStrategy
    if kind == "felb":
        from agg_server.strategy.felb import FELBStrategy

        return FELBStrategy
    if kind == "fnmf":
        from agg_server.strategy.fnmf import FNMFStrategy

        return FNMFStrategy
    raise ConfigError(f"model.kind: {kind!r} has no server strategy")
