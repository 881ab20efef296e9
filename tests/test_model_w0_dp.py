"""Protocol 1.7 on a real loopback server: the model download carries the w0 (and α) it goes with and a
sticky flag saying DP noise trained it.  A device that only downloads ranks and folds in with the server's
derived w0 (not round 1's floor) and, for a DP-trained model, with its ±1 code; the flag survives a restart."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agg_server.app import COORDINATOR, create_app
from agg_server.config import ServerConfig
from device_sdk.client import MODEL_FILE, ClientConfig, DeviceClient, RoundStatus
from device_sdk.models import LightFRConfig, LightFRModel
from fedsim.fleets.local import FleetConfig, run_fleet
from protocol.codec import decode, encode
from protocol.messages import ModelPayload, RegisterRequest, RegisterResponse
from protocol.policy import PrivacyPolicy
from tests.server_helpers import BITS, N_ITEMS, small_config, users

COHORT = 5
ITEMS = np.array([1, 4, 9, 16, 25, 36])


def _config(where: Path, *, dp: bool, rounds: int = 1) -> ServerConfig:
    """A server that stops after round ``rounds`` (round ids count across restarts on one data_dir): a fleet's
    devices check in again the moment their round commits, and without the cap those check-ins could open a
    round the test does not expect, drawing in the download-only device."""
    cfg = small_config(where, cohort=COHORT, timeout=30.0, min_cohort=COHORT, max_rounds=rounds)
    if dp:
        cfg = dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, enabled=True, epsilon=50.0))
    return cfg


async def _train(url: str, store_root: Path, rounds: int) -> list[DeviceClient]:
    fleet = FleetConfig(
        url=url,
        store_root=store_root,
        n_items=N_ITEMS,
        bits=BITS,
        rounds=rounds,
        seed=3,
        time_limit=120.0,
        announce_drops=True,
    )
    report, clients = await run_fleet(fleet, list(users(COHORT, seed=2).values()))
    assert report.rounds_finished == rounds and not report.errors
    assert [r["status"] for r in report.server_rounds] == ["committed"] * rounds
    return clients


def _downloader(url: str, store: Path) -> DeviceClient:
    """A device that is never invited: it only downloads the model (its first `run_round` adopts it)."""
    config = ClientConfig(store_dir=store, privacy=PrivacyPolicy(require_noise=False))
    return DeviceClient.connect(url, config, items=ITEMS, ratings=None, n_items=N_ITEMS, bits=BITS, retries=0)


async def _fetch(url: str) -> ModelPayload:
    """``GET /v1/model`` as a registered device that never checks in (so it is never drawn into a cohort)."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/devices", data=encode(RegisterRequest(platform="pytest"))) as resp:
            reg = decode(await resp.read())
        assert isinstance(reg, RegisterResponse)
        async with session.get(f"{url}/v1/model", headers={"Authorization": f"Bearer {reg.token}"}) as resp:
            payload = decode(await resp.read())
    assert isinstance(payload, ModelPayload)
    return payload


async def _download(url: str, store: Path) -> LightFRModel:
    async with _downloader(url, store) as device:
        outcome = await device.run_round()
        assert outcome.status is RoundStatus.WAITED  # max_rounds reached or no cohort: a download only
        model = device.model
    assert isinstance(model, LightFRModel)
    return model


