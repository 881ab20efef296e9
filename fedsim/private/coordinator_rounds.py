"""Private rounds in-process through the real `RoundCoordinator` and the real device code, any model family.

The coordinator (storage, cohort selection, SecAgg+ session, DP, strategy, commit) is driven by simulated
devices that run the real device code (`device_sdk.training.local_round` + `DeviceSecAggSession`), with no
sockets and a simulated clock.

Invariants:
- A device does exactly what `device_sdk.client.DeviceClient` does over HTTP, in the same order and
  with the same generators (`device_sdk.client.insecure_seeded_rngs`), so with the same seeds and the same
  dropout schedule this run and a run through the HTTP server end with bit-identical item codes.
- Dropouts follow a schedule given by the caller: ``dropout(round_id, device_id)`` names the phase
  before which a device stops (or `DropoutAt.NONE`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from agg_server.config import ServerConfig
from agg_server.coordinator import RoundCoordinator
from agg_server.storage import Storage
from agg_server.strategy.base import Strategy
from device_sdk.client import insecure_seeded_rngs
from device_sdk.family import FederatedModel, LocalRatings
from device_sdk.models import LightFRConfig, LightFRModel
from device_sdk.training import local_round
from fedsim.fleets.faults import DropoutAt
from protocol.codec import decode, encode
from protocol.messages import Message, ModelPayload, RoundInvite, RoundResult
from protocol.samplers import INSECURE_NOISE_NOTICE
from protocol.session import DeviceSecAggSession, Phase

__all__ = ["SimulatedDevice", "PrivateRun", "run_private", "run_private_lightfr"]

_STOP_BEFORE = {
    DropoutAt.BEFORE_KEYS: Phase.ADVERTISE_KEYS,
    DropoutAt.BEFORE_SHARES: Phase.SHARE_KEYS,
    DropoutAt.BEFORE_MASKED: Phase.MASKED_INPUT,
    DropoutAt.BEFORE_UNMASK: Phase.UNMASK,
}


@dataclass
class SimulatedDevice:
    """One device: its private ratings (one user, or many for a cross-silo client) and its model."""

    device_id: int
    data: LocalRatings
    model: Any


@dataclass
class PrivateRun:
    """Result of `run_private_lightfr`."""

    coordinator: RoundCoordinator
    devices: dict[int, SimulatedDevice]
    outcomes: list[dict[int, str]] = field(default_factory=list)

    @property
    def item_codes(self) -> NDArray[np.int8]:
        return self.coordinator.item_codes


def _wire(message: Message) -> Message:
    # Every message crosses the codec, as it would over HTTP.
    return decode(encode(message))


def run_private_lightfr(
    config: ServerConfig,
    users: Mapping[int, tuple[NDArray[np.int64], NDArray[np.float64] | None]],
    *,
    rounds: int,
    seed: int,
    dropout: Callable[[int, int], DropoutAt] | None = None,
    rating_range: tuple[float, float] | None = (1.0, 5.0),
    binary_positives: bool = True,
    storage: Storage | None = None,
    after_round: Callable[[PrivateRun], None] | None = None,
) -> PrivateRun:
    """Run ``rounds`` private LightFR rounds with one simulated device per entry of ``users``.

    Parameters
    ----------
    config : server configuration (its ``rounds.seed`` should be set for a reproducible run).
    users : for each simulated user, its (item ids, raw ratings or None).
    rounds : rounds to run (each one opens when every device has checked in).
    seed : seed of the devices' generators (`device_sdk.client.insecure_seeded_rngs`).
    dropout : dropout schedule; None means nobody drops.
    storage : an opened storage (default: one in ``config.data_dir``).
    after_round : called after every round (as for `run_private`).
    """
    m = config.model
    cfg = LightFRConfig(bits=config.lightfr.server.bits, rating_range=rating_range, binary_positives=binary_positives)
    data = {index: LocalRatings.single_user(items, ratings) for index, (items, ratings) in users.items()}
    return run_private(
        config,
        data,
        lambda device_id: LightFRModel(
            m.n_items, cfg, rng=np.random.default_rng(np.random.SeedSequence([seed, 0, device_id]))
        ),
        rounds=rounds,
        seed=seed,
        dropout=dropout,
        storage=storage,
        after_round=after_round,
    )


def run_private(
    config: ServerConfig,
    clients: Mapping[int, LocalRatings],
    new_model: Callable[[int], FederatedModel],
    *,
    rounds: int,
    seed: int,
    dropout: Callable[[int, int], DropoutAt] | None = None,
    storage: Storage | None = None,
    strategy: Strategy | None = None,
    after_round: Callable[[PrivateRun], None] | None = None,
) -> PrivateRun:
    """Run ``rounds`` private rounds of any model family with one simulated device per client.

    Parameters
    ----------
    config : server configuration (``model.kind`` picks the family; set ``rounds.seed`` for a
        reproducible run).
    clients : each client's local ratings (one user on a phone; many in the cross-silo mode).
    new_model : ``new_model(device_id)`` builds the client's fresh on-device model.
    rounds, seed, dropout, storage : as for `run_private_lightfr`.
    strategy : the server strategy (default: the one the configuration names).
    after_round : called after every round (evaluation, progress).
    """
    if config.privacy.enabled:
        print(INSECURE_NOISE_NOTICE, file=sys.stderr, flush=True)  # the devices' noise is seeded (test hook)
    store = storage or Storage(config.data_dir)
    clock = [1_000.0]
    coordinator = RoundCoordinator(config, store, now=clock[0], strategy=strategy)
    devices: dict[int, SimulatedDevice] = {}
    for index, data in clients.items():
        reg = coordinator.register(f"sim-{index}", clock[0])
        devices[reg.device_id] = SimulatedDevice(reg.device_id, data, new_model(reg.device_id))
    run = PrivateRun(coordinator, devices)
    schedule = dropout or (lambda r, d: DropoutAt.NONE)
    for _ in range(rounds):
        for d in devices:
            coordinator.check_in(d, clock[0])
        clock[0] += 1.0
        coordinator.tick(clock[0])
        r = coordinator.open_round
        if r is None:
            break
        run.outcomes.append(_one_round(coordinator, devices, r.round_id, schedule, seed, clock))
        if after_round is not None:
            after_round(run)
    return run


def _one_round(
    coordinator: RoundCoordinator,
    devices: dict[int, SimulatedDevice],
    round_id: int,
    schedule: Callable[[int, int], DropoutAt],
    seed: int,
    clock: list[float],
) -> dict[int, str]:
    r = coordinator.open_round
    if r is None:  # pragma: no cover - the caller just saw it open
        raise RuntimeError("no open round")
    sessions: dict[int, DeviceSecAggSession] = {}
    stopped: dict[int, str] = {}
    pending: dict[int, Message] = {}
    for d in r.cohort:
        invite = coordinator.check_in(d, clock[0])
        if not isinstance(invite, RoundInvite):
            stopped[d] = "waited"
            continue
        invite = _wire(invite)  # type: ignore[assignment]
        dev = devices[d]
        if dev.model.model_version != invite.model_version:
            payload = decode(coordinator.model_bytes)
            if not isinstance(payload, ModelPayload):  # pragma: no cover - the coordinator encodes it
                raise RuntimeError("the coordinator's model is not a ModelPayload")
            dev.model.set_global(payload.words, payload.values, payload.model_version, **payload.lightfr_extras())
        training_rng, noise_rng = insecure_seeded_rngs(seed, round_id, d)
        ring, _ = local_round(dev.model, invite, dev.data, None, training_rng, coins=noise_rng)
        sessions[d] = DeviceSecAggSession(invite, rng=noise_rng)
        sessions[d].provide_input(ring)
        pending[d] = sessions[d].send()
    for index, phase in enumerate((Phase.ADVERTISE_KEYS, Phase.SHARE_KEYS, Phase.MASKED_INPUT, Phase.UNMASK)):
        for d in sorted(pending):
            plan = schedule(round_id, d)
            if _STOP_BEFORE.get(plan) is phase:
                stopped[d] = "dropped"
                continue
            coordinator.submit(d, round_id, _wire(pending[d]), clock[0])
            if plan is DropoutAt.DISCONNECT_MASKED and phase is Phase.MASKED_INPUT:
                stopped[d] = "dropped"
        pending = {d: m for d, m in pending.items() if d not in stopped}
        if coordinator.open_round is not None and coordinator.open_round.round_id == round_id:
            # Whoever did not answer is dropped at the phase deadline.
            clock[0] = coordinator.open_round.session.params.deadlines[index] + 1e-3
            coordinator.tick(clock[0])
        replies = {d: coordinator.reply(d, round_id, phase) for d in pending}
        pending = {}
        for d, reply in replies.items():
            if reply is None or isinstance(reply, RoundResult):
                stopped[d] = "committed" if isinstance(reply, RoundResult) and reply.committed else "aborted"
                continue
            sessions[d].receive(_wire(reply))
            pending[d] = sessions[d].send()
        if not pending:
            break
    return stopped
