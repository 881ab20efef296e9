"""DeviceClient against the real `RoundCoordinator` (its SecAgg+ session, strategy, storage and privacy
ledger) through `tests.support.memory.InMemoryTransport`: no sockets, no fake server, a virtual clock.

Dropouts are injected the way load tests inject them (`fedsim.fleets.faults.FaultyTransport`); a phase that
waits only for devices whose `run_round` returned closes at once (its deadline on the virtual clock).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from agg_server import config_from_dict
from agg_server.coordinator import RoundCoordinator
from agg_server.storage import Storage
from agg_server.strategy import build_strategy
from device_sdk.client import ClientConfig, DeviceClient, RoundOutcome, RoundStatus, insecure_seeded_rngs
from device_sdk.training import local_round
from fedsim.fleets.faults import DropoutAt, FaultyTransport
from protocol.errors import AuthError
from protocol.families.lightfr import density_weight
from protocol.policy import PrivacyPolicy
from protocol.quantization import dequantize_sum
from protocol.session import ACTIVE_PHASES
from tests.support.memory import InMemoryServer
from tests.test_device_client import BITS, N_ITEMS, SEED, RecordingSession, _data, expected_sum
from tests.test_device_client import recording as recording  # noqa: F401  (fixture)

COHORT = 5


class RecordingStrategy:
    """The configured strategy, remembering the dequantized sum and survivor count of every round."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sums: list[tuple[NDArray[np.float64], int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def aggregate(self, state: Any, total: Any, survivors: int, rng: Any, *, round_index: int) -> Any:
        self.sums.append((np.array(total, copy=True), survivors))
        return self.inner.aggregate(state, total, survivors, rng, round_index=round_index)


def _server(
    tmp_path: Path, *, dp: bool = True, unobserved_weight: float | str = 0.0
) -> tuple[InMemoryServer, RecordingStrategy]:
    model = {"n_items": N_ITEMS, "bits": BITS, "negatives": 2, "max_sweeps": 5, "unobserved_weight": unobserved_weight}
    config = config_from_dict(
        {
            "server": {"data_dir": str(tmp_path / "server")},
            "model": model,
            "rounds": {"cohort_size": COHORT, "min_cohort": 3, "clip_norm": 4.0, "scale_bits": 12, "seed": 5},
            "privacy": {"enabled": True, "epsilon": 50.0, "planned_rounds": 4} if dp else {},
        },
        base_dir=tmp_path,
    )
    strategy = RecordingStrategy(build_strategy(config))
    coordinator = RoundCoordinator(config, Storage(config.data_dir), now=0.0, strategy=strategy)  # type: ignore[arg-type]
    return InMemoryServer(coordinator), strategy


def _clients(server: InMemoryServer, tmp_path: Path, dropouts: dict[int, DropoutAt]) -> list[DeviceClient]:
    clients: list[DeviceClient] = []
    for i in range(COHORT):
        items, ratings = _data(i)

        def rngs(round_id: int, i: int = i) -> Any:
            return insecure_seeded_rngs(SEED, round_id, int(clients[i].device_id or 0))

        transport = FaultyTransport(server.transport(), dropouts.get(i, DropoutAt.NONE), disconnect_after=0.02)
        clients.append(
            DeviceClient(
                transport,
                ClientConfig(store_dir=tmp_path / f"d{i}", privacy=PrivacyPolicy.no_floor()),
                items=items,
                ratings=ratings,
                n_items=N_ITEMS,
                bits=BITS,
                rng_for_round=rngs,
            )
        )
    return clients


async def _round(server: InMemoryServer, clients: Sequence[DeviceClient]) -> list[RoundOutcome]:
    """Every client checks in (and waits), the coordinator opens a round with all of them, and each takes part."""
    for c in clients:
        await c.register()
        waited = await c.run_round()
        assert waited.status is RoundStatus.WAITED and waited.retry_after is not None
    await server.open_round()

    async def drive(c: DeviceClient) -> RoundOutcome:
        try:
            return await c.run_round()
        finally:
            await server.mark_gone(int(c.device_id or 0))

    return list(await asyncio.gather(*(drive(c) for c in clients)))


