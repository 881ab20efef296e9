"""The training plan of a round, typed: what a device trains, how, and what it uploads.

Invariants:
- One parameter type per model family (`LightFRParams`, `MFParams`, `FELBParams`, `FNMFParams`, `IALSParams`):
  frozen, with the one set of defaults and the one validator of that family's training
  hyper-parameters.  The server's configuration tables, the strategies, the device models and the
  CLI all build these types, so they cannot disagree on a default or a bound.
- `TrainingPlan` is a family's parameters plus the model's shape, version and schedule index, and
  the upload's clipping bound.  A `RoundInvite` carries the parameters as one object (``params``); on the
  wire each parameter is one body key, declared beside its default (`param_field`: the key and what an
  invite without it means), so the codec derives the invite's plan keys from these types (`wire_params`)
  and a new parameter touches neither `protocol.messages` nor `protocol.codec`.  Protocol 1.1–1.3 and 1.6
  appended the keys one by one, and the evolution rule of docs/protocol.md keeps them.
- In-process runs (no secure aggregation) use a `TrainingPlan` directly: nothing in it is about
  SecAgg, and ``clip_norm`` defaults to infinity (nothing clipped).
- Every error is a `ValueError` whose message starts with the parameter's name
  (``local_epochs: must be an integer in [1, 1000], got 0``), so the server configuration can
  prefix its table (``mf.local_epochs: ...``) and a device can quote it when it refuses a round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar

import numpy as np

from protocol.families.fnmf import upload_length
from protocol.families.ials import IALSLayout
from protocol.families.lightfr import UploadLayout
from protocol.spec import (
    MAX_ITEMS,
    MAX_LOCAL_STEPS,
    MAX_QUERY_PLANES,
    MAX_RANK,
    MAX_VECTOR_LENGTH,
    USER_REG_RANGE,
    Aggregation,
    Alignment,
    ModelKind,
    StepRule,
)

__all__ = [
    "FamilyParams",
    "FELBParams",
    "FNMFParams",
    "IALSParams",
    "LightFRParams",
    "MFParams",
    "TrainingPlan",
    "WireParam",
    "check_choice",
    "check_float",
    "check_int",
    "known_wire_params",
    "param_field",
    "params_from_wire",
    "params_to_wire",
    "params_type",
    "wire_params",
]


# -- the checks (one per kind of value) -----------------------------------------------------------------


def _range_text(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {hi}"
    return ""


def _fail(name: str, what: str, value: object) -> ValueError:
    return ValueError(f"{name}: must be {what}, got {value!r}")


def check_int(name: str, value: object, *, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an int in [lo, hi] (numpy integers are accepted, a bool is not an int here);
    ValueError naming ``name`` otherwise."""
    what = f"an integer {_range_text(lo, hi, False, False)}".rstrip()
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise _fail(name, what, value)
    n = int(value)
    if (lo is not None and n < lo) or (hi is not None and n > hi):
        raise _fail(name, what, value)
    return n


def check_float(
    name: str,
    value: object,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    """``value`` as a finite float in the range (an int is accepted and converted, a bool is not)."""
    what = f"a finite number {_range_text(lo, hi, lo_open, hi_open)}".rstrip()
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.integer | np.floating):
        raise _fail(name, what, value)
    x = float(value)
    if not math.isfinite(x):
        raise _fail(name, what, value)
    if lo is not None and (x <= lo if lo_open else x < lo):
        raise _fail(name, what, value)
    if hi is not None and (x >= hi if hi_open else x > hi):
        raise _fail(name, what, value)
    return x


_E = TypeVar("_E", Aggregation, Alignment, StepRule)


def check_choice(name: str, value: object, vocabulary: type[_E]) -> _E:
    """``value`` as a member of ``vocabulary`` (a `protocol.spec` StrEnum)."""
    try:
        return vocabulary(value)  # type: ignore[arg-type]
    except ValueError:
        raise _fail(name, "one of " + ", ".join(repr(v.value) for v in vocabulary), value) from None


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)


def _epochs(obj: object, name: str) -> None:
    _set(obj, name, check_int(name, getattr(obj, name), lo=1, hi=MAX_LOCAL_STEPS))


