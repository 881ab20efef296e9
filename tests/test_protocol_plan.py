"""The typed training plan (`protocol.plan`): one validator per family, and the one mapping between a
plan and the flat `RoundInvite` fields, in both directions, through the real codec."""

from __future__ import annotations

import dataclasses
import math

import pytest

from protocol.codec import decode, encode
from protocol.messages import RoundInvite
from protocol.plan import FELBParams, FNMFParams, LightFRParams, MFParams, TrainingPlan, params_from_wire, params_type
from protocol.spec import Aggregation, Alignment, ModelKind, StepRule

PARAMS = [
    LightFRParams(
        aggregation=Aggregation.PARA, lam=0.2, negatives=3, local_epochs=2, max_sweeps=4, unobserved_weight=0
    ),
    LightFRParams(unobserved_weight=0.5, confidence=1.5, local_epochs=3),
    LightFRParams(unobserved_weight=0.05, query_planes=3, user_reg=30.0),  # protocol 1.6: asymmetric scoring
    MFParams(max_norm2=4.0, learning_rate=0.05, reg=0.01, pretrain_epochs=7, local_epochs=2, negatives=1),
    FELBParams(local_epochs=5, reg=0.2, reg_growth=1.1, kappa=0.01, proximity=0.5, inertia=0.1, step_rule=StepRule.MU),
    FNMFParams(local_steps=17, proximity=0.3, inertia=0.2, alignment=Alignment.LAP_RHO),
]


def _invite(plan: TrainingPlan) -> RoundInvite:
    bare = RoundInvite(
        round_id=4,
        device_id=9,
        vector_length=plan.vector_length,
        graph_k=3,
        graph_t=2,
        clip_norm=2.5,
        scale_bits=12,
        advertise_deadline=1.0,
        share_keys_deadline=2.0,
        masked_input_deadline=3.0,
        unmask_deadline=4.0,
    )
    return bare.with_plan(plan)


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: type(p).__name__)
def test_plan_survives_the_wire(params) -> None:
    plan = TrainingPlan(params=params, n_items=13, rank=6, model_version=5, round_index=4, example_cap=8, clip_norm=2.5)
    invite = decode(encode(_invite(plan)))
    assert isinstance(invite, RoundInvite)
    assert invite.plan == plan
    assert invite.model_kind == plan.kind.value and invite.bits == 6 and invite.vector_length == plan.vector_length


def test_vector_length_is_each_familys_upload() -> None:
    m, f = 13, 6
    assert TrainingPlan(params=LightFRParams(unobserved_weight=0.0), n_items=m, rank=f).vector_length == m * f
    assert TrainingPlan(params=LightFRParams(), n_items=m, rank=f).vector_length == m * f + 2 * m + f * f + f
    assert TrainingPlan(params=MFParams(), n_items=m, rank=f).vector_length == m * f
    assert TrainingPlan(params=FNMFParams(alignment=Alignment.LAP_RHO), n_items=m, rank=f).vector_length == m * f + f


def test_one_validator_names_the_parameter() -> None:
    with pytest.raises(ValueError, match=r"^local_epochs: must be an integer in \[1, 1000\], got 0"):
        MFParams(local_epochs=0)
    with pytest.raises(ValueError, match="^inertia"):
        FELBParams(inertia=1.0)
    with pytest.raises(ValueError, match="^alignment: must be one of"):
        FNMFParams(alignment="hungarian")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^unobserved_weight"):
        LightFRParams(unobserved_weight=2.5, confidence=1.0)
    with pytest.raises(ValueError, match="^aggregation"):
        LightFRParams(aggregation=Aggregation.PARA)  # the all-items objective (w0 = 0.1 by default) needs grad
    with pytest.raises(ValueError, match="^negatives"):
        MFParams(negatives=True)  # a bool is not a count
    assert MFParams(reg=1).reg == 1.0 and type(MFParams(reg=1).reg) is float
    assert FELBParams(step_rule="mu").step_rule is StepRule.MU  # type: ignore[arg-type]


