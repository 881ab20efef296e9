"""Every model family runs a private round over HTTP through the real server and real device clients,
and ends bit-identical to the same round driven in-process (`fedsim.private.coordinator_rounds.run_private`).

One device of the cohort drops (announced) before its masked input, so the SecAgg+ recovery path is part
of the round; the sum the strategy sees is the survivors' only.  Silent drops that wait a deadline out
are tested once, in tests/test_server_app.py.

iALS's item term (protocol 1.10) is followed across rounds: the levels of a round's summed holder counts go out
with the model it committed, every device downloads them for the next round and ranks with them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from agg_server.app import COORDINATOR, create_app
from agg_server.config import ServerConfig, config_from_dict
from agg_server.coordinator import RoundCoordinator
from agg_server.storage import Storage
from device_sdk.client import ClientConfig, DeviceClient, RoundStatus, insecure_seeded_rngs
from device_sdk.family import LocalRatings
from device_sdk.felb import FELBConfig, FELBModel
from device_sdk.fnmf import FNMFConfig, FNMFModel
from device_sdk.http import HttpTransport
from device_sdk.ials import IALSConfig, IALSModel, solve_users
from device_sdk.mf import MFConfig, MFModel
from fedsim.data.planted import planted_binary, planted_nonnegative
from fedsim.fleets.faults import DropoutAt, FaultyTransport
from fedsim.private.coordinator_rounds import run_private
from protocol import codec
from protocol.messages import ModelPayload
from protocol.policy import PrivacyPolicy

N_ITEMS = 24
DEVICES = 6
SEED = 7
DROPPER = 2  # index (registration order) of the device that leaves before its masked input


def _config(data_dir: Path, kind: str, *, level_weight: float = 0.5, max_rounds: int = 0) -> ServerConfig:
    # Deadlines far above any honest device's time on a loaded machine: the dropper announces its
    # departure, so phases close at quorum and the round never waits a deadline out.
    timeout = 30.0
    return config_from_dict(
        {
            "server": {"data_dir": str(data_dir), "port": 0},
            "model": {"kind": kind, "n_items": N_ITEMS},
            "rounds": {
                "cohort_size": DEVICES,
                "min_cohort": DEVICES,
                "seed": 5,
                "clip_norm": 1000.0,
                "scale_bits": 16,
                "advertise_timeout": timeout,
                "share_keys_timeout": timeout,
                "masked_input_timeout": timeout,
                "unmask_timeout": timeout,
                "round_interval": 0.05,
                "max_rounds": max_rounds,
            },
            # Only the kind's own table: another family's, changed from its defaults, is refused.
            kind: {
                "mf": {"rank": 4, "pretrain_epochs": 5},
                "felb": {"rank": 3, "local_epochs": 3},
                "fnmf": {"rank": 3, "local_steps": 5},
                "ials": {"rank": 4, "alpha": 5.0, "level_weight": level_weight},  # > 0: the item term (protocol 1.10)
            }[kind],
        },
        base_dir=data_dir,
    )


def _family(kind: str) -> tuple[Callable[[], Any], list[LocalRatings]]:
    """A fresh-model factory and each device's data: every device is a small silo of rows, the
    cross-silo setting of the papers, over the same protocol as a phone."""
    rng = np.random.default_rng(3)
    if kind == "mf":
        # Cross-silo (HFL): each device is a silo holding two users' ratings, through the same protocol.
        data = []
        for _ in range(DEVICES):
            users = np.repeat(np.arange(2), 8)
            items = np.concatenate([rng.choice(N_ITEMS, size=8, replace=False) for _ in range(2)])
            ratings = rng.integers(1, 6, size=16).astype(float)
            data.append(LocalRatings(users, items, ratings, 2))
        return (lambda: MFModel(N_ITEMS, MFConfig(factors=4), n_users=2, rng=np.random.default_rng(0))), data
    if kind == "ials":
        # Implicit feedback, one phone per user: each device's distinct items.
        data = [LocalRatings.single_user(rng.choice(N_ITEMS, size=6, replace=False)) for _ in range(DEVICES)]
        return (lambda: IALSModel(N_ITEMS, IALSConfig(factors=4, alpha=5.0))), data
    if kind == "felb":
        planted = planted_binary(DEVICES, 5, N_ITEMS, 3, tile_columns=(4, 8), rng=rng)
        return (lambda: FELBModel(N_ITEMS, FELBConfig(rank=3))), [
            LocalRatings.from_matrix(block) for block in planted.clients
        ]
    planted_real = planted_nonnegative(DEVICES, 5, N_ITEMS, 3, tile_columns=(4, 8), rng=rng)
    return (lambda: FNMFModel(N_ITEMS, FNMFConfig(rank=3))), [
        LocalRatings.from_matrix(block) for block in planted_real.clients
    ]


def _dropout(device_index: int) -> DropoutAt:
    return DropoutAt.BEFORE_MASKED if device_index == DROPPER else DropoutAt.NONE


def _client(
    url: str, index: int, local: LocalRatings, model: Any, store: Path, dropout: DropoutAt | Callable[[int], DropoutAt]
) -> DeviceClient:
    """Device ``index`` over HTTP, its round generators seeded by its device id, its store under ``store``."""
    holder: dict[str, DeviceClient] = {}
    client = DeviceClient(
        # A dropper leaves as an app closed cleanly would (an Abort), injected by its transport.
        FaultyTransport(HttpTransport(url, retries=2), dropout, announce=True),
        ClientConfig(
            store_dir=store / f"d{index}",
            request_timeout=10.0,
            long_poll_timeout=20.0,
            privacy=PrivacyPolicy.no_floor(),
        ),
        items=np.zeros(0, np.int64),
        ratings=None,
        n_items=N_ITEMS,
        model=model,
        data=local,
        rng_for_round=lambda r, _h=holder: insecure_seeded_rngs(SEED, r, int(_h["c"].device_id or 0)),
    )
    holder["c"] = client
    client._owns_transport = True
    return client


async def _until_done(client: DeviceClient) -> RoundStatus:
    """Check in until the device has been through a round: how it ended."""
    for _ in range(200):
        outcome = await client.run_round()
        if outcome.status is not RoundStatus.WAITED:
            return outcome.status
        await asyncio.sleep(min(outcome.retry_after or 0.05, 0.1))
    raise AssertionError("the round never opened")


async def _one_round(clients: list[DeviceClient]) -> list[RoundStatus]:
    return await asyncio.wait_for(asyncio.gather(*(_until_done(c) for c in clients)), timeout=60.0)


async def _http_round(cfg: ServerConfig, kind: str, aiohttp_server: Any, store: Path) -> Any:
    app = create_app(cfg)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    new_model, data = _family(kind)
    clients = [_client(url, i, local, new_model(), store, _dropout(i)) for i, local in enumerate(data)]
    for client in clients:  # register in order, so device ids match the in-process run
        await client.register()
    try:
        statuses = await _one_round(clients)
    finally:
        for client in clients:
            await client.close()
    return app[COORDINATOR], statuses, data, new_model


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["mf", "felb", "fnmf", "ials"])
async def test_family_round_over_http_matches_in_process(kind: str, aiohttp_server: Any, tmp_path: Path) -> None:
    coord, statuses, data, new_model = await _http_round(
        _config(tmp_path / "http", kind), kind, aiohttp_server, tmp_path / "devices"
    )
    assert statuses.count(RoundStatus.COMMITTED) == DEVICES - 1
    assert statuses[DROPPER] is RoundStatus.DROPPED
    assert coord.model_version == 2 and coord.strategy.kind == kind

    # The same round in-process: same seeds, same dropout, device ids 1..DEVICES in both runs.
    ref_cfg = _config(tmp_path / "ref", kind)
    ids = list(range(1, DEVICES + 1))
    index_of = {d: i for i, d in enumerate(ids)}
    store = Storage(ref_cfg.data_dir)
    ref = run_private(
        ref_cfg,
        dict(enumerate(data)),
        lambda device_id: new_model(),
        rounds=1,
        seed=SEED,
        dropout=lambda round_id, device_id: _dropout(index_of[device_id]),
        storage=store,
    )
    try:
        assert sorted(ref.devices) == ids
        assert ref.coordinator.model_version == 2
        assert ref.coordinator.model_bytes == coord.model_bytes
        assert not np.array_equal(ref.coordinator.model_state, _initial_state(ref_cfg))
        if kind == "ials":  # the model carries the levels of the survivors' holder counts and their weight
            served = codec.decode(coord.model_bytes)
            assert isinstance(served, ModelPayload) and served.level_weight == 0.5
            assert len(served.item_levels) == N_ITEMS and max(served.item_levels) == 255
    finally:
        store.close()


def _initial_state(cfg: ServerConfig) -> Any:
    store = Storage(cfg.data_dir.parent / "init")
    try:
        return RoundCoordinator(cfg, store, now=0.0).model_state
    finally:
        store.close()


# -- iALS's item term across rounds (protocol 1.10) -------------------------------------------------------


def _hand_levels(data: list[LocalRatings], devices: list[int]) -> NDArray[np.uint8]:
    """The levels of the holder counts of ``devices``' distinct items, by hand: rint(255·ln(1+c)/ln(1+max c))."""
    counts = np.zeros(N_ITEMS)
    for index in devices:
        counts[np.unique(data[index].items)] += 1
    return np.rint(255 * np.log1p(counts) / np.log1p(counts.max())).astype(np.uint8)


