"""An operator's own aggregation rule, plugged into the server through the `Strategy` contract.

`AnnealedAggGrad` is LightFR's Agg_grad (eq. 14–16) with a damping schedule: each item bit that the
sign test wants to flip is flipped with probability ρ_r = max(ρ_min, ρ_0 · decay^r) in round r.  Early
rounds move many bits (fast progress from random codes); later rounds move few (the simultaneous
update stops overshooting, which is why fedrec damps Agg_grad at all — see docs/design.md §2.3).  Like every
strategy it is pure numpy and sees only the secure **sum** of the survivors' uploads and their count.

The example
1. checks that the class keeps the contract (`isinstance(s, Strategy)`, wire round trip);
2. runs four private rounds in-process with `fedsim.private.coordinator_rounds.run_private`: the real
   `RoundCoordinator` (SecAgg+ session, storage, commit) with ``strategy=AnnealedAggGrad(...)`` and 30
   simulated devices running the real device code — no sockets;
3. checks that every committed model came from this strategy (one call per round, in order, with the
   scheduled ρ), that the checkpoint on disk decodes to the coordinator's model, that the bits moved
   per round follow the schedule, and that the federated item codes fit the devices' ratings better
   than random codes do;
4. starts the HTTP server in-process with ``agg_server.create_app(config, strategy=...)`` on a loopback
   port and reads ``/v1/status`` back.

Run: ``python examples/custom_strategy.py``.  A few seconds; exits 1 with a ``FAILED:`` line if any
check fails.

Invariants:
- The strategy draws its randomness only from the round generator the coordinator passes in, so a
  seeded server (``rounds.seed``) reproduces the same models.
- It never needs an individual device's upload, so it runs under secure aggregation unchanged.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import ClientSession, web
from numpy.typing import NDArray

from agg_server import RoundCoordinator, ServerConfig, Storage, config_from_dict, create_app
from agg_server.strategy import agg_grad
from agg_server.strategy.base import Strategy
from device_sdk import LightFRConfig, LightFRModel, from_bytes, pack_signs, random_signs, to_bytes, unpack_signs
from device_sdk.family import LocalRatings
from fedsim import synthetic
from fedsim.private.coordinator_rounds import run_private
from protocol.codec import decode
from protocol.messages import ModelPayload
from protocol.plan import LightFRParams
from protocol.spec import Aggregation

N_ITEMS = 150
BITS = 32
N_DEVICES = 30
ROUNDS = 4


@dataclass
class AnnealedAggGrad:
    """LightFR Agg_grad whose damping decays over rounds: ρ_r = max(rho_min, rho0 · decay^r).

    Attributes
    ----------
    n_items : catalogue size m.
    bits : code length f.
    rho0, decay, rho_min : the schedule; ρ_r is the chance that a bit the sign test wants to flip in
        round r (``round_index``) is flipped.
    negatives, local_epochs, max_sweeps : the devices' local training plan (sent in every invite).
    history : (round_index, ρ_r, bits flipped) of every `aggregate` call, for the operator's logs.
    """

    n_items: int
    bits: int = 64
    rho0: float = 0.5
    decay: float = 0.5
    rho_min: float = 0.05
    negatives: int = 4
    local_epochs: int = 1
    max_sweeps: int = 10
    kind: str = "lightfr"  # devices run the LightFR model; only the server rule differs
    history: list[tuple[int, float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (0 < self.rho_min <= self.rho0 <= 1 and 0 < self.decay <= 1):
            raise ValueError("need 0 < rho_min <= rho0 <= 1 and 0 < decay <= 1")

    @property
    def rank(self) -> int:
        return self.bits

    @property
    def vector_length(self) -> int:
        return self.n_items * self.bits

    def rho(self, round_index: int) -> float:
        """The damping of round ``round_index`` (0 = the round that trains version 2)."""
        return max(self.rho_min, self.rho0 * self.decay**round_index)

    def initialize(self, rng: np.random.Generator) -> NDArray[np.int8]:
        return random_signs(self.n_items, self.bits, rng)

    def plan(self) -> LightFRParams:
        # Devices upload item gradients (eq. 12) of the sampled-negatives objective (w0 = 0, so the
        # upload is the (m, f) gradient alone); λ = 0 (see docs/design.md §2.2 for why not the paper's 0.6).
        return LightFRParams(
            aggregation=Aggregation.GRAD,
            lam=0.0,
            negatives=self.negatives,
            local_epochs=self.local_epochs,
            max_sweeps=self.max_sweeps,
            unobserved_weight=0.0,
        )

    def aggregate(
        self,
        state: NDArray[np.int8],
        total: NDArray[np.float64],
        survivors: int,
        rng: np.random.Generator,
        *,
        round_index: int,
    ) -> NDArray[np.int8]:
        rho = self.rho(round_index)
        new = agg_grad(state, total.reshape(state.shape), 0.0, flip_fraction=rho, rng=rng)
        self.history.append((round_index, rho, int(np.count_nonzero(new != state))))
        return new

    def to_wire(self, state: NDArray[np.int8]) -> dict[str, bytes]:
        return {"words": to_bytes(pack_signs(state))}

    def from_wire(self, words: bytes, values: bytes) -> NDArray[np.int8]:
        if values:
            raise ValueError("LightFR models carry packed codes, not float values")
        return unpack_signs(from_bytes(words, self.bits, self.n_items), self.bits)

    def describe(self, old: NDArray[np.int8], new: NDArray[np.int8]) -> str:
        return f"{int(np.count_nonzero(old != new))} item bits flipped (annealed Agg_grad)"


class CheckFailed(Exception):
    """A property the example demonstrates does not hold."""


def check(condition: bool, what: str) -> None:
    """Stop the example (exit status 1) when ``condition`` is false."""
    if not condition:
        raise CheckFailed(what)


def server_config(data_dir: Path) -> ServerConfig:
    return config_from_dict(
        {
            "server": {"host": "127.0.0.1", "port": 0, "data_dir": str(data_dir)},
            "model": {"n_items": N_ITEMS, "bits": BITS},
            "rounds": {"cohort_size": N_DEVICES, "min_cohort": 3, "clip_norm": 64.0, "scale_bits": 12, "seed": 3},
            "log": {"level": "warning"},
        },
        base_dir=data_dir,
    )


def in_process_rounds(root: Path) -> None:
    config = server_config(root / "in-process")
    strategy = AnnealedAggGrad(N_ITEMS, bits=BITS)
    check(isinstance(strategy, Strategy), "AnnealedAggGrad keeps the Strategy contract")
    probe = strategy.initialize(np.random.default_rng(0))
    check(np.array_equal(strategy.from_wire(strategy.to_wire(probe)["words"], b""), probe), "wire round trip")

    log = synthetic(n_users=N_DEVICES, n_items=N_ITEMS, ratings_per_user=20, seed=5)
    clients = {
        u: LocalRatings.single_user(log.items[log.users == u], log.ratings[log.users == u]) for u in range(N_DEVICES)
    }
    device_config = LightFRConfig(bits=BITS, binary_positives=True)

    def new_model(device_id: int) -> LightFRModel:
        return LightFRModel(N_ITEMS, device_config, rng=np.random.default_rng(device_id))

    with Storage(config.data_dir) as storage:
        run = run_private(config, clients, new_model, rounds=ROUNDS, seed=0, strategy=strategy, storage=storage)
        coordinator: RoundCoordinator = run.coordinator
        for index, rho, flipped in strategy.history:
            print(
                f"round {index + 1}: ρ = {rho:.3f}, {flipped} of {N_ITEMS * BITS} item bits flipped "
                f"({flipped / (N_ITEMS * BITS):.1%}); devices told committed: "
                f"{sum(v == 'committed' for v in run.outcomes[index].values())}"
            )
        check([h[0] for h in strategy.history] == list(range(ROUNDS)), "one aggregate call per round, in order")
        check(all(rho == strategy.rho(i) for i, rho, _ in strategy.history), "each round used its scheduled ρ")
        check(coordinator.model_version == ROUNDS + 1, f"{ROUNDS} committed rounds give model version {ROUNDS + 1}")
        flips = [h[2] for h in strategy.history]
        check(flips[-1] < flips[0], "the annealed schedule moves fewer bits in later rounds")
        latest = storage.load_latest_model()
        check(latest is not None and latest[0] == ROUNDS + 1, "the last model is checkpointed")
        assert latest is not None  # for the type checker
        payload = decode(latest[1], max_size=len(latest[1]) + 1)
        check(isinstance(payload, ModelPayload), "the checkpoint holds a ModelPayload")
        assert isinstance(payload, ModelPayload)
        on_disk = strategy.from_wire(payload.words, payload.values)
        check(np.array_equal(on_disk, coordinator.model_state), "the checkpoint decodes to the served model")

    # Did the federation learn?  Each device fits its code to the final item codes and to random ones
    # (what version 1 was); in both cases its rated items look more similar to it than the others,
    # but by a wider margin when the item codes carry what the other devices taught them.
    random_codes = strategy.initialize(np.random.default_rng(1))
    learned: list[float] = []
    baseline: list[float] = []
    for device in run.devices.values():
        model: LightFRModel = device.model
        rated = np.unique(device.data.items)
        unrated = np.setdiff1d(np.arange(N_ITEMS), rated)
        for codes, out in ((on_disk, learned), (random_codes, baseline)):
            model.set_item_codes(codes, ROUNDS + 1)
            model.fit_local(device.data.items, device.data.ratings, rng=np.random.default_rng(device.device_id))
            out.append(float(model.similarity(rated).mean() - model.similarity(unrated).mean()))
    gain, base = float(np.mean(learned)), float(np.mean(baseline))
    print(
        f"devices: mean similarity of rated minus unrated items: {gain:.3f} with the federated codes, "
        f"{base:.3f} with random codes"
    )
    check(gain > base + 0.02, "the federated item codes fit the devices better than random codes")


async def over_loopback(root: Path) -> dict[str, Any]:
    """Serve the strategy over HTTP in this process and read the status back."""
    config = server_config(root / "http")
    runner = web.AppRunner(create_app(config, strategy=AnnealedAggGrad(N_ITEMS, bits=BITS)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        async with ClientSession() as session, session.get(f"http://{host}:{port}/v1/status") as resp:
            status: dict[str, Any] = json.loads(await resp.text())
        print(f"create_app(config, strategy=AnnealedAggGrad(...)) on http://{host}:{port}: /v1/status model =")
        print(f"  {status['model']}")
        return status
    finally:
        await runner.cleanup()


def main() -> int:
    """Run the example; returns the exit status (0 when every check held)."""
    try:
        with tempfile.TemporaryDirectory(prefix="fedrec-strategy-example-") as tmp:
            in_process_rounds(Path(tmp))
            status = asyncio.run(over_loopback(Path(tmp)))
            check(status["model"]["kind"] == "lightfr" and status["model"]["bits"] == BITS, "the server serves it")
    except CheckFailed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print("custom_strategy: all checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