def _nonneg(obj: object, name: str, *, positive: bool = False, below_one: bool = False) -> None:
    hi = 1.0 if below_one else None
    _set(obj, name, check_float(name, getattr(obj, name), lo=0.0, lo_open=positive, hi=hi, hi_open=below_one))


# -- how a parameter travels ------------------------------------------------------------------------------

_SAME: Any = object()


def param_field(default: Any, key: str, *, absent: Any = _SAME) -> Any:
    """A family parameter's dataclass field: its ``default``, and how it travels in a `RoundInvite`.

    ``key`` is its short body key (stable: never renamed, retyped or reused; a key may be shared by
    families whose parameters mean the same, with the same type); ``absent`` is what an invite without the
    key means, the value a peer of the protocol before the key implied (the default when not given).  The
    codec derives the invite's plan keys from these fields (`wire_params`): a new parameter declared here
    travels without a change to `protocol.messages` or `protocol.codec`.
    """
    plain = default if absent is _SAME else absent
    return field(default=default, metadata={"wire": key, "absent": plain.value if isinstance(plain, Enum) else plain})


class WireParam(NamedTuple):
    """One family parameter as it travels (`param_field`)."""

    name: str
    key: str
    absent: int | float | str


def wire_params(ptype: type[FamilyParams]) -> tuple[WireParam, ...]:
    """The parameters of ``ptype`` that travel in an invite, in declaration order."""
    return tuple(
        WireParam(f.name, f.metadata["wire"], f.metadata["absent"]) for f in fields(ptype) if "wire" in f.metadata
    )


def params_to_wire(params: FamilyParams) -> dict[str, int | float | str]:
    """``params`` by body key, as plain int, float and str values."""
    out: dict[str, int | float | str] = {}
    for w in wire_params(type(params)):
        value = getattr(params, w.name)
        out[w.key] = value.value if isinstance(value, Enum) else value
    return out


def params_from_wire(kind: str, body: Mapping[str, Any]) -> FamilyParams | None:
    """The parameters of family ``kind`` from invite body values by key (a missing key is its ``absent``
    value); None for a family this build does not know.  ValueError (naming the parameter) if they are
    not valid parameters of the family."""
    try:
        ptype = params_type(kind)
    except ValueError:
        return None
    return ptype(**{w.name: body.get(w.key, w.absent) for w in wire_params(ptype)})


def known_wire_params() -> dict[str, WireParam]:
    """Every body key a known family's parameters use (the first declaration of a shared key)."""
    out: dict[str, WireParam] = {}
    for ptype in _PARAMS.values():
        for w in wire_params(ptype):
            out.setdefault(w.key, w)
    return out


