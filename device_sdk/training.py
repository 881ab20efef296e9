"""One device's local work for a round: train on its own ratings as the invite's plan says, and turn
the update into the ring vector that secure aggregation masks.

Invariants:
- The ratings used never leave this function except inside the returned update, which is clipped,
  quantized and then only ever sent masked.
- Every random choice (which θ ratings, negatives, stochastic rounding) comes from the one generator
  passed in, in a fixed order, so a device with the same generator state produces the same vector —
  the in-process simulator and a device talking HTTP agree bit for bit.
- Agg_para uploads the change D^u − D (zero outside the rated items), not D^u itself: the server
  adds n·D back, and the change has a far smaller norm to clip.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import ArrayLike, NDArray

from device_sdk.models import LightFRModel
from protocol.messages import RoundInvite
from protocol.quantization import QuantizationConfig, QuantizationStats, quantize
from protocol.spec import Aggregation

__all__ = ["LocalRoundStats", "local_round", "apply_plan"]


@dataclass(frozen=True, slots=True)
class LocalRoundStats:
    """What the local round did (kept on the device; useful for logs and tests)."""

    examples: int
    flips: int
    quantization: QuantizationStats


def apply_plan(model: LightFRModel, invite: RoundInvite) -> None:
    """Adopt the round's training plan (λ, negatives, epochs, sweeps) after checking it fits the
    model the device holds."""
    if invite.model_kind != "lightfr":
        raise ValueError(f"this device runs LightFR; the round trains {invite.model_kind!r}")
    if invite.bits != model.config.bits or invite.n_items != model.n_items:
        raise ValueError(
            f"round plan is f={invite.bits}, m={invite.n_items}; the device model is "
            f"f={model.config.bits}, m={model.n_items}"
        )
    model.config = replace(
        model.config,
        lam=invite.lam,
        negatives=invite.negatives,
        local_epochs=invite.local_epochs,
        max_sweeps=invite.max_sweeps,
    )


def local_round(
    model: LightFRModel,
    invite: RoundInvite,
    items: ArrayLike,
    ratings: ArrayLike | None,
    rng: np.random.Generator,
) -> tuple[NDArray[np.uint32], LocalRoundStats]:
    """Train locally for one round and return the quantized update (length ``invite.vector_length``).

    Parameters
    ----------
    model : the device's model, holding the round's global item codes already.
    invite : the round invitation (plan, clipping and quantization parameters).
    items, ratings : this device's rated items and raw ratings (None for implicit feedback).
    rng : the round's generator for sampling and stochastic rounding.
    """
    apply_plan(model, invite)
    if not model.user_trained[0]:
        # The first round starts from a random code drawn from the round's generator, so that a
        # seeded simulation is reproducible and a real device's start is cryptographically random.
        model.reset_user(rng)
    item_ids = np.asarray(items, dtype=np.int64).ravel()
    values = None if ratings is None else np.asarray(ratings, dtype=np.float64).ravel()
    if values is not None and values.shape != item_ids.shape:
        raise ValueError(f"{item_ids.size} items but {values.size} ratings")
    if invite.example_cap and item_ids.size > invite.example_cap:
        # θ of the device's ratings per round bound its contribution (per-user DP).
        keep = np.sort(rng.choice(item_ids.size, invite.example_cap, replace=False))
        item_ids = item_ids[keep]
        values = None if values is None else values[keep]
    aggregation = Aggregation(invite.aggregation)
    update = model.fit_local(item_ids, values, aggregation=aggregation, rng=rng)
    x = update.values.astype(np.float64)
    if aggregation is Aggregation.PARA:
        x = x - model.item_codes
    cfg = QuantizationConfig(clip_norm=invite.clip_norm, scale_bits=invite.scale_bits)
    ring, qstats = quantize(x.ravel(), cfg, rng)
    if ring.size != invite.vector_length:
        raise ValueError(f"update has {ring.size} elements, the round expects {invite.vector_length}")
    return ring, LocalRoundStats(examples=update.n_examples, flips=update.flips, quantization=qstats)
