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
  family's batched trainer (`LightFRCohort`) computes each device's sparse update (only its rated
  items — and sampled negatives — are non-zero), clips it with `protocol.quantization.clip_l2` and
  rounds it with `protocol.quantization.stochastic_round`; the survivors' noise is drawn in one piece
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

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from agg_server.cohort import round_shape
from agg_server.config import ServerConfig
from agg_server.strategy import build_strategy
from agg_server.strategy.base import Strategy, round_plan
from device_sdk.client import insecure_seeded_rngs
from device_sdk.family import LocalRatings
from device_sdk.training import local_round
from fedsim.fleets.faults import DropoutAt
from fedsim.threads import one_blas_thread
from protocol.accounting import PrivacyLedger, calibrate_mu
from protocol.codec import decode, encode
from protocol.errors import ConfigError, NotEnoughParticipants
from protocol.families.lightfr import UploadLayout, bias_from_levels
from protocol.graph import harary_graph
from protocol.messages import ModelPayload, RoundInvite
from protocol.noise import (
    correct_noise,
    device_noise,
    minimum_survivors,
    released_variance,
    sample_skellam,
    to_ring,
)
from protocol.phases import prune_unmaskable, require_quorum
from protocol.plan import LightFRParams, TrainingPlan
from protocol.quantization import (
    check_bit_budget,
    clip_l2,
    dequantize_sum,
    sensitivity,
    stochastic_round,
)
from protocol.samplers import NoiseStream, insecure_test_noise_stream
from protocol.session import RoundParameters