# -- the families' parameters ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LightFRParams:
    """LightFR's local training (binary codes by discrete coordinate descent).

    Attributes
    ----------
    aggregation : "grad" (devices upload item gradients; the default) or "para" (updated codes).
    lam : balance weight λ >= 0 of the local DCD.
    negatives : sampled unobserved items per rating, fitted as 0 (>= 0; unused when w0 > 0).
    local_epochs, max_sweeps : local epochs E and the DCD sweep cap, each in [1, 1000].
    unobserved_weight : w0 in [0, 1 + confidence]; > 0 is the all-items objective (chosen on
        validation: 0.1), 0 the paper's sampled-negatives objective.  w0 > 0 needs "grad".
    confidence : α >= 0: observed items weigh 1 + α under the all-items objective.
    counts_share : s in [0, 1), only with w0 > 0: the device clips the per-item counts of its upload
        to √s·C and the rest to √(1 − s)·C (`protocol.families.lightfr.clip_parts`), the private
        popularity channel's share of the clip norm; 0 clips the upload as one.
    query_planes : P in [0, 8] (protocol 1.6).  P >= 1, only with w0 > 0, is asymmetric scoring: each
        device solves a real-valued user vector exactly against the binary item codes (ridge weight
        ``user_reg``), keeps it as P ±1 bit-planes and a weight, uploads the same parts with it instead
        of a ±1 code, and ranks items by the planes' integer score (`device_sdk.lightfr.ridge_users`,
        `quantize_planes`, `device_sdk.topk.plane_scores`).  0 (default): ±1 user codes by DCD.
    user_reg : the ridge weight of that solve, in [1e-6, 1e6] (protocol 1.6; default 1; used only with
        ``query_planes`` >= 1).
    """

    KIND: ClassVar[ModelKind] = ModelKind.LIGHTFR
    aggregation: Aggregation = param_field(Aggregation.GRAD, "ag", absent="grad")
    lam: float = param_field(0.0, "lam")
    negatives: int = param_field(4, "neg", absent=0)
    local_epochs: int = param_field(1, "E")
    max_sweeps: int = param_field(10, "sw")
    unobserved_weight: float = param_field(0.1, "w0", absent=0.0)
    confidence: float = param_field(0.0, "cf")
    counts_share: float = param_field(0.0, "cs")
    query_planes: int = param_field(0, "qp")
    user_reg: float = param_field(1.0, "ur")

    def __post_init__(self) -> None:
        _set(self, "aggregation", check_choice("aggregation", self.aggregation, Aggregation))
        _nonneg(self, "lam")
        _set(self, "negatives", check_int("negatives", self.negatives, lo=0))
        _epochs(self, "local_epochs")
        _epochs(self, "max_sweeps")
        _nonneg(self, "confidence")
        _set(
            self,
            "unobserved_weight",
            check_float("unobserved_weight", self.unobserved_weight, lo=0.0, hi=1.0 + self.confidence),
        )
        if self.unobserved_weight > 0 and self.aggregation is not Aggregation.GRAD:
            raise ValueError("aggregation: the all-items objective (unobserved_weight > 0) needs 'grad'")
        _nonneg(self, "counts_share", below_one=True)
        if self.counts_share > 0 and self.unobserved_weight == 0:
            raise ValueError(
                "counts_share: needs the all-items objective (unobserved_weight > 0), whose upload has counts"
            )
        _set(self, "query_planes", check_int("query_planes", self.query_planes, lo=0, hi=MAX_QUERY_PLANES))
        if self.query_planes > 0 and self.unobserved_weight == 0:
            raise ValueError("query_planes: asymmetric scoring needs the all-items objective (unobserved_weight > 0)")
        lo, hi = USER_REG_RANGE
        _set(self, "user_reg", check_float("user_reg", self.user_reg, lo=lo, hi=hi))

    def upload_length(self, n_items: int, rank: int) -> int:
        return UploadLayout(n_items, rank, full=self.unobserved_weight > 0).length


@dataclass(frozen=True, slots=True, kw_only=True)
class MFParams:
    """Real-valued MF's local training (projected SGD on the user vector, then the item gradient).

    Attributes
    ----------
    max_norm2 : R > 0, the embedding clipping bound (rows non-negative, squared norm <= R); the top
        of the rating scale, so one rating's item gradient has L2 norm <= 2R^{3/2}.
    learning_rate : device SGD step η >= 0 (0 freezes the user vectors).
    reg : L2 weight λ >= 0 on the user vector.
    pretrain_epochs : stage-1 steps fitting a new user's vector with V fixed, in [0, 1000].
    local_epochs : steps on u per round before the V-gradient is taken, in [1, 1000].
    negatives : unobserved items per kept rating fitted as 0 (>= 0).
    """

    KIND: ClassVar[ModelKind] = ModelKind.MF
    max_norm2: float = param_field(5.0, "R", absent=0.0)
    learning_rate: float = param_field(0.1, "lr", absent=0.0)
    reg: float = param_field(0.0, "rg")
    pretrain_epochs: int = param_field(50, "pe", absent=0)
    local_epochs: int = param_field(1, "E")
    negatives: int = param_field(0, "neg")

    def __post_init__(self) -> None:
        _nonneg(self, "max_norm2", positive=True)
        _nonneg(self, "learning_rate")
        _nonneg(self, "reg")
        _set(self, "pretrain_epochs", check_int("pretrain_epochs", self.pretrain_epochs, lo=0, hi=MAX_LOCAL_STEPS))
        _epochs(self, "local_epochs")
        _set(self, "negatives", check_int("negatives", self.negatives, lo=0))

    def upload_length(self, n_items: int, rank: int) -> int:
        return n_items * rank


