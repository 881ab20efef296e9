"""LightFR server-side aggregation (Zhang et al., LightFR, section 3.3.2–3.3.3), pure numpy.

Invariants:
- Item codes ``D`` are (m, f) int8 ±1.  Every function returns a new array.
- The only input from devices is a **sum** over the cohort (of item gradients for Agg_grad, of ±1
  item matrices for Agg_para), which is exactly what secure aggregation reveals.  Nothing here needs
  an individual device's upload.
- Updates are coordinate-wise over bits (eq. 15: bit k sees bits ¬k as already updated).  With λ = 0
  that is the same as the matrix form of eq. 16.  The sign test is done on z = f·d* (no division), so
  d* = 0 — "keep the bit" — is exact for short binary fractions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from protocol.codes import from_bytes, pack_signs, random_signs, to_bytes, unpack_signs
from protocol.families.lightfr import (
    LEVEL_CENTER,
    UploadLayout,
    bias_from_levels,
    density_weight,
    levels_from_bias,
)
from protocol.plan import LightFRParams, check_float, check_int
from protocol.spec import MAX_RANK, Aggregation

__all__ = [
    "Aggregation",
    "LightFRStrategy",
    "LightFRServerParams",
    "LightFRServerStrategy",
    "default_flip_fraction",
    "agg_grad",
    "agg_para",
    "agg_full",
    "popularity_bias",
    "cold_start_items",
]


def _check(D: NDArray[np.int8], total: NDArray[np.floating] | NDArray[np.integer]) -> None:
    if D.ndim != 2:
        raise ValueError(f"item codes must be (m, f), got {D.shape}")
    if total.shape != D.shape:
        raise ValueError(f"aggregate has shape {total.shape}, item codes {D.shape}")
    if not np.all(np.isfinite(total)):
        raise ValueError("aggregate contains non-finite values")


def agg_grad(
    D: NDArray[np.int8],
    grad_sum: NDArray[np.floating],
    lam: float,
    *,
    flip_fraction: float = 1.0,
    rng: np.random.Generator | None = None,
) -> NDArray[np.int8]:
    """Agg_grad (eq. 14–16): d*_ik = (1/f) Σ_u Δd^u_ik − 2λ Σ_{k'≠k} d_ik'; d_ik ← sign(d*) unless 0.

    Every d*_ik is computed from gradients taken at the *old* codes, so applying all of them at once
    (``flip_fraction = 1``, the paper's rule) is a simultaneous (Jacobi) step: each bit moves as if
    the others stayed put, and when the users of an item have correlated codes the bits overshoot
    together and the model oscillates.  With ``flip_fraction = ρ < 1`` each bit that wants to flip
    does so with probability ρ — a randomized block coordinate step that keeps eq. 15 as the rule
    for the bits it touches and damps the overshoot.

    Parameters
    ----------
    D : (m, f) int8 current item codes.
    grad_sum : (m, f) sum over the cohort of device item gradients (eq. 12).
    lam : balance weight λ ≥ 0.
    flip_fraction : probability ρ ∈ (0, 1] that a bit whose sign test says "flip" is flipped.
    rng : generator for the flip selection; required when ``flip_fraction < 1``.
    """
    _check(D, grad_sum)
    if lam < 0 or not np.isfinite(lam):
        raise ValueError(f"lam must be a finite value >= 0, got {lam}")
    if not 0 < flip_fraction <= 1:
        raise ValueError(f"flip_fraction must be in (0, 1], got {flip_fraction}")
    if flip_fraction < 1 and rng is None:
        raise ValueError("a generator is needed when flip_fraction < 1")
    f = D.shape[1]
    out = D.astype(np.int8, copy=True)
    S = out.sum(axis=1, dtype=np.int64)
    bal = 2.0 * lam * f
    for k in range(f):
        dk = out[:, k].astype(np.int64)
        z = grad_sum[:, k] - bal * (S - dk)  # = f · d*_ik
        new = np.where(z > 0, 1, np.where(z < 0, -1, dk))
        if flip_fraction < 1 and rng is not None:
            new = np.where(rng.random(new.size) < flip_fraction, new, dk)
        S += new - dk
        out[:, k] = new
    return out


def agg_full(
    D: NDArray[np.int8],
    beta: NDArray[np.float64],
    parts: dict[str, NDArray[np.float64]],
    survivors: int,
    w0: float,
    alpha: float,
    *,
    flip_fraction: float = 1.0,
    rng: np.random.Generator | None = None,
    learn_bias: bool = True,
    mean_field: bool = False,
    sweeps: int = 1,
) -> tuple[NDArray[np.int8], NDArray[np.float64]]:
    """One server step of the all-items objective (see `device_sdk.lightfr`): new item codes and
    item biases from the cohort's summed upload parts (`protocol.families.lightfr.UploadLayout.split`).

    Codes: for each item, bit by bit, d_ik ← −sign(C_ik) (kept when 0) with
    C_ik / f = gradient_ik + w0 (Σ_{k'≠k} (G_U)_{kk'} d_ik') / f + w0 β_i (Σ_u b_u)_k, where the first
    term was taken at the old codes (so, as in `agg_grad`, a bit the rule selects flips with
    probability ``flip_fraction``) and the Gram term follows the item's bits as they change.
    With ``mean_field`` the observed part of item i's quadratic, Σ_{u∈Ω_i} b_u b_uᵀ (not in the sum), is
    taken as (counts_i / n)·G_U, so a bit's C_ik also follows the item's bits already changed in this
    step: exact coordinate descent when the raters of every item look like the cohort, and less of the
    Jacobi overshoot otherwise (chosen on validation, docs/results/2026-11-quality.md).
    ``sweeps`` > 1 repeats the pass over the bits on the same summed statistics (no more uploads) until a
    pass flips nothing: each bit is then tested against the quadratic model of its item's loss around the
    old codes (the gradient at the old codes, the Gram term, and with ``mean_field`` the raters' part), its
    own change excluded, so with ``mean_field`` and raters that look like the cohort the step ends at a
    point no single bit flip improves; 1 = one pass (the default).
    Biases: the exact minimiser given the codes the devices trained against,
    β_i = (bias_i − w0 d_iᵀ Σ_u b_u / f) / ((c − w0) counts_i + w0 n), n = ``survivors``.
    """
    m, f = D.shape
    if beta.shape != (m,):
        raise ValueError(f"item biases must have shape ({m},), got {beta.shape}")
    grad, gram, bsum = parts["gradient"], parts["gram"], parts["code_sum"]
    _check(D, grad)
    if gram.shape != (f, f) or bsum.shape != (f,):
        raise ValueError(f"Gram and code sum must be ({f}, {f}) and ({f},)")
    if not (w0 > 0 and np.isfinite(w0)) or not (alpha >= 0 and np.isfinite(alpha)):
        raise ValueError(f"need w0 > 0 and alpha >= 0, got {w0}, {alpha}")
    if survivors < 1:
        raise ValueError("survivors must be >= 1")
    if not 0 < flip_fraction <= 1:
        raise ValueError(f"flip_fraction must be in (0, 1], got {flip_fraction}")
    if flip_fraction < 1 and rng is None:
        raise ValueError("a generator is needed when flip_fraction < 1")
    if isinstance(sweeps, bool) or not isinstance(sweeps, int | np.integer) or sweeps < 1:
        raise ValueError(f"sweeps must be an integer >= 1, got {sweeps!r}")
    old = D.astype(np.float64)
    out = old.copy()
    Q = out @ gram
    Q0 = Q.copy()
    diag = np.diag(gram)
    # Mean field: the observed part of item i's quadratic, Σ_{u∈Ω_i} u uᵀ, taken as (counts_i / n)·G_U, so the
    # gradient of bit k follows the item's bits k' already changed in this step (damps the Jacobi overshoot).
    share = (1.0 + alpha - w0) * np.maximum(parts["counts"], 0.0) / survivors if mean_field else None
    for _ in range(sweeps):
        flips = 0
        for k in range(f):
            dk = out[:, k]
            C = grad[:, k] + w0 * (Q[:, k] - diag[k] * dk) / f + w0 * beta * bsum[k]
            if share is not None:  # the raters' part of the bits changed so far, bit k's own change excluded
                C = C + share * (Q[:, k] - Q0[:, k] - diag[k] * (dk - old[:, k])) / f
            new = np.where(C < 0, 1.0, np.where(C > 0, -1.0, dk))
            if flip_fraction < 1 and rng is not None:
                new = np.where(rng.random(m) < flip_fraction, new, dk)
            delta = new - dk
            idx = np.flatnonzero(delta)
            if idx.size:
                flips += idx.size
                out[idx, k] = new[idx]
                Q[idx] += delta[idx, None] * gram[k][None, :]
        if flips == 0:
            break
    if learn_bias:
        wq = 1.0 + alpha - w0
        den = wq * np.maximum(parts["counts"], 0.0) + w0 * survivors
        beta = (parts["bias"] - w0 * (old @ bsum) / f) / den
    return out.astype(np.int8), beta


def popularity_bias(counts: NDArray[np.float64], span: float) -> NDArray[np.float64]:
    """Item biases from (noisy) per-item counts: span·log(1 + n̂) / log(1 + max n̂), n̂ = max(count, 0).

    Post-processing of the released sum only.  A log scale, so the head of the catalogue does not
    flatten the rest; all zeros when no count is positive.
    """
    c = np.asarray(counts, dtype=np.float64)
    if not np.all(np.isfinite(c)):
        raise ValueError("counts must be finite")
    lv = np.log1p(np.maximum(c, 0.0))
    top = float(lv.max()) if lv.size else 0.0
    return lv * (span / top) if top > 0 else np.zeros_like(lv)


def agg_para(D: NDArray[np.int8], codes_sum: NDArray[np.integer] | NDArray[np.floating]) -> NDArray[np.int8]:
    """Agg_para (eq. 17): D ← sign(Σ_u D^u), keeping the current bit where the sum is 0."""
    _check(D, codes_sum)
    return np.where(codes_sum > 0, 1, np.where(codes_sum < 0, -1, D)).astype(np.int8)


def cold_start_items(
    D: NDArray[np.int8], grad_sum: NDArray[np.floating], new_items: NDArray[np.int64]
) -> NDArray[np.int8]:
    """Codes for newly added items from the aggregated gradients of the devices that rated them
    (eq. 20–21: no balance term): d_ik ← sign(Σ_u Δd^u_ik) unless 0."""
    _check(D, grad_sum)
    new_items = np.asarray(new_items, dtype=np.int64)
    if new_items.size and (new_items.min() < 0 or new_items.max() >= D.shape[0]):
        raise ValueError("new item index out of range")
    out = D.astype(np.int8, copy=True)
    g = grad_sum[new_items]
    out[new_items] = np.where(g > 0, 1, np.where(g < 0, -1, out[new_items]))
    return out


@dataclass(frozen=True, slots=True)
class LightFRStrategy:
    """The LightFR server strategy: initial item codes and the aggregation of a secure sum.

    Attributes
    ----------
    bits : code length f.
    lam : balance weight λ (see docs/design.md §2.2 for why the default is 0, not the paper's 0.6).
    aggregation : `Aggregation.GRAD` (default) or `Aggregation.PARA`.
    flip_fraction : damping ρ of Agg_grad (see `agg_grad`); 1 is the paper's rule.
    """

    bits: int = 64
    lam: float = 0.0
    aggregation: Aggregation = Aggregation.GRAD
    flip_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.flip_fraction <= 1:
            raise ValueError(f"flip_fraction must be in (0, 1], got {self.flip_fraction}")
        if not 1 <= self.bits <= 4096:
            raise ValueError(f"bits must be in [1, 4096], got {self.bits}")
        if self.lam < 0 or not np.isfinite(self.lam):
            raise ValueError(f"lam must be a finite value >= 0, got {self.lam}")

    def initialize(self, n_items: int, rng: np.random.Generator) -> NDArray[np.int8]:
        """Random initial item codes (LightFR Algorithm 1, line 2)."""
        if n_items <= 0:
            raise ValueError("n_items must be positive")
        return random_signs(n_items, self.bits, rng)

    def aggregate(
        self, D: NDArray[np.int8], update_sum: NDArray[np.floating], rng: np.random.Generator | None = None
    ) -> NDArray[np.int8]:
        """New item codes from the cohort's summed uploads (``rng`` drives damped flips)."""
        if self.aggregation is Aggregation.GRAD:
            return agg_grad(D, update_sum, self.lam, flip_fraction=self.flip_fraction, rng=rng)
        return agg_para(D, update_sum)


def default_flip_fraction(all_items: bool, mean_field: bool) -> float:
    """The Agg_grad damping ρ used when none is configured: 1 for the all-items objective with the
    mean-field step (its validation winner), 0.3 otherwise (the Jacobi step oscillates at 1); both chosen
    on validation, docs/results/2026-11-quality.md."""
    return 1.0 if all_items and mean_field else 0.3


@dataclass(frozen=True, slots=True, kw_only=True)
class LightFRServerParams:
    """What only the server uses of LightFR's settings: nothing here is in a device's training plan
    (that is `protocol.plan.LightFRParams`).  The one home of these defaults and bounds: the server's
    ``[lightfr]`` table (`agg_server.config_families.LightFRSection`) builds this type, and every error is a
    ValueError whose message starts with the attribute's name, so the table can prefix its key.

    Attributes
    ----------
    bits : code length f in [1, 4096] (the model's shape; the plan carries it as its rank).
    flip_fraction : damping ρ in (0, 1] of the code step (see `agg_grad`; 1 is the paper's rule); None
        (the default) is `default_flip_fraction` for the objective the plan trains.
    unobserved_scale : κ >= 0.  κ > 0 derives w0 from the catalogue's density (the server configuration's
        "auto"): each round the server sets w0 = κ · density^γ (`protocol.families.lightfr.density_weight`)
        from the counts slice of that round's sum, steps with it, and sends it in the next round's plan;
        the plan's ``unobserved_weight`` is then only what the devices of the first round train with, and
        the coordinator stores the derived value with each committed model (`carry_state`,
        `restore_state`), so a restarted server plans with it.  0 (default): w0 stays the plan's.
    hamming_weight : B in [1, 255] of the devices' integer score (f − Hamming)·B + level.
    learn_bias : learn item levels (otherwise every level stays 128, no item term).
    popularity_span : >= 0; > 0 sets the item levels from the released counts instead of the learned
        biases (the private popularity channel, for rounds under DP, where the bias sums are noise):
        β_i = span·log(1 + n̂_i) / log(1 + max n̂), n̂ the round's counts (negative noise as 0),
        averaged over the rounds so far (`popularity_bias`).  0 = learned levels.
    mean_field : the code step's mean-field correction (`agg_full`; chosen on validation,
        docs/results/2026-11-quality.md).
    code_sweeps : passes in [1, 100] of the code step over one round's sum (`agg_full` ``sweeps``).
    """

    bits: int = 64
    flip_fraction: float | None = None
    unobserved_scale: float = 0.0
    hamming_weight: int = 2
    learn_bias: bool = True
    popularity_span: float = 0.0
    mean_field: bool = True
    code_sweeps: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", check_int("bits", self.bits, lo=1, hi=MAX_RANK))
        if self.flip_fraction is not None:
            ff = check_float("flip_fraction", self.flip_fraction, lo=0.0, hi=1.0, lo_open=True)
            object.__setattr__(self, "flip_fraction", ff)
        object.__setattr__(self, "unobserved_scale", check_float("unobserved_scale", self.unobserved_scale, lo=0.0))
        object.__setattr__(self, "hamming_weight", check_int("hamming_weight", self.hamming_weight, lo=1, hi=255))
        for name in ("learn_bias", "mean_field"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        object.__setattr__(self, "popularity_span", check_float("popularity_span", self.popularity_span, lo=0.0))
        object.__setattr__(self, "code_sweeps", check_int("code_sweeps", self.code_sweeps, lo=1, hi=100))

    def check_plan(self, params: LightFRParams) -> None:
        """Raise ValueError (naming the setting) if a server setting needs the all-items objective and
        ``params`` trains the sampled-negatives one."""
        if params.unobserved_weight > 0:
            return
        for name, off in (("unobserved_scale", 0.0), ("popularity_span", 0.0), ("code_sweeps", 1)):
            if getattr(self, name) != off:
                raise ValueError(f"{name}: needs the all-items objective (unobserved_weight > 0)")


@dataclass(frozen=True, slots=True, kw_only=True)
class LightFRServerStrategy:
    """`LightFRStrategy` behind the `agg_server.strategy.base.Strategy` contract the coordinator
    speaks: the model is the (m, f) ±1 item-code matrix, packed on the wire; devices upload item
    gradients (Agg_grad) or the change D^u − D of their local codes (Agg_para, the server adds
    s·D back).

    With ``params.unobserved_weight > 0`` (the all-items objective) the devices upload the parts of
    `protocol.families.lightfr.UploadLayout`, the server steps codes and item biases with `agg_full`
    and the state is an (m, f + 1) int8 matrix: the codes, then each item's level − 128 (levels ship
    as `ModelPayload.item_levels`, with ``hamming_weight``).

    Attributes
    ----------
    n_items : catalogue size m.
    params : the devices' training plan (`protocol.plan.LightFRParams`, sent in every invite; under a
        density-derived w0 its ``unobserved_weight`` is the first round's).
    server : what only the server uses (`LightFRServerParams`).
    """

    n_items: int
    params: LightFRParams = field(default_factory=LightFRParams)
    server: LightFRServerParams = field(default_factory=LightFRServerParams)
    kind: str = "lightfr"
    # The last density-derived w0 (empty until a round has been aggregated); the one mutable part.
    _derived: list[float] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.params, LightFRParams):
            raise ValueError(f"params: must be a LightFRParams, got {self.params!r}")
        if not isinstance(self.server, LightFRServerParams):
            raise ValueError(f"server: must be a LightFRServerParams, got {self.server!r}")
        self.server.check_plan(self.params)

    @property
    def rule(self) -> LightFRStrategy:
        """The aggregation rule and its hyper-parameters (ρ resolved for the objective)."""
        s, p = self.server, self.params
        rho = s.flip_fraction
        if rho is None:
            rho = default_flip_fraction(self.full and p.aggregation is Aggregation.GRAD, s.mean_field)
        return LightFRStrategy(bits=s.bits, lam=p.lam, aggregation=p.aggregation, flip_fraction=rho)

    @property
    def hamming_weight(self) -> int:
        """B of the devices' integer score (shipped with every all-items model)."""
        return self.server.hamming_weight

    @property
    def full(self) -> bool:
        """True under the all-items objective."""
        return self.params.unobserved_weight > 0

    @property
    def layout(self) -> UploadLayout:
        return UploadLayout(self.n_items, self.server.bits, full=self.full)

    @property
    def rank(self) -> int:
        return self.server.bits

    @property
    def vector_length(self) -> int:
        return self.layout.length

    def initialize(self, rng: np.random.Generator) -> NDArray[np.int8]:
        codes = self.rule.initialize(self.n_items, rng)
        if not self.full:
            return codes
        return np.concatenate([codes, np.zeros((self.n_items, 1), np.int8)], axis=1)

    def plan(self) -> LightFRParams:
        """The devices' training parameters for the next round: ``params`` with the w0 in force."""
        if self.current_weight == self.params.unobserved_weight:
            return self.params
        return dataclasses.replace(self.params, unobserved_weight=self.current_weight)

    @property
    def current_weight(self) -> float:
        """The w0 the next round's devices train with."""
        return self._derived[-1] if self._derived else float(self.params.unobserved_weight)

    def carry_state(self) -> dict[str, float]:
        """What the coordinator stores with a committed model and gives back to `restore_state` after a
        restart: the density-derived w0 (empty when w0 is fixed or no round has been aggregated)."""
        if self.server.unobserved_scale > 0 and self._derived:
            return {"unobserved_weight": self._derived[-1]}
        return {}

    def restore_state(self, stored: dict[str, object]) -> None:
        """Take back a `carry_state` mapping.  A fixed w0 (``unobserved_scale == 0``) ignores it; a value
        outside (0, 1 + α] or not a number is refused with a ValueError naming it."""
        if self.server.unobserved_scale == 0 or "unobserved_weight" not in stored:
            return
        w0 = stored["unobserved_weight"]
        if isinstance(w0, bool) or not isinstance(w0, int | float) or not (0 < w0 <= 1.0 + self.params.confidence):
            raise ValueError(f"stored unobserved_weight must be a number in (0, 1 + confidence], got {w0!r}")
        self._derived[:] = [float(w0)]

    def codes(self, state: NDArray[np.int8]) -> NDArray[np.int8]:
        """The (m, f) item codes of a state."""
        return state[:, : self.server.bits]

    def levels(self, state: NDArray[np.int8]) -> NDArray[np.uint8] | None:
        """The (m,) uint8 item levels of a state (None without the all-items objective)."""
        if not self.full:
            return None
        return (state[:, self.server.bits].astype(np.int16) + LEVEL_CENTER).astype(np.uint8)

    def aggregate(
        self,
        state: NDArray[np.int8],
        total: NDArray[np.float64],
        survivors: int,
        rng: np.random.Generator,
        *,
        round_index: int,
    ) -> NDArray[np.int8]:
        if self.full:
            return self._aggregate_full(state, total, survivors, rng, round_index)
        update_sum = np.asarray(total, dtype=np.float64).reshape(state.shape)
        if self.rule.aggregation is Aggregation.PARA:
            update_sum = update_sum + survivors * state  # Σ_u D^u = s·D + Σ_u (D^u − D)
        return self.rule.aggregate(state, update_sum, rng)

    def _aggregate_full(
        self,
        state: NDArray[np.int8],
        total: NDArray[np.float64],
        survivors: int,
        rng: np.random.Generator,
        round_index: int,
    ) -> NDArray[np.int8]:
        f, m = self.server.bits, self.n_items
        parts = self.layout.split(np.asarray(total, dtype=np.float64))
        beta = bias_from_levels(self.levels(state), m, f, self.hamming_weight)  # what the devices used
        w0 = self.current_weight
        if self.server.unobserved_scale > 0:
            w0 = density_weight(
                float(parts["counts"].sum()),
                survivors,
                m,
                scale=self.server.unobserved_scale,
                cap=1.0 + self.params.confidence,
            )
            self._derived[:] = [w0]
        D, beta = agg_full(
            self.codes(state),
            beta,
            parts,
            survivors,
            w0,
            self.params.confidence,
            flip_fraction=self.rule.flip_fraction,
            rng=rng,
            learn_bias=self.server.learn_bias and self.server.popularity_span == 0,
            mean_field=self.server.mean_field,
            sweeps=self.server.code_sweeps,
        )
        if self.server.popularity_span > 0:
            fresh = popularity_bias(parts["counts"], self.server.popularity_span)
            beta = (round_index * beta + fresh) / (round_index + 1)
        lv = levels_from_bias(beta, f, self.hamming_weight)
        return np.concatenate([D, (lv.astype(np.int16) - LEVEL_CENTER).astype(np.int8)[:, None]], axis=1)

    def to_wire(self, state: NDArray[np.int8]) -> dict[str, object]:
        """The `ModelPayload` fields of ``state``; under the all-items objective also the w0 and α the next
        round's plan carries (protocol 1.7): called right after `aggregate`, that is the w0 this round
        derived under "auto", so a device that only downloads ranks and folds in with it."""
        wire: dict[str, object] = {"words": to_bytes(pack_signs(self.codes(state)))}
        levels = self.levels(state)
        if levels is not None:
            wire["item_levels"] = levels.tobytes()
            wire["hamming_weight"] = self.hamming_weight
            wire["unobserved_weight"] = self.current_weight
            wire["confidence"] = float(self.params.confidence)
        return wire

    def from_wire(self, words: bytes, values: bytes, item_levels: bytes = b"") -> NDArray[np.int8]:
        if values:
            raise ValueError("LightFR models carry packed codes, not float values")
        f, m = self.server.bits, self.n_items
        codes = unpack_signs(from_bytes(words, f, m), f)
        if not self.full:
            return codes
        if len(item_levels) != m:
            raise ValueError(f"the all-items LightFR model needs {m} item levels, got {len(item_levels)} bytes")
        lv = np.frombuffer(item_levels, dtype=np.uint8)
        return np.concatenate([codes, (lv.astype(np.int16) - LEVEL_CENTER).astype(np.int8)[:, None]], axis=1)

    def describe(self, old: NDArray[np.int8], new: NDArray[np.int8]) -> str:
        flips = int(np.count_nonzero(self.codes(old) != self.codes(new)))
        if not self.full:
            return f"{flips} item bits flipped"
        moved = int(np.count_nonzero(old[:, -1] != new[:, -1]))
        return f"{flips} item bits flipped, {moved} item levels changed"
