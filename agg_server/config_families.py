"""The model families' configuration tables: ``[model]`` (which family, the catalogue size), ``[lightfr]``,
``[mf]``, ``[felb]``, ``[fnmf]`` and ``[ials]``, and how an older file's LightFR keys in ``[model]`` are read.

The families' training parameters live in `protocol.plan` (the [mf], [felb], [fnmf] and [ials] sections subclass
them; the [lightfr] section holds them beside the server's own,
`agg_server.strategy.lightfr.LightFRServerParams`).  `agg_server.config` assembles these sections into a
`ServerConfig`; the invariants of that module (every error names its TOML key, numbers are normalised on
construction) hold here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from agg_server.config_fields import _choice, _fail, _float, _int, _is_default, _set
from agg_server.strategy.lightfr import LightFRServerParams
from protocol.errors import ConfigError
from protocol.families.ials import DEFAULT_FACTORS as IALS_FACTORS
from protocol.families.lightfr import DENSITY_SCALE, density_weight
from protocol.plan import FELBParams, FNMFParams, IALSParams, LightFRParams, MFParams, params_type
from protocol.spec import MAX_ITEMS, MAX_LEVEL_WEIGHT, MAX_RANK, ModelKind

__all__ = [
    "ModelSection",
    "LightFRSection",
    "MFSection",
    "FELBSection",
    "FNMFSection",
    "IALSSection",
    "lightfr_keys",
    "lightfr_default",
]

# Limits shared with the wire messages (protocol.spec): a config the messages would refuse must be
# refused here, at start-up, instead of at the first round.
_MAX_BITS = MAX_RANK
_MAX_ITEMS = MAX_ITEMS

#: The keys of [model]: the model family and the catalogue size.  LightFR's settings have their own table,
#: [lightfr]; older files give them in [model], which is still read (`config_from_dict`).
_MODEL_KEYS = ("kind", "n_items")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSection:
    """The global model (TOML table ``[model]``).

    Attributes
    ----------
    kind : str
        Model family, a `protocol.spec.ModelKind` value: "lightfr" (default), "mf", "felb", "fnmf" or
        "ials"; each takes its hyper-parameters from the table of that name (``[lightfr]``, ``[mf]``, ...).
        LightFR's keys may also be given here, as older files do (`config_from_dict` moves them to
        ``[lightfr]``; a key given in both is refused).
    n_items : int
        Catalogue size m (required), 1 <= m <= 2**26.
    """

    kind: str = ModelKind.LIGHTFR.value
    n_items: int

    def __post_init__(self) -> None:
        # Stored as plain str (not the StrEnum) so the values serialise the same everywhere.
        _set(self, "kind", _choice("model.kind", self.kind, tuple(k.value for k in ModelKind)))
        _int("model.n_items", self.n_items, lo=1, hi=_MAX_ITEMS)


#: The [lightfr] keys that configure `LightFRServerParams` (``learn_bias`` is not an operator setting).
_LIGHTFR_SERVER_KEYS = tuple(f.name for f in dataclasses.fields(LightFRServerParams) if f.name != "learn_bias")
#: Where the [lightfr] table's defaults differ from the types it builds: w0 is "auto" (derived from the
#: catalogue's density each round), with κ the density rule's (`protocol.families.lightfr.DENSITY_SCALE`).
_LIGHTFR_TABLE_DEFAULTS: dict[str, object] = {"unobserved_weight": "auto", "unobserved_scale": DENSITY_SCALE}


def lightfr_keys() -> list[str]:
    """The keys of the [lightfr] table: `protocol.plan.LightFRParams`' fields, then the server's own."""
    return [f.name for f in dataclasses.fields(params_type(ModelKind.LIGHTFR))] + list(_LIGHTFR_SERVER_KEYS)


def lightfr_default(key: str) -> object:
    """The value a [lightfr] key has when it is left out."""
    if key in _LIGHTFR_TABLE_DEFAULTS:
        return _LIGHTFR_TABLE_DEFAULTS[key]
    for cls in (params_type(ModelKind.LIGHTFR), LightFRServerParams):
        for f in dataclasses.fields(cls):
            if f.name == key:
                return f.default.value if isinstance(f.default, Enum) else f.default
    raise KeyError(key)


@dataclass(frozen=True, slots=True, kw_only=True)
class LightFRSection:
    """LightFR (TOML table ``[lightfr]``, used when ``model.kind = "lightfr"``): the devices' training
    parameters, `protocol.plan.LightFRParams` (their keys, defaults and bounds), and what only the server
    uses, `agg_server.strategy.lightfr.LightFRServerParams`.  The table's keys are those two types'
    attributes, read by `from_table`; the server's strategy is built from ``params`` and ``server``.

    Two keys differ from the types they build:

    unobserved_weight : float or "auto"
        A number in [0, 1 + confidence] fixes w0 (0 = sampled negatives).  "auto" (the default) is the
        all-items objective with w0 derived each round from the catalogue's density,
        w0 = unobserved_scale · density^(2/3), density = the round's summed counts / (survivors · m)
        (`protocol.families.lightfr.density_weight`; chosen on validation across three datasets): the first
        round's plan carries the rule at its floor (one positive per device).
    unobserved_scale : float
        κ > 0 of that rule (default 0.6); used only with ``unobserved_weight = "auto"``.

    The others, as in those types: ``aggregation``, ``lam``, ``negatives``, ``local_epochs``, ``max_sweeps``,
    ``confidence``, ``counts_share``, ``query_planes``, ``user_reg`` (sent in every round's plan), and
    ``bits``, ``flip_fraction``, ``hamming_weight``, ``popularity_span``, ``mean_field``, ``code_sweeps``
    (server-only).  Built in code, ``LightFRSection()`` is the two types' defaults (w0 fixed at the plan's).
    """

    params: LightFRParams = field(default_factory=LightFRParams)
    server: LightFRServerParams = field(default_factory=LightFRServerParams)

    def __post_init__(self) -> None:
        if not isinstance(self.params, params_type(ModelKind.LIGHTFR)):
            raise _fail("lightfr", "LightFR's training parameters (protocol.plan.LightFRParams)", self.params)
        if not isinstance(self.server, LightFRServerParams):
            raise _fail("lightfr", "LightFR's server parameters (LightFRServerParams)", self.server)
        try:
            self.server.check_plan(self.params)
        except ValueError as exc:
            raise ConfigError(f"lightfr.{exc}") from None

    @classmethod
    def from_table(
        cls, table: Mapping[str, Any], n_items: int, *, origin: Mapping[str, str] | None = None
    ) -> LightFRSection:
        """The section of a [lightfr] table (keys as `lightfr_keys`; absent ones at `lightfr_default`) for
        a catalogue of ``n_items``.  ``origin`` names the table each key came from ("model" for the older
        place), so that an error names the key as the operator wrote it (``model.lam: must be ...``)."""
        where = dict(origin or {})

        def key(name: str) -> str:
            return f"{where.get(name, 'lightfr')}.{name}"

        def failed(exc: ValueError) -> ConfigError:  # the types' messages start with the attribute's name
            return ConfigError(f"{where.get(str(exc).split(':', 1)[0], 'lightfr')}.{exc}")

        w0 = table.get("unobserved_weight", _LIGHTFR_TABLE_DEFAULTS["unobserved_weight"])
        if isinstance(w0, str) and w0 != "auto":
            raise _fail(key("unobserved_weight"), '"auto" or a number in [0, 1 + confidence]', w0)
        scale = _float(key("unobserved_scale"), table.get("unobserved_scale", DENSITY_SCALE), lo=0.0, lo_open=True)
        auto = isinstance(w0, str)
        ptype = params_type(ModelKind.LIGHTFR)
        plan = {f.name: table[f.name] for f in dataclasses.fields(ptype) if f.name in table}
        plan["unobserved_weight"] = density_weight(0.0, 1, n_items, scale=scale, cap=1.0) if auto else w0
        server = {name: table[name] for name in _LIGHTFR_SERVER_KEYS if name in table}
        server["unobserved_scale"] = scale if auto else 0.0
        try:
            params: LightFRParams = ptype(**plan)  # type: ignore[assignment]  # LightFR's type, or a subclass
            server_params = LightFRServerParams(**server)
            server_params.check_plan(params)
        except ValueError as exc:
            raise failed(exc) from None
        return cls(params=params, server=server_params)


def _family_checks(table: str, params_type: type, section: object) -> None:
    """Run the family parameter type's validator (`protocol.plan`) on a config table, with the table
    named in the error (``mf.local_epochs: must be ...``)."""
    try:
        params_type.__post_init__(section)  # type: ignore[attr-defined]
    except ValueError as exc:
        raise ConfigError(f"{table}.{exc}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class MFSection(MFParams):
    """Real-valued MF (TOML table ``[mf]``, used when ``model.kind = "mf"``): the devices' training
    parameters are `protocol.plan.MFParams` (their defaults and bounds), plus the server's own.

    Attributes
    ----------
    rank : int
        Factor count f in [1, 4096].
    server_lr : float
        Server step on the survivors' mean gradient (> 0).
    max_norm2, learning_rate, reg, pretrain_epochs, local_epochs, negatives
        As in `protocol.plan.MFParams`.
    """

    rank: int = 32
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        _family_checks("mf", MFParams, self)
        _int("mf.rank", self.rank, lo=1, hi=_MAX_BITS)
        _set(self, "server_lr", _float("mf.server_lr", self.server_lr, lo=0.0, lo_open=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class FELBSection(FELBParams):
    """Federated Boolean MF (TOML table ``[felb]``, used when ``model.kind = "felb"``): the devices'
    training parameters are `protocol.plan.FELBParams`, plus the server's own.

    Attributes
    ----------
    rank : int
        Component count k in [1, 4096].
    server_scale : float
        s > 0 in the server prox with (s·κ, s·λ_r).
    local_epochs, reg, reg_growth, kappa, proximity, inertia, step_rule
        As in `protocol.plan.FELBParams`.
    """

    rank: int = 5
    server_scale: float = 1.0

    def __post_init__(self) -> None:
        _family_checks("felb", FELBParams, self)
        _int("felb.rank", self.rank, lo=1, hi=_MAX_BITS)
        _set(self, "server_scale", _float("felb.server_scale", self.server_scale, lo=0.0, lo_open=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class FNMFSection(FNMFParams):
    """Coherent federated NMF (TOML table ``[fnmf]``, used when ``model.kind = "fnmf"``): the devices'
    training parameters are `protocol.plan.FNMFParams`, plus the rank.

    Over HTTP the server runs the secure variant only: devices align their V to the broadcast V̄
    and the server needs just the sum.  The barycenter that needs each client's matrix exists only
    in the in-process simulator's explicit trusted-aggregator mode.

    Attributes
    ----------
    rank : int
        Component count k in [1, 4096].
    local_steps, proximity, inertia, alignment
        As in `protocol.plan.FNMFParams`.
    """

    rank: int = 5

    def __post_init__(self) -> None:
        _family_checks("fnmf", FNMFParams, self)
        _int("fnmf.rank", self.rank, lo=1, hi=_MAX_BITS)


@dataclass(frozen=True, slots=True, kw_only=True)
class IALSSection(IALSParams):
    """Federated implicit ALS (TOML table ``[ials]``, used when ``model.kind = "ials"``): the devices'
    training parameters are `protocol.plan.IALSParams`, plus the rank.

    For a non-private run, set ``rounds.clip_norm`` above the largest upload's norm (about the most items one
    device holds, times 1 + ‖u‖²) so that nothing is clipped (`device_sdk.ials` says how to pick
    ``rounds.scale_bits``).

    Attributes
    ----------
    rank : int
        Factor count d in [1, 4096] (default 64).
    alpha, reg, theta, gram_weight
        As in `protocol.plan.IALSParams`.  A server with ``privacy.enabled`` needs θ >= 1 (the bounded upload,
        norm at most √(2 + γ²): set ``rounds.clip_norm`` to that value).
    level_weight : float
        w in [0, 1000] (default 0): > 0 sends each model with its item levels (the log-scale holder counts of
        the round's sum; noisy under DP) and devices rank by u·v + w·level / 255 (protocol 1.10; a 1.9 device
        refuses such a model: keep 0 while any is in the fleet).  ``fedrec simulate --model ials`` chooses
        it on validation and prints the value.
    """

    rank: int = IALS_FACTORS
    level_weight: float = 0.0

    def __post_init__(self) -> None:
        _family_checks("ials", IALSParams, self)
        _int("ials.rank", self.rank, lo=1, hi=_MAX_BITS)
        _set(self, "level_weight", _float("ials.level_weight", self.level_weight, lo=0.0, hi=MAX_LEVEL_WEIGHT))


def _unused_table(table: str, key: str, kind: str, value: object) -> ConfigError:
    return ConfigError(
        f'{table}.{key}: the [{table}] table configures model.kind = "{table}", unused with '
        f'model.kind = "{kind}": delete it or set model.kind = "{table}" (got {value!r})'
    )


def _lightfr_table(values: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    """The [lightfr] table with the LightFR keys an older file gives in [model] moved into it (taken out of
    ``values["model"]``), and the table each key came from; a key given in both is refused."""
    table = dict(values["lightfr"])
    origin = dict.fromkeys(table, "lightfr")
    for key in [k for k in values["model"] if k not in _MODEL_KEYS]:
        value = values["model"].pop(key)
        if key in table:
            raise ConfigError(
                f"model.{key}: also given as lightfr.{key}; LightFR's settings belong in the [lightfr] table "
                f"([model] keeps them for older files): give it once, in [lightfr]"
            )
        table[key], origin[key] = value, "model"
    return table, origin


def _refuse_unused_lightfr(table: Mapping[str, Any], origin: Mapping[str, str], kind: str) -> None:
    """Nothing reads LightFR's settings under another ``model.kind``: one changed from its default is
    refused, named where the file gives it (``model.<key>`` for the older place, else ``lightfr.<key>``)."""
    for key, value in table.items():
        if _is_default(value, lightfr_default(key)):
            continue
        if origin.get(key) == "model":
            raise ConfigError(
                f'model.{key}: a LightFR setting, unused with model.kind = "{kind}", which reads '
                f"only model.kind, model.n_items and the [{kind}] table: delete it (got {value!r})"
            )
        raise _unused_table("lightfr", key, kind, value)