@pytest.mark.asyncio
async def test_a_device_that_only_downloads_a_dp_trained_model_ranks_with_its_code(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    """The DP flag reaches a device that never trained in a private round: after adopting the DP-trained
    model it ranks with its ±1 code (a vector solved before is dropped at once, and fold_in solves none).
    The same device on a server without DP ranks with the planes of its ridge vector.

    Why trusting the flag is safe: ranking is local, so a lying server can only make the device rank with
    its code (claiming DP) or its planes (denying it): recommendation quality, never privacy."""
    for dp in (True, False):
        app = create_app(_config(tmp_path / f"server-{dp}", dp=dp))
        server = await aiohttp_server(app)
        url = str(server.make_url("")).rstrip("/")
        store = tmp_path / f"downloader-{dp}"
        v1 = await _fetch(url)  # version 1: no round yet, so no DP noise either way
        first = LightFRModel(N_ITEMS, LightFRConfig(bits=BITS, rating_range=None))
        first.set_global(v1.words, v1.values, v1.model_version, **v1.lightfr_extras())
        assert first.model_version == 1 and not v1.dp_trained and not first.private_model
        first.fold_in(ITEMS)
        assert first.user_weight[0] > 0  # the default ranking: 3 planes of the ridge vector
        store.mkdir()
        first.save(store / MODEL_FILE)  # as the device keeps it

        await _train(url, tmp_path / f"devices-{dp}", rounds=1)
        served = decode(app[COORDINATOR].model_bytes)
        assert isinstance(served, ModelPayload) and served.model_version == 2 and served.dp_trained is dp
        model = await _download(url, store)
        assert model.model_version == 2 and model.private_model is dp and not model.private_rounds
        # The vector solved against version 1 is dropped on adopting a DP-trained model.
        assert bool(model.user_weight[0] == 0) is dp
        model.fold_in(ITEMS)
        assert bool(model.user_weight[0] == 0) is dp  # DP: the ±1 code; without DP: the planes
        ids, _ = model.recommend(ITEMS, N=5)
        assert ids.shape == (5,) and not np.isin(ids, ITEMS).any()
        # The flag is kept in the device's store.
        assert LightFRModel.load(store / MODEL_FILE).private_model is dp
        await server.close()


@pytest.mark.asyncio
async def test_the_w0_adopted_after_round_1_is_the_servers_derived_w0(aiohttp_server: Any, tmp_path: Path) -> None:
    """model.unobserved_weight = "auto": round 1 trains with the density rule's floor; the server then derives
    w0 from round 1's counts.  A device that downloads version 2 (one that only downloads, and one that
    trained in round 1 with the floor) ranks and folds in with that derived w0, the one the next plan carries."""
    app = create_app(_config(tmp_path / "server", dp=False))
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    coordinator = app[COORDINATOR]
    floor = coordinator.strategy.plan().unobserved_weight
    v1 = await _fetch(url)
    assert v1.unobserved_weight == floor  # version 1 goes with round 1's floor

    clients = await _train(url, tmp_path / "devices", rounds=1)
    derived = coordinator.strategy.plan().unobserved_weight
    assert derived != floor and coordinator.storage.strategy_state(2) == {"unobserved_weight": derived}
    served = decode(coordinator.model_bytes)
    assert isinstance(served, ModelPayload) and served.unobserved_weight == derived
    trained = clients[0].model
    assert trained.model_version == 1 and trained.config.unobserved_weight == floor  # round 1's plan

    fresh = await _download(url, tmp_path / "fresh")
    assert fresh.model_version == 2 and fresh.config.unobserved_weight == derived
    # A device that trained in round 1 takes it at its next contact.
    async with DeviceClient.connect(
        url,
        ClientConfig(store_dir=clients[0].config.store_dir, privacy=PrivacyPolicy(require_noise=False)),
        items=ITEMS,
        ratings=None,
        n_items=N_ITEMS,
        bits=BITS,
        retries=0,
    ) as again:
        await again.run_round()
        assert again.model.model_version == 2 and again.model.config.unobserved_weight == derived

    # The ranking ridge rank_ridge·w0·m uses it: the same fold-in as a device told w0 by hand.
    fresh.fold_in(ITEMS)
    by_hand = LightFRModel(N_ITEMS, LightFRConfig(bits=BITS, rating_range=None, unobserved_weight=derived))
    by_hand.set_global(served.words, b"", 2, item_levels=served.item_levels, hamming_weight=served.hamming_weight)
    by_hand.fold_in(ITEMS)
    assert by_hand.user_weight[0] > 0 and fresh.user_weight[0] == by_hand.user_weight[0]
    assert np.array_equal(fresh.user_q[0], by_hand.user_q[0])
    floor_model = LightFRModel(N_ITEMS, LightFRConfig(bits=BITS, rating_range=None, unobserved_weight=floor))
    floor_model.set_global(served.words, b"", 2, item_levels=served.item_levels, hamming_weight=served.hamming_weight)
    floor_model.fold_in(ITEMS)
    assert (floor_model.user_weight[0], floor_model.user_q[0].tolist()) != (
        fresh.user_weight[0],
        fresh.user_q[0].tolist(),
    )


@pytest.mark.asyncio
async def test_a_server_restart_keeps_the_dp_flag_and_it_stays_set(aiohttp_server: Any, tmp_path: Path) -> None:
    """The flag is stored with the model (inside its checkpoint): a server restarted on the same data_dir
    serves it again, and a later round without DP noise keeps it set (the model was still trained with it)."""
    data_dir = tmp_path / "server"
    app = create_app(_config(data_dir, dp=True))
    server = await aiohttp_server(app)
    await _train(str(server.make_url("")).rstrip("/"), tmp_path / "devices", rounds=1)
    assert app[COORDINATOR].model_dp_trained and app[COORDINATOR].model_version == 2
    await server.close()

    # Restarted without DP on the same folder: version 2 comes back with its flag.
    app = create_app(_config(data_dir, dp=False, rounds=2))
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    coordinator = app[COORDINATOR]
    assert coordinator.model_version == 2 and coordinator.model_dp_trained
    served = await _fetch(url)
    assert served.model_version == 2 and served.dp_trained
    await _train(url, tmp_path / "devices", rounds=1)  # a round without noise
    assert coordinator.model_dp_trained  # what the next round's model starts from
    model = await _download(url, tmp_path / "downloader")
    assert model.model_version == 3 and model.private_model
    await server.close()

    # A fresh data_dir without DP: never set.
    app = create_app(_config(tmp_path / "plain", dp=False))
    server = await aiohttp_server(app)
    await _train(str(server.make_url("")).rstrip("/"), tmp_path / "plain-devices", rounds=1)
    served = decode(app[COORDINATOR].model_bytes)
    assert isinstance(served, ModelPayload) and served.model_version == 2 and not served.dp_trained
    await server.close()


def test_a_restart_serves_the_17_fields_for_an_older_or_reconfigured_checkpoint(tmp_path: Path) -> None:
    """A checkpoint written by a 1.6 server holds neither w0 nor the DP flag: restarted as 1.7 on it, the
    server serves them at once (the flag from the privacy ledger that charged its rounds), not only after its
    next commit; a restart whose configuration fixes another w0 serves that one.  The stored file is kept."""
    import msgpack

    from agg_server.coordinator import RoundCoordinator
    from agg_server.storage import Storage
    from fedsim.private.coordinator_rounds import run_private_lightfr

    cfg = _config(tmp_path / "server", dp=True)
    run = run_private_lightfr(cfg, users(COHORT, seed=2), rounds=1, seed=1)
    coordinator = run.coordinator
    assert coordinator.model_version == 2 and coordinator.model_dp_trained
    # What a 1.6 server would have stored as version 3: the same model without the 1.7 keys.
    envelope = msgpack.unpackb(coordinator.model_bytes, raw=False)
    envelope["v"], envelope["b"]["mv"] = [1, 6], 3
    for key in ("w0", "al", "dp"):
        del envelope["b"][key]
    old = msgpack.packb(envelope, use_bin_type=True)
    old_payload = decode(old)
    assert isinstance(old_payload, ModelPayload) and not old_payload.dp_trained and old_payload.unobserved_weight == 0
    coordinator.storage.commit_model(3, None, old, 10.0, base_version=2)
    coordinator.storage.close()

    restarted = RoundCoordinator(cfg, Storage(cfg.data_dir), now=20.0)
    try:
        served = decode(restarted.model_bytes)
        assert isinstance(served, ModelPayload) and served.model_version == 3
        assert served.dp_trained and restarted.model_dp_trained
        assert served.unobserved_weight == restarted.strategy.plan().unobserved_weight > 0  # type: ignore[union-attr]
        assert served.words == old_payload.words and served.item_levels == old_payload.item_levels
        assert restarted.storage.load_model(3) == old  # the stored checkpoint is untouched
    finally:
        restarted.storage.close()

    plain = _config(tmp_path / "plain", dp=False)
    run = run_private_lightfr(plain, users(COHORT, seed=2), rounds=1, seed=1)
    derived = decode(run.coordinator.model_bytes)
    assert isinstance(derived, ModelPayload) and derived.unobserved_weight != 0.05 and not derived.dp_trained
    run.coordinator.storage.close()
    lightfr = plain.lightfr
    fixed = dataclasses.replace(
        plain,
        lightfr=dataclasses.replace(
            lightfr,
            params=dataclasses.replace(lightfr.params, unobserved_weight=0.05),
            server=dataclasses.replace(lightfr.server, unobserved_scale=0.0),
        ),
    )
    again = RoundCoordinator(fixed, Storage(fixed.data_dir), now=20.0)
    try:
        served = decode(again.model_bytes)
        assert isinstance(served, ModelPayload) and served.unobserved_weight == 0.05 and not served.dp_trained
    finally:
        again.storage.close()
    same = RoundCoordinator(plain, Storage(plain.data_dir), now=30.0)  # unchanged configuration: the same bytes
    try:
        assert same.model_bytes == run.coordinator.model_bytes
    finally:
        same.storage.close()
