"""The private-round simulator: what the server of a private round learns, computed directly.

A private round releases exactly one thing to the server: the modular sum, over the survivors U3, of
each device's clipped, quantized update plus the Skellam noise it still carries after the survivor
correction (docs/design.md §4–5).  The masks cancel by construction, so running SecAgg+'s crypto for tens of
thousands of simulated devices buys nothing for the model: this module computes that released value
without it, and then does what `agg_server.coordinator.RoundCoordinator` does with it (privacy
ledger, dequantization, the family's `Strategy.aggregate`, the next model version).

Two modes, one set of rules:

* **exact** (`PrivateSimulator.run_round` with real `device_sdk` models, meant for n <= a few
  hundred): every device runs `device_sdk.training.local_round` with the generators of
  `device_sdk.client.insecure_seeded_rngs`, and draws and corrects its noise with `protocol.noise.device_noise`
  / `protocol.noise.correct_noise`, the functions the device session calls.  With the coordinator's
  ``rounds.seed`` and the same dropout schedule, the final model is bit-identical to
  `fedsim.private.coordinator_rounds.run_private` (real coordinator, real crypto) — `tests/test_fedsim_privsim.py`.
* **scale** (`PrivateSimulator.run_scaled_round`, every device of amazon-book in one round): a
  family's cohort (`fedsim.private.cohorts.LightFRCohort`, `MFCohort`) computes each device's sparse
  update (only its rated items — and sampled negatives — are non-zero), clips it with
  `protocol.quantization.clip_l2` and rounds it with `protocol.quantization.stochastic_round`, through the
  batched form of the device kernels (`device_sdk.batched`); the survivors' noise is drawn in one piece
  as Skellam of `protocol.noise.released_variance` (Skellam laws add), which is the released noise's
  exact law.  Exact in distribution, not bit for bit: the draws come from a simulation generator.

Survivor rules (the server session's, `protocol.session.ServerSecAggSession`): U1 = devices that
advertised keys; the Harary graph over U1 is drawn from the round generator; U2 = devices that shared
keys, pruned while some member has fewer than t sharing neighbours; U3 = devices whose masked input
arrived; each needs >= t and, with DP, >= t_min members.  Devices of U3 that answer the unmask request
correct their noise; the round aborts (nothing released, nothing charged) when a survivor or a dropped
member of U2 has fewer than t answering neighbours.

Randomness: the noise and thinning coins follow whatever `protocol.noise` samples with.  A seed enters
only through ``seed=`` of the runs (the devices' `insecure_seeded_rngs`, the test hook of the real runs) and
``sim_seed=`` of the scaled mode; nothing here is a device's production randomness.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from agg_server.cohort import round_parameters, round_shape
from agg_server.config import ServerConfig
from agg_server.strategy import build_strategy
from agg_server.strategy.base import Strategy, round_plan
from device_sdk.client import insecure_seeded_rngs
from device_sdk.family import LocalRatings
from device_sdk.training import local_round
from fedsim.fleets.faults import DropoutAt
from fedsim.private.cohorts import DeviceDraws, LightFRCohort, MFCohort
from fedsim.threads import one_blas_thread
from protocol.accounting import PrivacyLedger, calibrate_mu
from protocol.codec import decode, encode
from protocol.errors import ConfigError, NotEnoughParticipants
from protocol.families.lightfr import bias_from_levels
from protocol.graph import harary_graph
from protocol.messages import ModelPayload
from protocol.noise import (
    colluding_devices,
    correct_noise,
    device_noise,
    minimum_survivors,
    released_variance,
    sample_skellam,
    to_ring,
)
from protocol.phases import prune_unmaskable, require_quorum
from protocol.plan import TrainingPlan
from protocol.quantization import (
    check_bit_budget,
    dequantize_sum,
    sensitivity,
)
from protocol.samplers import NoiseStream, insecure_test_noise_stream
from protocol.session import RoundParameters

__all__ = [
    "RoundOutcome",
    "Survivors",
    "survivor_sets",
    "PrivateSimulator",
    "one_blas_thread",
    "SimulatedRun",
    "run_simulated",
]

#: Context word of the scale mode's rounding-coin stream (its noise stream is keyed by (seed, round) alone).
_ROUNDING_CONTEXT = 0x90D


@dataclass(frozen=True, slots=True)
class Survivors:
    """Who took part in each phase of one round, as the server session decides it."""

    u1: frozenset[int]
    u2: frozenset[int]
    u3: frozenset[int]
    corrected: frozenset[int]
    error: str = ""

    @property
    def released(self) -> bool:
        return not self.error


def survivor_sets(
    cohort: Sequence[int],
    plan: Mapping[int, DropoutAt],
    *,
    k: int,
    t: int,
    t_min: int,
    rng: np.random.Generator,
    need_graph: bool = True,
) -> Survivors:
    """U1 ⊇ U2 ⊇ U3 and the correcting survivors for one round (the server session's rules).

    ``rng`` is the round generator; the Harary graph is drawn from it over sorted U1 exactly as the
    server session does, so the generator leaves in the same state.  ``need_graph=False`` skips the
    neighbourhood rules (only valid when nobody drops after advertising keys).
    """

    def need(count: int, what: str) -> str:
        try:
            require_quorum(count, what, t=t, dp_mu=1.0 if t_min > 0 else 0.0, dp_t_min=t_min)
        except NotEnoughParticipants as exc:
            return str(exc)
        return ""

    def stop(d: int, at: DropoutAt) -> bool:
        return plan.get(d, DropoutAt.NONE) is at

    empty: frozenset[int] = frozenset()
    u1 = frozenset(d for d in cohort if not stop(d, DropoutAt.BEFORE_KEYS))
    err = need(len(u1), "devices advertised keys")
    if err:
        return Survivors(u1, empty, empty, empty, err)
    graph = harary_graph(sorted(u1), k, rng) if need_graph else {}
    sharers = {d for d in u1 if not stop(d, DropoutAt.BEFORE_SHARES)}
    u2 = prune_unmaskable(sharers, graph, t) if need_graph else frozenset(sharers)
    err = need(len(u2), "devices shared keys")
    if err:
        return Survivors(u1, u2, empty, empty, err)
    u3 = frozenset(d for d in u2 if not stop(d, DropoutAt.BEFORE_MASKED))
    err = need(len(u3), "masked inputs arrived")
    if err:
        return Survivors(u1, u2, u3, empty, err)
    answered = frozenset(
        d for d in u3 if plan.get(d, DropoutAt.NONE) not in (DropoutAt.BEFORE_UNMASK, DropoutAt.DISCONNECT_MASKED)
    )
    if need_graph:
        for owner in (*sorted(u3), *sorted(u2 - u3)):
            if sum(1 for v in graph[owner] if v in answered) < t:
                return Survivors(u1, u2, u3, answered, f"too few neighbours of {owner} answered")
    elif len(answered) < len(u2):
        raise ConfigError("need_graph=False is only valid when nobody drops after advertising keys")
    return Survivors(u1, u2, u3, answered)


@dataclass
class RoundOutcome:
    """One simulated round."""

    round_id: int
    committed: bool
    survivors: Survivors
    epsilon_spent: float | None
    model_version: int
    seconds: float
    noise_variance: float = 0.0  # per-coordinate variance of the released noise (quantized units)
    timings: dict[str, float] = field(default_factory=dict)


class PrivateSimulator:
    """The server of private rounds, minus the crypto: cohort choice, survivor sets, the released
    sum, the privacy ledger and the strategy's aggregation, with the coordinator's generators.

    Parameters
    ----------
    config : the server configuration the coordinator would run with (its ``rounds.seed`` makes
        the cohort choice, graph and aggregation reproducible; None draws from ``secrets``).
    strategy : the server strategy (default: the configuration's).
    mu : the aggregate noise variance of every round (default: calibrated for the configuration's
        ε over ``privacy.planned_rounds``, as the coordinator does); a caller that charges other
        releases to the same ledger (`fedsim.private.scaled_lightfr`) passes the μ its split asks for.
    """

    def __init__(self, config: ServerConfig, *, strategy: Strategy | None = None, mu: float | None = None) -> None:
        self.config = config
        self.strategy: Strategy = strategy if strategy is not None else build_strategy(config)
        if self.strategy.n_items != config.model.n_items:
            raise ConfigError(
                f"the strategy is for n_items={self.strategy.n_items}, model.n_items is {config.model.n_items}"
            )
        self.quantization = config.rounds.quantization()
        self.vector_length = int(self.strategy.vector_length)
        self.l2, self.l1 = sensitivity(self.quantization, self.vector_length)
        self.ledger: PrivacyLedger | None = None
        self.mu = 0.0
        if config.privacy.enabled:
            self.ledger = PrivacyLedger(epsilon_budget=config.privacy.epsilon, delta=config.privacy.delta)
            self.mu = (
                calibrate_mu(
                    config.privacy.epsilon, config.privacy.delta, config.privacy.planned_rounds, self.l1, self.l2
                )
                if mu is None
                else float(mu)
            )
        n = config.rounds.cohort_size
        rc = config.rounds
        honest = minimum_survivors(n, rc.dropout_rate) - colluding_devices(n, rc.adversary_rate) if self.mu else 1
        check_bit_budget(n, self.quantization, self.vector_length, n * self.mu / honest)
        self.model_state = self.strategy.initialize(self._rng(0))
        self.model_version = 1
        #: Whether a committed round added DP noise (`ModelPayload.dp_trained`, sticky as the server keeps it).
        self.dp_trained = False
        self.next_round_id = 1
        self.stopped_reason = ""
        #: The last released sum as signed integers (quantized units), for diagnostics and tests.
        self.last_release: NDArray[np.int64] | None = None
        #: The device ids whose uploads that sum holds (U3 of the last committed round).
        self.last_survivors: tuple[int, ...] = ()

    # -- the coordinator's generators and plan ------------------------------------------------------
    def _rng(self, round_id: int) -> np.random.Generator:
        seed = self.config.rounds.seed
        if seed is None:
            import secrets

            return np.random.default_rng(secrets.randbits(128))
        return np.random.default_rng(np.random.SeedSequence([seed, round_id]))

    def payload(self) -> ModelPayload:
        """The model the devices download (through the codec, as the coordinator serves it)."""
        st = self.strategy
        wire = {"words": b"", "values": b"", **st.to_wire(self.model_state)}
        raw = encode(
            ModelPayload(
                model_version=self.model_version,
                model_kind=st.kind,
                bits=st.rank,
                n_items=st.n_items,
                dp_trained=self.dp_trained,
                **wire,
            )
        )
        msg = decode(raw, max_size=len(raw) + 1)
        assert isinstance(msg, ModelPayload)
        return msg

    def _open(self, eligible: Sequence[int]) -> tuple[int, tuple[int, ...], RoundParameters, TrainingPlan] | None:
        cfg = self.config.rounds
        if cfg.max_rounds and self.next_round_id > cfg.max_rounds:
            self.stopped_reason = f"max_rounds={cfg.max_rounds} reached"
            return None
        fresh = sorted(int(d) for d in eligible)
        if len(fresh) < cfg.min_cohort:
            raise ConfigError(f"{len(fresh)} eligible devices, below min_cohort={cfg.min_cohort}")
        if self.ledger is not None:
            self.ledger.check_round(self.mu, self.l1, self.l2)
        round_id = self.next_round_id
        self.next_round_id += 1
        self._round_rng = rng = self._rng(round_id)
        shape = round_shape(cfg, fresh, rng, dp=bool(self.mu))
        if shape is None:  # the server would wait for a full cohort that a simulation never gets
            raise ConfigError(
                f"rounds.k/t are fixed for a cohort of {cfg.cohort_size} but only {len(fresh)} devices are eligible"
            )
        cohort, k, t, t_min, colluders = shape
        params = round_parameters(round_id, self.vector_length, (k, t, t_min, colluders), self.quantization, self.mu)
        plan = round_plan(
            self.strategy, self.model_version, example_cap=cfg.example_cap, clip_norm=self.quantization.clip_norm
        )
        return round_id, cohort, params, plan

    def _commit(self, ring_total: NDArray[np.uint32], survivors: int, plan: TrainingPlan) -> float | None:
        self.last_release = ring_total.view(np.int32).astype(np.int64)
        total = dequantize_sum(ring_total, self.quantization)
        epsilon = None
        if self.ledger is not None:
            epsilon = self.ledger.record_round(self.mu, self.l1, self.l2)
        self.model_state = self.strategy.aggregate(
            self.model_state, total, survivors, self._round_rng, round_index=plan.round_index
        )
        self.model_version += 1
        self.dp_trained = self.dp_trained or self.mu > 0
        return epsilon

    # -- exact mode ---------------------------------------------------------------------------------
    def run_round(
        self,
        devices: Mapping[int, Any],
        data: Mapping[int, LocalRatings],
        *,
        seed: int,
        dropout: Callable[[int, int], DropoutAt] | None = None,
        per_device_noise: bool = True,
    ) -> RoundOutcome | None:
        """One round with real device models (``devices[id]`` a `device_sdk` model holding its state,
        ``data[id]`` its ratings), bit-identical to the coordinator's round for the same seeds.

        ``per_device_noise=False`` draws the survivors' released noise in one piece (Skellam of
        `released_variance`, its exact law) from a generator seeded by ``seed`` and the round: the
        same distribution for a fraction of the cost, but no longer bit-identical.

        Returns None when the configuration stops (``max_rounds``).
        """
        start = time.perf_counter()
        opened = self._open(list(devices))
        if opened is None:
            return None
        round_id, cohort, params, plan = opened
        schedule = dropout or (lambda r, d: DropoutAt.NONE)
        drops = {d: schedule(round_id, d) for d in cohort}
        payload = self.payload()
        rings: dict[int, NDArray[np.uint32]] = {}
        noise_rngs: dict[int, NoiseStream] = {}
        for d in cohort:
            model = devices[d]
            invite = params.invite(d).with_plan(plan)
            if model.model_version != invite.model_version:
                model.set_global(payload.words, payload.values, payload.model_version, **payload.lightfr_extras())
            training_rng, noise_rng = insecure_seeded_rngs(seed, round_id, d)
            rings[d], _ = local_round(model, invite, data[d], None, training_rng, coins=noise_rng)
            noise_rngs[d] = noise_rng
        sets = survivor_sets(cohort, drops, k=params.k, t=params.t, t_min=params.dp_t_min, rng=self._round_rng)
        if not sets.released:
            return RoundOutcome(round_id, False, sets, self._spent(), self.model_version, time.perf_counter() - start)
        total = np.zeros(self.vector_length, dtype=np.int64)
        s = len(sets.u3)
        for d in sorted(sets.u3):
            total += rings[d].view(np.int32)
            if params.dp_mu > 0.0 and per_device_noise:
                draw = device_noise(
                    params.dp_mu, params.dp_t_min, self.vector_length, noise_rngs[d], colluders=params.dp_colluders
                )
                if d in sets.corrected:
                    draw, _ = correct_noise(draw, params.dp_t_min, s, noise_rngs[d], colluders=params.dp_colluders)
                total += draw.value()
        if params.dp_mu > 0.0 and not per_device_noise:
            noise = insecure_test_noise_stream(seed, round_id, 0x5EED)  # a simulation: ε is not a guarantee here
            var = released_variance(
                params.dp_mu, params.dp_t_min, s, len(sets.corrected), colluders=params.dp_colluders
            )
            total += sample_skellam(var, self.vector_length, noise).value()
        ring_total = to_ring(total)
        self.last_survivors = tuple(sorted(sets.u3))
        eps = self._commit(ring_total, s, plan)
        var = (
            released_variance(self.mu, params.dp_t_min, s, len(sets.corrected), colluders=params.dp_colluders)
            if self.mu
            else 0.0
        )
        return RoundOutcome(round_id, True, sets, eps, self.model_version, time.perf_counter() - start, var)

    def _spent(self) -> float | None:
        return self.ledger.spent() if self.ledger is not None else None

    # -- scale mode ---------------------------------------------------------------------------------
    def run_scaled_rounds(
        self,
        trainer: LightFRCohort | MFCohort,
        rounds: int,
        *,
        sim_seed: int,
        on_round: Callable[[int, float], None] | None = None,
    ) -> list[float]:
        """``rounds`` rounds of `run_scaled_round`, nobody dropping; each round's seconds.  ``on_round(r,
        seconds)`` after round r (from 1).

        Raises
        ------
        RuntimeError
            A round did not open or commit.
        """
        seconds = []
        for r in range(rounds):
            out = self.run_scaled_round(trainer, sim_seed=sim_seed)
            if out is None or not out.committed:
                raise RuntimeError(f"round {r + 1} did not commit: {out}")
            seconds.append(out.seconds)
            if on_round is not None:
                on_round(r + 1, out.seconds)
        return seconds

    def run_scaled_round(
        self,
        trainer: LightFRCohort | MFCohort,
        *,
        sim_seed: int,
        dropout: Callable[[int, int], DropoutAt] | None = None,
        device_seed: int | None = None,
    ) -> RoundOutcome | None:
        """One round over every device of ``trainer`` (batched local training on sparse uploads,
        the released noise drawn in one piece): exact in distribution.

        ``device_seed`` (MF only; the test hook `insecure_seeded_rngs`, so ε is not a guarantee): every
        device draws its training, its rounding coins and its DP noise (with the survivor correction)
        from its own seeded generator and stream, as `run_round` and the coordinator's devices do, so the
        round is the real one bit for bit (`MFCohort` says when it could differ).  Its noise is dense
        per device: for small cohorts and tests.
        """
        start = time.perf_counter()
        opened = self._open(trainer.device_ids)
        if opened is None:
            return None
        round_id, cohort, params, plan = opened
        schedule = dropout or (lambda r, d: DropoutAt.NONE)
        drops = {d: schedule(round_id, d) for d in cohort} if dropout is not None else {}
        late = any(v not in (DropoutAt.NONE, DropoutAt.BEFORE_KEYS) for v in drops.values())
        sets = survivor_sets(
            cohort,
            drops,
            k=params.k,
            t=params.t,
            t_min=params.dp_t_min,
            rng=self._round_rng,
            need_graph=late or len(cohort) <= 20_000,
        )
        sim = np.random.default_rng(np.random.SeedSequence([sim_seed, round_id]))
        invite = params.invite(0).with_plan(plan)
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        draws: DeviceDraws | None = None
        if device_seed is not None:
            if not isinstance(trainer, MFCohort):
                raise ConfigError("device_seed= is implemented for the MF cohort only")
            draws = {d: insecure_seeded_rngs(device_seed, round_id, d) for d in cohort}
        with one_blas_thread():
            # a simulation: the rounding coins come from a seeded stream, so ε is not a guarantee here
            coins = insecure_test_noise_stream(sim_seed, round_id, _ROUNDING_CONTEXT)
            if isinstance(trainer, MFCohort):
                total = trainer.quantized_sum(self.model_state, invite, cohort, sets.u3, sim, coins, device_draws=draws)
            elif getattr(self.strategy, "full", False):  # LightFR's all-items objective: codes and item biases
                extras = self.payload().lightfr_extras()
                levels = np.frombuffer(extras["item_levels"], dtype=np.uint8) if extras["item_levels"] else None
                st: Any = self.strategy
                beta = bias_from_levels(levels, st.n_items, st.rank, int(extras["hamming_weight"]))
                weight = int(extras["hamming_weight"])
                total = trainer.quantized_sum(
                    st.codes(self.model_state), invite, cohort, sets.u3, sim, coins, beta, hamming_weight=weight
                )
            else:
                total = trainer.quantized_sum(self.model_state, invite, cohort, sets.u3, sim, coins)
        timings["devices"] = time.perf_counter() - t0
        if not sets.released:
            return RoundOutcome(round_id, False, sets, self._spent(), self.model_version, time.perf_counter() - start)
        s = len(sets.u3)
        var = 0.0
        t0 = time.perf_counter()
        if params.dp_mu > 0.0:
            f = params.dp_colluders
            var = released_variance(params.dp_mu, params.dp_t_min, s, len(sets.corrected), colluders=f)
            if draws is not None:  # each survivor's own noise after its coins, corrected as in run_round
                for d in sorted(sets.u3):
                    draw = device_noise(params.dp_mu, params.dp_t_min, self.vector_length, draws[d][1], colluders=f)
                    if d in sets.corrected:
                        draw, _ = correct_noise(draw, params.dp_t_min, s, draws[d][1], colluders=f)
                    total += draw.value()
            else:
                noise = insecure_test_noise_stream(sim_seed, round_id)  # a simulation: ε is not a guarantee here
                total += sample_skellam(var, self.vector_length, noise).value()
        timings["noise"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.last_survivors = tuple(sorted(sets.u3))
        eps = self._commit(to_ring(total), s, plan)
        timings["aggregate"] = time.perf_counter() - t0
        return RoundOutcome(round_id, True, sets, eps, self.model_version, time.perf_counter() - start, var, timings)


@dataclass
class SimulatedRun:
    """Result of `run_simulated`: the simulator (model, ledger) and the devices (``.model``,
    ``.data``), keyed by the device ids the coordinator would have given them (1, 2, ...)."""

    simulator: PrivateSimulator
    devices: dict[int, Any]
    outcomes: list[RoundOutcome] = field(default_factory=list)

    @property
    def coordinator(self) -> PrivateSimulator:
        """The simulator, where `fedsim.private.coordinator_rounds.PrivateRun` has the coordinator (``model_version``,
        ``model_state``, ``ledger``, ``mu``), so progress callbacks work with either run."""
        return self.simulator


def run_simulated(
    config: ServerConfig,
    clients: Mapping[int, LocalRatings],
    new_model: Callable[[int], Any],
    *,
    rounds: int,
    seed: int,
    dropout: Callable[[int, int], DropoutAt] | None = None,
    strategy: Strategy | None = None,
    after_round: Callable[[SimulatedRun], None] | None = None,
    per_device_noise: bool = True,
    mu: float | None = None,
    prior_charges: Sequence[tuple[float, float, float]] = (),
) -> SimulatedRun:
    """`fedsim.private.coordinator_rounds.run_private` without the crypto: the same devices (ids in the mapping's order,
    from 1), the same seeds and dropout schedule, and the same final model, bit for bit.

    ``mu`` and ``prior_charges`` are for runs that spend part of the budget on other releases (a
    private popularity release, `fedsim.private.mf`): the rounds' noise variance, and (μ, Δ1, Δ2) of
    each earlier release, recorded in the ledger before the first round."""
    from fedsim.private.coordinator_rounds import SimulatedDevice

    sim = PrivateSimulator(config, strategy=strategy, mu=mu)
    for charge in prior_charges:
        if sim.ledger is None:
            raise ConfigError("prior releases are charged to a privacy ledger: enable privacy")
        sim.ledger.record_round(*charge)
    devices = {i + 1: SimulatedDevice(i + 1, data, new_model(i + 1)) for i, data in enumerate(clients.values())}
    run = SimulatedRun(sim, devices)
    models = {d: dev.model for d, dev in devices.items()}
    data = {d: dev.data for d, dev in devices.items()}
    for _ in range(rounds):
        out = sim.run_round(models, data, seed=seed, dropout=dropout, per_device_noise=per_device_noise)
        if out is None:
            break
        run.outcomes.append(out)
        if after_round is not None:
            after_round(run)
    return run


def _noise_check(
    mu: float,
    n: int,
    dropout_rate: float,
    survivors: int,
    corrected: int,
    length: int,
    adversary_rate: float = 0.0,
    silent: int = 0,
) -> float:
    """Empirical variance of the released noise of one round drawn device by device with the
    device's functions, as the simulator's exact mode draws it (used by tests/test_fedsim_privsim.py);
    the first ``silent`` survivors are colluders that add no noise."""
    rng = insecure_test_noise_stream(0)  # a check of the variance, not a private run
    t_min = minimum_survivors(n, dropout_rate)
    f = colluding_devices(n, adversary_rate)
    total = np.zeros(length, dtype=np.int64)
    for d in range(silent, survivors):
        draw = device_noise(mu, t_min, length, rng, colluders=f)
        if d < corrected:
            draw, _ = correct_noise(draw, t_min, survivors, rng, colluders=f)
        total += draw.value()
    return float(np.var(total))