@pytest.mark.asyncio
async def test_a_round_commits_the_exact_secure_sum(tmp_path: Path, recording: list[RecordingSession]) -> None:
    server, strategy = _server(tmp_path)
    clients = _clients(server, tmp_path, {})
    before = [copy.deepcopy(c.model) for c in clients]
    global_codes = server.coordinator.item_codes.copy()
    outcomes = await _round(server, clients)

    assert [o.status for o in outcomes] == [RoundStatus.COMMITTED] * COHORT
    assert {o.model_version for o in outcomes} == {2} and server.coordinator.model_version == 2
    ((total, survivors),) = strategy.sums
    assert survivors == COHORT and len(recording) == COHORT
    ids = frozenset(int(c.device_id or 0) for c in clients)
    ring = expected_sum(recording, ids)  # every device's quantized update plus the noise it kept
    assert any(s.kept_noise().any() for s in recording)  # DP noise is really in the sum
    np.testing.assert_array_equal(total, dequantize_sum(ring, server.coordinator.quantization))
    assert all(s.phase not in ACTIVE_PHASES for s in recording)
    assert server.model_requests == [None] * COHORT  # a fresh device has no ETag to send
    # Each update is exactly what the in-process reference computes from the invite the coordinator sent
    # (devices train in worker threads, so their sessions are recorded in whatever order training ended).
    by_device = {s.device_id: s for s in recording}
    for c, model in zip(clients, before, strict=True):
        device_id = int(c.device_id or 0)
        model.set_item_codes(global_codes, 1)
        training_rng, coins = insecure_seeded_rngs(SEED, 1, device_id)
        items, ratings = _data(clients.index(c))
        q, _ = local_round(model, server.invites[device_id], items, ratings, training_rng, coins=coins)
        np.testing.assert_array_equal(q, by_device[device_id].recorded)
        np.testing.assert_array_equal(c.model.user_codes, model.user_codes)
    outcome = outcomes[0]
    assert outcome.bytes_up > 4 * N_ITEMS * BITS  # the masked input alone is 4 bytes per element
    assert outcome.bytes_down > N_ITEMS * BITS // 8
    assert {"checkin", "train", "keys", "shares", "masked", "unmask", "total"} <= set(outcome.timings)
    assert "model" not in outcome.timings  # fetched at the first contact (the waited call), held since
    # The server charged its privacy ledger for the released sum.
    assert server.coordinator.ledger is not None and len(server.coordinator.ledger.rounds) == 1


@pytest.mark.asyncio
async def test_the_model_step_times_model_requests_only(tmp_path: Path) -> None:
    # A load test's "model" latencies read 1e-6 s: the step timed the no-op of a device that held the round's
    # model already.  Now a "model" time is a request for the model, and a round of a held model has none.
    server, _ = _server(tmp_path, dp=False)
    clients = _clients(server, tmp_path, {})

    async def drive(c: DeviceClient) -> RoundOutcome:
        try:
            return await c.run_round()
        finally:
            await server.mark_gone(int(c.device_id or 0))

    requests = len(server.model_requests)
    first = []
    for c in clients:
        await c.register()
        first.append(await c.run_round())  # the first contact: GET /v1/model, then told to wait
    assert all(o.status is RoundStatus.WAITED and o.timings["model"] > 0 for o in first)
    assert len(server.model_requests) == requests + COHORT
    await server.open_round()
    held = await asyncio.gather(*(drive(c) for c in clients))
    assert all(o.status is RoundStatus.COMMITTED and "model" not in o.timings for o in held)
    assert len(server.model_requests) == requests + COHORT  # nothing downloaded: no step timed
    for c in clients:
        assert (await c.run_round()).status is RoundStatus.WAITED
    await server.open_round()
    newer = await asyncio.gather(*(drive(c) for c in clients))  # round 2 trains version 2, which none holds
    assert all(o.status is RoundStatus.COMMITTED and o.timings["model"] > 0 for o in newer)
    assert len(server.model_requests) == requests + 2 * COHORT


@pytest.mark.asyncio
@pytest.mark.parametrize("dropout", [d for d in DropoutAt if d is not DropoutAt.NONE], ids=lambda d: d.name)
async def test_each_dropout_leaves_the_round_to_the_others(
    tmp_path: Path, recording: list[RecordingSession], dropout: DropoutAt
) -> None:
    server, strategy = _server(tmp_path)
    clients = _clients(server, tmp_path, {2: dropout})
    outcomes = await _round(server, clients)

    assert outcomes[2].status is RoundStatus.DROPPED and dropout.value in outcomes[2].reason
    assert [o.status for i, o in enumerate(outcomes) if i != 2] == [RoundStatus.COMMITTED] * (COHORT - 1)
    # Without the consistency check (no enrollment authority), BEFORE_CONSISTENCY is right before unmask.
    in_sum = dropout in (DropoutAt.BEFORE_UNMASK, DropoutAt.BEFORE_CONSISTENCY, DropoutAt.DISCONNECT_MASKED)
    ((total, survivors),) = strategy.sums
    assert survivors == (COHORT if in_sum else COHORT - 1)
    ids = [int(c.device_id or 0) for c in clients]
    kept = frozenset(ids) if in_sum else frozenset(ids) - {ids[2]}
    np.testing.assert_array_equal(total, dequantize_sum(expected_sum(recording, kept), server.coordinator.quantization))
    # A device whose masked input may be in the sum has charged its own ledger, whatever happened next.
    assert (clients[2].privacy_spent > 0) is in_sum
    assert all(s.phase not in ACTIVE_PHASES for s in recording)


