"""FELB: federated Boolean matrix factorization with the ELB proximal operator (Dalleiger, Vreeken,
Kamp, "Federated Binary Matrix Factorization using Proximal Optimization"), device side: the
kernels of one client's local iterations and `FELBModel`, the on-device model of the "felb" family.

A client holds a Boolean block A_i (n_i × m): one row on a phone, many rows in the cross-silo setting
the paper targets.  It keeps its row factors U_i ∈ [0,1]^{n_i×k} private and, each round, starts its
copy V_i ∈ [0,1]^{k×m} of the global components V̂ from the broadcast, runs b local iterations and
uploads ΔV_i = V_i − V̂.  The server only needs the sum of the ΔV_i (see `agg_server.strategy.felb`).

The local objective, in the ½-convention the gradients use (see `docs/design.md` §3.2
for the papers' errata this follows: squared norms, exact soft-threshold, corrected step sizes):

    Φ_i(U, V; V̂) = ½‖A − U V‖²_F + R(U) + R(V) + (γ/2)‖V − V̂‖²_F,
    R(X) = Σ_x min{κ|x| + (λ/2)x², κ|x − 1| + (λ/2)(x − 1)²}      (the "W-shaped" ELB regularizer).

With the quadratic term read as (λ/2)x², `prox_elb` (η scaled) is the exact proximal map of ηR and
`prox_proximity` the exact one of (ηγ/2)‖· − V̂‖², so a step of 1/L (L the block's Lipschitz constant)
never increases Φ for β = 0 and γ = 0.

Invariants:
- Kernels are pure numpy: arrays in, new arrays out; no logging, no config, no global randomness.
  Factors are float64 and stay in [0, 1] after every iteration (every prox output is clamped).
- One local iteration updates U first, then V with the new U (Gauss–Seidel), then pulls V towards
  V̂; each block starts from its iPALM extrapolation X + β(X − X_prev), projected onto [0, 1] so
  the multiplicative-update steps stay non-negative.
- Python loops run over iterations only, never over rows, items or entries.
- `FELBModel.local_update` draws randomness only for a local user factor it does not have yet (the
  first round), from the generator passed in: same generator state, same upload.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from device_sdk.family import LocalRatings, LocalResult, RoundHooks
from device_sdk.retrieval import Recommender, as_items
from device_sdk.store import load_store, save_store
from protocol.codes import float_matrix_from_bytes, float_matrix_to_bytes
from protocol.errors import ModelError, StorageError
from protocol.families.felb import prox_elb, prox_elb_unchecked, schedule
from protocol.plan import FELBParams, TrainingPlan
from protocol.spec import MAX_RANK, StepRule

__all__ = [
    "FELBConfig",
    "FELBModel",
    "boolean_product",
    "elb_regularizer",
    "felb_iteration",
    "felb_local",
    "integrality_gap",
    "lipschitz_steps",
    "local_objective",
    "mu_steps",
    "prox_elb",
    "prox_proximity",
    "schedule",
]

_KIND = "felb"
LIPSCHITZ_SAFETY = 1.1  # step 1/(1.1 L): descent with room for rounding (as the ELBMF reference code)
LIPSCHITZ_FLOOR = 1e-4  # L of an all-zero block would give an infinite step
MU_EPS = 1e-12  # added to the multiplicative-update denominators
STEP_RULES = tuple(r.value for r in StepRule)

FloatArray = NDArray[np.float64]


def prox_proximity(X: ArrayLike, V_hat: ArrayLike, g: ArrayLike) -> FloatArray:
    """Proximal map of (g/2)‖· − V̂‖² (paper eq. 7): (X + g·V̂)/(1 + g); g = η_V·γ (scalar or
    elementwise), so g = 0 returns X and g → ∞ returns V̂."""
    ga = np.asarray(g, dtype=np.float64)
    if np.any(ga < 0):
        raise ValueError("the proximity weight must be >= 0")
    return (np.asarray(X, dtype=np.float64) + ga * np.asarray(V_hat, dtype=np.float64)) / (1.0 + ga)


def lipschitz_steps(U: FloatArray, V: FloatArray) -> tuple[float, float]:
    """FELB step sizes (η_U, η_V) = 1/(1.1·L) with L_U = ‖V Vᵀ‖₂ and L_V = ‖UᵀU‖₂ (spectral norms of
    the k × k Gram matrices; floored at 1e-4)."""
    return _step(V @ V.T), _step(U.T @ U)


def _step(G: FloatArray) -> float:
    # 1/(1.1·‖G‖₂) for a symmetric PSD Gram matrix: its spectral norm is its largest eigenvalue.
    L = float(np.linalg.eigvalsh(G)[-1]) if G.size else 0.0
    return 1.0 / (LIPSCHITZ_SAFETY * max(L, LIPSCHITZ_FLOOR))


def mu_steps(
    A: FloatArray, U: FloatArray, V: FloatArray, *, eps: float = MU_EPS
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """FELB^MU step matrix and gradient for the U block: (η_U, ∇_U, AVᵀ) with
    η_U = U ⊘ (U V Vᵀ + ε) and ∇_U = U V Vᵀ − A Vᵀ, so that U − η_U ⊙ ∇_U = U ⊙ (AVᵀ + ε) ⊘ (UVVᵀ + ε)
    — the Lee–Seung multiplicative update.  For the V block call it on the transposes:
    ``mu_steps(A.T, V.T, U.T)`` gives (η_Vᵀ, ∇_Vᵀ, (UᵀA)ᵀ)."""
    P = U @ (V @ V.T)
    Q = A @ V.T
    return U / (P + eps), P - Q, Q


def _extrapolate(X: FloatArray, X_prev: FloatArray, beta: float) -> FloatArray:
    # iPALM inertia, projected onto the box the factors live in (MU steps need X ≥ 0).
    if beta == 0.0:
        return X
    return np.clip(X + beta * (X - X_prev), 0.0, 1.0)


def felb_iteration(
    A: FloatArray,
    U: FloatArray,
    V: FloatArray,
    U_prev: FloatArray,
    V_prev: FloatArray,
    V_hat: FloatArray,
    *,
    kappa: float,
    lam: float,
    gamma: float,
    beta: float = 0.0,
    step_rule: str = "lipschitz",
    eps: float = MU_EPS,
) -> tuple[FloatArray, FloatArray]:
    """One local iteration (paper eq. 8 / Alg. 1 lines 3–5): U block, then V block with the new U,
    then prox^p of V towards V̂.

    Parameters
    ----------
    A : (n, m) Boolean data as float64.
    U, V : (n, k), (k, m) current factors in [0, 1]; U_prev, V_prev the previous iterates (iPALM).
    V_hat : (k, m) the last broadcast global components.
    kappa, lam : ELB weights κ and λ (this round's λ_r).
    gamma : proximity γ ≥ 0.
    beta : iPALM inertia β ∈ [0, 1).
    step_rule : "lipschitz" (FELB, η = 1/(1.1 L)) or "mu" (FELB^MU, elementwise η).
    eps : the multiplicative-update denominator guard.

    Returns
    -------
    (new U, new V), both in [0, 1].
    """
    if step_rule not in STEP_RULES:
        raise ValueError(f"step_rule must be one of {STEP_RULES}, got {step_rule!r}")
    # U block: ∇_U = (UV − A)Vᵀ.
    Ue = _extrapolate(U, U_prev, beta)
    G = V @ V.T
    P = Ue @ G
    if step_rule == StepRule.MU:
        eta_u = Ue / (P + eps)
        U_new = prox_elb_unchecked(Ue - eta_u * (P - A @ V.T), eta_u * kappa, eta_u * lam)
    else:
        s_u = _step(G)
        U_new = prox_elb_unchecked(Ue - s_u * (P - A @ V.T), s_u * kappa, s_u * lam)
    # V block (Gauss–Seidel: the new U): ∇_V = Uᵀ(UV − A).
    Ve = _extrapolate(V, V_prev, beta)
    H = U_new.T @ U_new
    Q = H @ Ve
    if step_rule == StepRule.MU:
        eta_v = Ve / (Q + eps)
        V_new = prox_elb_unchecked(Ve - eta_v * (Q - U_new.T @ A), eta_v * kappa, eta_v * lam)
        V_new = (V_new + (eta_v * gamma) * V_hat) / (1.0 + eta_v * gamma)  # prox^p, elementwise η_V
    else:
        s_v = _step(H)
        V_new = prox_elb_unchecked(Ve - s_v * (Q - U_new.T @ A), s_v * kappa, s_v * lam)
        V_new = (V_new + (s_v * gamma) * V_hat) / (1.0 + s_v * gamma)  # prox^p
    return U_new, V_new


def felb_local(
    A: ArrayLike,
    U: ArrayLike,
    V: ArrayLike,
    V_hat: ArrayLike,
    *,
    kappa: float,
    lam: float,
    gamma: float,
    beta: float = 0.0,
    step_rule: str = "lipschitz",
    iterations: int = 1,
    eps: float = MU_EPS,
) -> tuple[FloatArray, FloatArray]:
    """``iterations`` local iterations (`felb_iteration`) from (U, V), with λ fixed (the round's λ_r)
    and the iPALM history starting at the inputs (the first step has no momentum).

    Returns
    -------
    (U, V) after the last iteration; the inputs are not modified.
    """
    Af = np.asarray(A, dtype=np.float64)
    Uc = np.array(U, dtype=np.float64)
    Vc = np.array(V, dtype=np.float64)
    Vh = np.asarray(V_hat, dtype=np.float64)
    n, m = Af.shape
    k = Uc.shape[1] if Uc.ndim == 2 else -1
    if Uc.shape != (n, k) or Vc.shape != (k, m) or Vh.shape != (k, m):
        raise ValueError(f"shapes do not fit: A {Af.shape}, U {Uc.shape}, V {Vc.shape}, V_hat {Vh.shape}")
    if iterations < 0:
        raise ValueError(f"iterations must be >= 0, got {iterations}")
    for name, val in (("kappa", kappa), ("lam", lam), ("gamma", gamma)):
        if not (np.isfinite(val) and val >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {val}")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {beta}")
    U_prev, V_prev = Uc, Vc
    for _ in range(iterations):
        U_new, V_new = felb_iteration(
            Af, Uc, Vc, U_prev, V_prev, Vh, kappa=kappa, lam=lam, gamma=gamma, beta=beta, step_rule=step_rule, eps=eps
        )
        U_prev, V_prev, Uc, Vc = Uc, Vc, U_new, V_new
    return Uc, Vc


def elb_regularizer(X: ArrayLike, kappa: float, lam: float) -> float:
    """R_{κ,λ}(X) = Σ min{κ|x| + (λ/2)x², κ|x − 1| + (λ/2)(x − 1)²}."""
    x = np.asarray(X, dtype=np.float64)
    r0 = kappa * np.abs(x) + 0.5 * lam * x * x
    r1 = kappa * np.abs(x - 1.0) + 0.5 * lam * (x - 1.0) ** 2
    return float(np.minimum(r0, r1).sum())


def local_objective(
    A: ArrayLike, U: ArrayLike, V: ArrayLike, V_hat: ArrayLike, *, kappa: float, lam: float, gamma: float
) -> float:
    """Φ_i = ½‖A − UV‖²_F + R(U) + R(V) + (γ/2)‖V − V̂‖²_F (see the module docstring)."""
    Af, Uf, Vf = (np.asarray(a, dtype=np.float64) for a in (A, U, V))
    resid = Af - Uf @ Vf
    prox = np.asarray(Vf - np.asarray(V_hat, dtype=np.float64))
    return float(
        0.5 * np.sum(resid * resid)
        + elb_regularizer(Uf, kappa, lam)
        + elb_regularizer(Vf, kappa, lam)
        + 0.5 * gamma * np.sum(prox * prox)
    )


def boolean_product(U: ArrayLike, V: ArrayLike) -> NDArray[np.uint8]:
    """The Boolean reconstruction [round(U) ∘ round(V) ≥ 1]: both factors rounded at ½ (ties to 1),
    then the OR-of-ANDs product, as uint8 (n, m)."""
    Ub = (np.asarray(U, dtype=np.float64) >= 0.5).astype(np.int64)
    Vb = (np.asarray(V, dtype=np.float64) >= 0.5).astype(np.int64)
    return ((Ub @ Vb) >= 1).astype(np.uint8)


def integrality_gap(X: ArrayLike) -> float:
    """mean(min(X, 1 − X)): 0 for a Boolean matrix, ½ at worst."""
    x = np.asarray(X, dtype=np.float64)
    return float(np.minimum(x, 1.0 - x).mean()) if x.size else 0.0


@dataclass(frozen=True, slots=True)
class FELBConfig:
    """Device-side settings of a FELB model (the training plan itself comes with each round).

    Attributes
    ----------
    rank : number of components k.
    binarize_at : a rated item counts as a 1 iff its rating is ≥ this (implicit data: every
        observed item is a 1).
    fold_in_iterations : proximal-gradient steps `FELBModel.fold_in` takes.
    fold_in_kappa, fold_in_reg, fold_in_growth : ELB weights of the fold-in, whose λ grows by
        ``fold_in_growth`` per step so the new row ends (near) Boolean.
    """

    rank: int = 20
    binarize_at: float = 4.0
    fold_in_iterations: int = 100
    fold_in_kappa: float = 1e-3
    fold_in_reg: float = 0.1
    fold_in_growth: float = 1.05

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_RANK:
            raise ValueError(f"rank must be in [1, {MAX_RANK}], got {self.rank}")
        if not np.isfinite(self.binarize_at):
            raise ValueError(f"binarize_at must be finite, got {self.binarize_at}")
        if not 1 <= self.fold_in_iterations <= 100_000:
            raise ValueError(f"fold_in_iterations must be in [1, 100000], got {self.fold_in_iterations}")
        for name in ("fold_in_kappa", "fold_in_reg"):
            v = getattr(self, name)
            if not (np.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {v}")
        if not (np.isfinite(self.fold_in_growth) and self.fold_in_growth >= 1.0):
            raise ValueError(f"fold_in_growth must be >= 1, got {self.fold_in_growth}")

    def binarize(self, data: LocalRatings, n_items: int) -> FloatArray:
        """The local Boolean block A (n_users, n_items) as float64 in {0, 1}."""
        data.check_items(n_items)
        A = np.zeros((data.n_users, n_items), dtype=np.float64)
        keep = np.ones(data.items.size, dtype=bool) if data.ratings is None else data.ratings >= self.binarize_at
        A[data.users[keep], data.items[keep]] = 1.0
        return A


@dataclass
class FELBModel(Recommender, RoundHooks):
    """The on-device FELB model (`device_sdk.family.FederatedModel` of kind "felb").

    Parameters
    ----------
    n_items : catalogue size m.
    config : device-side settings (rank k, binarization threshold, fold-in).
    rng : the default tie-breaking generator of `recommend`.

    Attributes
    ----------
    item_factors : (k, m) float64 the global components V̂ last adopted (zeros before any).
    user_factors : (n_users, k) float64 the private row factors U_i, or None before the first round.
    model_version : version of ``item_factors`` (0: none yet).
    """

    KIND: ClassVar[str] = _KIND
    n_items: int
    config: FELBConfig = field(default_factory=FELBConfig)
    model_version: int = 0
    item_factors: FloatArray = field(init=False, repr=False)
    user_factors: FloatArray | None = field(default=None, init=False, repr=False)
    rng: np.random.Generator = field(default_factory=np.random.default_rng, repr=False)

    def __post_init__(self) -> None:
        if self.n_items <= 0:
            raise ValueError(f"n_items must be positive, got {self.n_items}")
        self.item_factors = np.zeros((self.config.rank, self.n_items), dtype=np.float64)

    @property
    def rank(self) -> int:
        """Number of components k (the ``bits`` field of the wire messages)."""
        return self.config.rank

    # -- the global model -------------------------------------------------------------------------
    def set_global(self, words: bytes, values: bytes, version: int) -> None:
        """Adopt V̂ from a `ModelPayload`: ``values`` is (k, m) float64 little-endian in C order with
        entries in [0, 1]; ``words`` must be empty."""
        if words:
            raise ValueError("a FELB model travels as float values, not packed words")
        V = float_matrix_from_bytes(values, (self.config.rank, self.n_items))
        if V.size and (V.min() < 0.0 or V.max() > 1.0):
            raise ValueError("FELB components must be finite and in [0, 1]")
        if version < 1:
            raise ValueError(f"a global model version is >= 1, got {version}")
        self.item_factors = V
        self.model_version = int(version)

    def values(self) -> bytes:
        """V̂ as `set_global` expects it (for tests and checkpoints)."""
        return float_matrix_to_bytes(self.item_factors)

    # -- training -------------------------------------------------------------------------------
    def _check_plan(self, plan: TrainingPlan) -> FELBParams:
        plan.check_fits(_KIND, self.n_items, self.config.rank)
        assert isinstance(plan.params, FELBParams)
        if self.model_version < 1:
            raise ModelError("no global model yet: call set_global first")
        if plan.model_version and plan.model_version != self.model_version:
            raise ValueError(f"the round trains version {plan.model_version}; the device holds {self.model_version}")
        return plan.params

    def local_update(self, plan: TrainingPlan, data: LocalRatings, rng: np.random.Generator) -> LocalResult:
        """One round on the device: V_i ← V̂, ``local_epochs`` local iterations at
        λ_r = reg · reg_growth**round_index, and the upload ΔV_i = V_i − V̂ flattened to (k·m,).

        U_i is drawn Uniform[0, 1] from ``rng`` the first time (one row per local user) and kept.

        Raises
        ------
        ValueError : the plan or the data do not fit this model.
        ModelError : no global model adopted yet.
        """
        p = self._check_plan(plan)
        A = self.config.binarize(data, self.n_items)
        k = self.config.rank
        if self.user_factors is None:
            self.user_factors = rng.random((data.n_users, k))
        elif self.user_factors.shape[0] != data.n_users:
            raise ValueError(f"the device holds {self.user_factors.shape[0]} users; the data has {data.n_users}")
        lam = schedule(p.reg, p.reg_growth, plan.round_index)
        V_hat = self.item_factors
        U, V = felb_local(
            A,
            self.user_factors,
            V_hat,
            V_hat,
            kappa=p.kappa,
            lam=lam,
            gamma=p.proximity,
            beta=p.inertia,
            step_rule=p.step_rule,
            iterations=p.local_epochs,
        )
        self.user_factors = U
        delta = (V - V_hat).ravel()
        info = {
            "lambda": lam,
            "objective": local_objective(A, U, V, V_hat, kappa=p.kappa, lam=lam, gamma=p.proximity),
            "ones": int(A.sum()),
            "integrality_gap": integrality_gap(U),
        }
        return LocalResult(vector=delta, examples=int(A.size), info=info)

    def fold_in(self, user_items: ArrayLike, *, userid: int = 0) -> FloatArray:
        """Fit a row of U for a (new) user from the items it likes, with V̂ fixed and no server round.

        Starts at ½ everywhere and takes ``config.fold_in_iterations`` proximal-gradient steps of
        1/(1.1 L) on ½‖a − uV̂‖² + R(u), λ growing by ``fold_in_growth`` per step.  ``userid`` may be
        one past the last held row (a new row is added).

        Returns
        -------
        (k,) the fitted row, also stored as ``user_factors[userid]``.
        """
        if self.model_version < 1:
            raise ModelError("no global model yet: call set_global first")
        items = as_items(user_items, self.n_items)
        held = 0 if self.user_factors is None else self.user_factors.shape[0]
        if not 0 <= userid <= held:
            raise ValueError(f"userid {userid} out of range [0, {held}]")
        cfg = self.config
        a = np.zeros((1, self.n_items))
        a[0, items] = 1.0
        V = self.item_factors
        G = V @ V.T
        eta = 1.0 / (LIPSCHITZ_SAFETY * max(float(np.linalg.norm(G, 2)), LIPSCHITZ_FLOOR))
        aVt = a @ V.T
        u = np.full((1, cfg.rank), 0.5)
        for t in range(cfg.fold_in_iterations):
            lam = schedule(cfg.fold_in_reg, cfg.fold_in_growth, t)
            u = prox_elb(u - eta * (u @ G - aVt), eta * cfg.fold_in_kappa, eta * lam)
        if self.user_factors is None:
            self.user_factors = u.copy()
        elif userid == held:
            self.user_factors = np.vstack([self.user_factors, u])
        else:
            self.user_factors[userid] = u[0]
        return u[0].copy()

    # -- retrieval ------------------------------------------------------------------------------
    def scores(self, *, userid: int = 0) -> FloatArray:
        """Relaxed scores u·V̂ of every item for a held user, (m,)."""
        if self.user_factors is None:
            raise ModelError("no user factors yet: run a round (local_update) or fold_in first")
        if not 0 <= userid < self.user_factors.shape[0]:
            raise ValueError(f"userid {userid} out of range [0, {self.user_factors.shape[0]})")
        return np.asarray(self.user_factors[userid] @ self.item_factors, dtype=np.float64)

    def _held_users(self) -> int:
        return 0 if self.user_factors is None else int(self.user_factors.shape[0])

    def _check_ready(self, users: NDArray[np.int64]) -> None:
        if self.user_factors is None:
            raise ModelError("no user factors yet: run a round (local_update) or fold_in first")

    def _scores(self, users: NDArray[np.int64]) -> FloatArray:
        """Relaxed scores u·V̂ (the Boolean product before thresholding) of every item."""
        if self.user_factors is None:
            raise ModelError("no user factors yet: run a round (local_update) or fold_in first")
        return np.asarray(self.user_factors[users] @ self.item_factors, dtype=np.float64)

    def reconstruct(self) -> NDArray[np.uint8]:
        """The Boolean reconstruction [round(U_i) ∘ round(V̂) ≥ 1] of the local block, (n_users, m)."""
        if self.user_factors is None:
            raise ModelError("no user factors yet: run a round (local_update) or fold_in first")
        return boolean_product(self.user_factors, self.item_factors)

    # -- persistence ----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the model atomically to one store file (see `device_sdk.store`)."""
        U = self.user_factors
        save_store(
            path,
            _KIND,
            {
                "config": asdict(self.config),
                "n_items": self.n_items,
                "model_version": self.model_version,
                "item_factors": self.values(),
                "n_users": 0 if U is None else int(U.shape[0]),
                "user_factors": b"" if U is None else np.ascontiguousarray(U, dtype="<f8").tobytes(),
            },
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, rng: np.random.Generator | None = None) -> FELBModel:
        """Read a model written by `save` (``rng``: its tie-breaking generator); raises
        `StorageError` on any problem with the file."""
        state = load_store(path, _KIND)
        try:
            config = FELBConfig(**dict(state["config"]))
            model = cls(int(state["n_items"]), config, rng=rng or np.random.default_rng())
            version = int(state["model_version"])
            if version:
                model.set_global(b"", bytes(state["item_factors"]), version)
            n_users = int(state["n_users"])
            raw: Any = state["user_factors"]
            if n_users:
                if len(raw) != 8 * n_users * config.rank:
                    raise ValueError(f"user factors are {len(raw)} bytes for {n_users} × {config.rank}")
                U = np.frombuffer(raw, dtype="<f8").astype(np.float64).reshape(n_users, config.rank)
                if not np.all(np.isfinite(U)) or U.min() < 0.0 or U.max() > 1.0:
                    raise ValueError("user factors must be finite and in [0, 1]")
                model.user_factors = U
            elif raw:
                raise ValueError("user factors given for zero users")
        except (KeyError, TypeError, ValueError) as exc:
            raise StorageError(f"{path} is a valid store file but its FELB state is invalid: {exc}") from exc
        return model
