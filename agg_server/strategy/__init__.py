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
            bits=m.bits, lam=m.lam, aggregation=Aggregation(m.aggregation), flip_fraction=m.flip_fraction
        )
        return LightFRServerStrategy(
            rule, m.n_items, negatives=m.negatives, local_epochs=m.local_epochs, max_sweeps=m.max_sweeps
        )
    try:
        if m.kind == "mf":
            from agg_server.strategy.mf import MFStrategy

            c = config.mf
            return MFStrategy(
                n_items=m.n_items,
                rank=c.rank,
                max_norm2=c.max_norm2,
                server_lr=c.server_lr,
                learning_rate=c.learning_rate,
                reg=c.reg,
                pretrain_epochs=c.pretrain_epochs,
                local_epochs=c.local_epochs,
                negatives=c.negatives,
            )
        if m.kind == "felb":
            from agg_server.strategy.felb import FELBStrategy

            b = config.felb
            return FELBStrategy(
                rank=b.rank,
                n_items=m.n_items,
                kappa=b.kappa,
                reg=b.reg,
                reg_growth=b.reg_growth,
                proximity=b.proximity,
                inertia=b.inertia,
                local_epochs=b.local_epochs,
                step_rule=b.step_rule,
                server_scale=b.server_scale,
            )
        if m.kind == "fnmf":
            from agg_server.strategy.fnmf import FNMFStrategy

            n = config.fnmf
            return FNMFStrategy(
                rank=n.rank,
                n_items=m.n_items,
                local_steps=n.local_steps,
                proximity=n.proximity,
                inertia=n.inertia,
                alignment=n.alignment,
            )
    except ValueError as exc:
        raise ConfigError(f"[{m.kind}] {exc}") from exc
    raise ConfigError(f"model.kind: {m.kind!r} has no server strategy")
