"""Real-valued implicit ALS on a device: the local side of federated iALS (Hu, Koren and Volinsky, ICDM 2008;
docs/design.md §3.5).

Objective.  Every (user, item) pair has a preference p = 1 if the user holds the item, else 0, and a
confidence 1 + α on held pairs, 1 elsewhere; the model fits p by u·v with ridge weight λ on u and v.
The item factors V (m, d) are global; a user's vector u never leaves the device.

A round on the device, for every local user present in the data (I = the user's distinct items):
1. adopt the downloaded V;
2. exact user step, u = (VᵀV + α·V_Iᵀ V_I + λI)⁻¹ (1 + α)·V_Iᵀ 1 (Hu et al. eq. 4);
3. upload the sums the server's item step needs (`protocol.families.ials.IALSLayout`):
   B (row j = Σ u over the users holding j), c (c_j = how many hold j), Σ u uᵀ, Σ |I|·u uᵀ and Σ |I|.
The server solves every item from the cohort's sum (`agg_server.strategy.ials`).

Quantization.  The upload goes through the same clip + quantize path as every family.  It is not bounded
a priori (|I| multiplies two of its parts), so for a non-private run the server's ``rounds.clip_norm`` must be
above the largest upload's norm, about |I|·(1 + ‖u‖²) for the device with the most items (the quantizer
reports the norm before clipping; nothing is clipped below it), and ``rounds.scale_bits`` s sets the rounding
error: each entry of the sum is off by at most (devices)·2^-s, unbiased.  s = 16 with clip_norm 10^3
(n·clip·2^s < 2^31 for the ring: at most ~30 devices of norm 10^3 at s = 16, or s = 10 for ~2,000) keeps
the item factors within ~1e-4 of the plain sum's on the test sets (tests/test_ials.py).

Invariants:
- Kernels are pure numpy: arrays in, new arrays out; Python loops run over chunks of users only.
- `IALSModel.local_update` draws nothing from its generator: the user step is exact, so equal global
  models and data give equal uploads (the HTTP run and the in-process run agree bit for bit).
- Ratings are implicit: every held (user, item) pair counts once, whatever its rating.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from device_sdk.family import LocalRatings, LocalResult, RoundHooks
from device_sdk.retrieval import Recommender, fold_in_items
from device_sdk.store import factor_state, load_store, read_factor_state, save_store
from protocol.codes import float_matrix_from_bytes
from protocol.errors import ModelError, StorageError
from protocol.families.ials import DEFAULT_FACTORS, LEVEL_TOP, IALSLayout, initial_item_factors
from protocol.plan import IALSParams, TrainingPlan
from protocol.spec import MAX_LEVEL_WEIGHT, MAX_RANK, ModelKind

__all__ = ["IALSConfig", "IALSModel", "initial_item_factors", "solve_users", "upload_sums", "user_item_csr"]

_STORE_KIND = "fedrec.ials-model"


# -- kernels ----------------------------------------------------------------------------------------


def user_item_csr(
    users: NDArray[np.int64], items: NDArray[np.int64], n_users: int, n_items: int
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(indptr, items) of the distinct (user, item) pairs, each user's items sorted."""
    keys = np.unique(np.asarray(users, np.int64) * n_items + np.asarray(items, np.int64))
    owner = keys // n_items
    indptr = np.zeros(n_users + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner, minlength=n_users), out=indptr[1:])
    return indptr, keys - owner * n_items