def test_invites_without_a_valid_plan_are_refused() -> None:
    plan = TrainingPlan(params=MFParams(), n_items=5, rank=2)
    invite = _invite(plan)
    with pytest.raises(ValueError, match="no training plan"):
        _ = dataclasses.replace(invite, bits=0, n_items=0).plan  # a 1.0 invite
    with pytest.raises(ValueError, match="unknown model family"):
        _ = dataclasses.replace(invite, model_kind="tensor", params=None).plan  # what a decoder makes of it
    with pytest.raises(ValueError, match="params are 'mf' parameters, model_kind is 'felb'"):
        dataclasses.replace(invite, model_kind="felb")
    with pytest.raises(ValueError, match="^step_rule: must be one of"):
        params_from_wire("felb", {"sr": ""})  # "" (the key's absent value) is no FELB step rule
    felb = dataclasses.replace(invite, model_kind="felb", params=FELBParams(step_rule=StepRule.MU))
    assert felb.plan.kind is ModelKind.FELB
    with pytest.raises(ValueError, match="vector_length"):
        _ = dataclasses.replace(felb, vector_length=11).plan
    with pytest.raises(ValueError, match="vector_length"):
        invite.with_plan(TrainingPlan(params=MFParams(), n_items=6, rank=2))
    with pytest.raises(ValueError, match="lightfr"):
        plan.check_fits(ModelKind.LIGHTFR, 5, 2)
    with pytest.raises(ValueError, match="rank 2"):
        plan.check_fits(ModelKind.MF, 5, 3)


def test_in_process_plans_clip_nothing() -> None:
    assert math.isinf(TrainingPlan(params=FNMFParams(), n_items=4, rank=2).clip_norm)
    with pytest.raises(ValueError, match="clip_norm"):
        TrainingPlan(params=FNMFParams(), n_items=4, rank=2, clip_norm=0.0)
    assert params_type("felb") is FELBParams


def test_server_config_devices_and_cli_share_defaults_and_bounds() -> None:
    from agg_server.config import FELBSection, FNMFSection, LightFRSection, MFSection
    from device_sdk.fnmf import FNMFConfig
    from device_sdk.mf import MFConfig
    from device_sdk.models import LightFRConfig
    from fedsim.cli import build_parser
    from protocol.errors import ConfigError

    for section, params in ((MFSection, MFParams), (FELBSection, FELBParams), (FNMFSection, FNMFParams)):
        assert issubclass(section, params)  # the config table *is* the parameter type, plus server keys
        shared = {f.name for f in dataclasses.fields(params)}
        assert {f.name: getattr(section(), f.name) for f in dataclasses.fields(params)} == dataclasses.asdict(params())
        assert shared <= {f.name for f in dataclasses.fields(section)}
    # The server's default w0 is "auto" (derived from the density of each round's counts): its first
    # plan carries the density rule at its floor; every other parameter is the plan's default.
    from protocol.families.lightfr import density_weight

    first = dataclasses.replace(LightFRParams(), unobserved_weight=density_weight(0.0, 1, 3))
    assert LightFRSection.from_table({}, 3).params == first
    assert LightFRSection().params == LightFRParams()  # built in code: the plan's defaults, w0 fixed
    assert LightFRConfig().params(Aggregation.GRAD) == LightFRParams()
    assert MFConfig().params() == MFParams()
    fnmf = FNMFConfig()
    assert FNMFParams(local_steps=fnmf.local_steps, alignment=fnmf.alignment) == FNMFParams()  # type: ignore[arg-type]
    # local_epochs: the same bound everywhere.
    with pytest.raises(ConfigError, match=r"^mf\.local_epochs: must be an integer in \[1, 1000\]"):
        MFSection(local_epochs=1001)
    with pytest.raises(ConfigError, match=r"^lightfr\.local_epochs: must be an integer in \[1, 1000\]"):
        LightFRSection.from_table({"local_epochs": 0}, 3)
    with pytest.raises(ValueError, match=r"^local_epochs: must be an integer in \[1, 1000\]"):
        LightFRConfig(local_epochs=1001)
    with pytest.raises(ValueError, match=r"^local_steps"):
        FNMFConfig(local_steps=0)
    with pytest.raises(ValueError, match=r"^local_epochs"):
        MFConfig(local_epochs=0)
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["simulate", "--epochs", "1001"])
    assert parser.parse_args(["simulate", "--epochs", "1000"]).epochs == 1000


