"""Real-valued matrix factorization with embedding clipping on a device: the local side of the FMF
paper's LFL-SGDMF (cross-device, one user per phone) and HFL-SGDMF (cross-silo, many users per
client), sections 3–6 of that paper (summarised in `docs/design.md` §3.1).

Loss and constraints.  A rating r_ij is fitted by the inner product of a private user vector u_i and
the global item vector v_j; each example costs (r_ij − u_i·v_j)² (the paper's loss, no 1/2).  Ratings
stay on their raw scale [0, R] (R = ``max_norm2``, 5 for MovieLens; no rescaling).  Embedding
clipping Π (paper eq. 6) keeps every row of U and V non-negative with squared norm ≤ R, so
0 ≤ u·v ≤ R and |r − u·v| ≤ R; the gradient of one example with respect to v_j is −2(r − u·v)·u,
whose L2 norm is therefore at most 2·R·√R = 2R^{3/2} (section 4.1.1).  A user who contributes at
most θ examples per round has L2 sensitivity θ·2R^{3/2}.

A round on the device (stage 2), for every local user present in the data:
1. a user seen for the first time gets a small random u and is pre-trained with V fixed
   (stage 1, ``pretrain_epochs`` projected gradient steps on all its ratings);
2. ``local_epochs`` projected gradient steps on u against the new global V (all its ratings;
   u never leaves the device, so using every rating costs no privacy);
3. at most θ (``example_cap``; 0 = all) of its ratings are sampled at random (trimming, section
   4.1.1), plus ``negatives`` unobserved items per kept rating fitted as rating 0 (optional);
4. the upload is the **sum** over the kept examples (and, on a silo, over its users) of the
   V-gradients at the updated u: a dense (n_items·f,) float64 vector, non-zero only on the rows of
   the examples' items.
The server applies V ← Π(V − γ/|survivors| · Σ uploads) (`agg_server.strategy.mf`).  Stage 3
(`MFModel.fine_tune`) refits u with the final V on all local ratings.

User steps are full-batch projected gradient steps on each user's mean loss,
u ← Π(u − η·[(1/n_u)·Σ_j −2(r_uj − u·v_j)·v_j + 2λ·u]); with ‖v_j‖² ≤ R the gradient is
(2R + 2λ)-Lipschitz, so η ≤ 1/(2R + 2λ) (0.1 at R = 5, λ = 0) always descends.

Invariants:
- After every update, every row of ``user_factors`` and ``item_factors`` satisfies the clipping
  constraint (non-negative, squared norm ≤ R up to float rounding of the rescale); downloaded item
  matrices are projected as well, so a server cannot push the per-example bound above 2R^{3/2}.
- Kernels are pure numpy: arrays in, new arrays out, randomness only from the generator passed in;
  Python loops run over epochs and the small rank f, never over users, items or ratings.
- `MFModel.local_update` draws from its generator in a fixed order (initial vectors of new users,
  trimming keys, negatives), so equal generator states give equal uploads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from device_sdk.family import LocalRatings, LocalResult, RoundHooks
from device_sdk.retrieval import Recommender, as_items, check_userid, fold_in_items
from device_sdk.store import factor_state, load_store, read_factor_state, save_store
from protocol.codes import float_matrix_from_bytes
from protocol.errors import ModelError, StorageError
from protocol.families.mf import project_rows
from protocol.plan import MFParams, TrainingPlan
from protocol.spec import MAX_RANK, ModelKind

__all__ = [
    "MFConfig",
    "MFModel",
    "example_rmse",
    "fit_users",
    "initial_factors",
    "item_gradient_sum",
    "project_rows",
    "sample_negatives",
    "trim_per_user",
    "user_step",
]

_STORE_KIND = "fedrec.mf-model"
_NORM_SLACK = 1e-9  # relative slack on ‖row‖² ≤ R accepted when loading (float rounding of the rescale)


# -- kernels ----------------------------------------------------------------------------------------


def initial_factors(n: int, f: int, R: float, scale: float, rng: np.random.Generator) -> NDArray[np.float64]:
    """Small non-negative random rows, Π(scale · Uniform[0, 1)^{n×f}), drawn from ``rng``."""
    if n < 0 or f < 1:
        raise ValueError(f"need n >= 0 and f >= 1, got {n}, {f}")
    if not (scale > 0 and np.isfinite(scale)):
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    return project_rows(scale * rng.random((n, f)), R)


def _residuals(
    U: NDArray[np.float64], V: NDArray[np.float64], users: NDArray[np.int64], items: NDArray[np.int64], r: NDArray[Any]
) -> NDArray[np.float64]:
    return np.asarray(r, dtype=np.float64) - np.einsum("ij,ij->i", U[users], V[items])


def user_step(
    U: NDArray[np.float64],
    V: NDArray[np.float64],
    users: NDArray[np.int64],
    items: NDArray[np.int64],
    r: NDArray[np.float64],
    lr: float,
    reg: float,
    R: float,
) -> NDArray[np.float64]:
    """One projected gradient step on the users present in ``users`` (V fixed):
    u_i ← Π(u_i − η·[(1/n_i)·Σ_j −2(r_ij − u_i·v_j)·v_j + 2λ·u_i]).  Other rows are unchanged.

    Parameters
    ----------
    U : (n_users, f) user vectors; V : (m, f) item vectors.
    users, items, r : the examples as COO triples (user index, item id, target in [0, R]).
    lr : step η ≥ 0; reg : L2 weight λ ≥ 0 on u; R : clipping bound.

    Returns
    -------
    New (n_users, f) float64 array.
    """
    n, f = U.shape
    counts = np.bincount(users, minlength=n)
    present = counts > 0
    w = -2.0 * _residuals(U, V, users, items, r) / counts[users]
    grad = np.empty((n, f), dtype=np.float64)
    Vi = V[items]
    for k in range(f):  # loop over the small rank only
        grad[:, k] = np.bincount(users, weights=w * Vi[:, k], minlength=n)
    out = np.array(U, dtype=np.float64, copy=True)
    rows = np.flatnonzero(present)
    out[rows] = project_rows(U[rows] - lr * (grad[rows] + 2.0 * reg * U[rows]), R)
    return out


def fit_users(
    U: NDArray[np.float64],
    V: NDArray[np.float64],
    users: NDArray[np.int64],
    items: NDArray[np.int64],
    r: NDArray[np.float64],
    lr: float,
    reg: float,
    R: float,
    epochs: int,
) -> NDArray[np.float64]:
    """``epochs`` calls of `user_step` (stage 1 pre-training, the per-round refresh, stage 3)."""
    out = np.array(U, dtype=np.float64, copy=True)
    for _ in range(epochs):
        out = user_step(out, V, users, items, r, lr, reg, R)
    return out


def item_gradient_sum(
    U: NDArray[np.float64],
    V: NDArray[np.float64],
    users: NDArray[np.int64],
    items: NDArray[np.int64],
    r: NDArray[np.float64],
) -> NDArray[np.float64]:
    """Σ over the examples of ∇_V (r_ij − u_i·v_j)² = −2(r_ij − u_i·v_j)·u_i on row j (section 4.1.1),
    as a dense flat (m·f,) float64 vector in C order of the (m, f) matrix."""
    m, f = V.shape
    w = -2.0 * _residuals(U, V, users, items, r)
    idx = (items[:, None] * f + np.arange(f, dtype=np.int64)[None, :]).ravel()
    return np.bincount(idx, weights=(w[:, None] * U[users]).ravel(), minlength=m * f).astype(np.float64)


def trim_per_user(users: NDArray[np.int64], cap: int, rng: np.random.Generator) -> NDArray[np.int64]:
    """Random trimming (section 4.1.1): indices of at most ``cap`` examples per user, drawn uniformly
    without replacement (``cap = 0`` keeps all).  One uniform key per example is drawn from ``rng``
    (always, so the generator advances the same way whatever the cap); the result is sorted."""
    keys = rng.random(users.size)
    if cap <= 0 or users.size == 0:
        return np.arange(users.size, dtype=np.int64)
    order = np.lexsort((keys, users))
    su = users[order]
    starts = np.flatnonzero(np.r_[True, su[1:] != su[:-1]])
    first = np.repeat(starts, np.diff(np.r_[starts, su.size]))
    keep = order[np.arange(su.size) - first < cap]
    return np.sort(keep).astype(np.int64)


def sample_negatives(
    users: NDArray[np.int64],
    rated_users: NDArray[np.int64],
    rated_items: NDArray[np.int64],
    n_items: int,
    rng: np.random.Generator,
    *,
    attempts: int = 8,
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """One uniformly drawn item each user of ``users`` has not rated (with replacement across draws).

    Rejection sampling over all draws at once; a draw still rated after ``attempts`` redraws (a user
    who rated almost every item) is dropped.

    Returns
    -------
    (users, items) of the negatives, in the order of ``users``.
    """
    keys = np.unique(rated_users * n_items + rated_items)
    cand = rng.integers(0, n_items, size=users.size, dtype=np.int64)
    for _ in range(attempts):  # loop over redraw rounds, not over examples
        pos = np.minimum(np.searchsorted(keys, users * n_items + cand), max(keys.size - 1, 0))
        bad = keys[pos] == users * n_items + cand if keys.size else np.zeros(users.size, dtype=bool)
        if not bad.any():
            return users.copy(), cand
        cand[bad] = rng.integers(0, n_items, size=int(bad.sum()), dtype=np.int64)
    pos = np.minimum(np.searchsorted(keys, users * n_items + cand), max(keys.size - 1, 0))
    ok = keys[pos] != users * n_items + cand
    return users[ok], cand[ok]


def example_rmse(
    U: NDArray[np.float64],
    V: NDArray[np.float64],
    users: NDArray[np.int64],
    items: NDArray[np.int64],
    r: NDArray[np.float64],
) -> float:
    """Root mean squared error of u_i·v_j against the targets (0.0 for no examples)."""
    if users.size == 0:
        return 0.0
    return float(np.sqrt(np.mean(_residuals(U, V, users, items, r) ** 2)))


# -- the model --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MFConfig:
    """Hyper-parameters of MF on a device (the round's `RoundInvite` plan overrides the training ones).

    Attributes
    ----------
    factors : f, columns of U and V (docs/design.md §3.1: 32).
    max_norm2 : R, the clipping bound and the top of the rating scale (5 for MovieLens).
    learning_rate : step η of the projected gradient steps on u.
    reg : L2 weight λ on u.
    pretrain_epochs : stage-1 steps for a user seen for the first time (and for `fold_in`).
    local_epochs : steps on u per round, before the V-gradient is taken.
    example_cap : θ, ratings per user per round (0 = all).
    negatives : unobserved items per kept rating, fitted as rating 0 (0 = explicit ratings only).
    fine_tune_epochs : stage-3 steps in `fine_tune`.
    init_scale : new rows are Π(init_scale · Uniform[0, 1)).
    """

    factors: int = 32
    max_norm2: float = 5.0
    learning_rate: float = 0.1
    reg: float = 0.0
    pretrain_epochs: int = 50
    local_epochs: int = 1
    example_cap: int = 0
    negatives: int = 0
    fine_tune_epochs: int = 50
    init_scale: float = 0.1

    def __post_init__(self) -> None:
        if not 1 <= self.factors <= MAX_RANK:
            raise ValueError(f"factors must be in [1, {MAX_RANK}], got {self.factors}")
        if not (np.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(f"init_scale must be finite and > 0, got {self.init_scale}")
        for name in ("example_cap", "fine_tune_epochs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        # The plan's bounds, checked as the server's strategy checks them (one validator).
        self.params()

    def params(self) -> MFParams:
        """The training parameters of this configuration (`protocol.plan.MFParams` checks them)."""
        return MFParams(
            max_norm2=self.max_norm2,
            learning_rate=self.learning_rate,
            reg=self.reg,
            pretrain_epochs=self.pretrain_epochs,
            local_epochs=self.local_epochs,
            negatives=self.negatives,
        )


def _targets(ratings: NDArray[np.float64] | None, n: int, R: float) -> NDArray[np.float64]:
    """Raw ratings as targets; implicit feedback (None) fits every observed entry as 1."""
    if ratings is None:
        return np.ones(n)
    r = np.asarray(ratings, dtype=np.float64).ravel()
    if r.shape != (n,):
        raise ValueError(f"expected {n} ratings, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError("ratings must be finite")
    if r.size and (r.min() < 0 or r.max() > R):
        # Outside [0, R] the residual bound |r − u·v| ≤ R, hence the sensitivity, would not hold.
        raise ValueError(f"ratings must lie in [0, R] = [0, {R}], got [{r.min()}, {r.max()}]")
    return r


@dataclass
class MFModel(Recommender, RoundHooks):
    """Matrix-factorization recommender with embedding clipping for one device or one silo.

    Parameters
    ----------
    n_items : catalogue size m.
    config : hyper-parameters.
    n_users : local users (1 on a phone; a silo's user count in the cross-silo mode).
    rng : generator for initial vectors, `fold_in` and tie-breaking in `recommend`.
    """

    KIND: ClassVar[str] = ModelKind.MF.value

    n_items: int
    config: MFConfig = field(default_factory=MFConfig)
    n_users: int = 1
    rng: np.random.Generator = field(default_factory=np.random.default_rng, repr=False)
    model_version: int = 0
    user_factors: NDArray[np.float64] = field(init=False, repr=False)
    item_factors: NDArray[np.float64] = field(init=False, repr=False)
    user_trained: NDArray[np.bool_] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.n_items <= 0:
            raise ValueError(f"n_items must be positive, got {self.n_items}")
        if self.n_users <= 0:
            raise ValueError(f"n_users must be positive, got {self.n_users}")
        cfg = self.config
        self.item_factors = initial_factors(self.n_items, cfg.factors, cfg.max_norm2, cfg.init_scale, self.rng)
        self.user_factors = initial_factors(self.n_users, cfg.factors, cfg.max_norm2, cfg.init_scale, self.rng)
        self.user_trained = np.zeros(self.n_users, dtype=bool)

    @property
    def rank(self) -> int:
        """Factor count f (the ``bits`` field of the wire messages)."""
        return self.config.factors

    # -- the global model -------------------------------------------------------------------------
    def set_global(self, words: bytes, values: bytes, version: int) -> None:
        """Adopt global item matrix ``version``: ``values`` is float64 little-endian V (n_items, f).

        The matrix is projected with Π (a no-op for an honest server), so the per-example gradient
        bound 2R^{3/2} holds whatever was downloaded.

        Raises
        ------
        ValueError
            If ``words`` is not empty or ``values`` has the wrong length or non-finite entries.
        """
        if words:
            raise ValueError("an MF model payload carries no packed words")
        V = float_matrix_from_bytes(values, (self.n_items, self.config.factors))
        self.item_factors = project_rows(V, self.config.max_norm2)
        self.model_version = int(version)

    # -- training ---------------------------------------------------------------------------------
    def _check_data(self, data: LocalRatings) -> None:
        if data.n_users != self.n_users:
            raise ValueError(f"data has {data.n_users} local users, the model holds {self.n_users}")
        data.check_items(self.n_items)

    def _start_new_users(
        self,
        users: NDArray[np.int64],
        items: NDArray[np.int64],
        r: NDArray[np.float64],
        rng: np.random.Generator,
        lr: float,
        reg: float,
        R: float,
        epochs: int,
    ) -> int:
        """Stage 1 for users present but not trained yet: fresh small u, then ``epochs`` steps."""
        present = np.unique(users)
        new = present[~self.user_trained[present]]
        if new.size == 0:
            return 0
        U = self.user_factors.copy()
        U[new] = initial_factors(new.size, self.config.factors, R, self.config.init_scale, rng)
        mask = np.isin(users, new)
        self.user_factors = fit_users(U, self.item_factors, users[mask], items[mask], r[mask], lr, reg, R, epochs)
        self.user_trained[new] = True
        return int(new.size)

    def local_update(self, plan: TrainingPlan, data: LocalRatings, rng: np.random.Generator) -> LocalResult:
        """One round of LFL/HFL-SGDMF stage 2 on the local users' ratings (see the module docstring).

        Parameters
        ----------
        plan : the round's plan: `protocol.plan.MFParams` (``max_norm2`` must be the model's R) and
            ``example_cap`` (θ); its shape must be the model's.
        data : local ratings (raw, in [0, R]); users absent from it are not touched.
        rng : the round's generator (new users' vectors, trimming, negatives — in that order).

        Returns
        -------
        LocalResult with the (n_items·f,) float64 sum of the kept examples' V-gradients.

        Raises
        ------
        ValueError
            On a plan for another model or data that does not fit it.
        """
        m = self.n_items
        plan.check_fits(self.KIND, m, self.config.factors)
        p = plan.params
        assert isinstance(p, MFParams)  # check_fits checked the kind
        self._check_data(data)
        R = p.max_norm2
        if R != self.config.max_norm2:
            raise ValueError(f"the round's max_norm2 {R} differs from the model's {self.config.max_norm2}")
        users, items = data.users, data.items
        r = _targets(data.ratings, items.size, R)
        lr, reg = p.learning_rate, p.reg
        V = self.item_factors
        pretrained = self._start_new_users(users, items, r, rng, lr, reg, R, p.pretrain_epochs)
        U = fit_users(self.user_factors, V, users, items, r, lr, reg, R, p.local_epochs)
        self.user_factors = U
        keep = trim_per_user(users, plan.example_cap, rng)
        ku, ki, kr = users[keep], items[keep], r[keep]
        if p.negatives > 0 and keep.size:
            nu, ni = sample_negatives(np.repeat(ku, p.negatives), users, items, m, rng)
            ku, ki, kr = np.r_[ku, nu], np.r_[ki, ni], np.r_[kr, np.zeros(nu.size)]
        vector = item_gradient_sum(U, V, ku, ki, kr)
        info = {
            "users": int(np.unique(users).size),
            "pretrained": pretrained,
            "kept_ratings": int(keep.size),
            "train_rmse": example_rmse(U, V, users, items, r),
        }
        return LocalResult(vector=vector, examples=int(ku.size), info=info)

    def fine_tune(
        self, data: LocalRatings, epochs: int | None = None, *, rng: np.random.Generator | None = None
    ) -> float:
        """Stage 3: refit the user vectors of the users in ``data`` against the current V (fixed),
        on all their ratings (no trimming).  Users never trained start from a fresh vector.

        Returns
        -------
        The training RMSE after fine-tuning.
        """
        self._check_data(data)
        cfg = self.config
        epochs = cfg.fine_tune_epochs if epochs is None else int(epochs)
        if epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {epochs}")
        r = _targets(data.ratings, data.items.size, cfg.max_norm2)
        args = (cfg.learning_rate, cfg.reg, cfg.max_norm2)
        self._start_new_users(data.users, data.items, r, rng or self.rng, *args, 0)
        self.user_factors = fit_users(self.user_factors, self.item_factors, data.users, data.items, r, *args, epochs)
        return example_rmse(self.user_factors, self.item_factors, data.users, data.items, r)

    def fold_in(
        self, user_items: ArrayLike, ratings: ArrayLike | None = None, *, userid: int = 0
    ) -> NDArray[np.float64]:
        """A new user's vector from its ratings against the current V, offline and without a server
        round (stage 1 from a fresh vector: ``pretrain_epochs`` steps).  Returns a copy of u."""
        cfg = self.config
        items = fold_in_items(user_items, self.n_items, userid, self.n_users)
        r = _targets(None if ratings is None else np.asarray(ratings, dtype=np.float64), items.size, cfg.max_norm2)
        u0 = initial_factors(1, cfg.factors, cfg.max_norm2, cfg.init_scale, self.rng)
        zeros = np.zeros(items.size, dtype=np.int64)
        u = fit_users(
            u0, self.item_factors, zeros, items, r, cfg.learning_rate, cfg.reg, cfg.max_norm2, cfg.pretrain_epochs
        )
        self.user_factors[userid] = u[0]
        self.user_trained[userid] = True
        return u[0].copy()

    # -- prediction and retrieval -----------------------------------------------------------------
    def _check_user(self, userid: int) -> None:
        check_userid(userid, self.n_users)
        if not self.user_trained[userid]:
            raise ModelError("this user has no trained vector yet: call local_update, fine_tune or fold_in first")

    def predict(self, items: ArrayLike, *, userid: int = 0) -> NDArray[np.float64]:
        """Predicted ratings u·v_j (in [0, R]) of the given items."""
        ids = as_items(items, self.n_items)
        self._check_user(userid)
        return self.item_factors[ids] @ self.user_factors[userid]

    def _held_users(self) -> int:
        return self.n_users

    def _check_ready(self, users: NDArray[np.int64]) -> None:
        if not self.user_trained[users].all():
            raise ModelError("this user has no trained vector yet: call local_update, fine_tune or fold_in first")

    def _scores(self, users: NDArray[np.int64]) -> NDArray[np.float64]:
        """Predicted ratings u·v_j of every item (the `recommend` scores, returned as float32)."""
        return self.user_factors[users] @ self.item_factors.T

    # -- persistence ------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the model atomically to one store file (see `device_sdk.store`)."""
        save_store(path, _STORE_KIND, factor_state(self))

    @classmethod
    def load(cls, path: str | os.PathLike[str], rng: np.random.Generator | None = None) -> MFModel:
        """Read a model written by `save`; raises `StorageError` on any problem with the file,
        including factors that break the clipping constraint."""
        state = load_store(path, _STORE_KIND)
        try:
            model = read_factor_state(state, cls, MFConfig, rng, check=_check_clipped)
        except (KeyError, TypeError, ValueError) as exc:
            raise StorageError(f"{path} is a valid store file but its MF state is invalid: {exc}") from exc
        return model


def _check_clipped(V: NDArray[np.float64], U: NDArray[np.float64], config: MFConfig) -> None:
    """Stored factors must keep the clipping constraint (rows >= 0, squared norm <= R, up to `_NORM_SLACK`)."""
    R = config.max_norm2
    for name, X in (("item_factors", V), ("user_factors", U)):
        if X.size and (X.min() < 0 or np.einsum("ij,ij->i", X, X).max() > R * (1 + _NORM_SLACK)):
            raise ValueError(f"{name} break the clipping constraint (rows >= 0, squared norm <= {R})")