@dataclass(frozen=True, slots=True, kw_only=True)
class FELBParams:
    """FELB's local training (iPALM on the ELB-regularized Boolean factorization).

    Attributes
    ----------
    local_epochs : local iterations b per round, in [1, 1000].
    reg : base L2 weight λ >= 0 of the ELB regularizer; round r uses λ_r = reg · reg_growth**r.
    reg_growth : >= 1.
    kappa : L1 weight κ >= 0 of the ELB regularizer.
    proximity : γ >= 0, the pull towards the broadcast V̂.
    inertia : iPALM β in [0, 1).
    step_rule : "lipschitz" (FELB) or "mu" (FELB^MU).
    """

    KIND: ClassVar[ModelKind] = ModelKind.FELB
    local_epochs: int = param_field(10, "E", absent=1)
    reg: float = param_field(0.1, "rg", absent=0.0)
    reg_growth: float = param_field(1.05, "rgg", absent=1.0)
    kappa: float = param_field(1e-3, "ka", absent=0.0)
    proximity: float = param_field(1.0, "px", absent=0.0)
    inertia: float = param_field(1e-3, "bt", absent=0.0)
    step_rule: StepRule = param_field(StepRule.LIPSCHITZ, "sr", absent="")

    def __post_init__(self) -> None:
        _epochs(self, "local_epochs")
        _nonneg(self, "reg")
        _set(self, "reg_growth", check_float("reg_growth", self.reg_growth, lo=1.0))
        _nonneg(self, "kappa")
        _nonneg(self, "proximity")
        _nonneg(self, "inertia", below_one=True)
        _set(self, "step_rule", check_choice("step_rule", self.step_rule, StepRule))

    def upload_length(self, n_items: int, rank: int) -> int:
        return n_items * rank


@dataclass(frozen=True, slots=True, kw_only=True)
class FNMFParams:
    """FNMF's local training (projected gradient with a pull towards the aligned broadcast V̄).

    Attributes
    ----------
    local_steps : T, local projected-gradient steps per round, in [1, 1000] (``local_epochs`` on the wire).
    proximity : γ >= 0 (0 with alignment "none" is FedAvg).
    inertia : iPALM β in [0, 1).
    alignment : "lap" (Hungarian), "lap_rho" (partial, correlation distance), "sinkhorn" (soft) or "none".
    """

    KIND: ClassVar[ModelKind] = ModelKind.FNMF
    local_steps: int = param_field(100, "E", absent=1)
    proximity: float = param_field(1.0, "px", absent=0.0)
    inertia: float = param_field(0.0, "bt")
    alignment: Alignment = param_field(Alignment.LAP, "al", absent="")

    def __post_init__(self) -> None:
        _epochs(self, "local_steps")
        _nonneg(self, "proximity")
        _nonneg(self, "inertia", below_one=True)
        _set(self, "alignment", check_choice("alignment", self.alignment, Alignment))

    def upload_length(self, n_items: int, rank: int) -> int:
        return upload_length(rank, n_items, self.alignment)