@pytest.mark.asyncio
async def test_the_next_round_downloads_the_new_model_with_the_stored_etag(tmp_path: Path) -> None:
    server, _ = _server(tmp_path, dp=False)
    clients = _clients(server, tmp_path, {})
    await _round(server, clients)
    first = server.model_requests[:]
    await _round(server, clients)
    assert first == [None] * COHORT
    # Each device sends the ETag of the version-1 model it stored; the server serves version 2.
    assert len(set(server.model_requests[COHORT:])) == 1 and server.model_requests[COHORT] is not None
    # They check in with the version they hold (1: a commit does not ship the new model), then download 2.
    assert [c.model_version for c in server.checkins[-COHORT:]] == [1] * COHORT
    assert server.coordinator.model_version == 3


@pytest.mark.asyncio
async def test_an_unknown_token_is_the_servers_auth_error(tmp_path: Path) -> None:
    server, _ = _server(tmp_path / "a", dp=False)
    (device,) = _clients(server, tmp_path, {})[:1]
    await device.register()
    other, _ = _server(tmp_path / "b", dp=False)  # a server that never saw this device
    (stranger,) = _clients(other, tmp_path, {})[:1]  # the same store folder: the same identity
    assert stranger.device_id == device.device_id
    with pytest.raises(AuthError):
        await stranger.run_round()
    response = await other.transport().request("POST", "/v1/checkin", None, token="not-a-token")
    assert response.status == 401


@pytest.mark.asyncio
async def test_the_identity_persists_across_a_restart(tmp_path: Path) -> None:
    server, _ = _server(tmp_path, dp=False)
    first = _clients(server, tmp_path, {})[0]
    device_id = await first.register()
    assert await first.register() == device_id
    again = _clients(server, tmp_path, {})[0]  # a new client on the same store folder
    assert again.device_id == device_id and await again.register() == device_id
    assert server.registrations == 1


@pytest.mark.asyncio
async def test_the_derived_w0_survives_a_server_restart(tmp_path: Path) -> None:
    """w0 = "auto": the server derives w0 from each round's counts; a server restarted on the same
    data_dir plans its first round with the w0 the last committed round derived, not the round-1 floor."""
    server, strategy = _server(tmp_path, dp=False, unobserved_weight="auto")
    floor = strategy.plan().unobserved_weight
    clients = _clients(server, tmp_path, {})
    outcomes = await _round(server, clients)
    assert [o.status for o in outcomes] == [RoundStatus.COMMITTED] * COHORT
    derived = strategy.plan().unobserved_weight
    ((total, survivors),) = strategy.sums
    counts = strategy.layout.split(total)["counts"]
    assert derived == density_weight(float(counts.sum()), survivors, N_ITEMS, scale=strategy.server.unobserved_scale)
    assert derived != floor  # 7 positives per device is above the one-per-device floor
    assert server.coordinator.storage.strategy_state(2) == {"unobserved_weight": derived}

    restarted, fresh = _server(tmp_path, dp=False, unobserved_weight="auto")
    assert restarted.coordinator.model_version == 2
    assert fresh.plan().unobserved_weight == derived  # was the floor before the w0 was stored
    # A fixed w0 in the configuration wins over what was stored.
    fixed, fixed_strategy = _server(tmp_path, dp=False, unobserved_weight=0.05)
    assert fixed.coordinator.model_version == 2 and fixed_strategy.plan().unobserved_weight == 0.05


@pytest.mark.asyncio
async def test_run_stops_while_waiting(tmp_path: Path) -> None:
    server, _ = _server(tmp_path, dp=False)
    device = _clients(server, tmp_path, {})[0]
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.02, stop.set)
    outcomes = await asyncio.wait_for(device.run(stop=stop), timeout=10)
    assert [o.status for o in outcomes] == [RoundStatus.WAITED]  # one device: no round opens
    assert outcomes[0].retry_after is not None and outcomes[0].retry_after >= 1
