"""A LightFR device that ranks with its ridge vector (``rank_planes``, symmetric training) re-solves it for
its own ratings when it adopts a newer global model, on a real loopback server: its ranking is then the one
of a device that solved its vector against the new model by hand, it is stored with the model in one atomic
file (a restart keeps it; a failed save keeps the old model with its old vector), and a DP-trained download
leaves no vector."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agg_server.app import COORDINATOR, create_app
from agg_server.config import ServerConfig
from device_sdk.client import MODEL_FILE, ClientConfig, DeviceClient, RoundStatus
from device_sdk.family import LocalRatings
from device_sdk.models import LightFRConfig, LightFRModel
from fedsim.fleets.local import FleetConfig, run_fleet
from protocol.codec import decode
from protocol.errors import StorageError
from protocol.messages import ModelPayload
from protocol.policy import PrivacyPolicy
from tests.server_helpers import BITS, N_ITEMS, small_config, users
from tests.test_model_w0_dp import _fetch as fetch_model

COHORT = 5


def _config(where: Path, *, dp: bool, rounds: int) -> ServerConfig:
    """A server that runs exactly the ``rounds`` rounds the test's fleets take part in: a fleet's devices check
    in again the moment their round commits, so when the fleet stops the server's pool may still hold the whole
    cohort, and without the cap it would open one more round from those check-ins (inviting the lone device that
    checks in next, or training a version the test does not expect)."""
    cfg = small_config(where, cohort=COHORT, timeout=30.0, min_cohort=COHORT, max_rounds=rounds)
    if dp:
        cfg = dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, enabled=True, epsilon=50.0))
    return cfg


async def _round(url: str, store_root: Path, *, before: int = 0) -> None:
    """One committed round of the COHORT devices, round ``before + 1`` (the same stores each call: they train on
    what they hold).  The fleet counts that round as its own even when it opened before the fleet's monitor first
    read the server's status: the previous fleet's devices checked in again as their round committed, and those
    check-ins alone may open the round (the same devices then join it); counted as a stranger's, the fleet would
    run one round more."""
    fleet = FleetConfig(
        url=url,
        store_root=store_root,
        n_items=N_ITEMS,
        bits=BITS,
        rounds=1,
        seed=3,
        time_limit=120.0,
        rounds_before=before,
    )
    report, _ = await run_fleet(fleet, list(users(COHORT, seed=2).values()))
    assert report.rounds_finished == 1 and not report.errors
    assert [(r["round_id"], r["status"]) for r in report.server_rounds] == [(before + 1, "committed")]


def _client(url: str, store: Path, items: np.ndarray, ratings: np.ndarray) -> DeviceClient:
    config = ClientConfig(store_dir=store, privacy=PrivacyPolicy(require_noise=False))
    return DeviceClient.connect(url, config, items=items, ratings=ratings, n_items=N_ITEMS, bits=BITS, retries=0)


def _ranking(model: LightFRModel, items: np.ndarray) -> list[int]:
    ids, _ = model.recommend(items, N=N_ITEMS - items.size, rng=np.random.default_rng(0))
    return ids.tolist()


@pytest.mark.asyncio
async def test_a_download_re_solves_the_ranking_vector_against_the_new_model(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    app = create_app(_config(tmp_path / "server", dp=False, rounds=2))
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    devices = tmp_path / "devices"
    await _round(url, devices)  # round 1: every device trains against version 1 and ranks with its vector
    await _round(url, devices, before=1)  # round 2 trains version 2; the server now serves version 3
    served = decode(app[COORDINATOR].model_bytes)
    assert isinstance(served, ModelPayload) and served.model_version == 3 and not served.dp_trained
    items, ratings = users(COHORT, seed=2)[0]
    store = devices / "device-000000"
    held = LightFRModel.load(store / MODEL_FILE)
    assert held.model_version == 2 and held.user_weight[0] > 0  # solved against version 2 in round 2

    # Stale: version 3 adopted without re-solving (what the device did before).
    stale = LightFRModel.load(store / MODEL_FILE)
    stale.set_global(served.words, served.values, 3, **served.lightfr_extras())
    assert np.array_equal(stale.user_q[0], held.user_q[0])
    by_hand = LightFRModel.load(store / MODEL_FILE)
    by_hand.set_global(served.words, served.values, 3, **served.lightfr_extras())
    by_hand.fold_in(items, ratings)
    assert by_hand.user_weight[0] > 0

    async with _client(url, store, items, ratings) as device:
        outcome = await device.run_round()
        assert outcome.status is RoundStatus.WAITED  # not invited (the server runs no third round): a download only
        model = device.model
        assert isinstance(model, LightFRModel) and model.model_version == 3
        assert model.config.unobserved_weight == served.unobserved_weight
        assert np.array_equal(model.user_codes[0], held.user_codes[0])  # the training code is kept
        assert model.user_weight[0] == by_hand.user_weight[0]
        assert np.array_equal(model.user_q[0], by_hand.user_q[0])
        assert _ranking(model, items) == _ranking(by_hand, items)
        # The stale vector ranks version 3's items otherwise.
        assert (stale.user_weight[0], stale.user_q[0].tolist()) != (model.user_weight[0], model.user_q[0].tolist())
        assert _ranking(stale, items) != _ranking(model, items)
        # Once per version: a second call gets a 304 and leaves the vector as it is.
        q, a = model.user_q[0].copy(), int(model.user_weight[0])
        model.user_q[0] = held.user_q[0]
        await device.run_round()
        assert np.array_equal(model.user_q[0], held.user_q[0])
        model.user_q[0], model.user_weight[0] = q, a

    # A restart from the store ranks with the vector solved against version 3.
    restarted = LightFRModel.load(store / MODEL_FILE)
    assert restarted.model_version == 3
    assert np.array_equal(restarted.user_q[0], by_hand.user_q[0]) and restarted.user_weight[0] == by_hand.user_weight[0]
    async with _client(url, store, items, ratings) as again:
        assert np.array_equal(again.model.user_q[0], by_hand.user_q[0])
        assert _ranking(again.model, items) == _ranking(by_hand, items)
    await server.close()


@pytest.mark.asyncio
async def test_a_failed_save_keeps_the_old_model_with_its_old_vector(
    aiohttp_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vector is stored in the model's own file: a save that fails part-way (disk full) leaves version 1
    with the vector solved against version 1, never version 1's codes with a vector of version 2."""
    app = create_app(_config(tmp_path / "server", dp=False, rounds=1))
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    devices = tmp_path / "devices"
    await _round(url, devices)
    items, ratings = users(COHORT, seed=2)[1]
    store = devices / "device-000001"
    before = (store / MODEL_FILE).read_bytes()
    held = LightFRModel.load(store / MODEL_FILE)
    assert held.model_version == 1 and held.user_weight[0] > 0

    def disk_full(fh: Any, chunk: bytes) -> None:
        fh.write(chunk[: len(chunk) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("device_sdk.store._write_chunk", disk_full)
    async with _client(url, store, items, ratings) as device:
        with pytest.raises(StorageError):
            await device.run_round()
        assert device.model.model_version == 2  # adopted in memory, with its vector re-solved
        assert not np.array_equal(device.model.user_q[0], held.user_q[0])
    assert (store / MODEL_FILE).read_bytes() == before
    kept = LightFRModel.load(store / MODEL_FILE)
    assert kept.model_version == 1 and np.array_equal(kept.user_q[0], held.user_q[0])
    monkeypatch.undo()
    async with _client(url, store, items, ratings) as device:
        await device.run_round()  # the next contact downloads version 2 again and stores both
    stored = LightFRModel.load(store / MODEL_FILE)
    served = decode(app[COORDINATOR].model_bytes)
    assert isinstance(served, ModelPayload)
    held.set_global(served.words, served.values, served.model_version, **served.lightfr_extras())
    held.refresh_ranking(LocalRatings.single_user(items, ratings))
    assert stored.model_version == 2 and np.array_equal(stored.user_q[0], held.user_q[0])
    await server.close()


@pytest.mark.asyncio
async def test_a_dp_trained_download_leaves_no_vector(aiohttp_server: Any, tmp_path: Path) -> None:
    """A device holding a vector solved against version 1 adopts a DP-trained version 2: no vector is
    solved (it ranks with its ±1 code), in memory and in its store."""
    app = create_app(_config(tmp_path / "server", dp=True, rounds=1))
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    items, ratings = users(COHORT + 1, seed=9)[COHORT]
    store = tmp_path / "outsider"
    store.mkdir()
    v1 = await fetch_model(url)  # a bare download: a device that checked in would be drawn into the cohort
    first = LightFRModel(N_ITEMS, LightFRConfig(bits=BITS))
    first.set_global(v1.words, v1.values, v1.model_version, **v1.lightfr_extras())
    first.fold_in(items, ratings)
    assert first.model_version == 1 and first.user_weight[0] > 0
    first.save(store / MODEL_FILE)
    await _round(url, tmp_path / "devices")
    async with _client(url, store, items, ratings) as device:
        await device.run_round()
        model = device.model
        assert model.model_version == 2 and model.private_model and model.user_weight[0] == 0
        assert model.refresh_ranking(LocalRatings.single_user(items, ratings)) == 0
    stored = LightFRModel.load(store / MODEL_FILE)
    assert stored.model_version == 2 and stored.private_model and stored.user_weight[0] == 0
    await server.close()


def test_refresh_ranking_solves_every_trained_local_user_in_one_batch() -> None:
    """Several local users (cross-silo data): the batched solve gives each trained user the vector its own
    fold_in gives; an untrained user and a user without ratings keep what they hold; repeated (user, item)
    pairs count once, with the first rating."""
    rng = np.random.default_rng(4)
    cfg = LightFRConfig(bits=BITS, unobserved_weight=0.05)
    model = LightFRModel(N_ITEMS, cfg, n_users=4, rng=rng)
    rows = {u: (rng.choice(N_ITEMS, 8, replace=False), rng.integers(1, 6, 8).astype(float)) for u in (0, 1, 2)}
    for u in (0, 2, 3):
        model.fold_in(*rows.get(u, rows[0]), userid=u)
    untouched_q3, untouched_a3 = model.user_q[3].copy(), int(model.user_weight[3])
    model.set_global(np.asarray(model._item_words[:, ::-1]).tobytes(), b"", 2, item_levels=bytes(range(N_ITEMS)))
    dup_items = np.concatenate([rows[0][0], rows[0][0][:2]])
    dup_ratings = np.concatenate([rows[0][1], [5.0, 5.0]])
    data = LocalRatings(
        users=np.concatenate([np.zeros(10, np.int64), np.full(8, 1), np.full(8, 2)]).astype(np.int64),
        items=np.concatenate([dup_items, rows[1][0], rows[2][0]]).astype(np.int64),
        ratings=np.concatenate([dup_ratings, rows[1][1], rows[2][1]]),
        n_users=4,
    )
    assert model.refresh_ranking(data) == 2  # users 0 and 2: user 1 never trained, user 3 has no ratings
    for u in (0, 2):
        single = LightFRModel(N_ITEMS, cfg, rng=np.random.default_rng(0))
        single.set_global(np.asarray(model._item_words).tobytes(), b"", 2, item_levels=bytes(range(N_ITEMS)))
        single.fold_in(*rows[u])
        assert np.array_equal(model.user_q[u], single.user_q[0]) and model.user_weight[u] == single.user_weight[0]
    assert model.user_weight[1] == 0
    assert np.array_equal(model.user_q[3], untouched_q3) and model.user_weight[3] == untouched_a3
    with pytest.raises(ValueError, match="local users"):
        model.refresh_ranking(LocalRatings.single_user(rows[0][0]))