#: Bounds of iALS's confidence α and ridge weight (inclusive): the solves' matrices stay well away from singular
#: and their results finite whatever a server ships.
IALS_ALPHA_MAX = 1e6
IALS_REG_RANGE = (1e-6, 1e6)
#: The largest θ of the bounded iALS upload.
IALS_THETA_MAX = 1_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class IALSParams:
    """Implicit ALS's local training (Hu, Koren and Volinsky's confidence-weighted objective): the device
    solves its user vectors exactly against the downloaded item factors and uploads the sums the server's
    item solve needs (`protocol.families.ials.IALSLayout`).

    Attributes
    ----------
    alpha : confidence α in [0, 1e6]: an observed (user, item) pair weighs 1 + α, every other pair 1
        (``cf`` on the wire, the key LightFR's α uses).
    reg : ridge weight λ in [1e-6, 1e6] of the user and the item solves (``rg``).
    theta : 0 (the default) for the plain upload; θ >= 1 for the **bounded** upload a DP round needs
        (``bd``): each user's vector is scaled to unit norm, its rows of B and its counts weigh
        1/√max(|I|, θ), the Gram part is Σ γ·u uᵀ and the weighted Gram and positives parts are 0, so one
        user's upload has L2 norm at most √(2 + γ²) whatever it holds (`bounded_norm`).
    gram_weight : γ in (0, 1] of the bounded upload's Gram part (``gw``; unused when θ = 0).
    """

    KIND: ClassVar[ModelKind] = ModelKind.IALS
    # The keys LightFR's α and MF's λ use, with their meaning and absence (a new family has no older peer, and
    # an invite without "rg" is refused: λ must be > 0).
    alpha: float = param_field(20.0, "cf", absent=0.0)
    reg: float = param_field(0.1, "rg", absent=0.0)
    theta: int = param_field(0, "bd")
    gram_weight: float = param_field(0.1, "gw")

    def __post_init__(self) -> None:
        _set(self, "alpha", check_float("alpha", self.alpha, lo=0.0, hi=IALS_ALPHA_MAX))
        lo, hi = IALS_REG_RANGE
        _set(self, "reg", check_float("reg", self.reg, lo=lo, hi=hi))
        _set(self, "theta", check_int("theta", self.theta, lo=0, hi=IALS_THETA_MAX))
        _set(self, "gram_weight", check_float("gram_weight", self.gram_weight, lo=0.0, hi=1.0, lo_open=True))

    @property
    def bounded_norm(self) -> float:
        """The largest L2 norm of one user's bounded upload, √(2 + γ²) (θ >= 1; infinite for the plain upload,
        whose norm grows with |I|): B's rows weigh |I|/max(|I|, θ) <= 1 in total, the counts as much, the
        Gram part ‖γ u uᵀ‖_F = γ."""
        return math.sqrt(2.0 + self.gram_weight**2) if self.theta else math.inf

    def upload_length(self, n_items: int, rank: int) -> int:
        return IALSLayout(n_items, rank).length


FamilyParams = LightFRParams | MFParams | FELBParams | FNMFParams | IALSParams
"""The training parameters of one family."""

_PARAMS: dict[ModelKind, type[FamilyParams]] = {
    ModelKind.LIGHTFR: LightFRParams,
    ModelKind.MF: MFParams,
    ModelKind.FELB: FELBParams,
    ModelKind.FNMF: FNMFParams,
    ModelKind.IALS: IALSParams,
}

# Attribute of a parameter type -> its name in the stored round record (`TrainingPlan.record`), where the two
# differ.
_RECORD_NAME = {"local_steps": "local_epochs"}


def params_type(kind: str) -> type[FamilyParams]:
    """The parameter type of model family ``kind``; ValueError for a family this build does not know."""
    try:
        return _PARAMS[ModelKind(kind)]
    except ValueError:
        raise ValueError(f"model_kind: unknown model family {kind!r} (known: {[k.value for k in ModelKind]})") from None


class _InviteFields(Protocol):
    """What `TrainingPlan.from_invite` reads (a `protocol.messages.RoundInvite`)."""

    @property
    def model_kind(self) -> str: ...
    @property
    def bits(self) -> int: ...
    @property
    def n_items(self) -> int: ...
    @property
    def model_version(self) -> int: ...
    @property
    def round_index(self) -> int: ...
    @property
    def example_cap(self) -> int: ...
    @property
    def vector_length(self) -> int: ...
    @property
    def clip_norm(self) -> float: ...
    @property
    def params(self) -> FamilyParams | None: ...