def solve_users(
    V: NDArray[np.floating],
    indptr: NDArray[np.int64],
    cols: NDArray[np.int64],
    alpha: float,
    reg: float,
    budget: int = 1 << 22,
    *,
    gram: NDArray[np.floating] | None = None,
) -> NDArray[np.float64]:
    """Every row's exact iALS step against fixed item factors (Hu et al. eq. 4):
    u = (VᵀV + α·V_Iᵀ V_I + λI)⁻¹ (1 + α)·V_Iᵀ 1, with I the row's items ``cols[indptr[r]:indptr[r+1]]``.

    Rows are taken in order of their length and padded to the longest row of their chunk, so each chunk's
    corrections V_Iᵀ V_I are one batched matmul over at most ``budget`` floats; a row with no item gets 0.

    Parameters
    ----------
    V : (m, d) item factors (any float dtype: the rows a chunk uses are taken to float64).
    indptr, cols : CSR of the rows' distinct items.
    alpha, reg : confidence α >= 0 and ridge weight λ > 0.
    gram : VᵀV (d, d) when the caller holds it (a device caches it per model: at 10^6 items it is a pass
        over the catalogue); None computes it.

    Returns
    -------
    (n_rows, d) float64.
    """
    n, d = indptr.size - 1, V.shape[1]
    base = (V.T @ V if gram is None else np.asarray(gram, dtype=np.float64)) + reg * np.eye(d)
    X = np.zeros((n, d))
    deg = np.diff(indptr)
    order = np.argsort(deg, kind="stable")
    order = order[deg[order] > 0]
    deg_sorted = deg[order]
    start = 0
    while start < order.size:  # loop over chunks of rows of similar length
        ahead = deg_sorted[start : start + 2048]
        padded = ahead * np.arange(1, ahead.size + 1) * d
        size = max(1, int(np.searchsorted(padded, budget, side="right")))
        rows = order[start : start + size]
        L = int(deg_sorted[start + rows.size - 1])
        pos = indptr[rows][:, None] + np.arange(L)[None, :]
        live = np.arange(L)[None, :] < deg[rows][:, None]
        P = V[cols[np.where(live, pos, 0)]].astype(np.float64, copy=False) * live[..., None]  # (B, L, d), 0-padded
        A = base + alpha * np.matmul(P.transpose(0, 2, 1), P)
        b = (1.0 + alpha) * P.sum(axis=1)
        X[rows] = np.linalg.solve(A, b[..., None])[..., 0]
        start += rows.size
    return X


def upload_sums(
    U: NDArray[np.float64],
    indptr: NDArray[np.int64],
    cols: NDArray[np.int64],
    n_items: int,
    *,
    theta: int = 0,
    gram_weight: float = 0.1,
) -> NDArray[np.float64]:
    """The upload of users with vectors ``U`` and items (indptr, cols) (`protocol.families.ials.IALSLayout`):
    B, c, Σ u uᵀ, Σ |I|·u uᵀ, Σ |I| over the users holding at least one item.

    ``theta`` >= 1 gives the bounded upload of a DP round (`protocol.plan.IALSParams.theta`): each u scaled to
    unit norm (a zero u stays 0), its B rows and counts weighted by w = 1/√max(|I|, θ), the Gram part
    Σ γ·u uᵀ (γ = ``gram_weight``), the weighted Gram and positives parts 0.  One user's bounded upload has
    L2 norm at most √(2 + γ²): Σ_j w²‖u‖² = |I|/max(|I|, θ) <= 1 for B, as much for c, γ‖u‖² for the Gram.
    """
    n, d = U.shape
    deg = np.diff(indptr)
    held = deg > 0
    weight = np.ones(n)
    if theta:
        norms = np.linalg.norm(U, axis=1)
        U = np.divide(U, norms[:, None], out=np.zeros_like(U), where=norms[:, None] > 0)
        weight = 1.0 / np.sqrt(np.maximum(deg, theta).astype(np.float64))
    owner = np.repeat(np.arange(n), deg)
    idx = (cols[:, None] * d + np.arange(d)[None, :]).ravel()
    B = np.bincount(idx, weights=(U * weight[:, None])[owner].ravel(), minlength=n_items * d).reshape(n_items, d)
    c = np.bincount(cols, weights=weight[owner], minlength=n_items).astype(np.float64)
    Uh = U[held]
    layout = IALSLayout(n_items, d)
    if theta:
        zero = np.zeros((d, d))
        return layout.join(B, c, gram_weight * (Uh.T @ Uh), zero, 0.0)
    w = deg[held].astype(np.float64)
    return layout.join(B, c, Uh.T @ Uh, (Uh * w[:, None]).T @ Uh, float(w.sum()))


# -- the model --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IALSConfig:
    """Hyper-parameters of iALS on a device (a round's plan overrides α and λ for its own step).

    Attributes
    ----------
    factors : d, columns of U and V (default 64).
    alpha : confidence α of `fold_in` (`protocol.plan.IALSParams`' default and bounds).
    reg : ridge weight λ of `fold_in`.
    """

    factors: int = DEFAULT_FACTORS
    alpha: float = IALSParams().alpha
    reg: float = IALSParams().reg

    def __post_init__(self) -> None:
        if isinstance(self.factors, bool) or not isinstance(self.factors, int) or not 1 <= self.factors <= MAX_RANK:
            raise ValueError(f"factors must be an integer in [1, {MAX_RANK}], got {self.factors!r}")
        self.params()  # the plan's bounds on α and λ, as the server's strategy checks them

    def params(self) -> IALSParams:
        """The training parameters of this configuration (`protocol.plan.IALSParams` checks them)."""
        return IALSParams(alpha=self.alpha, reg=self.reg)


