"""iALS's item term (protocol 1.10): the server sends each model with the log-scale holder counts of its round and
their weight w, and a device ranks by u·v + w·level / 255.  The payload and an older one, the server's emission and
its checkpoint, the configuration key, the device's ranking against numpy, and the simulator's choice of w."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from agg_server.config import config_from_dict
from agg_server.strategy import build_strategy
from agg_server.strategy.ials import IALSStrategy
from device_sdk.ials import IALSConfig, IALSModel, upload_sums, user_item_csr
from fedsim.evaluation.experiment import prepare
from fedsim.federation.ials import IALSSchedule, run_federated_ials, validation_metric
from protocol import codec
from protocol.errors import ConfigError, DecodeError, ModelError
from protocol.families.ials import IALSLayout, item_levels
from protocol.messages import ModelPayload

M, D = 12, 3


def _payload(**over: object) -> ModelPayload:
    rng = np.random.default_rng(0)
    fields: dict[str, object] = {
        "model_version": 4,
        "model_kind": "ials",
        "bits": D,
        "n_items": M,
        "words": b"",
        "values": rng.normal(size=(M, D)).astype("<f8").tobytes(),
        "item_levels": bytes(rng.integers(0, 256, M, dtype=np.uint8)),
        "level_weight": 0.25,
    }
    fields.update(over)
    return ModelPayload(**fields)  # type: ignore[arg-type]


# -- the payload ------------------------------------------------------------------------------------------


def test_levels_and_weight_round_trip_through_the_codec() -> None:
    sent = _payload()
    back = codec.decode(codec.encode(sent))
    assert isinstance(back, ModelPayload)
    assert (back.item_levels, back.level_weight, back.values) == (sent.item_levels, 0.25, sent.values)
    assert back.ials_extras() == {"item_levels": sent.item_levels, "level_weight": 0.25}
    assert back.family_extras() == back.ials_extras() and back.lightfr_extras() == {}
    # Without the term (the server's default): nothing but V; the device ranks by u·v.
    plain = codec.decode(codec.encode(_payload(item_levels=b"", level_weight=0.0)))
    assert isinstance(plain, ModelPayload) and plain.ials_extras() == {"item_levels": b"", "level_weight": 0.0}


def test_a_payload_without_the_new_key_decodes_with_no_item_term() -> None:
    import msgpack

    body = msgpack.unpackb(codec.encode(_payload()), raw=False)["b"]
    for key in ("lw", "lv"):  # what a 1.9 server writes for an iALS model
        body.pop(key)
    older = msgpack.packb({"v": [1, 9], "t": ModelPayload.TYPE, "b": body}, use_bin_type=True)
    decoded = codec.decode(older)
    assert isinstance(decoded, ModelPayload) and (decoded.item_levels, decoded.level_weight) == (b"", 0.0)
    model = IALSModel(M, IALSConfig(factors=D))
    model.set_global(decoded.words, decoded.values, decoded.model_version, **decoded.family_extras())
    assert model.item_levels is None and model.level_weight == 0.0


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"item_levels": b""}, "level_weight > 0 is for iALS models with item_levels"),
        ({"item_levels": b"\x01" * (M - 1)}, "item_levels"),
        ({"level_weight": -0.5}, "level_weight must be >= 0.0"),
        ({"level_weight": math.nan}, "level_weight must be a finite float"),
        ({"level_weight": 1000.5}, "level_weight must be <= 1000"),
        ({"model_kind": "mf"}, "item_levels are for LightFR and iALS models only"),
    ],
)
def test_a_payload_refuses_a_bad_item_term(over: dict[str, object], message: str) -> None:
    with pytest.raises((ValueError, DecodeError), match=message):
        _payload(**over)


# -- the server --------------------------------------------------------------------------------------------


def _upload(rng: np.random.Generator, n_users: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """A plain upload of ``n_users`` random users and its holder counts."""
    users, items = rng.integers(0, n_users, 40), rng.integers(0, M - 2, 40)  # the last two items held by nobody
    indptr, cols = user_item_csr(users, items, n_users, M)
    vector = upload_sums(rng.normal(size=(n_users, D)), indptr, cols, M)
    return vector, IALSLayout(M, D).split(vector)["counts"]


def test_the_strategy_sends_the_levels_of_the_sum_that_made_the_model() -> None:
    rng = np.random.default_rng(1)
    st = IALSStrategy(M, rank=D, alpha=5.0, reg=0.5, level_weight=0.3)
    V0 = st.initialize(rng)
    assert set(st.to_wire(V0)) == {"values"}  # version 1: no round has counted anything yet
    vector, counts = _upload(rng)
    V1 = st.aggregate(V0, vector, 3, rng, round_index=0)
    wire = st.to_wire(V1)
    want = np.rint(255 * np.log1p(counts) / np.log1p(counts.max())).astype(np.uint8)
    assert wire["item_levels"] == want.tobytes() and wire["level_weight"] == 0.3
    assert want.max() == 255 and want[-1] == 0
    # A checkpoint gives the levels back with V: the same payload after a restart.
    again = IALSStrategy(M, rank=D, alpha=5.0, reg=0.5, level_weight=0.3)
    state = again.from_wire(b"", wire["values"], wire["item_levels"])
    assert again.to_wire(state) == wire
    with pytest.raises(ValueError, match=f"needs {M} item levels, got 3 bytes"):
        again.from_wire(b"", wire["values"], b"abc")
    # w = 0 (the default): V alone, whatever the sum counted; the model is the same.
    plain = IALSStrategy(M, rank=D, alpha=5.0, reg=0.5)
    assert set(plain.to_wire(plain.aggregate(V0, vector, 3, rng, round_index=0))) == {"values"}
    np.testing.assert_array_equal(plain.aggregate(V0, vector, 3, rng, round_index=0), V1)


def test_levels_of_noisy_or_empty_counts() -> None:
    np.testing.assert_array_equal(item_levels(np.array([-3.0, 0.0, 1.0, 7.0])), [0, 0, 85, 255])
    np.testing.assert_array_equal(item_levels(np.array([-1.0, 0.0])), [0, 0])


def test_the_config_key_is_checked_and_reaches_the_strategy() -> None:
    base = {"server": {"data_dir": "/srv/fedrec"}, "model": {"kind": "ials", "n_items": M}}
    cfg = config_from_dict({**base, "ials": {"rank": D, "level_weight": 0.03}}, base_dir=Path("/srv"))
    assert build_strategy(cfg) == IALSStrategy(M, rank=D, level_weight=0.03)
    assert config_from_dict(base, base_dir=Path("/srv")).ials.level_weight == 0.0
    for bad in (-1.0, 1e4, "high", float("inf")):
        with pytest.raises(ConfigError, match=r"^ials\.level_weight: .*1000") as info:
            config_from_dict({**base, "ials": {"level_weight": bad}}, base_dir=Path("/srv"))
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="level_weight must be a finite number in"):
        IALSStrategy(M, rank=D, level_weight=True)


# -- the device --------------------------------------------------------------------------------------------


def test_the_device_ranks_by_uv_plus_the_weighted_level(tmp_path: Path) -> None:
    payload = _payload()
    model = IALSModel(M, IALSConfig(factors=D, alpha=5.0, reg=0.5), rng=np.random.default_rng(0))
    with pytest.raises(ModelError):
        model.recommend(np.array([0]), N=3)
    model.set_global(payload.words, payload.values, payload.model_version, **payload.family_extras())
    held = np.array([1, 4, 7])
    u = model.fold_in(held)
    V = np.frombuffer(payload.values, "<f8").reshape(M, D)
    level = np.frombuffer(payload.item_levels, np.uint8).astype(np.float64)
    ref = V @ u + 0.25 * level / 255
    np.testing.assert_allclose(model._scores(np.array([0])), ref[None, :], rtol=1e-12)
    ids, scores = model.recommend(held, N=M - held.size)
    order = np.argsort(-np.where(np.isin(np.arange(M), held), -np.inf, ref), kind="stable")[: M - held.size]
    assert sorted(ids.tolist()) == sorted(order.tolist())
    np.testing.assert_allclose(np.sort(scores)[::-1], ref[order], rtol=1e-6)
    # The item term moves the ranking: w = 0 ranks by u·v alone.
    model.save(tmp_path / "m.fedrec")
    back = IALSModel.load(tmp_path / "m.fedrec")
    assert back.level_weight == 0.25 and np.array_equal(back.item_levels, level.astype(np.uint8))
    model.set_global(b"", payload.values, 5)
    np.testing.assert_allclose(model._scores(np.array([0])), (V @ u)[None, :], rtol=1e-12)
    for bad, message in (
        ({"item_levels": b"\x00" * 3, "level_weight": 0.1}, "one byte per item"),
        ({"level_weight": 0.1}, "needs item_levels"),
        ({"item_levels": payload.item_levels, "level_weight": -1.0}, "level_weight must be"),
    ):
        with pytest.raises(ValueError, match=message):
            model.set_global(b"", payload.values, 6, **bad)  # type: ignore[arg-type]


# -- the simulator -------------------------------------------------------------------------------------------


def test_the_simulated_device_scores_as_the_run_does() -> None:
    exp = prepare("synthetic")
    st = IALSStrategy(exp.train.n_items, rank=8, alpha=5.0, reg=1.0, level_weight=0.5)
    run = run_federated_ials(exp.train, st, IALSSchedule(rounds=2, seed=0))
    assert run.level_weight == 0.5 and run.item_levels is not None
    np.testing.assert_array_equal(run.item_levels, st.levels)  # the levels the server would send
    counts = np.bincount(np.unique(exp.train.users * exp.train.n_items + exp.train.items) % exp.train.n_items)
    np.testing.assert_array_equal(run.item_levels, item_levels(np.r_[counts, [0] * (exp.train.n_items - counts.size)]))
    users = np.arange(5)
    uv = run.user_factors[users] @ run.item_factors.T
    np.testing.assert_allclose(run.score(users), uv + 0.5 * run.item_levels / 255.0, rtol=1e-12)
    run.level_weight = 0.0
    np.testing.assert_allclose(run.score(users), uv, rtol=1e-12)
    assert validation_metric(exp, run)[0] == "hr@10"


def test_a_saved_run_keeps_the_item_term(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse
    import io
    import json

    from fedsim.cli import main
    from fedsim.cli.simulate_ials import save_ials_run
    from fedsim.evaluation.ranking import TieMode, evaluate_candidates
    from fedsim.federation.ials import select_and_train
    from fedsim.federation.runs import load_run

    exp = prepare("synthetic")
    schedule = IALSSchedule(rounds=2, seed=0)
    sel = select_and_train(exp, schedule, factors=(8,), alphas=(5.0,), regs=(1.0,), level_weights=(0.5,))
    assert sel.level_weight == 0.5 and sel.run.item_levels is not None
    path = tmp_path / "run.fedrec"
    args = argparse.Namespace(save=path, dataset="synthetic", seed=0, eval_seed=0)
    out = io.StringIO()
    save_ials_run(args, exp, schedule, sel, out)
    assert "saved the run" in out.getvalue()
    run = load_run(path)
    whole, _ = run.device_model(None)
    one, _ = run.device_model(3)
    for model in (whole, one):
        assert model.level_weight == 0.5 and np.array_equal(model.item_levels, sel.run.item_levels)
    np.testing.assert_allclose(one._scores(np.array([0])), sel.run.score(np.array([3])), rtol=1e-12)
    # `fedrec eval` scores with the term: the figure of the run's own scores (not of u·v alone).
    assert main(["eval", str(path), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    want = evaluate_candidates(sel.run.scores(exp.test.users, exp.test.items), 10, TieMode.RANDOM).hr
    assert rec["metrics"]["model"]["hr@10"] == pytest.approx(want, abs=1e-12)
    sel.run.level_weight = 0.0
    assert evaluate_candidates(sel.run.scores(exp.test.users, exp.test.items), 10, TieMode.RANDOM).hr != want