# -- the plan -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingPlan:
    """What every device of a round trains, with which parameters, and what it uploads.

    Attributes
    ----------
    params : the family's parameters; their type names the family (`kind`).
    n_items, rank : catalogue size m and the code length / factor or component count (``bits`` on
        the wire), each >= 1; the upload has `vector_length` entries.
    model_version : the global model version the round trains (0 = not stated).
    round_index : 0 for the round that trains version 1, then 1, 2, ... (drives schedules).
    example_cap : θ, at most this many of a device's ratings are used per round (0 = all).
    clip_norm : the L2 bound the upload is clipped to before quantization (> 0; infinity = none,
        the in-process default). FNMF's "lap_rho" shrinks its components to it so its counts survive.
    """

    params: FamilyParams
    n_items: int
    rank: int
    model_version: int = 0
    round_index: int = 0
    example_cap: int = 0
    clip_norm: float = math.inf

    def __post_init__(self) -> None:
        if not isinstance(self.params, LightFRParams | MFParams | FELBParams | FNMFParams | IALSParams):
            raise ValueError(f"params: must be a family's parameters, got {self.params!r}")
        check_int("n_items", self.n_items, lo=1, hi=MAX_ITEMS)
        check_int("rank", self.rank, lo=1, hi=MAX_RANK)
        for name in ("model_version", "round_index", "example_cap"):
            check_int(name, getattr(self, name), lo=0)
        if not (isinstance(self.clip_norm, int | float) and self.clip_norm > 0 and not math.isnan(self.clip_norm)):
            raise _fail("clip_norm", "> 0", self.clip_norm)
        _set(self, "clip_norm", float(self.clip_norm))
        if not 1 <= self.vector_length <= MAX_VECTOR_LENGTH:
            raise ValueError(f"vector_length: the upload has {self.vector_length} entries, limit {MAX_VECTOR_LENGTH}")

    @property
    def kind(self) -> ModelKind:
        """The model family."""
        return self.params.KIND

    @property
    def vector_length(self) -> int:
        """Entries of one device's upload (the family's upload layout for this shape and plan)."""
        return self.params.upload_length(self.n_items, self.rank)

    def check_fits(self, kind: str, n_items: int, rank: int) -> None:
        """Raise ValueError unless this plan trains a ``kind`` model of ``n_items`` × ``rank`` (what a
        device checks before it trains)."""
        if self.kind != kind:
            raise ValueError(f"this device runs {kind!r}; the round trains {self.kind.value!r}")
        if (self.n_items, self.rank) != (n_items, rank):
            raise ValueError(
                f"the round trains m={self.n_items} items at rank {self.rank}; "
                f"the device model has m={n_items}, rank {rank}"
            )

    def invite_fields(self) -> dict[str, Any]:
        """The `RoundInvite` fields of this plan: its shape, version and schedule index, and ``params``
        (``clip_norm`` and ``vector_length`` are the SecAgg parameters' and not included)."""
        return {
            "model_kind": self.kind.value,
            "bits": self.rank,
            "n_items": self.n_items,
            "model_version": self.model_version,
            "round_index": self.round_index,
            "example_cap": self.example_cap,
            "params": self.params,
        }

    def record(self) -> dict[str, Any]:
        """This plan as one flat JSON-able record (plain str, int and float values), as the server stores
        it with a round: `invite_fields` with the parameters by name in place of ``params`` (FNMF's
        ``local_steps`` as ``local_epochs``)."""
        out = self.invite_fields()
        del out["params"]
        for f in fields(self.params):
            value = getattr(self.params, f.name)
            out[_RECORD_NAME.get(f.name, f.name)] = value.value if isinstance(value, Enum) else value
        return out

    @classmethod
    def from_invite(cls, invite: _InviteFields) -> TrainingPlan:
        """The plan a `RoundInvite` carries (its parameters were validated by the family's type when the
        invite was built or decoded).

        Raises
        ------
        ValueError
            The invite names no plan (a 1.0 invite: ``bits`` or ``n_items`` is 0), an unknown family,
            or a ``vector_length`` that is not this plan's upload.
        """
        if not invite.bits or not invite.n_items:
            raise ValueError("the invite carries no training plan (bits and n_items must be >= 1)")
        params_type(invite.model_kind)  # an unknown family: ValueError naming it
        params = invite.params
        if params is None:
            raise ValueError(f"the invite carries no {invite.model_kind} training parameters")
        plan = cls(
            params=params,
            n_items=invite.n_items,
            rank=invite.bits,
            model_version=invite.model_version,
            round_index=invite.round_index,
            example_cap=invite.example_cap,
            clip_norm=invite.clip_norm,
        )
        if plan.vector_length != invite.vector_length:
            raise ValueError(
                f"vector_length: {invite.vector_length} is not the {plan.kind.value} upload of this plan "
                f"({plan.vector_length} for n_items={plan.n_items}, rank={plan.rank})"
            )
        return plan
