"""The private-round simulator against the real coordinator, and its released noise."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agg_server.config import ServerConfig, config_from_dict
from device_sdk.family import LocalRatings
from device_sdk.felb import FELBConfig, FELBModel
from device_sdk.fnmf import FNMFConfig, FNMFModel
from device_sdk.mf import MFConfig, MFModel
from device_sdk.models import LightFRConfig, LightFRModel
from fedsim.data.planted import planted_binary, planted_nonnegative
from fedsim.fleets.faults import DropoutAt
from fedsim.private.cohorts import LightFRCohort
from fedsim.private.coordinator_rounds import run_private
from fedsim.private.simulator import PrivateSimulator, _noise_check, run_simulated, survivor_sets
from protocol.noise import colluding_devices, minimum_survivors
from protocol.samplers import insecure_test_noise_stream

N_ITEMS = 20
SEED = 13


#: LightFR's private popularity channel: a share of the clip norm for the counts, levels from them.
POPULARITY = {"counts_share": 0.5, "popularity_span": 2.0, "hamming_weight": 1}


def _config(
    data_dir: Path,
    kind: str,
    n: int,
    *,
    dp: bool,
    rounds: int,
    n_items: int = N_ITEMS,
    sampled: bool = False,
    model: dict[str, Any] | None = None,
) -> ServerConfig:
    # sampled: LightFR's sampled-negatives objective, the one the scaled mode (LightFRCohort) runs.
    extra = {"unobserved_weight": 0.0} if sampled else {}
    extra.update(model or {})
    return config_from_dict(
        {
            "server": {"data_dir": str(data_dir), "port": 0},
            # model.bits is LightFR's: another kind refuses it changed from its default.
            "model": {"kind": kind, "n_items": n_items, **({"bits": 16} if kind == "lightfr" else {}), **extra},
            "rounds": {
                "cohort_size": n,
                "min_cohort": n,
                "seed": 5,
                "clip_norm": 4.0,
                "scale_bits": 10,
                "dropout_rate": 0.3,
                "example_cap": 6,
            },
            "privacy": {"enabled": True, "epsilon": 4.0, "delta": 1e-5, "planned_rounds": rounds} if dp else {},
            **{
                table: values
                for table, values in (
                    ("mf", {"rank": 4, "pretrain_epochs": 2}),
                    ("felb", {"rank": 3, "local_epochs": 2}),
                    ("fnmf", {"rank": 3, "local_steps": 3}),
                )
                if table == kind
            },
        },
        base_dir=data_dir,
    )


def _family(kind: str, n: int) -> tuple[Callable[[], Any], list[LocalRatings]]:
    rng = np.random.default_rng(3)
    if kind == "lightfr":
        data = [
            LocalRatings.single_user(rng.choice(N_ITEMS, size=int(rng.integers(2, 9)), replace=False)) for _ in range(n)
        ]
        return lambda: LightFRModel(N_ITEMS, LightFRConfig(bits=16), rng=np.random.default_rng(1)), data
    if kind == "mf":
        data = []
        for _ in range(n):
            items = rng.choice(N_ITEMS, size=6, replace=False)
            data.append(LocalRatings.single_user(items, rng.integers(1, 6, size=6).astype(float)))
        return lambda: MFModel(N_ITEMS, MFConfig(factors=4), rng=np.random.default_rng(0)), data
    if kind == "felb":
        planted = planted_binary(n, 2, N_ITEMS, 3, tile_columns=(4, 8), rng=rng)
        return lambda: FELBModel(N_ITEMS, FELBConfig(rank=3)), [LocalRatings.from_matrix(b) for b in planted.clients]
    planted_real = planted_nonnegative(n, 2, N_ITEMS, 3, tile_columns=(4, 8), rng=rng)
    return lambda: FNMFModel(N_ITEMS, FNMFConfig(rank=3)), [LocalRatings.from_matrix(b) for b in planted_real.clients]


_PHASES = [
    DropoutAt.BEFORE_KEYS,
    DropoutAt.BEFORE_SHARES,
    DropoutAt.BEFORE_MASKED,
    DropoutAt.BEFORE_UNMASK,
    DropoutAt.DISCONNECT_MASKED,
]


def _schedule(r: int, d: int) -> DropoutAt:
    # One device per phase drops in each round (a different one every round).
    slot = (d + 3 * r) % 10
    return _PHASES[slot] if slot < len(_PHASES) else DropoutAt.NONE


@pytest.mark.parametrize(
    ("kind", "dp", "n", "model"),
    [
        ("lightfr", True, 12, None),
        ("lightfr", False, 12, None),
        ("lightfr", True, 12, POPULARITY),
        ("mf", True, 10, None),
        ("felb", True, 10, None),
        ("fnmf", False, 10, None),
    ],
)
def test_simulator_is_bit_identical_to_the_coordinator(
    kind: str, dp: bool, n: int, model: dict[str, Any] | None, tmp_path: Path
) -> None:
    rounds = 2
    new_model, data = _family(kind, n)
    ref = run_private(
        _config(tmp_path / "ref", kind, n, dp=dp, rounds=rounds, model=model),
        dict(enumerate(data)),
        lambda device_id: new_model(),
        rounds=rounds,
        seed=SEED,
        dropout=_schedule,
    )
    sim = PrivateSimulator(_config(tmp_path / "sim", kind, n, dp=dp, rounds=rounds, model=model))
    ids = sorted(ref.devices)
    models = {d: new_model() for d in ids}
    local = {d: data[i] for i, d in enumerate(ids)}
    outcomes = [sim.run_round(models, local, seed=SEED, dropout=_schedule) for _ in range(rounds)]
    assert all(o is not None and o.committed for o in outcomes)
    coord = ref.coordinator
    assert sim.model_version == coord.model_version == rounds + 1
    assert np.array_equal(np.asarray(sim.model_state), np.asarray(coord.model_state))
    assert sim.payload().words == coord.strategy.to_wire(coord.model_state).get("words", b"")
    if model is not None:  # the item levels came from the released counts: popular items rank higher
        levels = coord.strategy.levels(coord.model_state)
        assert levels is not None and int(levels.max()) > 128
    if dp:
        assert coord.ledger is not None and sim.ledger is not None
        assert sim.ledger.spent() == coord.ledger.spent() > 0
    for o in outcomes:
        assert o is not None
        plan = {d: _schedule(o.round_id, d) for d in ids}
        early = {DropoutAt.BEFORE_KEYS, DropoutAt.BEFORE_SHARES, DropoutAt.BEFORE_MASKED}
        assert o.survivors.u3 == {d for d in ids if plan[d] not in early}
        assert o.survivors.corrected == {d for d in ids if plan[d] is DropoutAt.NONE}


def test_simulator_aborts_like_the_coordinator(tmp_path: Path) -> None:
    # Half the cohort leaves before its masked input: below t_min, nothing is released or charged.
    n = 10
    new_model, data = _family("lightfr", n)

    def half(r: int, d: int) -> DropoutAt:
        return DropoutAt.BEFORE_MASKED if d % 2 == 0 else DropoutAt.NONE

    ref = run_private(
        _config(tmp_path / "ref", "lightfr", n, dp=True, rounds=1),
        dict(enumerate(data)),
        lambda device_id: new_model(),
        rounds=1,
        seed=SEED,
        dropout=half,
    )
    sim = PrivateSimulator(_config(tmp_path / "sim", "lightfr", n, dp=True, rounds=1))
    ids = sorted(ref.devices)
    out = sim.run_round({d: new_model() for d in ids}, {d: data[i] for i, d in enumerate(ids)}, seed=SEED, dropout=half)
    assert out is not None and not out.committed and "t_min" in out.survivors.error
    assert ref.coordinator.model_version == sim.model_version == 1
    assert ref.coordinator.ledger is not None and ref.coordinator.ledger.spent() == 0.0
    assert sim.ledger is not None and sim.ledger.spent() == 0.0


@pytest.mark.parametrize(("survivors", "corrected"), [(70, 70), (85, 80), (100, 100), (100, 60)])
def test_released_noise_variance_is_mu_after_the_correction(survivors: int, corrected: int) -> None:
    mu, n, omega = 400.0, 100, 0.3
    t_min = minimum_survivors(n, omega)
    want = corrected * mu / survivors + (survivors - corrected) * mu / t_min
    var = _noise_check(mu, n, omega, survivors, corrected, 40_000)
    assert abs(var - want) <= 0.05 * want
    if corrected == survivors:
        assert abs(var - mu) <= 0.05 * mu


@pytest.mark.parametrize(("survivors", "corrected"), [(70, 70), (100, 100), (85, 80)])
def test_the_honest_survivors_keep_mu_when_the_colluders_add_no_noise(survivors: int, corrected: int) -> None:
    # γ = 0.05 of a cohort of 100: f = 5 colluders among the survivors add nothing; the others carry >= mu.
    mu, n, omega, gamma = 400.0, 100, 0.3, 0.05
    f = colluding_devices(n, gamma)
    var = _noise_check(mu, n, omega, survivors, corrected, 40_000, adversary_rate=gamma, silent=f)
    t_min = minimum_survivors(n, omega)
    want = (corrected - f) * mu / (survivors - f) + (survivors - corrected) * mu / (t_min - f)
    assert abs(var - want) <= 0.05 * want
    assert var >= 0.95 * mu


def _honest_share(sim: PrivateSimulator, n: int) -> float:
    """n / (n − f): the released noise over μ when all n devices add theirs (each keeps μ/(n − f), so the
    honest ones alone carry μ even if the f = ⌊γ n⌋ colluders add none)."""
    return n / (n - colluding_devices(n, sim.config.rounds.adversary_rate))


def test_scaled_round_noise_has_variance_mu(tmp_path: Path) -> None:
    # Devices with no ratings upload nothing: the released sum is pure noise, of variance n/(n - f)·mu.
    n, m = 200, 2000
    sim = PrivateSimulator(_config(tmp_path, "lightfr", n, dp=True, rounds=1, n_items=m, sampled=True))
    cohort = LightFRCohort([(np.zeros(0, np.int64), None)] * n, m, 16)
    out = sim.run_scaled_round(cohort, sim_seed=1)
    want = sim.mu * _honest_share(sim, n)
    assert _honest_share(sim, n) == pytest.approx(200 / 190)
    assert out is not None and out.committed and out.noise_variance == pytest.approx(want)
    assert sim.last_release is not None and sim.last_release.size == m * 16
    assert abs(float(np.var(sim.last_release)) - want) <= 0.05 * want
    assert abs(float(np.mean(sim.last_release))) < 4 * np.sqrt(want / sim.last_release.size)


def test_survivor_sets_refuse_a_graph_shortcut_with_late_dropouts() -> None:
    with pytest.raises(Exception, match="need_graph"):
        survivor_sets(
            [1, 2, 3, 4],
            {4: DropoutAt.BEFORE_UNMASK},
            k=3,
            t=1,
            t_min=0,
            rng=np.random.default_rng(0),
            need_graph=False,
        )


def _real_devices_sum(
    users: list[tuple[np.ndarray, None]],
    cohort: LightFRCohort,
    invite: Any,
    bits: int,
    install: Callable[[LightFRModel], None],
) -> np.ndarray:
    """The sum of what real `LightFRModel` devices upload for ``invite`` (``install`` gives each its
    model; device j draws from seed j), with the batched ``cohort`` set to the same user codes."""
    from device_sdk.training import local_round

    m = invite.n_items
    expected = np.zeros(invite.vector_length, dtype=np.int64)
    for j, (items, _) in enumerate(users):
        model = LightFRModel(m, LightFRConfig(bits=bits), rng=np.random.default_rng(1))
        install(model)
        model.reset_user(np.random.default_rng(j))
        model.user_trained[0] = True
        cohort.codes[j] = model.user_codes[0]
        ring, _ = local_round(
            model,
            invite,
            LocalRatings.single_user(items),
            None,
            np.random.default_rng(j),
            coins=insecure_test_noise_stream(j),
        )
        expected += ring.view(np.int32)
    cohort.trained[:] = True
    return expected


def test_batched_lightfr_devices_match_real_devices(tmp_path: Path) -> None:
    # Same user codes, no sampling (θ = 0, no negatives): the batched uploads equal the devices'
    # own `local_round` outputs up to the stochastic rounding (< 1 per device and coordinate).
    from dataclasses import replace

    from protocol.session import RoundParameters

    n, m = 15, 40
    cfg = _config(tmp_path, "lightfr", n, dp=False, rounds=1, n_items=m, sampled=True)
    lightfr = replace(cfg.lightfr, params=replace(cfg.lightfr.params, negatives=0))
    cfg = replace(cfg, lightfr=lightfr, rounds=replace(cfg.rounds, example_cap=0))
    sim = PrivateSimulator(cfg)
    rng = np.random.default_rng(4)
    users = [(np.sort(rng.choice(m, size=int(rng.integers(1, 12)), replace=False)), None) for _ in range(n)]
    cohort = LightFRCohort(users, m, 16)
    from agg_server.strategy.base import round_plan

    params = RoundParameters(
        round_id=1, vector_length=m * 16, k=n, t=1, clip_norm=4.0, scale_bits=10, deadlines=(0.0,) * 4
    )
    invite = params.invite(0).with_plan(round_plan(sim.strategy, 1))
    expected = _real_devices_sum(users, cohort, invite, 16, lambda model: model.set_item_codes(sim.model_state, 1))
    coins = insecure_test_noise_stream(0)
    got = cohort.quantized_sum(
        sim.model_state, invite, cohort.device_ids, cohort.device_ids, np.random.default_rng(0), coins
    )
    assert np.max(np.abs(got - expected)) <= n
    assert np.count_nonzero(expected) > 100


def test_run_simulated_matches_run_private_device_ids_and_model(tmp_path: Path) -> None:
    new_model, data = _family("mf", 8)
    clients = dict(enumerate(data))
    ref = run_private(
        _config(tmp_path / "ref", "mf", 8, dp=True, rounds=2), clients, lambda d: new_model(), rounds=2, seed=SEED
    )
    sim = run_simulated(
        _config(tmp_path / "sim", "mf", 8, dp=True, rounds=2), clients, lambda d: new_model(), rounds=2, seed=SEED
    )
    assert sorted(sim.devices) == sorted(ref.devices)
    assert np.array_equal(sim.simulator.model_state, ref.coordinator.model_state)
    for d in ref.devices:
        assert np.array_equal(sim.devices[d].model.user_factors, ref.devices[d].model.user_factors)


def test_aggregate_noise_mode_releases_variance_mu(tmp_path: Path) -> None:
    n, m = 30, 1500
    cfg = _config(tmp_path, "mf", n, dp=True, rounds=1, n_items=m)
    sim = PrivateSimulator(cfg)
    empty = {d: LocalRatings.single_user(np.zeros(0, np.int64), np.zeros(0)) for d in range(1, n + 1)}
    models = {d: MFModel(m, MFConfig(factors=4), rng=np.random.default_rng(0)) for d in empty}
    out = sim.run_round(models, empty, seed=1, per_device_noise=False)
    assert out is not None and out.committed and sim.last_release is not None
    want = sim.mu * _honest_share(sim, n)
    assert abs(float(np.var(sim.last_release)) - want) <= 0.05 * want


@pytest.mark.asyncio
async def test_http_round_with_dp_equals_the_simulator(aiohttp_server: Any, tmp_path: Path) -> None:
    # One real HTTP round (aiohttp server, DeviceClients, SecAgg+ with real crypto, DP noise from the
    # devices' keystreams, one device leaving before its masked input) ends with the model the simulator
    # computes for the same seeds and dropout schedule.
    from dataclasses import replace

    from tests import test_families_http as fh

    def private(cfg: ServerConfig) -> ServerConfig:
        return replace(cfg, privacy=replace(cfg.privacy, enabled=True, epsilon=8.0, delta=1e-5, planned_rounds=1))

    coord, statuses, data, new_model = await fh._http_round(
        private(fh._config(tmp_path / "http", "mf")), "mf", aiohttp_server, tmp_path / "devices"
    )
    assert coord.model_version == 2 and coord.ledger is not None and coord.ledger.spent() > 0
    ids = list(range(1, fh.DEVICES + 1))
    sim = run_simulated(
        private(fh._config(tmp_path / "sim", "mf")),
        dict(enumerate(data)),
        lambda device_id: new_model(),
        rounds=1,
        seed=fh.SEED,
        dropout=lambda round_id, device_id: fh._dropout(ids.index(device_id)),
    )
    assert np.array_equal(sim.simulator.model_state, coord.model_state)
    assert sim.simulator.ledger is not None and sim.simulator.ledger.spent() == coord.ledger.spent()


@pytest.mark.parametrize(("share", "planes"), [(0.0, 0), (0.5, 0), (0.0, 2), (0.5, 3)])
def test_batched_all_items_devices_match_real_devices(share: float, planes: int, tmp_path: Path) -> None:
    # The all-items objective (w0 > 0) with item levels, clipped as one or with a counts share, with ±1
    # codes or (protocol 1.6) bit-plane user vectors: the batched uploads equal the devices' own
    # `local_round` outputs up to the stochastic rounding.
    from dataclasses import replace

    from agg_server.strategy.base import round_plan
    from protocol.families.lightfr import bias_from_levels
    from protocol.session import RoundParameters

    n, m, f = 15, 40, 16
    model = {"counts_share": share, "query_planes": planes, "user_reg": 3.0}
    cfg = _config(tmp_path, "lightfr", n, dp=False, rounds=1, n_items=m, model=model)
    cfg = replace(cfg, rounds=replace(cfg.rounds, example_cap=0))
    sim = PrivateSimulator(cfg)
    rng = np.random.default_rng(4)
    sim.model_state[:, f] = rng.integers(-20, 20, size=m)  # item levels around the centre
    payload = sim.payload()
    st: Any = sim.strategy
    beta = bias_from_levels(np.frombuffer(payload.item_levels, dtype=np.uint8), m, f, payload.hamming_weight)
    assert np.count_nonzero(beta) > 10
    users = [(np.sort(rng.choice(m, size=int(rng.integers(1, 12)), replace=False)), None) for _ in range(n)]
    cohort = LightFRCohort(users, m, f)
    length = st.vector_length
    params = RoundParameters(
        round_id=1, vector_length=length, k=n, t=1, clip_norm=1.5, scale_bits=10, deadlines=(0.0,) * 4
    )
    invite = params.invite(0).with_plan(round_plan(st, 1))
    p = invite.params
    assert p.counts_share == share and p.unobserved_weight > 0 and p.query_planes == planes
    expected = _real_devices_sum(
        users, cohort, invite, f, lambda model: model.set_global(payload.words, b"", 1, **payload.lightfr_extras())
    )
    got = cohort.quantized_sum(
        st.codes(sim.model_state),
        invite,
        cohort.device_ids,
        cohort.device_ids,
        np.random.default_rng(0),
        insecure_test_noise_stream(0),
        beta,
        hamming_weight=payload.hamming_weight,
    )
    assert bool(np.any(cohort.vectors)) is (planes > 0)
    assert got.shape == expected.shape
    assert np.max(np.abs(got - expected)) <= n
    assert np.count_nonzero(expected) > 100
    # The uploads were clipped (C = 1.5 is below their norms), so the comparison covers the clip factors.
    assert np.abs(expected).max() < 1.5 * 2**10 * n


def _mf_users(n: int, m: int = N_ITEMS) -> list[tuple[np.ndarray, np.ndarray]]:
    # 0 to 9 ratings per device (one device with none), raw ratings in [1, 5].
    rng = np.random.default_rng(8)
    users = []
    for d in range(n):
        k = 0 if d == 3 else int(rng.integers(1, 10))
        users.append((rng.choice(m, size=k, replace=False).astype(np.int64), rng.integers(1, 6, size=k).astype(float)))
    return users


@pytest.mark.parametrize(("dp", "negatives"), [(True, 1), (False, 0), (True, 0)])
def test_scaled_mf_round_is_bit_identical_to_the_coordinator(
    dp: bool, negatives: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sparse MF cohort with each device's own seeded generator and stream (the test hook) against the
    # real coordinator with SecAgg+ and the devices' dense uploads: same model, same user vectors, same ε.
    from device_sdk import batched
    from fedsim.private.cohorts import MFCohort

    clipped: list[bool] = []

    def clip_l2(x: Any, c: float) -> Any:
        out = real_clip(x, c)
        clipped.append(out[1])
        return out

    real_clip = batched.clip_l2
    monkeypatch.setattr(batched, "clip_l2", clip_l2)

    n, rounds = 12, 2
    users = _mf_users(n)

    def cfg(where: str) -> ServerConfig:
        c = _config(tmp_path / where, "mf", n, dp=dp, rounds=rounds)
        from dataclasses import replace

        # clip C = 4 sits inside the spread of the uploads' norms: some devices are clipped, some not
        return replace(c, mf=replace(c.mf, negatives=negatives), rounds=replace(c.rounds, example_cap=5))

    ref = run_private(
        cfg("ref"),
        {i: LocalRatings.single_user(it, r) for i, (it, r) in enumerate(users)},
        lambda device_id: MFModel(N_ITEMS, MFConfig(factors=4), rng=np.random.default_rng(0)),
        rounds=rounds,
        seed=SEED,
        dropout=_schedule,
    )
    sim = PrivateSimulator(cfg("sim"))
    cohort = MFCohort(users, N_ITEMS, 4, max_norm2=5.0)
    outcomes = [sim.run_scaled_round(cohort, sim_seed=0, dropout=_schedule, device_seed=SEED) for _ in range(rounds)]
    assert all(o is not None and o.committed for o in outcomes)
    assert any(clipped) and not all(clipped)  # the clip norm is inside the spread of the uploads' norms
    coord = ref.coordinator
    assert sim.model_version == coord.model_version == rounds + 1
    assert np.array_equal(sim.model_state, coord.model_state)
    for i, d in enumerate(sorted(ref.devices)):  # (a device with no ratings never trains its u)
        assert cohort.trained[i] == ref.devices[d].model.user_trained[0] == (users[i][0].size > 0)
        if cohort.trained[i]:
            assert np.array_equal(cohort.user_factors[i], ref.devices[d].model.user_factors[0])
    if dp:
        assert coord.ledger is not None and sim.ledger is not None
        assert sim.ledger.spent() == coord.ledger.spent() > 0


def test_scaled_mf_cohort_batched_matches_per_device(tmp_path: Path) -> None:
    # The scale mode (one generator and one coin stream for the cohort) computes the same uploads as
    # the devices' own draws when nothing is drawn but the coins (trained users, θ = all, no negatives):
    # equal up to the stochastic rounding (< 1 per device and coordinate).
    from dataclasses import replace

    from agg_server.strategy.base import round_plan
    from device_sdk.client import insecure_seeded_rngs
    from fedsim.private.cohorts import MFCohort
    from protocol.session import RoundParameters

    n = 15
    cfg = _config(tmp_path, "mf", n, dp=False, rounds=1)
    cfg = replace(cfg, rounds=replace(cfg.rounds, example_cap=0))
    sim = PrivateSimulator(cfg)
    users = _mf_users(n)
    params = RoundParameters(
        round_id=1, vector_length=N_ITEMS * 4, k=n, t=1, clip_norm=3.0, scale_bits=10, deadlines=(0.0,) * 4
    )
    invite = params.invite(0).with_plan(round_plan(sim.strategy, 1))
    start = np.random.default_rng(2).random((n, 4)) * 0.8
    got = []
    for per_device in (False, True):
        cohort = MFCohort(users, N_ITEMS, 4, max_norm2=5.0)
        cohort.user_factors[:] = start
        cohort.trained[:] = True
        draws = {d: insecure_seeded_rngs(1, 1, d) for d in cohort.device_ids} if per_device else None
        total = cohort.quantized_sum(
            sim.model_state,
            invite,
            cohort.device_ids,
            cohort.device_ids[1:],
            np.random.default_rng(0),
            insecure_test_noise_stream(0),
            device_draws=draws,
        )
        got.append(total)
    assert np.count_nonzero(got[1]) > 20
    assert np.max(np.abs(got[0] - got[1])) <= n
    assert not np.array_equal(got[0], got[1])  # the coins differ


def test_scaled_mf_round_noise_has_variance_mu(tmp_path: Path) -> None:
    # MF devices without ratings upload zeros: the released sum of a scaled MF round is pure noise of variance μ.
    from fedsim.private.cohorts import MFCohort

    n, m = 200, 5000
    sim = PrivateSimulator(_config(tmp_path, "mf", n, dp=True, rounds=1, n_items=m))
    cohort = MFCohort([(np.zeros(0, np.int64), None)] * n, m, 4, max_norm2=5.0)
    out = sim.run_scaled_round(cohort, sim_seed=3)
    want = sim.mu * _honest_share(sim, n)
    assert out is not None and out.committed and out.noise_variance == pytest.approx(want)
    assert sim.last_release is not None and sim.last_release.size == m * 4
    assert abs(float(np.var(sim.last_release)) - want) <= 0.05 * want
