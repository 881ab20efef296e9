"""One device's local work for a round: train on its own ratings as the invite's plan says, and turn
the update into the ring vector that secure aggregation masks.  Works for every model family that
keeps the `device_sdk.family.FederatedModel` contract (LightFR, MF, FELB, FNMF).

Invariants:
- The ratings used never leave this function except inside the returned update, which is clipped,
  quantized and then only ever sent masked.
- Every random choice of training (which θ ratings, negatives) comes from the training generator passed
  in; the stochastic-rounding coins come from the device's noise stream (`protocol.samplers.NoiseStream`,
  a ChaCha20 keystream the server cannot predict), read before the session draws its DP noise from the
  same stream.  A device with the same generator and stream produces the same vector: the in-process
  simulator and a device talking HTTP agree bit for bit.
- LightFR's Agg_para uploads the change D^u − D (zero outside the rated items), not D^u itself: the
  server adds n·D back, and the change has a far smaller norm to clip.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from device_sdk.family import FederatedModel, LocalRatings
from device_sdk.models import apply_plan
from protocol.messages import RoundInvite
from protocol.quantization import QuantizationStats, quantize
from protocol.samplers import NoiseStream

__all__ = ["LocalRoundStats", "local_round", "apply_plan"]


@dataclass(frozen=True, slots=True)
class LocalRoundStats:
    """What the local round did (kept on the device; useful for logs and tests)."""

    examples: int
    flips: int
    quantization: QuantizationStats


def local_round(
    model: FederatedModel,
    invite: RoundInvite,
    items: ArrayLike | LocalRatings,
    ratings: ArrayLike | None,
    rng: np.random.Generator,
    *,
    coins: NoiseStream,
) -> tuple[NDArray[np.uint32], LocalRoundStats]:
    """Train locally for one round and return the quantized update (length ``invite.vector_length``).

    Parameters
    ----------
    model : the device's model, holding the round's global model already.
    invite : the round invitation (plan, clipping and quantization parameters).
    items, ratings : this device's rated items and raw ratings (None for implicit feedback); or
        ``items`` is a `LocalRatings` (several local users, cross-silo) and ``ratings`` is None.
    rng : the round's training generator (θ ratings, negatives).
    coins : the round's noise stream; the stochastic-rounding coins are its next ``vector_length`` words.

    Raises
    ------
    ValueError
        The plan is for another model kind or shape, or the data do not fit the model.
    """
    plan = invite.plan
    plan.check_fits(model.KIND, model.n_items, model.rank)
    if isinstance(items, LocalRatings):
        if ratings is not None:
            raise ValueError("pass ratings inside the LocalRatings")
        data = items
    else:
        data = LocalRatings.single_user(items, ratings)
    model.start_round(invite)
    result = model.local_update(plan, data, rng)
    x = np.asarray(result.vector, dtype=np.float64).ravel()
    if x.size != invite.vector_length:
        raise ValueError(f"update has {x.size} elements, the round expects {invite.vector_length}")
    ring, qstats = quantize(x, invite.quantization(), coins)
    flips = int(result.info.get("flips", 0))
    return ring, LocalRoundStats(examples=result.examples, flips=flips, quantization=qstats)