# -- protocol 1.6: asymmetric scoring in the plan ---------------------------------------------------------


def _planes_invite(**fields: object) -> RoundInvite:
    plan = TrainingPlan(params=LightFRParams(unobserved_weight=0.1, query_planes=2, user_reg=10.0), n_items=5, rank=4)
    return dataclasses.replace(_invite(plan), **fields)  # type: ignore[arg-type]


def _hostile_bytes(**body: object) -> bytes:
    """A planes invite re-encoded with some body keys replaced (what a hostile server could send)."""
    import msgpack

    envelope = msgpack.unpackb(encode(_planes_invite()), raw=False)
    envelope["b"].update(body)
    return msgpack.packb(envelope, use_bin_type=True)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"qp": 9}, "query_planes"),  # more planes than the device scans
        ({"qp": 1 << 40}, "query_planes"),
        ({"qp": -1}, "query_planes"),
        ({"qp": 2.0}, "qp"),  # a float where an int belongs
        ({"qp": 2, "w0": 0.0, "L": 20}, "query_planes"),  # planes without the all-items objective
        ({"ur": 0.0}, "user_reg"),
        ({"ur": 1e-9}, "user_reg"),  # a near-singular solve
        ({"ur": 1e7}, "user_reg"),
        ({"ur": float("nan")}, "user_reg"),
        ({"ur": float("inf")}, "user_reg"),
        ({"ur": "1"}, "ur"),
    ],
)
def test_a_device_refuses_hostile_plane_settings_naming_the_field(body: dict[str, object], field: str) -> None:
    from protocol.errors import DecodeError

    with pytest.raises(DecodeError, match=field):
        decode(_hostile_bytes(**body))


def test_plane_settings_out_of_range_are_refused_by_the_plan_type() -> None:
    with pytest.raises(ValueError, match=r"^query_planes: must be an integer in \[0, 8\], got 9"):
        LightFRParams(query_planes=9)
    with pytest.raises(ValueError, match=r"^query_planes: must be an integer"):
        LightFRParams(query_planes=True)
    with pytest.raises(ValueError, match=r"^query_planes: asymmetric scoring needs the all-items objective"):
        LightFRParams(query_planes=1, unobserved_weight=0.0)
    with pytest.raises(ValueError, match=r"^user_reg: must be a finite number in \[1e-06, 1000000.0\]"):
        LightFRParams(query_planes=1, user_reg=0.0)
    # A plan that leaves the planes out (every 1.5 server's) keeps ±1 user codes.
    assert LightFRParams().query_planes == 0 and LightFRParams().user_reg == 1.0


