"""Server strategies: pure numpy aggregation of the cohort's secure sum, one per model family, all
behind the `agg_server.strategy.base.Strategy` contract."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from agg_server.strategy.base import Strategy
from agg_server.strategy.lightfr import (
    Aggregation,
    LightFRServerParams,
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
    "LightFRServerParams",
    "LightFRServerStrategy",
    "LightFRStrategy",
    "Strategy",
    "agg_grad",
    "agg_para",
    "build_strategy",
    "cold_start_items",
]


def build_strategy(config: ServerConfig) -> Strategy:
    """The strategy ``config.model.kind`` names, built from that family's table (``[lightfr]``, ``[mf]``,
    ``[felb]``, ``[fnmf]`` or ``[ials]``), whose attributes are exactly the strategy's keyword arguments."""
    m = config.model
    table = getattr(config, m.kind)
    try:
        return _family(m.kind)(n_items=m.n_items, **{f.name: getattr(table, f.name) for f in dataclasses.fields(table)})
    except ValueError as exc:
        raise ConfigError(f"[{m.kind}] {exc}") from exc


def _family(kind: str) -> Callable[..., Strategy]:
    # Imported here: the family modules import `agg_server.strategy.base`, i.e. this package.
    if kind == "lightfr":
        return LightFRServerStrategy
    if kind == "mf":
        from agg_server.strategy.mf import MFStrategy

        return MFStrategy
    if kind == "felb":
        from agg_server.strategy.felb import FELBStrategy

        return FELBStrategy
    if kind == "fnmf":
        from agg_server.strategy.fnmf import FNMFStrategy

        return FNMFStrategy
    if kind == "ials":
        from agg_server.strategy.ials import IALSStrategy

        return IALSStrategy
    raise ConfigError(f"model.kind: {kind!r} has no server strategy")