def _served(coord: RoundCoordinator) -> tuple[ModelPayload, NDArray[np.float64]]:
    payload = codec.decode(coord.model_bytes)
    assert isinstance(payload, ModelPayload)
    return payload, np.frombuffer(payload.values, "<f8").reshape(N_ITEMS, 4)


def _check_device_scores(
    model: IALSModel, local: LocalRatings, V: NDArray[np.float64], levels: NDArray[np.uint8] | None, w: float
) -> NDArray[np.float64]:
    """``model`` holds V (and the levels, with w > 0), its user vector is the exact step against that V, and its
    `recommend` ranks every item it does not hold by u·v + w·level / 255 (u·v alone with w = 0)."""
    np.testing.assert_array_equal(model.item_factors, V)
    assert model.level_weight == w
    if levels is None:
        assert model.item_levels is None
    else:
        np.testing.assert_array_equal(model.item_levels, levels)
    held = np.unique(local.items)
    u = model.user_factors[0]
    step = solve_users(V, np.array([0, held.size]), held, model.config.alpha, model.config.reg)[0]
    np.testing.assert_allclose(u, step, rtol=1e-12, atol=1e-15)
    ref = V @ u + (0.0 if levels is None else w * levels.astype(np.float64) / 255)
    ids, scores = model.recommend(held, N=N_ITEMS - held.size)
    assert sorted(ids.tolist()) == sorted(set(range(N_ITEMS)) - set(held.tolist()))
    np.testing.assert_allclose(scores, ref[ids].astype(np.float32), rtol=1e-6, atol=1e-7)
    assert np.all(np.diff(ref[ids]) <= 1e-7)  # best first by the hand scores
    return ref