__all__ = [
    "RoundOutcome",
    "Survivors",
    "survivor_sets",
    "PrivateSimulator",
    "LightFRCohort",
    "MFCohort",
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
        t_min = minimum_survivors(n, config.rounds.dropout_rate) if self.mu else 1
        check_bit_budget(n, self.quantization, self.vector_length, n * self.mu / t_min)
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
        cohort, k, t, t_min = shape
        params = RoundParameters(
            round_id=round_id,
            vector_length=self.vector_length,
            k=k,
            t=t,
            clip_norm=float(self.quantization.clip_norm),
            scale_bits=self.quantization.scale_bits,
            dp_mu=float(self.mu),
            dp_t_min=t_min,
            deadlines=(0.0, 0.0, 0.0, 0.0),
        )
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
                draw = device_noise(params.dp_mu, params.dp_t_min, self.vector_length, noise_rngs[d])
                if d in sets.corrected:
                    draw, _ = correct_noise(draw, params.dp_t_min, s, noise_rngs[d])
                total += draw.value()
        if params.dp_mu > 0.0 and not per_device_noise:
            noise = insecure_test_noise_stream(seed, round_id, 0x5EED)  # a simulation: ε is not a guarantee here
            var = released_variance(params.dp_mu, params.dp_t_min, s, len(sets.corrected))
            total += sample_skellam(var, self.vector_length, noise).value()
        ring_total = to_ring(total)
        self.last_survivors = tuple(sorted(sets.u3))
        eps = self._commit(ring_total, s, plan)
        var = released_variance(self.mu, params.dp_t_min, s, len(sets.corrected)) if self.mu else 0.0
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
            var = released_variance(params.dp_mu, params.dp_t_min, s, len(sets.corrected))
            if draws is not None:  # each survivor's own noise after its coins, corrected as in run_round
                for d in sorted(sets.u3):
                    draw = device_noise(params.dp_mu, params.dp_t_min, self.vector_length, draws[d][1])
                    if d in sets.corrected:
                        draw, _ = correct_noise(draw, params.dp_t_min, s, draws[d][1])
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


class LightFRCohort:
    """Every LightFR device of a dataset at once, for `PrivateSimulator.run_scaled_round`.

    Holds each device's private user code b_u (``codes``, (n, f) ±1) and its ratings, and runs one
    round of every device's local work in batches with the device's own kernels
    (`device_sdk.lightfr.sample_negatives`, `dcd_update`, `inner_products`): θ ratings kept at
    random, negatives sampled, DCD sweeps, then the eq. 12 item gradient of the kept and sampled
    items only — the upload's non-zero part.  Each device's part is clipped with
    `protocol.quantization.clip_l2` and rounded with `protocol.quantization.stochastic_round`.

    Parameters
    ----------
    users : for each device (one user), its rated item ids and raw ratings (or None).
    n_items, bits : model shape.
    rating_range : raw rating range, None for implicit feedback.
    batch : devices per vectorised batch (memory: batch × entries × f floats).
    """

    def __init__(
        self,
        users: Sequence[tuple[NDArray[np.int64], NDArray[np.float64] | None]],
        n_items: int,
        bits: int,
        *,
        rating_range: tuple[float, float] | None = None,
        binary_positives: bool = True,
        batch: int = 4096,
        first_id: int = 1,
    ) -> None:
        from device_sdk.models import LightFRConfig

        self.n_items, self.bits = int(n_items), int(bits)
        self.device_ids = list(range(first_id, first_id + len(users)))
        self._index = {d: i for i, d in enumerate(self.device_ids)}
        self._cfg = LightFRConfig(bits=bits, rating_range=rating_range, binary_positives=binary_positives)
        lengths = np.array([np.asarray(u[0]).size for u in users], dtype=np.int64)
        self.indptr = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        self.items = (
            np.concatenate([np.asarray(u[0], dtype=np.int64) for u in users]) if users else np.zeros(0, np.int64)
        )
        self.targets = np.concatenate(
            [self._cfg.normalize(None if r is None else np.asarray(r, float), np.asarray(i).size) for i, r in users]
        )
        self.codes = np.ones((len(users), bits), dtype=np.int8)
        #: Each device's snapped real vector Δ'·q under asymmetric scoring (protocol 1.6); zeros otherwise.
        self.vectors = np.zeros((len(users), bits))
        self.trained = np.zeros(len(users), dtype=bool)
        self.batch = int(batch)

    def quantized_sum(
        self,
        D: NDArray[np.int8],
        invite: RoundInvite,
        cohort: Iterable[int],
        survivors: Iterable[int],
        rng: np.random.Generator,
        coins: NoiseStream,
        beta: NDArray[np.float64] | None = None,
        hamming_weight: int = 1,
    ) -> NDArray[np.int64]:
        """Train every cohort device for one round; return Σ over ``survivors`` of the quantized
        uploads as signed integers (the invite's upload length).  ``rng`` drives training, ``coins`` the
        stochastic rounding (of the non-zero part of each upload: same law as a device's dense rounding,
        other words).  Under the all-items objective ``D`` is the (m, f) item codes, ``beta`` the item
        biases the downloaded levels stand for and ``hamming_weight`` the downloaded B (`_full_sum`)."""
        from device_sdk.lightfr import dcd_update, inner_products, sample_negatives
        from protocol.spec import Aggregation

        p = _lightfr_params(invite)
        if p.aggregation is not Aggregation.GRAD:
            raise ConfigError("the scaled LightFR simulation runs Agg_grad uploads only")
        if p.unobserved_weight > 0:
            if beta is None:
                raise ConfigError("the all-items objective needs the item biases the devices download (beta=)")
            return self._full_sum(D, beta, invite, cohort, survivors, rng, coins, hamming_weight)
        m, f = self.n_items, self.bits
        qcfg = invite.quantization()
        lam = float(p.lam)
        negatives = int(p.negatives)
        cap = int(invite.example_cap)
        epochs = int(p.local_epochs)
        sweeps = int(p.max_sweeps)
        alive = {self._index[d] for d in survivors}
        rows_all = np.array(sorted(self._index[d] for d in cohort), dtype=np.int64)
        total = np.zeros(m * f, dtype=np.int64)
        fresh = rows_all[~self.trained[rows_all]]
        if fresh.size:  # a device's first round starts from a random code
            self.codes[fresh] = np.where(rng.random((fresh.size, f)) < 0.5, -1, 1).astype(np.int8)
        for lo in range(0, rows_all.size, self.batch):
            rows = rows_all[lo : lo + self.batch]
            counts = self.indptr[rows + 1] - self.indptr[rows]
            take = np.concatenate([np.arange(self.indptr[r], self.indptr[r + 1]) for r in rows])
            items, targets = self.items[take], self.targets[take]
            indptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
            if cap:
                # θ ratings per device, uniformly without replacement (random keys, smallest θ kept).
                owner = np.repeat(np.arange(rows.size), counts)
                order = np.lexsort((rng.random(items.size), owner))
                rank = np.arange(items.size) - np.repeat(indptr[:-1], counts)
                keep = np.sort(order[rank < cap])
                items, targets, owner = items[keep], targets[keep], owner[keep]
                counts = np.bincount(owner, minlength=rows.size)
                indptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
            B = self.codes[rows]
            grad_items: NDArray[np.int64] | None = None
            acc: NDArray[np.float64] | None = None
            for _ in range(epochs):
                if negatives:
                    neg_ptr, neg = sample_negatives(indptr, items, m, negatives, rng)
                    ei, er, eo = _merge_csr(indptr, items, targets, neg_ptr, neg)
                else:
                    ei, er, eo = items, targets, indptr
                B, _ = dcd_update(eo, ei, er, B, D, lam, max_sweeps=sweeps)
                g_items, g_rows, g_vals = _entry_gradients(eo, ei, er, B, D, inner_products)
                if acc is None:
                    grad_items, grad_rows, acc = g_items, g_rows, g_vals
                else:  # later epochs: stack and merge below (the device averages epochs)
                    grad_items = np.concatenate([grad_items, g_items])
                    grad_rows = np.concatenate([grad_rows, g_rows])
                    acc = np.concatenate([acc, g_vals])
            self.codes[rows] = B
            self.trained[rows] = True
            assert grad_items is not None and acc is not None
            keys, inv = np.unique(grad_rows * m + grad_items, return_inverse=True)
            vals = np.zeros((keys.size, f))
            np.add.at(vals, inv, acc)
            vals /= epochs
            urow, uitem = keys // m, keys % m
            bounds = np.searchsorted(urow, np.arange(rows.size + 1))
            for j in range(rows.size):
                if int(rows[j]) not in alive:
                    continue
                a, b = bounds[j], bounds[j + 1]
                if a == b:
                    continue
                clipped, _ = clip_l2(vals[a:b], qcfg.clip_norm)
                q = stochastic_round(clipped * qcfg.scale, coins)
                idx = (uitem[a:b, None] * f + np.arange(f)).ravel()
                _scatter_add(total, idx, q.ravel())
        return total

    def _kept(
        self, rows: NDArray[np.int64], cap: int, rng: np.random.Generator
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64], NDArray[np.int64]]:
        """(indptr, items, targets, owner) of a batch after the θ cap: θ ratings per device, uniformly
        without replacement (random keys, smallest θ kept), then each item once (the device's unique)."""
        counts = self.indptr[rows + 1] - self.indptr[rows]
        take = np.concatenate([np.arange(self.indptr[r], self.indptr[r + 1]) for r in rows])
        items, targets = self.items[take], self.targets[take]
        owner = np.repeat(np.arange(rows.size), counts)
        if cap:
            indptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
            order = np.lexsort((rng.random(items.size), owner))
            rank = np.arange(items.size) - np.repeat(indptr[:-1], counts)
            keep = np.sort(order[rank < cap])
            items, targets, owner = items[keep], targets[keep], owner[keep]
        _, first = np.unique(owner * self.n_items + items, return_index=True)  # sorted by (device, item)
        items, targets, owner = items[first], targets[first], owner[first]
        counts = np.bincount(owner, minlength=rows.size)
        return np.concatenate(([0], np.cumsum(counts))).astype(np.int64), items, targets, owner

    def _full_sum(
        self,
        D: NDArray[np.int8],
        beta: NDArray[np.float64],
        invite: RoundInvite,
        cohort: Iterable[int],
        survivors: Iterable[int],
        rng: np.random.Generator,
        coins: NoiseStream,
        hamming_weight: int = 1,
    ) -> NDArray[np.int64]:
        """`quantized_sum` under the all-items objective (``invite.params.unobserved_weight > 0``).

        Per device, as `device_sdk.models.LightFRModel` does: the θ cap, ``local_epochs`` of
        `device_sdk.lightfr.dcd_full` against the codes and biases, then the parts of
        `device_sdk.lightfr.full_upload` one device at a time — a row (w_q s/f − w_l)·b − (w_q/f)·d_i and
        a bias term c·t − w_q s/f per kept item, a count of 1 per kept item, b bᵀ/f and b/f — clipped as
        `protocol.families.lightfr.clip_parts` clips them (the counts to √s·C and the rest to
        √(1 − s)·C for a counts share s > 0; the whole to C otherwise; each part's norm is known in closed
        form: ‖b bᵀ‖/f = 1, ‖b‖/f = 1/√f) and stochastically rounded.  Batched: the Python loops run over
        batches and bits, never over devices.

        With ``invite.params.query_planes`` P >= 1 (asymmetric scoring, protocol 1.6) each device instead solves
        its vector exactly against the codes (`device_sdk.lightfr.ridge_users`, ridge ``invite.params.user_reg``),
        snaps it to P bit-planes and an integer weight for B = ``hamming_weight`` (`quantize_planes`,
        `snap_scale`), keeps it in ``vectors`` and uploads the same parts with the vector u in place of b:
        rows (w_q s/f − w_l)·u − (w_q/f)·u∘u∘d_i, and u uᵀ/f, u/f, whose norms are ‖u‖²/f and ‖u‖/f.
        """
        from device_sdk.lightfr import dcd_full, inner_products, quantize_planes, ridge_users, snap_scale

        m, f = self.n_items, self.bits
        layout = UploadLayout(m, f, full=True)
        scale = float(2**invite.scale_bits)
        clip = float(invite.clip_norm)
        p = _lightfr_params(invite)
        share = float(p.counts_share)
        w0, alpha = float(p.unobserved_weight), float(p.confidence)
        c = 1.0 + alpha
        wq = c - w0
        Df = D.astype(np.float64)
        gram = (Df.T @ Df, Df.T @ beta)  # G_D and Dᵀβ, once per model version (as a device caches them)
        alive = np.zeros(len(self.device_ids), dtype=bool)
        alive[[self._index[d] for d in survivors]] = True
        rows_all = np.array(sorted(self._index[d] for d in cohort), dtype=np.int64)
        fresh = rows_all[~self.trained[rows_all]]
        if fresh.size:  # a device's first round starts from a random code
            self.codes[fresh] = np.where(rng.random((fresh.size, f)) < 0.5, -1, 1).astype(np.int8)
        grad_t = np.zeros(m * f)
        bias_t = np.zeros(m)
        count_t = np.zeros(m)
        gram_t = np.zeros((f, f))
        code_t = np.zeros(f)
        for lo in range(0, rows_all.size, self.batch):
            rows = rows_all[lo : lo + self.batch]
            indptr, items, targets, owner = self._kept(rows, int(invite.example_cap), rng)
            planes = int(p.query_planes)
            if planes:
                U = ridge_users(indptr, items, targets, D, beta, w0, alpha, float(p.user_reg), gram=gram)
                odd, step = quantize_planes(U, planes)
                _, snapped = snap_scale(step, hamming_weight)
                Bf = snapped[:, None] * odd.astype(np.float64)
                self.vectors[rows] = Bf
                self.codes[rows] = np.where(odd > 0, 1, -1).astype(np.int8)
                s_e = np.einsum("ef,ef->e", Df[items], Bf[owner])
            else:
                B = self.codes[rows]
                for _ in range(int(p.local_epochs)):
                    B, _ = dcd_full(
                        indptr, items, targets, B, D, beta, w0, alpha, max_sweeps=int(p.max_sweeps), gram=gram
                    )
                self.codes[rows] = B
                s_e = inner_products(indptr, items, B, D).astype(np.float64)
                Bf = B.astype(np.float64)
            self.trained[rows] = True
            coef = wq * s_e / f - (c * targets - wq * beta[items])
            if planes:
                grad = coef[:, None] * Bf[owner] - (wq / f) * Bf[owner] ** 2 * Df[items]
            else:
                grad = coef[:, None] * Bf[owner] - (wq / f) * Df[items]
            bias = c * targets - wq * s_e / f
            k = np.bincount(owner, minlength=rows.size).astype(np.float64)
            sq = np.einsum("ij,ij->i", grad, grad) + bias * bias
            n2 = np.einsum("ij,ij->i", Bf, Bf)  # ‖b‖² (= f for a ±1 code)
            rest2 = np.bincount(owner, weights=sq, minlength=rows.size).astype(np.float64) + (n2 * n2 + n2) / f**2
            # (the last term is ‖b bᵀ/f‖² + ‖b/f‖²)
            if share > 0:
                fc = np.minimum(1.0, math.sqrt(share) * clip / np.sqrt(np.maximum(k, 1.0)))
                fr = np.minimum(1.0, math.sqrt(1.0 - share) * clip / np.sqrt(rest2))
            else:
                fc = fr = np.minimum(1.0, clip / np.sqrt(rest2 + k))
            up = alive[rows]
            sel = up[owner]
            e_items, e_own = items[sel], owner[sel]
            q = stochastic_round(grad[sel] * (fr[e_own] * scale)[:, None], coins)
            idx = (e_items[:, None] * f + np.arange(f)).ravel()
            grad_t += np.bincount(idx, weights=q.ravel().astype(np.float64), minlength=m * f)
            bias_t += np.bincount(e_items, weights=stochastic_round(bias[sel] * fr[e_own] * scale, coins), minlength=m)
            count_t += np.bincount(e_items, weights=stochastic_round(fc[e_own] * scale, coins), minlength=m)
            live = np.flatnonzero(up)
            for g in range(0, live.size, 512):  # b bᵀ/f of 512 devices at a time (512·f² values)
                j = live[g : g + 512]
                outer = Bf[j, :, None] * Bf[j, None, :] * (fr[j] * scale / f)[:, None, None]
                gram_t += stochastic_round(outer, coins).sum(axis=0)
            code_t += stochastic_round(Bf[live] * (fr[live] * scale / f)[:, None], coins).sum(axis=0)
        parts = (grad_t, bias_t, count_t, gram_t.ravel(), code_t)
        total = np.rint(np.concatenate(parts)).astype(np.int64)
        assert total.size == layout.length
        return total


