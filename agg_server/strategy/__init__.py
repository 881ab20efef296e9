"""Server strategies: pure numpy aggregation of the cohort's secure sum."""

from __future__ import annotations

from agg_server.strategy.lightfr import (
    Aggregation,
    LightFRStrategy,
    agg_grad,
    agg_para,
    cold_start_items,
)

__all__ = ["Aggregation", "LightFRStrategy", "agg_grad", "agg_para", "cold_start_items"]