@pytest.mark.asyncio
@pytest.mark.parametrize("w", [0.1, 0.0])
async def test_ials_item_term_reaches_the_devices_across_rounds(w: float, aiohttp_server: Any, tmp_path: Path) -> None:
    """Two rounds over HTTP: round 1 commits V2 with the levels of its survivors' counts; every device downloads
    it for round 2 and ranks by u·v + w·level / 255 with it; a device restarted after round 2 takes V3 and the
    levels of round 2's counts.  With w = 0 (the default) no model carries levels and devices rank by u·v."""
    cfg = _config(tmp_path / "server", "ials", level_weight=w, max_rounds=2)
    app = create_app(cfg)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    coord = app[COORDINATOR]
    new_model, data = _family("ials")

    def leaves_round_1(index: int) -> Callable[[int], DropoutAt]:
        return lambda round_id: DropoutAt.BEFORE_MASKED if (index, round_id) == (DROPPER, 1) else DropoutAt.NONE

    store = tmp_path / "devices"
    clients = [_client(url, i, local, new_model(), store, leaves_round_1(i)) for i, local in enumerate(data)]
    try:
        for client in clients:
            await client.register()
        statuses = await _one_round(clients)
        assert statuses.count(RoundStatus.COMMITTED) == DEVICES - 1 and statuses[DROPPER] is RoundStatus.DROPPED
        assert coord.model_version == 2
        payload2, V2 = _served(coord)
        survivors = [i for i in range(DEVICES) if i != DROPPER]
        levels1 = _hand_levels(data, survivors) if w > 0 else None
        if levels1 is None:
            assert coord.strategy.levels is None and (payload2.item_levels, payload2.level_weight) == (b"", 0.0)
        else:
            np.testing.assert_array_equal(coord.strategy.levels, levels1)  # what the strategy computed
            assert payload2.item_levels == levels1.tobytes() and payload2.level_weight == w
            assert levels1.max() == 255 and levels1.min() == 0
            assert not np.array_equal(levels1, _hand_levels(data, list(range(DEVICES))))  # the dropper's: not counted
        for client in clients:  # nothing downloaded yet: version 1 counted nobody's items
            assert client.model.model_version == 1 and client.model.item_levels is None

        statuses = await _one_round(clients)  # every device downloads model 2 for round 2, the dropper too
        assert statuses == [RoundStatus.COMMITTED] * DEVICES and coord.model_version == 3
        moved = 0
        for client, local in zip(clients, data, strict=True):
            assert client.model.model_version == 2
            ref = _check_device_scores(client.model, local, V2, levels1, w)
            uv = V2 @ client.model.user_factors[0]
            moved += not np.array_equal(np.argsort(-ref, kind="stable"), np.argsort(-uv, kind="stable"))
        assert (moved > 0) == (w > 0)  # the item term reorders some devices' items, and only the term
    finally:
        for client in clients:
            await client.close()

    # After round 2 (the server stops at max_rounds): a device restarted from its store takes model 3 at once,
    # with the levels of round 2's counts (every device's), and ranks with them.
    payload3, V3 = _served(coord)
    levels2 = _hand_levels(data, list(range(DEVICES))) if w > 0 else None
    assert (payload3.item_levels, payload3.level_weight) == (b"" if levels2 is None else levels2.tobytes(), w)
    np.testing.assert_array_equal(coord.strategy.levels, levels2)  # None with w = 0
    restarted = _client(url, 0, data[0], new_model(), store, DropoutAt.NONE)
    try:
        assert restarted.model.model_version == 2  # the stored model, its levels with it
        _check_device_scores(restarted.model, data[0], V2, levels1, w)
        assert (await restarted.run_round()).status is RoundStatus.WAITED
        assert restarted.model.model_version == 3
        _check_device_scores(restarted.model, data[0], V3, levels2, w)
    finally:
        await restarted.close()