def test_the_device_follows_the_plans_planes_and_a_15_device_ignores_them() -> None:
    """A 1.6 device trains what the plan says (a bit-plane vector, the upload in the same layout); a 1.5
    device (a decoder without the qp/ur keys) reads the same bytes as a plan without planes and trains a
    ±1 code: its upload has the same length and layout, so the round takes it."""
    import msgpack
    import numpy as np

    from device_sdk.family import LocalRatings
    from device_sdk.models import LightFRConfig, LightFRModel

    wire = encode(_planes_invite())
    plan = decode(wire).plan  # type: ignore[union-attr]
    assert plan.params.query_planes == 2 and plan.params.user_reg == 10.0
    # A 1.5 decoder ignores the qp and ur keys it does not know: it reads the body without them.
    envelope = msgpack.unpackb(wire, raw=False)
    assert {"qp", "ur"} <= set(envelope["b"])
    envelope["b"] = {k: v for k, v in envelope["b"].items() if k not in ("qp", "ur")}
    old_plan = decode(msgpack.packb(envelope, use_bin_type=True)).plan  # type: ignore[union-attr]
    assert old_plan.params.query_planes == 0 and old_plan == dataclasses.replace(
        plan, params=dataclasses.replace(plan.params, query_planes=0, user_reg=1.0)
    )
    data = LocalRatings(np.zeros(3, np.int64), np.array([0, 2, 3]), None, 1)
    uploads = []
    for p, planes in ((plan, True), (old_plan, False)):
        model = LightFRModel(5, LightFRConfig(bits=4, rating_range=None, rank_planes=0), rng=np.random.default_rng(0))
        model.set_item_codes(np.array([[1, -1, 1, 1]] * 2 + [[-1, 1, 1, -1]] * 3, np.int8), 1)
        out = model.local_update(p, data, np.random.default_rng(1))
        assert model.config.query_planes == (2 if planes else 0) and model.config.user_reg == (10.0 if planes else 1.0)
        assert bool(model.user_weight[0] > 0) is planes  # a bit-plane vector, or a ±1 code
        uploads.append(out.vector)
    assert uploads[0].shape == uploads[1].shape == (p.vector_length,)
    assert not np.array_equal(uploads[0], uploads[1])


# -- one contract: a new LightFR hyper-parameter is declared once -----------------------------------------


def test_a_new_lightfr_parameter_flows_from_the_config_table_to_the_devices_plan(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """A parameter added to `LightFRParams` (here by a subclass registered in its place) is a key of the
    server's [lightfr] table, reaches the strategy's plan, travels in the invite under the key it declares,
    and is in the plan the device decodes; an invite without the key (an older server's) means ``absent``.
    Nothing but the parameter type knows of it."""
    import msgpack

    from agg_server.config import config_from_dict, lightfr_keys
    from agg_server.strategy import build_strategy
    from agg_server.strategy.base import round_plan
    from protocol import plan as plan_module
    from protocol.plan import param_field
    from protocol.session import RoundParameters

    fake = dataclasses.make_dataclass(
        "LightFRParams",
        [("fake_knob", float, param_field(0.5, "fk", absent=0.0))],
        bases=(LightFRParams,),
        frozen=True,
        slots=True,
        kw_only=True,
    )
    monkeypatch.setitem(plan_module._PARAMS, ModelKind.LIGHTFR, fake)
    assert "fake_knob" in lightfr_keys()
    table = {"server": {"data_dir": str(tmp_path)}, "model": {"n_items": 20}, "lightfr": {"bits": 8, "fake_knob": 0.75}}
    config = config_from_dict(table, base_dir=tmp_path)
    assert isinstance(config.lightfr.params, fake) and config.lightfr.params.fake_knob == 0.75  # type: ignore[attr-defined]
    strategy = build_strategy(config)
    plan = round_plan(strategy, 1)
    assert plan.params.fake_knob == 0.75  # type: ignore[union-attr]
    assert plan.record()["fake_knob"] == 0.75  # the stored round record names it too
    params = RoundParameters(
        round_id=1, vector_length=plan.vector_length, k=3, t=2, clip_norm=1.0, scale_bits=8, deadlines=(0.0,) * 4
    )
    wire = encode(params.invite(7).with_plan(plan))
    envelope = msgpack.unpackb(wire, raw=False)
    assert envelope["b"]["fk"] == 0.75 and list(envelope["b"])[-1] == "fk"  # appended after protocol 1.7's keys
    device_plan = decode(wire).plan  # type: ignore[union-attr]
    assert device_plan.params == plan.params and device_plan.params.fake_knob == 0.75  # type: ignore[union-attr]
    del envelope["b"]["fk"]
    older = decode(msgpack.packb(envelope, use_bin_type=True)).plan  # type: ignore[union-attr]
    assert older.params.fake_knob == 0.0  # type: ignore[union-attr]
    # Left out of the table, it is the parameter type's default.
    table["lightfr"] = {"bits": 8}
    assert build_strategy(config_from_dict(table, base_dir=tmp_path)).plan().fake_knob == 0.5  # type: ignore[attr-defined]