def _scatter_add(total: NDArray[np.int64], idx: NDArray[np.int64], values: NDArray[np.int64]) -> None:
    # Indices of one device are distinct (one row per (device, item)), so fancy += is exact.
    total[idx] += values


def _merge_csr(
    indptr: NDArray[np.int64],
    items: NDArray[np.int64],
    targets: NDArray[np.float64],
    neg_ptr: NDArray[np.int64],
    neg: NDArray[np.int64],
) -> tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.int64]]:
    """Each user's positives followed by its negatives (r = 0), as one CSR batch (the device's
    `_user_csr` order)."""
    n = indptr.size - 1
    counts = np.diff(indptr) + np.diff(neg_ptr)
    out_ptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    pos_owner = np.repeat(np.arange(n), np.diff(indptr))
    neg_owner = np.repeat(np.arange(n), np.diff(neg_ptr))
    pos_slot = out_ptr[pos_owner] + (np.arange(items.size) - indptr[pos_owner])
    neg_slot = out_ptr[neg_owner] + np.diff(indptr)[neg_owner] + (np.arange(neg.size) - neg_ptr[neg_owner])
    all_items = np.empty(out_ptr[-1], dtype=np.int64)
    all_r = np.zeros(out_ptr[-1])
    all_items[pos_slot], all_items[neg_slot] = items, neg
    all_r[pos_slot] = targets
    return all_items, all_r, out_ptr