@dataclass
class IALSModel(Recommender, RoundHooks):
    """Implicit-ALS recommender for one device or one silo: exact user vectors against the global item factors.

    Parameters
    ----------
    n_items : catalogue size m.
    config : hyper-parameters.
    n_users : local users (1 on a phone; a silo's user count in the cross-silo mode).
    rng : generator for the initial item factors and tie-breaking in `recommend`.

    A downloaded model may carry an item term (protocol 1.10): uint8 ``item_levels`` (the log-scale holder
    counts of the round that produced it) and their weight w; `recommend` then ranks by u·v_i + w·level_i / 255.
    """

    KIND: ClassVar[str] = ModelKind.IALS.value

    n_items: int
    config: IALSConfig = field(default_factory=IALSConfig)
    n_users: int = 1
    rng: np.random.Generator = field(default_factory=np.random.default_rng, repr=False)
    model_version: int = 0
    user_factors: NDArray[np.float64] = field(init=False, repr=False)
    item_factors: NDArray[np.float64] = field(init=False, repr=False)
    user_trained: NDArray[np.bool_] = field(init=False, repr=False)
    item_levels: NDArray[np.uint8] | None = field(default=None, init=False, repr=False)
    level_weight: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.n_items <= 0:
            raise ValueError(f"n_items must be positive, got {self.n_items}")
        if self.n_users <= 0:
            raise ValueError(f"n_users must be positive, got {self.n_users}")
        self.item_factors = initial_item_factors(self.n_items, self.config.factors, self.rng)
        self.user_factors = np.zeros((self.n_users, self.config.factors))
        self.user_trained = np.zeros(self.n_users, dtype=bool)

    @property
    def rank(self) -> int:
        """Factor count d (the ``bits`` field of the wire messages)."""
        return self.config.factors

    def set_global(
        self, words: bytes, values: bytes, version: int, *, item_levels: bytes = b"", level_weight: float = 0.0
    ) -> None:
        """Adopt global item factors ``version``: ``values`` is float64 little-endian V (n_items, d); with
        ``item_levels`` (n_items uint8, or empty) and ``level_weight`` w the item term `recommend` adds
        (protocol 1.10, `protocol.messages.ModelPayload.ials_extras`).

        Raises
        ------
        ValueError
            If ``words`` is not empty, ``values`` has the wrong length or non-finite entries, the levels are
            not one byte per item, or w is not in [0, MAX_LEVEL_WEIGHT] (> 0 only with levels).
        """
        if words:
            raise ValueError("an iALS model payload carries no packed words")
        levels, weight = _item_term(item_levels, level_weight, self.n_items)
        self.item_factors = float_matrix_from_bytes(values, (self.n_items, self.config.factors))
        self.item_levels, self.level_weight = levels, weight
        self.model_version = int(version)

    def local_update(self, plan: TrainingPlan, data: LocalRatings, rng: np.random.Generator) -> LocalResult:
        """One round: the exact user step for every local user in ``data``, then the upload sums.

        Parameters
        ----------
        plan : the round's plan (`protocol.plan.IALSParams`: α and λ); its shape must be the model's.
        data : local ratings (implicit: each held pair counts once); users absent from it are not touched.
        rng : unused (the step is exact); accepted for the family contract.

        Returns
        -------
        LocalResult with the `protocol.families.ials.IALSLayout` vector.

        Raises
        ------
        ValueError
            On a plan for another model or data that does not fit it.
        """
        plan.check_fits(self.KIND, self.n_items, self.config.factors)
        p = plan.params
        if not isinstance(p, IALSParams):  # check_fits checked the kind; this narrows the type
            raise ValueError(f"expected iALS parameters, got {p!r}")
        if data.n_users != self.n_users:
            raise ValueError(f"data has {data.n_users} local users, the model holds {self.n_users}")
        data.check_items(self.n_items)
        indptr, cols = user_item_csr(data.users, data.items, self.n_users, self.n_items)
        U = solve_users(self.item_factors, indptr, cols, p.alpha, p.reg)
        present = np.diff(indptr) > 0
        self.user_factors[present] = U[present]
        self.user_trained |= present
        info = {"users": int(present.sum()), "positives": int(cols.size)}
        vector = upload_sums(U, indptr, cols, self.n_items, theta=p.theta, gram_weight=p.gram_weight)
        return LocalResult(vector=vector, examples=int(cols.size), info=info)

    def adopted(self, data: LocalRatings) -> None:
        """After a new global V: every local user in ``data`` takes its exact user step against it (the config's
        α and λ), so `recommend` ranks with the V just downloaded.  Nothing is uploaded."""
        if data.n_users != self.n_users:
            raise ValueError(f"data has {data.n_users} local users, the model holds {self.n_users}")
        data.check_items(self.n_items)
        indptr, cols = user_item_csr(data.users, data.items, self.n_users, self.n_items)
        present = np.diff(indptr) > 0
        if present.any():
            U = solve_users(self.item_factors, indptr, cols, self.config.alpha, self.config.reg)
            self.user_factors[present] = U[present]
            self.user_trained |= present

    def fold_in(self, user_items: ArrayLike, *, userid: int = 0) -> NDArray[np.float64]:
        """A user's vector from its items against the current V, offline (the config's α and λ).
        Returns a copy of u."""
        items = np.unique(fold_in_items(user_items, self.n_items, userid, self.n_users))
        indptr = np.array([0, items.size], dtype=np.int64)
        u = solve_users(self.item_factors, indptr, items, self.config.alpha, self.config.reg)[0]
        self.user_factors[userid] = u
        self.user_trained[userid] = True
        return u.copy()

    # -- retrieval (`device_sdk.retrieval.Recommender`) ---------------------------------------------
    def _held_users(self) -> int:
        return self.n_users

    def _check_ready(self, users: NDArray[np.int64]) -> None:
        if not self.user_trained[users].all():
            raise ModelError("this user has no trained vector yet: call local_update or fold_in first")

    def _scores(self, users: NDArray[np.int64]) -> NDArray[np.float64]:
        """u·v_j + w·level_j / 255 of every item (the `recommend` scores, returned as float32; u·v_j alone
        without an item term)."""
        scores = self.user_factors[users] @ self.item_factors.T
        if self.item_levels is not None and self.level_weight > 0:
            scores += (self.level_weight / LEVEL_TOP) * self.item_levels.astype(np.float64)
        return scores

    # -- persistence --------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the model atomically to one store file (see `device_sdk.store`)."""
        levels = None if self.item_levels is None else self.item_levels.tobytes()
        save_store(path, _STORE_KIND, factor_state(self) | {"item_levels": levels, "level_weight": self.level_weight})

    @classmethod
    def load(cls, path: str | os.PathLike[str], rng: np.random.Generator | None = None) -> IALSModel:
        """Read a model written by `save`; raises `StorageError` on any problem with the file."""
        state = load_store(path, _STORE_KIND)
        try:
            model = read_factor_state(state, cls, IALSConfig, rng)
            # A file written before the item term (protocol 1.10) has neither key: u·v alone.
            levels = state.get("item_levels")
            model.item_levels, model.level_weight = _item_term(
                b"" if levels is None else bytes(levels), float(state.get("level_weight", 0.0)), model.n_items
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StorageError(f"{path} is a valid store file but its iALS state is invalid: {exc}") from exc
        return model


def _item_term(item_levels: bytes, level_weight: float, n_items: int) -> tuple[NDArray[np.uint8] | None, float]:
    """(levels or None, w) of a model's item term, checked: one byte per item or none, w finite in
    [0, MAX_LEVEL_WEIGHT], > 0 only with levels."""
    w = float(level_weight)
    if not (np.isfinite(w) and 0.0 <= w <= MAX_LEVEL_WEIGHT):
        raise ValueError(f"level_weight must be a finite number in [0, {MAX_LEVEL_WEIGHT:g}], got {level_weight!r}")
    if not item_levels:
        if w > 0:
            raise ValueError("level_weight > 0 needs item_levels")
        return None, w
    if len(item_levels) != n_items:
        raise ValueError(f"item_levels must hold one byte per item ({n_items}), got {len(item_levels)}")
    return np.frombuffer(item_levels, dtype=np.uint8).copy(), w
