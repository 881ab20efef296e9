"""LightFR's device-side configuration (`LightFRConfig`), what one local round uploads (`LocalUpdate`), and
how a round's training plan replaces the configuration's plan parameters (`apply_plan`).

The training parameters' defaults and bounds are `protocol.plan.LightFRParams`' (a round's plan replaces
them); the model that holds a configuration is `device_sdk.models.LightFRModel`, whose module re-exports
these names.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from protocol.plan import LightFRParams, TrainingPlan
from protocol.spec import MAX_RANK, Aggregation

if TYPE_CHECKING:
    from device_sdk.models import LightFRModel

__all__ = ["LightFRConfig", "LocalUpdate", "apply_plan"]

_KIND = "lightfr"
_PARAMS = LightFRParams()


@dataclass(frozen=True, slots=True)
class LightFRConfig:
    """Hyper-parameters of LightFR on a device.

    Attributes
    ----------
    bits : code length f (64 by default, as in the paper).
    lam : balance weight λ.  The paper uses 0.6, but at f = 64 the balance term (≥ 2λ per bit)
        then outweighs the data term (≈ |Ω_u|/f) for almost every user, so DCD flips nothing and codes
        stay random; 0 (the authors' reference code) learns.  See docs/design.md §2.2.
    negatives : sampled unobserved items per observed rating, fitted as rating 0 (implicit feedback,
        resampled every local epoch); 0 fits the observed ratings only (the paper's explicit setting).
    local_epochs : local epochs E per round.
    max_sweeps : cap on DCD sweeps over the f bits per epoch.
    rating_range : (r_min, r_max) used to normalise raw ratings to [0, 1]; None means the ratings
        given are already normalised.
    binary_positives : fit every observed rating as 1 (pure implicit feedback) instead of its
        normalised value.
    unobserved_weight : w0 (0.1 for a model trained alone; in federated rounds the server's plan sets
        it, by default from the catalogue's density, `protocol.families.lightfr.density_weight`).
        0 selects the paper's objective with ``negatives`` sampled unobserved items; w0 > 0 the
        all-items objective (every unobserved item at target 0 with weight w0, through the item Gram;
        ``negatives`` is then unused; see `device_sdk.lightfr.dcd_full`).
    confidence : α ≥ 0 of the all-items objective: observed items weigh c = 1 + α (w0 ≤ c).
    query_planes : P in [0, 8].  P >= 1 (all-items objective only: refused with ``unobserved_weight = 0``,
        as the server's config and the round plan refuse it) is asymmetric scoring: the device
        solves its real-valued vector exactly against the item codes (`lightfr.ridge_users`) instead of
        a ±1 code by DCD, keeps it as P ±1 bit-planes and a weight, uploads the same parts with it, and
        `recommend` ranks by the integer a·Σ_p 2^p(f − 2·Hamming) + 2^8·level (`device_sdk.topk.plane_scores`).
        0 (default): ±1 user codes.  In federated rounds the plan sets it (protocol 1.6,
        `protocol.plan.LightFRParams.query_planes`; a plan from a 1.5 server means 0).
    user_reg : ridge weight of that solve, in [1e-6, 1e6] (the plan's bounds; set by the plan too).
    rank_planes : a device setting (not in the plan): with ``query_planes`` >= 1, the planes of the vector
        the device keeps and ranks with (0 = ``query_planes``), while its uploads keep ``query_planes``
        planes.  With ``query_planes`` 0 under the all-items objective (symmetric training): the device
        still trains and uploads with its ±1 code by DCD, and also solves its real-valued vector against
        the item codes (ridge weight ``rank_ridge``·w0·m) and ranks with it as ``rank_planes`` planes
        (`fit_local`, `fold_in`; the vector depends only on the ratings and the model, so
        `refresh_ranking` (which `DeviceClient` runs on adopting a model) or `fold_in` after a download
        refreshes it); 0 ranks with the ±1 code; unused without the all-items objective
        (and accepted then: the plan switches the objective and the planes round by round, `apply_plan`,
        and this standing preference must survive a round whose plan turns them off).
    rank_ridge : a device setting (not in the plan): the ridge weight of that ranking-time solve in units
        of w0·m (tr(w0·DᵀD)/f, the unobserved term's weight on the catalogue), > 0.
    substring_index : a device setting (not in the plan): let `recommend` for one user search a
        catalogue of 786,432 items or more (262,144 for a plane user; f = 64) through exact
        multi-index hashing tables
        (`device_sdk.topk.HammingIndex`), built on the first such call: about 48 bytes an item (480 MB
        at 10^7 items) beside the 8 of the codes, and a few times faster than the scan.  False keeps
        the linear scan and no extra memory; the recommendations are the same either way.
    candidates : a device setting (not in the plan): C, the items stage 1 of the two-stage ranking keeps
        per user (`device_sdk.lightfr_rank`).  A user ranked with a real-valued vector (the model's item
        embeddings, `LightFRModel.set_embeddings`) or with bit-planes has its C best items by the
        Hamming distance of its sign code plus the item term found by one XOR + popcount scan, and only
        those re-scored by E·u or by the planes: exact among the C, not over the catalogue (see
        `device_sdk.realvalued.stage1_recall`).  0: no stage 1, every item scored by the planes (exact,
        several times slower) or by E·u (exact, a float product per item).
    rerank : a device setting (not in the plan): False switches stage 2 off for the smallest devices:
        `recommend` returns stage 1's own N best (the Hamming distance of the vector's sign plus the item
        term, scored 1 − v/f), one scan and no planes or embeddings read; a user with only a ±1 code
        ranks as always.
    """

    bits: int = 64
    # The training parameters: defaults and bounds are `protocol.plan.LightFRParams`' (a round's plan
    # replaces them).
    lam: float = _PARAMS.lam
    negatives: int = _PARAMS.negatives
    local_epochs: int = _PARAMS.local_epochs
    max_sweeps: int = _PARAMS.max_sweeps
    rating_range: tuple[float, float] | None = (1.0, 5.0)
    binary_positives: bool = False
    unobserved_weight: float = _PARAMS.unobserved_weight
    confidence: float = _PARAMS.confidence
    query_planes: int = _PARAMS.query_planes
    user_reg: float = _PARAMS.user_reg
    rank_planes: int = 3
    rank_ridge: float = 2.0
    substring_index: bool = True
    candidates: int = 200
    rerank: bool = True

    def __post_init__(self) -> None:
        bits = self.bits
        if isinstance(bits, bool) or not isinstance(bits, int | np.integer) or not 1 <= bits <= MAX_RANK:
            raise ValueError(f"bits must be an integer in [1, {MAX_RANK}], got {bits!r}")
        planes = self.query_planes
        if isinstance(planes, bool) or not isinstance(planes, int | np.integer) or not 0 <= planes <= 8:
            raise ValueError(f"query_planes must be an integer in [0, 8], got {planes!r}")
        ranked = self.rank_planes
        if isinstance(ranked, bool) or not isinstance(ranked, int | np.integer) or not 0 <= ranked <= 8:
            raise ValueError(f"rank_planes must be an integer in [0, 8], got {ranked!r}")
        if not (isinstance(self.user_reg, int | float) and np.isfinite(self.user_reg) and self.user_reg > 0):
            raise ValueError(f"user_reg must be a finite number > 0, got {self.user_reg!r}")
        ridge = self.rank_ridge
        if isinstance(ridge, bool) or not (isinstance(ridge, int | float) and np.isfinite(ridge) and 0 < ridge <= 1e6):
            raise ValueError(f"rank_ridge must be a finite number in (0, 1e6], got {ridge!r}")
        if not isinstance(self.substring_index, bool):
            raise ValueError(f"substring_index must be a bool, got {self.substring_index!r}")
        cand = self.candidates
        if isinstance(cand, bool) or not isinstance(cand, int | np.integer) or not 0 <= cand <= 1 << 20:
            raise ValueError(f"candidates must be an integer in [0, {1 << 20}], got {cand!r}")
        if not isinstance(self.rerank, bool):
            raise ValueError(f"rerank must be a bool, got {self.rerank!r}")
        w0 = self.unobserved_weight
        if planes and isinstance(w0, int | float) and not isinstance(w0, bool) and w0 == 0:
            # Would train ±1 codes by DCD while asking for planes; the server's config and the plan refuse it too.
            raise ValueError(
                f"query_planes: {planes} planes (asymmetric scoring) need the all-items objective, "
                f"unobserved_weight > 0, got unobserved_weight={w0!r}; set unobserved_weight > 0 or query_planes=0"
            )
        self.params(Aggregation.GRAD)  # the plan's bounds, as the server's config checks them
        if self.rating_range is not None:
            bounds = self.rating_range
            if not (
                isinstance(bounds, tuple | list)
                and len(bounds) == 2
                and all(
                    isinstance(b, int | float | np.integer | np.floating) and not isinstance(b, bool) for b in bounds
                )
                and np.isfinite(bounds[0])
                and np.isfinite(bounds[1])
                and bounds[1] > bounds[0]
            ):
                raise ValueError(f"rating_range must be (low, high), finite numbers with high > low, got {bounds!r}")

    def params(self, aggregation: Aggregation) -> LightFRParams:
        """These training parameters as a `protocol.plan.LightFRParams` (which validates them; a parameter
        this configuration does not hold is the plan's default)."""
        return LightFRParams(aggregation=aggregation, **{name: getattr(self, name) for name in _PLAN_NAMES})

    def normalize(self, ratings: NDArray[np.float64] | None, n: int) -> NDArray[np.float64]:
        """Targets in [0, 1] for ``n`` observed ratings (all 1 when ``ratings`` is None)."""
        if ratings is None or self.binary_positives:
            return np.ones(n)
        r = np.asarray(ratings, dtype=np.float64)
        if r.shape != (n,):
            raise ValueError(f"expected {n} ratings, got shape {r.shape}")
        if not np.all(np.isfinite(r)):
            raise ValueError("ratings must be finite")
        if self.rating_range is None:
            return r
        lo, hi = self.rating_range
        return (r - lo) / (hi - lo)


#: The plan's parameters a device's configuration holds: a round's plan replaces them (`apply_plan`).
_PLAN_NAMES = tuple(f.name for f in fields(LightFRConfig) if f.name in {g.name for g in fields(LightFRParams)})


@dataclass(frozen=True, slots=True)
class LocalUpdate:
    """What one device uploads after a local round.

    Attributes
    ----------
    values : (m, f) float64 item gradient (Agg_grad) or int64 updated item codes (Agg_para); dense,
        so that which items the user rated stays hidden inside secure aggregation.
    aggregation : which rule the values are for.
    n_examples : observed ratings plus sampled negatives fitted in the last epoch.
    flips : user-code bits flipped by DCD over all epochs.
    parts : under the all-items objective, every part of the upload by name
        (`protocol.families.lightfr.UploadLayout`; ``values`` is then its "gradient").
    """

    values: NDArray[Any]
    aggregation: Aggregation
    n_examples: int
    flips: int
    parts: dict[str, NDArray[np.float64]] | None = None


def apply_plan(model: LightFRModel, plan: TrainingPlan) -> None:
    """Adopt the round's training plan (λ, negatives, epochs, sweeps, w0, α, and since protocol 1.6 the
    query planes P and ridge weight of asymmetric scoring) after checking it fits the model the device
    holds.  The plan wins over the device's own setting: P = 0 in the plan (a 1.5 server's) trains and
    ranks with a ±1 user code."""
    plan.check_fits(_KIND, model.n_items, model.config.bits)
    p = plan.params
    assert isinstance(p, LightFRParams)
    model.config = replace(model.config, **{name: getattr(p, name) for name in _PLAN_NAMES})
