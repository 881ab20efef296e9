"""Every model family runs a private round over HTTP through the real server and real device clients,
and ends bit-identical to the same round driven in-process (`fedsim.private.coordinator_rounds.run_private`).

One device of the cohort drops (announced) before its masked input, so the SecAgg+ recovery path is part
of the round; the sum the strategy sees is the survivors' only.  Silent drops that wait a deadline out
are tested once, in tests/test_server_app.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agg_server.app import COORDINATOR, create_app
from agg_server.config import ServerConfig, config_from_dict
from agg_server.coordinator import RoundCoordinator
from agg_server.storage import Storage
from device_sdk.client import ClientConfig, DeviceClient, RoundStatus, insecure_seeded_rngs
from device_sdk.family import LocalRatings
from device_sdk.felb import FELBConfig, FELBModel
from device_sdk.fnmf import FNMFConfig, FNMFModel
from device_sdk.http import HttpTransport
from device_sdk.ials import IALSConfig, IALSModel
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


def _config(data_dir: Path, kind: str) -> ServerConfig:
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
            },
            # Only the kind's own table: another family's, changed from its defaults, is refused.
            kind: {
                "mf": {"rank": 4, "pretrain_epochs": 5},
                "felb": {"rank": 3, "local_epochs": 3},
                "fnmf": {"rank": 3, "local_steps": 5},
                "ials": {"rank": 4, "alpha": 5.0, "level_weight": 0.5},  # with the item term (protocol 1.10)
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


async def _http_round(cfg: ServerConfig, kind: str, aiohttp_server: Any, store: Path) -> Any:
    app = create_app(cfg)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    new_model, data = _family(kind)
    clients: list[DeviceClient] = []
    for index, local in enumerate(data):
        holder: dict[str, DeviceClient] = {}
        client = DeviceClient(
            # The dropper leaves as an app closed cleanly would (an Abort), injected by its transport.
            FaultyTransport(HttpTransport(url, retries=2), _dropout(index), announce=True),
            ClientConfig(
                store_dir=store / f"d{index}",
                request_timeout=10.0,
                long_poll_timeout=20.0,
                privacy=PrivacyPolicy.no_floor(),
            ),
            items=np.zeros(0, np.int64),
            ratings=None,
            n_items=N_ITEMS,
            model=new_model(),
            data=local,
            rng_for_round=lambda r, _h=holder: insecure_seeded_rngs(SEED, r, int(_h["c"].device_id or 0)),
        )
        holder["c"] = client
        client._owns_transport = True
        clients.append(client)
    for client in clients:  # register in order, so device ids match the in-process run
        await client.register()

    async def until_done(index: int, client: DeviceClient) -> RoundStatus:
        for _ in range(200):
            outcome = await client.run_round()
            if outcome.status is not RoundStatus.WAITED:
                return outcome.status
            await asyncio.sleep(min(outcome.retry_after or 0.05, 0.1))
        raise AssertionError("the round never opened")

    try:
        statuses = await asyncio.wait_for(
            asyncio.gather(*(until_done(i, c) for i, c in enumerate(clients))), timeout=60.0
        )
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