def _entry_gradients(
    indptr: NDArray[np.int64],
    items: NDArray[np.int64],
    r: NDArray[np.float64],
    B: NDArray[np.int8],
    D: NDArray[np.int8],
    inner_products: Callable[..., NDArray[np.int32]],
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64]]:
    """Per CSR entry e of user u and item i: the eq. 12 row Δd^u_i = (r − 1/2 − s/(2f))·b_u + d_i/(2f)
    (the terms `device_sdk.lightfr.item_gradient_sum` adds up), returned as (items, users, rows)."""
    f = B.shape[1]
    s = inner_products(indptr, items, B, D)
    resid = r - 0.5 - s / (2.0 * f)
    owner = np.repeat(np.arange(indptr.size - 1), np.diff(indptr))
    rows = resid[:, None] * B[owner].astype(np.float64) + D[items].astype(np.float64) / (2.0 * f)
    return items, owner, rows


def _noise_check(mu: float, n: int, dropout_rate: float, survivors: int, corrected: int, length: int) -> float:
    """Empirical variance of the released noise of one round drawn device by device with the
    device's functions, as the simulator's exact mode draws it (used by tests/test_fedsim_privsim.py)."""
    rng = insecure_test_noise_stream(0)  # a check of the variance, not a private run
    t_min = minimum_survivors(n, dropout_rate)
    total = np.zeros(length, dtype=np.int64)
    for d in range(survivors):
        draw = device_noise(mu, t_min, length, rng)
        if d < corrected:
            draw, _ = correct_noise(draw, t_min, survivors, rng)
        total += draw.value()
    return float(np.var(total))


