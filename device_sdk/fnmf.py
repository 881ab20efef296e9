"""Coherent federated NMF on the device (Dalleiger & Gionis, "Creating Coherence in Federated
Non-Negative Matrix Factorization"; `docs/design.md` §3.3): projected-gradient NMF
steps, the frozen-P alignment-aware proximal pull, and `FNMFModel`, the device side of the "anchored one-round"
secure variant.

Notation: a client holds X (n, m) ≥ 0 (its rows: many users in the cross-silo setting), its private
U (n, k) ≥ 0 and a local component matrix V (k, m) ≥ 0 in its *own* row order; the server's
V̄ (k, m) ≥ 0 is in the *global* order.  The alignments P of V to V̄ ("none", "lap", "lap_rho",
"sinkhorn") and the upload layout are `protocol.families.fnmf`'s, shared with the server.

Invariants:
- Every kernel is pure numpy: arrays in, new arrays out; no logging, no global randomness.  Python
  loops run over local steps, Sinkhorn iterations or the rank k, never over rows, items or entries.
- Gradients are those of the ½-squared loss ½‖X − UV‖²_F; step sizes are 1/L with the corrected
  Lipschitz constants L_U = ‖VVᵀ‖₂ and L_V = ‖UᵀU‖₂ (the paper prints them swapped).
- The upload is Δ = PV − diag(P𝟙)V̄ flattened (k·m), followed for "lap_rho" by the k match counts
  P𝟙: the server needs only the cohort's sum of it (`agg_server.strategy.fnmf.FNMFStrategy`).
- The model never sends U, X or its own V: only the upload vector leaves it.  Every random draw
  comes from the generator passed to `FNMFModel.local_update` (U first, then V when the client
  starts from its own V).
- Round 0 (``invite.round_index == 0``) trains against the untrained version-1 V̄, so the pull is
  off in that round (there is nothing to be coherent with yet) and "lap_rho" uploads with the plain
  LAP (no correlation with a random V̄ is significant).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from device_sdk.family import LocalRatings, LocalResult, RoundHooks
from device_sdk.retrieval import Recommender, as_items
from device_sdk.store import load_store, save_store
from protocol.codes import float_matrix_from_bytes
from protocol.errors import ModelError, StorageError
from protocol.families.fnmf import (
    align,
    lap_align,
    lap_rho_align,
    rho_distances,
    sinkhorn_align,
    upload_length,
    upload_vector,
)
from protocol.plan import FNMFParams, TrainingPlan
from protocol.spec import MAX_RANK, Alignment

__all__ = [
    "ALIGNMENTS",
    "FNMFConfig",
    "FNMFModel",
    "align",
    "frozen_prox",
    "lap_align",
    "lap_rho_align",
    "lipschitz_u",
    "lipschitz_v",
    "nmf_objective",
    "pgd_steps",
    "pgd_u",
    "pgd_v",
    "pull_target",
    "rho_distances",
    "sinkhorn_align",
    "upload_vector",
    "upload_length",
]

_KIND = "fnmf"
_PARAMS = FNMFParams()
ALIGNMENTS = tuple(a.value for a in Alignment)

Array = NDArray[np.float64]


# -- projected gradient NMF ----------------------------------------------------------------------
def nmf_objective(X: Array, U: Array, V: Array) -> float:
    """½‖X − UV‖²_F, the local data term."""
    R = X - U @ V
    return 0.5 * float(np.einsum("ij,ij->", R, R))


def _spectral_psd(G: Array) -> float:
    # G is a symmetric positive semi-definite k × k Gram matrix: its 2-norm is the largest eigenvalue
    # (eigvalsh is several times cheaper than the SVD behind np.linalg.norm(G, 2)).
    return max(float(np.linalg.eigvalsh(G)[-1]), 0.0)


def lipschitz_u(V: Array) -> float:
    """L_U = ‖VVᵀ‖₂, the Lipschitz constant of ∇_U ½‖X − UV‖² (corrected; see the module notes)."""
    return _spectral_psd(V @ V.T)


def lipschitz_v(U: Array) -> float:
    """L_V = ‖UᵀU‖₂, the Lipschitz constant of ∇_V ½‖X − UV‖²."""
    return _spectral_psd(U.T @ U)


def pgd_u(X: Array, U: Array, V: Array) -> tuple[Array, float]:
    """One projected gradient step on U with step 1/L_U: U ← [U − (UVVᵀ − XVᵀ)/L_U]_+.

    Returns the new U and the step η_U (0 when L_U = 0: U is then left as it is).
    """
    G = V @ V.T
    L = _spectral_psd(G)
    if L <= 0.0:
        return U.copy(), 0.0
    eta = 1.0 / L
    return np.maximum(0.0, U - eta * (U @ G - X @ V.T)), eta


def pgd_v(X: Array, U: Array, V: Array) -> tuple[Array, float]:
    """One projected gradient step on V with step 1/L_V: V ← [V − (UᵀUV − UᵀX)/L_V]_+."""
    G = U.T @ U
    L = _spectral_psd(G)
    if L <= 0.0:
        return V.copy(), 0.0
    eta = 1.0 / L
    return np.maximum(0.0, V - eta * (G @ V - U.T @ X)), eta


def pull_target(P: Array, V_bar: Array) -> tuple[Array, Array]:
    """V̄ brought into the client's row order, and which local rows it covers.

    Local row b's target is the P-weighted mean of the global rows matched to it
    (Σ_a P_ab V̄_a / Σ_a P_ab): V̄_a for a permutation, a convex combination for Sinkhorn.  Local rows
    no global row matched (``mask`` 0) are personal and get a zero target.

    Returns
    -------
    target : (k, m), mask : (k,) float64 in {0, 1}.
    """
    col = P.sum(axis=0)
    mask = (col > 0.0).astype(np.float64)
    Q = P.T / np.where(col > 0.0, col, 1.0)[:, None]
    return Q @ V_bar, mask


def frozen_prox(V: Array, target: Array, mask: Array, weight: float) -> Array:
    """The alignment-aware prox with P frozen: V_b ← (V_b + w·target_b)/(1 + w) on covered rows.

    With squared norms the exact frozen-P prox of step t is w = tγ (FELB's prox^p form); the
    paper's printed form drops the step (w = γ).  `FNMFConfig.scaled_prox` picks one.
    """
    w = weight * mask[:, None]
    return (V + w * target) / (1.0 + w)


def pgd_steps(
    X: Array,
    U: Array,
    V: Array,
    steps: int,
    *,
    V_bar: Array | None = None,
    gamma: float = 0.0,
    alignment: str = "none",
    scaled_prox: bool = True,
    inertia: float = 0.0,
    eps: float = 0.05,
    alpha: float = 0.05,
) -> tuple[Array, Array]:
    """T local iPALM steps (FNMF Alg. 2, client): a U step, a V step, then the pull towards P̂V̄.

    P̂ is recomputed at the current V on every step and frozen for the prox.  With ``inertia`` β > 0
    each block is first extrapolated, X ← X + β(X − X_prev) (iPALM).  With ``gamma`` 0 or no V̄ the
    pull is off (FedAvg's local solver).

    Returns
    -------
    The new (U, V); the inputs are not modified.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not 0.0 <= inertia < 1.0:
        raise ValueError(f"inertia must be in [0, 1), got {inertia}")
    if gamma < 0.0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    pull = gamma > 0.0 and V_bar is not None
    U_prev, V_prev = U, V
    for _ in range(steps):  # loop over local iterations
        Ue = U + inertia * (U - U_prev) if inertia else U
        U_prev = U
        U, _ = pgd_u(X, Ue, V)
        Ve = V + inertia * (V - V_prev) if inertia else V
        V_prev = V
        V, eta = pgd_v(X, U, Ve)
        if pull and V_bar is not None:
            target, mask = pull_target(align(V, V_bar, alignment, eps=eps, alpha=alpha), V_bar)
            V = frozen_prox(V, target, mask, gamma * eta if scaled_prox else gamma)
    return U, V


def _clip_keeping_counts(vector: Array, k: int, clip_norm: float) -> Array:
    """Shrink the Δ part of a "lap_rho" upload so that the whole vector has norm ≤ ``clip_norm``
    while its last k entries (match counts) stay exact."""
    counts = vector[-k:]
    room = clip_norm * clip_norm - float(counts @ counts)
    if room <= 0.0:
        raise ValueError(f"clip_norm {clip_norm} leaves no room for Δ beside {k} match counts (need clip_norm² > k)")
    delta = vector[:-k]
    norm = float(np.linalg.norm(delta))
    budget = math.sqrt(room) * (1.0 - 1e-12)  # a hair inside, so the quantizer's clip never rescales
    if norm <= budget:
        return vector
    return np.concatenate([delta * (budget / norm), counts])


# -- the device model ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FNMFConfig:
    """Device-side FNMF hyper-parameters (the round plan overrides steps, γ, β and alignment).

    Attributes
    ----------
    rank : component count k.
    local_steps : T projected-gradient steps per round.
    proximity : γ, the pull towards the aligned V̄.
    inertia : iPALM β in [0, 1).
    alignment : "none", "lap", "lap_rho" or "sinkhorn".
    scaled_prox : True for the exact frozen-P prox (V + tγP̂V̄)/(1 + tγ) with t the V step; False
        for the paper's printed (V + γP̂V̄)/(1 + γ).
    sinkhorn_eps : entropic regularisation ε of "sinkhorn", relative to the largest cost.
    rho_alpha : significance level α of the "lap_rho" correlation test.
    independent_init : start round 0 from the client's own random V (the paper's setting) instead
        of the broadcast V̄.
    fold_in_steps : projected-gradient steps of `FNMFModel.fold_in`.
    """

    rank: int = 5
    # The training parameters: defaults and bounds are `protocol.plan.FNMFParams`' (a round's plan
    # replaces them).
    local_steps: int = _PARAMS.local_steps
    proximity: float = _PARAMS.proximity
    inertia: float = _PARAMS.inertia
    alignment: str = _PARAMS.alignment.value
    scaled_prox: bool = True
    sinkhorn_eps: float = 0.05
    rho_alpha: float = 0.05
    independent_init: bool = False
    fold_in_steps: int = 200

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_RANK:
            raise ValueError(f"rank must be in [1, {MAX_RANK}], got {self.rank}")
        if not 1 <= self.fold_in_steps <= 100_000:
            raise ValueError(f"fold_in_steps must be in [1, 1e5], got {self.fold_in_steps}")
        # The plan's bounds, as the server's config checks them (one validator).
        FNMFParams(
            local_steps=self.local_steps,
            proximity=self.proximity,
            inertia=self.inertia,
            alignment=self.alignment,  # type: ignore[arg-type]
        )
        if not (self.sinkhorn_eps >= 0.002 and math.isfinite(self.sinkhorn_eps)):
            raise ValueError(f"sinkhorn_eps must be a finite value >= 0.002, got {self.sinkhorn_eps}")
        if not 0.0 < self.rho_alpha < 1.0:
            raise ValueError(f"rho_alpha must be in (0, 1), got {self.rho_alpha}")


@dataclass
class FNMFModel(Recommender, RoundHooks):
    """The FNMF device model: private U and local V in the client's order, the global V̄ as received.

    Parameters
    ----------
    n_items : catalogue size m.
    config : hyper-parameters (`FNMFConfig`).
    rng : the default tie-breaking generator of `recommend`.
    """

    KIND: ClassVar[str] = _KIND
    n_items: int
    config: FNMFConfig = field(default_factory=FNMFConfig)
    model_version: int = 0
    v_bar: Array | None = field(default=None, repr=False)
    v_local: Array | None = field(default=None, repr=False)
    u: Array | None = field(default=None, repr=False)
    rng: np.random.Generator = field(default_factory=np.random.default_rng, repr=False)

    def __post_init__(self) -> None:
        if self.n_items <= 0:
            raise ValueError(f"n_items must be positive, got {self.n_items}")

    @property
    def rank(self) -> int:
        """Component count k."""
        return self.config.rank

    # -- the global model -------------------------------------------------------------------------
    def set_global(self, words: bytes, values: bytes, version: int) -> None:
        """Adopt V̄ (``values``: k·m little-endian float64, C order); ``words`` must be empty."""
        if words:
            raise ValueError("an FNMF model has no packed words")
        v = float_matrix_from_bytes(values, (self.rank, self.n_items))
        if np.any(v < 0.0):
            raise ValueError("V̄ must be finite and non-negative")
        self.v_bar = v
        self.model_version = int(version)

    def _require_global(self) -> Array:
        if self.v_bar is None:
            raise ModelError("no global model yet: call set_global first")
        return self.v_bar

    def alignment_matrix(self, V: Array | None = None) -> Array:
        """P aligning ``V`` (default: the local V) to V̄ with the configured alignment."""
        v_bar = self._require_global()
        V = self.v_local if V is None else V
        if V is None:
            return np.eye(self.rank)
        c = self.config
        return align(V, v_bar, c.alignment, eps=c.sinkhorn_eps, alpha=c.rho_alpha)

    def item_matrix(self) -> Array:
        """The component matrix this client scores with: V̄ in the client's row order (matched rows),
        its own rows where a local component is personal ("lap_rho")."""
        v_bar = self._require_global()
        if self.v_local is None:
            return v_bar.copy()
        target, mask = pull_target(self.alignment_matrix(), v_bar)
        return mask[:, None] * target + (1.0 - mask[:, None]) * self.v_local

    # -- training -------------------------------------------------------------------------------
    def apply_plan(self, plan: TrainingPlan) -> None:
        """Adopt the round plan (T, γ, β, alignment) after checking it fits this model."""
        plan.check_fits(_KIND, self.n_items, self.rank)
        p = plan.params
        assert isinstance(p, FNMFParams)
        self.config = replace(
            self.config,
            local_steps=p.local_steps,
            proximity=p.proximity,
            inertia=p.inertia,
            alignment=p.alignment.value,
        )

    def train(self, plan: TrainingPlan, data: LocalRatings, rng: np.random.Generator) -> Array:
        """Sync to V̄ and run T local steps; returns the trained local V (client order).

        The trusted-aggregator simulator sends this matrix itself; `local_update` sends only its
        aligned difference to V̄.
        """
        self.apply_plan(plan)
        v_bar = self._require_global()
        X = data.dense(self.n_items)
        k, n = self.rank, data.n_users
        if self.u is None or self.u.shape[0] != n:
            self.u = rng.random((n, k))
            own = rng.random((k, self.n_items)) if self.config.independent_init else None
            V = v_bar.copy() if own is None else own  # the first round starts from V̄ or the client's own V
        elif self.v_local is None:
            V = v_bar.copy()
        else:
            V = self.item_matrix()  # V_j ← V̄, in this client's order
        c = self.config
        pull = plan.round_index > 0
        self.u, V = pgd_steps(
            X,
            self.u,
            V,
            c.local_steps,
            V_bar=v_bar if pull else None,
            gamma=c.proximity,
            alignment=c.alignment,
            scaled_prox=c.scaled_prox,
            inertia=c.inertia,
            eps=c.sinkhorn_eps,
            alpha=c.rho_alpha,
        )
        self.v_local = V
        return V

    def align_update(self, *, first_round: bool = False) -> Array:
        """The upload of the current local V against the current V̄, without training (the
        "align-only" rounds of the exact fixed point over sums).

        With ``first_round`` the V̄ is the untrained version-1 draw: "lap_rho" then matches every
        component with the plain LAP (a correlation test against random numbers would leave all of
        them unmatched and V̄ would never move), keeping the upload's count layout.
        """
        v_bar = self._require_global()
        if self.v_local is None:
            raise ModelError("no local component matrix yet: train first")
        if first_round and self.config.alignment == "lap_rho":
            P = lap_align(self.v_local, v_bar)
        else:
            P = self.alignment_matrix()
        return upload_vector(self.v_local, v_bar, P, self.config.alignment)

    def local_update(self, plan: TrainingPlan, data: LocalRatings, rng: np.random.Generator) -> LocalResult:
        """One round of the anchored secure variant: sync, T local steps, align to V̄, upload Δ.

        For "lap_rho" the match counts must reach the server unscaled, but the upload is clipped
        to ``plan.clip_norm`` as a whole before quantization; so Δ alone is shrunk here to the
        norm the counts leave free, and the later clip is a no-op.

        Raises
        ------
        ValueError
            If the plan does not fit the model, or "lap_rho" runs with ``clip_norm² ≤ k``.
        """
        V = self.train(plan, data, rng)
        vector = self.align_update(first_round=plan.round_index == 0)
        if self.config.alignment == "lap_rho" and math.isfinite(plan.clip_norm):
            vector = _clip_keeping_counts(vector, self.rank, plan.clip_norm)
        if self.u is None:  # pragma: no cover - train always sets U
            raise ModelError("training produced no U")
        X = data.dense(self.n_items)
        P = self.alignment_matrix(V)
        info = {
            "objective": nmf_objective(X, self.u, V),
            "steps": self.config.local_steps,
            "matched": int(round(float((P.sum(axis=1) > 0).sum()))),
        }
        return LocalResult(vector=vector, examples=int(X.size), info=info)

    def fold_in(self, user_items: ArrayLike, ratings: ArrayLike | None = None, *, userid: int | None = None) -> Array:
        """A new row's coefficients u ≥ 0 minimising ½‖x − u·V‖² with this client's V fixed
        (projected gradient, step 1/‖VVᵀ‖₂, ``config.fold_in_steps`` steps); x is the dense row,
        zero where unrated, 1 for an implicit rating.

        With ``userid`` the row is also kept as ``u[userid]`` for `recommend` (one past the last
        held row adds a row); without it nothing is stored.
        """
        held = 0 if self.u is None else int(self.u.shape[0])
        if userid is not None and not 0 <= userid <= held:
            raise ValueError(f"userid {userid} out of range [0, {held}]")
        V = self.item_matrix()
        items = as_items(user_items, self.n_items)
        if items.size == 0:
            raise ValueError("fold_in needs at least one rated item")
        x = np.zeros((1, self.n_items))
        x[0, items] = 1.0 if ratings is None else np.asarray(ratings, dtype=np.float64).ravel()
        if not np.all(np.isfinite(x)):
            raise ValueError("ratings must be finite")
        u = np.zeros((1, self.rank))
        for _ in range(self.config.fold_in_steps):  # loop over iterations
            u, eta = pgd_u(x, u, V)
            if eta == 0.0:
                break
        if userid is not None:
            self.u = u.copy() if self.u is None else (np.vstack([self.u, u]) if userid == held else self.u)
            self.u[userid] = u[0]
        return u[0]

    # -- retrieval ------------------------------------------------------------------------------
    def _held_users(self) -> int:
        return 0 if self.u is None else int(self.u.shape[0])

    def _check_ready(self, users: NDArray[np.int64]) -> None:
        if self.u is None:
            raise ModelError("this client has no trained rows yet: run a local update first")
        self._require_global()

    def _scores(self, users: NDArray[np.int64]) -> Array:
        """Reconstructed ratings (U V̄)_{u,i}, V̄ in this client's order."""
        if self.u is None:
            raise ModelError("this client has no trained rows yet: run a local update first")
        return self.u[users] @ self.item_matrix()

    # -- persistence ----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the model atomically to one store file (see `device_sdk.store`)."""

        def pack(a: Array | None) -> dict[str, Any] | None:
            return None if a is None else {"shape": list(a.shape), "data": np.ascontiguousarray(a, "<f8").tobytes()}

        save_store(
            path,
            _KIND,
            {
                "config": asdict(self.config),
                "n_items": self.n_items,
                "model_version": self.model_version,
                "v_bar": pack(self.v_bar),
                "v_local": pack(self.v_local),
                "u": pack(self.u),
            },
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, rng: np.random.Generator | None = None) -> FNMFModel:
        """Read a model written by `save` (``rng``: its tie-breaking generator); raises
        `StorageError` on any problem with the file."""
        state = load_store(path, _KIND)
        try:
            config = FNMFConfig(**dict(state["config"]))
            model = cls(
                int(state["n_items"]),
                config,
                model_version=int(state["model_version"]),
                rng=rng or np.random.default_rng(),
            )
            k, m = config.rank, model.n_items

            def unpack(entry: Any, rows: int | None, cols: int) -> Array | None:
                if entry is None:
                    return None
                shape = tuple(int(s) for s in entry["shape"])
                if len(shape) != 2 or shape[1] != cols or (rows is not None and shape[0] != rows):
                    raise ValueError(f"stored matrix has shape {shape}")
                a = np.frombuffer(entry["data"], dtype="<f8").astype(np.float64).reshape(shape)
                if not np.all(np.isfinite(a)) or np.any(a < 0.0):
                    raise ValueError("stored matrix is not finite and non-negative")
                return a

            model.v_bar = unpack(state["v_bar"], k, m)
            model.v_local = unpack(state["v_local"], k, m)
            model.u = unpack(state["u"], None, k)
        except (KeyError, TypeError, ValueError) as exc:
            raise StorageError(f"{path} is a valid store file but its FNMF state is invalid: {exc}") from exc
        return model