#: A device's training generator and noise stream (`device_sdk.client.insecure_seeded_rngs`).
DeviceDraws = Mapping[int, tuple[np.random.Generator, NoiseStream]]


class MFCohort:
    """Every MF device of a dataset at once, for `PrivateSimulator.run_scaled_round`.

    Holds each device's private user vector u (``user_factors``) and its ratings, and runs one round of
    every device's `device_sdk.mf.MFModel.local_update` in batches with the device's own kernels
    (`fit_users`, `initial_factors`, `trim_per_user`, `sample_negatives`): stage 1 for a device seen for
    the first time, ``local_epochs`` steps on u against the downloaded V (projected with Π, as
    `MFModel.set_global` does), θ ratings kept, negatives drawn, then the V-gradient of the kept
    examples.  A device's dense (m·f,) upload is non-zero only on the rows of its kept and negative
    items, so only those rows are built: each device's rows are clipped with
    `protocol.quantization.clip_l2` and rounded with the formula of `stochastic_round`, and the
    survivors' rounded rows are summed sparsely.  The zero coordinates a device also uploads round to
    0 whatever their coins, so the sum is the one the devices' dense uploads give.

    Two sources of randomness:

    * one training generator and one coin stream for the whole cohort (the scale mode): the same
      law as the devices' draws, other words;
    * ``device_draws`` (``{device_id: (training generator, noise stream)}``, the test hook
      `insecure_seeded_rngs` of every device): each device draws exactly what its `local_update`
      draws, and its coins are words ``item·f + j`` of its stream, which is left after the m·f coin
      words of a device's `quantize`, where the device's DP noise starts.  The sum is then the devices'
      `local_round` sum bit for bit, up to one floating-point difference: a device's norm is summed over
      its non-zero coordinates rather than over the dense vector, which can move the clip factor by an
      ulp, and a rounded value changes only if a coin falls within that ulp of its threshold.

    Parameters
    ----------
    users : for each device (one user), its rated item ids and raw ratings (None: implicit, fitted as 1).
    n_items, factors : model shape (m, f).
    max_norm2 : R of the embedding clipping (must equal the round plan's).
    init_scale : a new user vector is Π(init_scale · Uniform[0, 1)) (`MFConfig.init_scale`).
    batch : devices per vectorised batch.
    """

    def __init__(
        self,
        users: Sequence[tuple[NDArray[np.int64], NDArray[np.float64] | None]],
        n_items: int,
        factors: int,
        *,
        max_norm2: float = 5.0,
        init_scale: float = 0.1,
        batch: int = 8192,
        first_id: int = 1,
    ) -> None:
        if n_items <= 0 or factors <= 0:
            raise ConfigError(f"need n_items > 0 and factors > 0, got {n_items}, {factors}")
        if not (math.isfinite(max_norm2) and max_norm2 > 0):
            raise ConfigError(f"max_norm2 must be finite and > 0, got {max_norm2}")
        self.n_items, self.factors, self.max_norm2 = int(n_items), int(factors), float(max_norm2)
        self.init_scale = float(init_scale)
        self.device_ids = list(range(first_id, first_id + len(users)))
        self._index = {d: i for i, d in enumerate(self.device_ids)}
        lengths = np.array([np.asarray(u[0]).size for u in users], dtype=np.int64)
        self.indptr = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        self.items = (
            np.concatenate([np.asarray(u[0], dtype=np.int64).ravel() for u in users])
            if users
            else np.zeros(0, np.int64)
        )
        if self.items.size and (self.items.min() < 0 or self.items.max() >= n_items):
            raise ConfigError(f"an item id is outside [0, {n_items})")
        self.targets = (
            np.concatenate(
                [np.ones(np.asarray(i).size) if r is None else np.asarray(r, np.float64).ravel() for i, r in users]
            )
            if users
            else np.zeros(0)
        )
        if self.targets.shape != self.items.shape:
            raise ConfigError("every device needs one rating per rated item (or None)")
        if self.targets.size and not (
            np.all(np.isfinite(self.targets)) and self.targets.min() >= 0 and self.targets.max() <= max_norm2
        ):
            # Outside [0, R] the per-example gradient bound 2R^{3/2} would not hold (`device_sdk.mf`).
            raise ConfigError(f"ratings must be finite and lie in [0, R] = [0, {max_norm2}]")
        self.user_factors = np.zeros((len(users), factors))
        self.trained = np.zeros(len(users), dtype=bool)
        self.batch = int(batch)

    def _gen(self, draws: DeviceDraws, row: np.integer | int) -> np.random.Generator:
        return draws[self.device_ids[int(row)]][0]

    def quantized_sum(
        self,
        V: NDArray[np.float64],
        invite: RoundInvite,
        cohort: Iterable[int],
        survivors: Iterable[int],
        rng: np.random.Generator,
        coins: NoiseStream,
        *,
        device_draws: DeviceDraws | None = None,
    ) -> NDArray[np.int64]:
        """Train every cohort device for one round against the item matrix ``V``; return Σ over
        ``survivors`` of their quantized uploads as signed integers (length m·f).  ``rng`` and ``coins``
        are the cohort's generator and coin stream; ``device_draws`` replaces both by each device's own
        (see the class)."""
        from device_sdk.mf import fit_users, initial_factors, sample_negatives, trim_per_user
        from protocol.families.mf import project_rows
        from protocol.plan import MFParams

        p = invite.plan.params
        if not isinstance(p, MFParams):
            raise ConfigError(f"an MF cohort needs an MF plan, got {type(p).__name__}")
        R = float(p.max_norm2)
        if R != self.max_norm2:
            raise ConfigError(f"the round's max_norm2 {R} differs from the cohort's {self.max_norm2}")
        m, f = self.n_items, self.factors
        if int(invite.vector_length) != m * f:
            raise ConfigError(f"the round expects {invite.vector_length} values, an MF upload has {m * f}")
        Vd = project_rows(np.asarray(V, dtype=np.float64).reshape(m, f), R)  # as the device's set_global
        qcfg = invite.quantization()
        lr, reg, neg, cap = float(p.learning_rate), float(p.reg), int(p.negatives), int(invite.example_cap)
        alive = np.zeros(len(self.device_ids), dtype=bool)
        alive[[self._index[d] for d in survivors]] = True
        rows_all = np.array(sorted(self._index[d] for d in cohort), dtype=np.int64)
        total = np.zeros(m * f)
        cols = np.arange(f, dtype=np.int64)
        for lo in range(0, rows_all.size, self.batch):
            rows = rows_all[lo : lo + self.batch]
            counts = self.indptr[rows + 1] - self.indptr[rows]
            owner = np.repeat(np.arange(rows.size), counts)
            first = np.cumsum(counts) - counts
            take = np.arange(owner.size) - first[owner] + self.indptr[rows][owner]
            items, r = self.items[take], self.targets[take]
            U = self.user_factors[rows]
            # Stage 1 for devices seen for the first time (with ratings): a fresh small u, then pre-training.
            new = np.flatnonzero(~self.trained[rows] & (counts > 0))
            if new.size:
                if device_draws is None:
                    U[new] = initial_factors(new.size, f, R, self.init_scale, rng)
                else:
                    for jn in new.tolist():
                        U[jn] = initial_factors(1, f, R, self.init_scale, self._gen(device_draws, rows[jn]))[0]
                is_new = np.zeros(rows.size, dtype=bool)
                is_new[new] = True
                sel = is_new[owner]
                U = fit_users(U, Vd, owner[sel], items[sel], r[sel], lr, reg, R, int(p.pretrain_epochs))
                self.trained[rows[new]] = True
            U = fit_users(U, Vd, owner, items, r, lr, reg, R, int(p.local_epochs))
            self.user_factors[rows] = U
            # θ ratings per device (trimming keys are drawn for every rating, as the device draws them).
            if device_draws is None:
                keep = trim_per_user(owner, cap, rng)
            else:
                keep = np.concatenate(
                    [np.zeros(0, np.int64)]
                    + [
                        trim_per_user(np.zeros(int(counts[j]), np.int64), cap, self._gen(device_draws, rows[j]))
                        + first[j]
                        for j in range(rows.size)
                    ]
                )
            ku, ki, kr = owner[keep], items[keep], r[keep]
            if neg > 0 and ku.size:
                if device_draws is None:
                    nu, ni = sample_negatives(np.repeat(ku, neg), owner, items, m, rng)
                else:  # a device with kept ratings draws its negatives after its trimming keys
                    parts = []
                    kc = np.bincount(ku, minlength=rows.size)
                    for jk in np.flatnonzero(kc).tolist():
                        g = self._gen(device_draws, rows[jk])
                        own = items[first[jk] : first[jk] + counts[jk]]
                        _, nj = sample_negatives(
                            np.zeros(int(kc[jk]) * neg, np.int64), np.zeros(own.size, np.int64), own, m, g
                        )
                        parts.append((np.full(nj.size, jk), nj))
                    nu = np.concatenate([a for a, _ in parts]).astype(np.int64)
                    ni = np.concatenate([b for _, b in parts]).astype(np.int64)
                # Each device's negatives after its kept ratings (the device's example order).
                ku, ki, kr = np.r_[ku, nu], np.r_[ki, ni], np.r_[kr, np.zeros(nu.size)]
                order = np.argsort(ku, kind="stable")
                ku, ki, kr = ku[order], ki[order], kr[order]
            # The V-gradient rows, summed per (device, item) in example order (`item_gradient_sum`).
            w = -2.0 * (kr - np.einsum("ij,ij->i", U[ku], Vd[ki]))
            keys, inv = np.unique(ku * m + ki, return_inverse=True)
            inv = inv.ravel()
            vals = np.empty((keys.size, f))
            g_rows = w[:, None] * U[ku]
            for k in range(f):  # loop over the small rank only
                vals[:, k] = np.bincount(inv, weights=g_rows[:, k], minlength=keys.size)
            downer, ditem = keys // m, keys % m
            bounds = np.searchsorted(downer, np.arange(rows.size + 1))
            scaled_parts: list[NDArray[np.float64]] = []
            idx_parts: list[NDArray[np.int64]] = []
            words = np.zeros(0)
            for j in range(rows.size):
                a, b = int(bounds[j]), int(bounds[j + 1])
                up = alive[rows[j]]
                if device_draws is not None:  # every cohort device reads its m·f coin words (its quantize)
                    stream = device_draws[self.device_ids[int(rows[j])]][1]
                    words = stream.uniform(m * f)
                if not up or a == b:
                    continue
                clipped, _ = clip_l2(vals[a:b], qcfg.clip_norm)
                v = clipped * qcfg.scale
                idx = (ditem[a:b, None] * f + cols).ravel()
                if device_draws is not None:
                    low = np.floor(v).ravel()
                    q = low.astype(np.int64) + (words[idx] < v.ravel() - low).astype(np.int64)
                    total += np.bincount(idx, weights=q.astype(np.float64), minlength=m * f)
                else:
                    scaled_parts.append(v.ravel())
                    idx_parts.append(idx)
            if scaled_parts:
                q = stochastic_round(np.concatenate(scaled_parts), coins)
                total += np.bincount(np.concatenate(idx_parts), weights=q.astype(np.float64), minlength=m * f)
        return np.rint(total).astype(np.int64)


def _lightfr_params(invite: RoundInvite) -> LightFRParams:
    """The LightFR training parameters an invite of the scaled LightFR simulation carries."""
    if not isinstance(invite.params, LightFRParams):
        raise ConfigError(f"the scaled LightFR simulation needs a LightFR plan, got {invite.params!r}")
    return invite.params
