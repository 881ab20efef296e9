"""`RoundCoordinator`: the round lifecycle — check-in, cohort selection, the SecAgg+ round's phases,
finishing and releasing it — without aiohttp, time or global randomness (``now`` is passed in; HTTP
handlers and the in-process simulator drive the very same object).  It delegates registration and
authentication to `agg_server.enrollment.Enrollment`, the model and the commit path to
`agg_server.commit.GlobalModel`, and the privacy ledger to `agg_server.ledger.PrivacyAccount`.

Invariants:
- At most one round is open.  A round's devices were sampled from the devices that checked in
  recently; they learn of the round at their next check-in (a `RoundInvite` carrying the training
  plan) and then speak the phases in order.  A device that misses a deadline is dropped by the
  `ServerSecAggSession`; fewer than t survivors abort the round with nothing revealed.
- The only thing the coordinator learns from devices' updates is the secure sum of the survivors'
  quantized updates plus their DP noise; the strategy turns that sum into the new item codes.
- Every committed model is on disk (checkpoint + database row) before any device is told "committed"
  (`agg_server.commit`).
- Which upload belongs to which phase is `protocol.phases.SERVER_EXPECTS`; the phase order is
  `protocol.phases.ACTIVE_PHASES`: nothing here restates the phase table.
- The privacy ledger reserves a round's ε in the transaction that opens it (`Storage.start_round`), so
  rounds of several cohorts on several instances can never overspend; the round is marked revealed
  before its UNMASK phase is announced, and a round that ends without committing gives its reservation
  back only if it was never revealed (docs/dp-accounting.md §5).
- Several cohorts (docs/operations.md): with ``leased=True`` the coordinator opens rounds only while it
  holds a cohort lease (`take_lease`), writes every round row with its fencing token, and commits with a
  compare-and-set on the model version: a sum computed against version v whose commit finds a newer
  head h is applied to h (rebased) and committed as h + 1 (`agg_server.commit.GlobalModel.commit`).
- All server-side randomness of round r (cohort, graph, damping) comes from one generator seeded by
  ``SeedSequence([seed, r])`` when the operator set a seed (reproducible simulations), else from
  `secrets`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from agg_server.cohort import round_parameters, round_shape
from agg_server.commit import FinishJob, GlobalModel, Prepared
from agg_server.config import ServerConfig
from agg_server.enrollment import Enrollment
from agg_server.ledger import PrivacyAccount
from agg_server.presence import Presence
from agg_server.status import closed_phase_endings, coordinator_status
from agg_server.storage import DatabaseUnavailable, LeaseLost, Storage
from agg_server.strategy import build_strategy
from agg_server.strategy.base import Strategy, round_plan
from protocol.accounting import PrivacyLedger
from protocol.errors import (
    ConfigError,
    FedRecError,
    LocalProtocolError,
    PermissionDenied,
    PrivacyBudgetExceeded,
    RemoteProtocolError,
    RoundClosed,
    StaleRound,
    StorageError,
)
from protocol.messages import (
    Abort,
    MaskedInput,
    Message,
    RegisterResponse,
    RoundInvite,
    RoundResult,
    Wait,
)
from protocol.noise import colluding_devices, minimum_survivors
from protocol.phases import ACTIVE_PHASES, SERVER_EXPECTS, TERMINAL_PHASES, Phase
from protocol.plan import TrainingPlan
from protocol.quantization import check_bit_budget
from protocol.session import ServerSecAggSession

__all__ = ["RoundCoordinator"]

log = logging.getLogger("agg_server.coordinator")

_KEEP_FINISHED = 64  # outcomes of recent rounds kept for late long-polls
CHECKIN_RATE = 400.0  # target check-ins per second from waiting devices


@dataclass
class _OpenRound:
    round_id: int
    session: ServerSecAggSession
    cohort: tuple[int, ...]
    plan: TrainingPlan
    rng: np.random.Generator
    base_version: int
    started: float
    phase: Phase
    phase_started: float
    alive: set[int]
    mu: float = 0.0
    l1: float = 0.0
    l2: float = 0.0
    handed_out: set[int] = field(default_factory=set)
    revealed: bool = False  # the UNMASK phase was announced: the ε reservation can no longer be returned
    polling: dict[int, int] = field(default_factory=dict)  # device -> open long-polls
    gone: dict[int, float] = field(default_factory=dict)  # device -> when its long-poll broke unanswered
    finishing: bool = False  # UNMASK closed; the mask removal and commit run off the event loop
    delivered: set[int] = field(default_factory=set)  # the invitation reached the device (its connection took it)
    departed: dict[int, str] = field(default_factory=dict)  # device -> why it left while nothing was awaited
    ended: dict[Phase, str] = field(default_factory=dict)  # closed phase -> how it ended (`closed_phase_endings`)


class RoundCoordinator(Presence):
    """Runs training rounds for one model.

    Parameters
    ----------
    config : the server configuration.
    storage : the opened storage (devices, rounds, ledger, checkpoints).
    now : the caller's clock at start-up.
    """

    def __init__(
        self,
        config: ServerConfig,
        storage: Storage,
        *,
        now: float,
        strategy: Strategy | None = None,
        defer_finish: bool = False,
        leased: bool = False,
    ) -> None:
        self.config = config
        #: With ``leased`` (the server app) rounds open only while `take_lease` gave this coordinator a
        #: cohort; the open rounds of a cohort are abandoned by whoever acquires its lease.  Without it
        #: (simulators, tests) it runs alone: open rounds are abandoned here and no lease is needed.
        self.leased = leased
        self.fence: tuple[int, int] | None = None
        #: With ``defer_finish`` a round whose UNMASK closed waits in a "finishing" state until the caller
        #: runs `take_finish_job`'s job (off its event loop) and hands it back to `complete_finish`;
        #: without it (simulations, tests) the round finishes inside the call that closed UNMASK.
        self.defer_finish = defer_finish
        self._job: FinishJob | None = None
        self.storage = storage
        self.strategy: Strategy = strategy if strategy is not None else build_strategy(config)
        if not isinstance(self.strategy, Strategy):
            raise ConfigError(f"{type(self.strategy).__name__} does not implement agg_server.strategy.base.Strategy")
        if self.strategy.n_items != config.model.n_items:
            raise ConfigError(
                f"the strategy is for n_items={self.strategy.n_items}, model.n_items is {config.model.n_items}"
            )
        self.quantization = config.rounds.quantization()
        self.vector_length = int(self.strategy.vector_length)
        self._seed = config.rounds.seed
        self.abandoned = [] if leased else storage.abandon_open_rounds(now)
        for rid in self.abandoned:
            log.warning("round %d was open when the server stopped; abandoned (its devices will check in again)", rid)
        #: The model trained and served, and the path that commits a round into it.
        self.global_model = GlobalModel(config, storage, self.strategy, self.quantization, now=now, rng=self._rng)
        self.enrollment = Enrollment(config, storage)
        if self.enrollment.open:
            log.warning(
                "open registration: any client may register any number of devices (Sybils); set "
                "enrollment.authority_key or issue enrollment tokens for anything but local development"
            )
        #: The privacy ledger, the noise μ per round and the sensitivities it charges with.
        self.privacy = PrivacyAccount(config, storage, self.quantization, self.vector_length)
        self._check_bit_budget()
        self._pool: dict[int, float] = {}  # waiting device -> last check-in
        self._pool_since: dict[int, float] = {}  # waiting device -> first check-in of this wait
        self._round: _OpenRound | None = None
        self._finished: dict[int, RoundResult] = {}
        #: Round id -> (status, reason) of ended rounds whose end the unreachable database missed (`tick` retries).
        self._unrecorded: dict[int, tuple[str, str]] = {}
        self._phase_ends: dict[int, dict[str, str]] = {}  # round -> phase -> how it ended (recent rounds)
        self._next_open = now
        self._rounds_run = 0
        self.stopped_reason = ""
        #: Observers of round events, called as ``listener(event, fields)`` (metrics, dashboards).
        #: Events: "round_opened" {round_id, cohort}; "phase" {round_id, phase, seconds, alive,
        #: dropped, ended (`agg_server.status.PHASE_ENDINGS`)}; "round_finished" {round_id, outcome:
        #: "committed" | "aborted" | "abandoned", seconds, survivors, epsilon_spent, model_version, reason}.
        #: A listener that raises is logged and otherwise ignored: observers never break a round.
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []

    # -- model and privacy ledger (`agg_server.commit`, `agg_server.ledger`) ----------------------------
    @property
    def model_version(self) -> int:
        """The newest model's version (trained by the next round, served by GET /v1/model)."""
        return self.global_model.version

    @property
    def model_state(self) -> NDArray[Any]:
        """The newest model's state (the strategy's array)."""
        return self.global_model.state

    @property
    def model_bytes(self) -> bytes:
        """The newest model as served: an encoded `ModelPayload`."""
        return self.global_model.payload

    @property
    def model_sha256(self) -> str:
        """SHA-256 (hex) of `model_bytes`."""
        return self.global_model.sha256

    @property
    def model_etag(self) -> str:
        """The HTTP ETag of `model_bytes`."""
        return self.global_model.etag

    @property
    def model_dp_trained(self) -> bool:
        """Sticky: set when a round with DP noise committed this model or one it was trained from."""
        return self.global_model.dp_trained

    @property
    def ledger(self) -> PrivacyLedger | None:
        """The privacy ledger as last read from storage (None without ``privacy.enabled``)."""
        return self.privacy.ledger

    @property
    def mu(self) -> float:
        """The Gaussian noise variance μ every round adds (0 without DP)."""
        return self.privacy.mu

    @property
    def l1(self) -> float:
        """L1 sensitivity of one device's quantized update."""
        return self.privacy.l1

    @property
    def l2(self) -> float:
        """L2 sensitivity of one device's quantized update."""
        return self.privacy.l2

    # -- cohort leases ----------------------------------------------------------------------------
    def take_lease(self, cohort: int, token: int, abandoned: list[int]) -> None:
        """This coordinator leads ``cohort`` with fencing ``token`` (from `Storage.acquire_lease`, which
        abandoned the cohort's open rounds ``abandoned``)."""
        self.fence = (cohort, token)
        self.abandoned = list(abandoned)
        for rid in abandoned:
            self._finished[rid] = RoundResult(
                round_id=rid, committed=False, model_version=self.model_version, reason="round abandoned"
            )
        log.info("leading cohort %d (fencing token %d)", cohort, token)

    def lose_lease(self, now: float, reason: str) -> None:
        """The lease is gone (expired, or taken by another instance): drop the open round without writing
        (every write would be refused); its new leader abandons it in the database."""
        r, self.fence = self._round, None
        self._unrecorded.clear()  # the cohort's new leader abandons those rounds
        self._pool.clear()
        self._pool_since.clear()
        self._job = None
        if r is None:
            return
        log.warning("round %d dropped: %s", r.round_id, reason)
        if r.session.phase in ACTIVE_PHASES and not r.finishing:
            r.session.abort(reason)
        self._finished[r.round_id] = RoundResult(
            round_id=r.round_id, committed=False, model_version=self.model_version, reason=reason
        )
        self._round = None
        self._emit_finished(r, now, "abandoned", self.model_version, reason)

    @property
    def cohort(self) -> int | None:
        """The cohort this coordinator leads (None without a lease)."""
        return None if self.fence is None else self.fence[0]

    @property
    def item_codes(self) -> NDArray[Any]:
        """The global model (LightFR: the (m, f) ±1 item codes); kept for LightFR callers."""
        if self.strategy.kind == "lightfr":
            return self.model_state[:, : self.strategy.rank]
        return self.model_state

    def _rng(self, round_id: int) -> np.random.Generator:
        if self._seed is None:
            return np.random.default_rng(secrets.randbits(128))
        return np.random.default_rng(np.random.SeedSequence([self._seed, round_id]))

    def _check_bit_budget(self) -> None:
        cfg = self.config.rounds
        n = cfg.cohort_size
        honest = minimum_survivors(n, cfg.dropout_rate) - colluding_devices(n, cfg.adversary_rate) if self.mu else 1
        # Before correction every device carries μ/(t_min − f), so n of them carry n·μ/(t_min − f).
        check_bit_budget(n, self.quantization, self.vector_length, n * self.mu / honest)

    # -- devices ------------------------------------------------------------------------------------
    def register(
        self,
        platform: str,
        now: float,
        *,
        certificate: bytes = b"",
        proof: bytes = b"",
        enrollment_token: str = "",
        peer: str = "",
    ) -> RegisterResponse:
        """Create a device identity: `agg_server.enrollment.Enrollment.register` (which raises
        `EnrollmentRefused` or `RateLimited`)."""
        return self.enrollment.register(
            platform, now, certificate=certificate, proof=proof, enrollment_token=enrollment_token, peer=peer
        )

    def authenticate(self, token: str | None) -> int:
        """The device a bearer token belongs to: `agg_server.enrollment.Enrollment.authenticate` (which
        raises `AuthError`, or `EnrollmentRefused` for a revoked device)."""
        return self.enrollment.authenticate(token)

    @staticmethod
    def check_sender(device_id: int, message: Message) -> None:
        """Refuse a message that names another device than the authenticated one."""
        claimed = getattr(message, "device_id", device_id)
        if claimed != device_id:
            raise PermissionDenied(f"authenticated as device {device_id}, message names device {claimed}")

    @property
    def retry_after(self) -> float:
        """Seconds a waiting device should pause before checking in again.  It grows with the number
        of waiting devices so that check-ins arrive at about `CHECKIN_RATE` per second."""
        return max(0.2, self.config.rounds.round_interval, len(self._pool) / CHECKIN_RATE)

    def check_in(self, device_id: int, now: float) -> RoundInvite | Wait:
        """A device is available: invite it if it is in the open round's cohort, else pool it.

        Raises
        ------
        EnrollmentRefused
            The device's certified key is on the enrollment authority's revocation list.
        """
        self.enrollment.refuse_revoked(device_id, "it takes part in no round")
        r = self._round
        if r is not None and device_id in r.session.invited:
            # The invitation is handed out while the round collects keys and the device has sent
            # none: a device whose answer was lost (a timeout, a failover to another instance) gets
            # the same invitation again.  It cannot take part twice: the session accepts one key
            # advertisement per device, and the device charges its ledger only when its masked
            # input leaves.
            # A device whose invitation reached it (`invitation_delivered`) and that checks in again
            # before sending its keys has left, like a device in a later phase: a vanished device that
            # comes back is not waited for until the deadline.
            awaited = r.session.phase is Phase.ADVERTISE_KEYS and device_id in r.session.expected()
            if awaited and device_id not in r.delivered:
                invite = r.session.outbox(device_id)
                if isinstance(invite, RoundInvite):
                    r.handed_out.add(device_id)
                    return invite.with_plan(r.plan)
            if device_id in r.handed_out:
                # A device checks in only when it is in no round: one that already sent its keys
                # and checks in again left ours.
                self._leave(r, device_id, "checked in again while in the round", now)
            return Wait(retry_after=self.retry_after, reason=f"already invited to round {r.round_id}")
        self._pool[device_id] = now
        self._pool_since.setdefault(device_id, now)
        if self.stopped_reason:
            return Wait(retry_after=max(60.0, self.retry_after), reason=self.stopped_reason)
        reason = "no round open" if r is None else f"round {r.round_id} in progress"
        return Wait(retry_after=self.retry_after, reason=reason)

    # -- rounds -------------------------------------------------------------------------------------
    def _maybe_open(self, now: float) -> None:
        cfg = self.config.rounds
        if self._round is not None or now < self._next_open or self.stopped_reason:
            return
        if self.leased and self.fence is None:
            return
        if cfg.max_rounds and self._rounds_run >= cfg.max_rounds:
            self.stopped_reason = f"max_rounds={cfg.max_rounds} reached"
            return
        fresh = self._ready_pool(now)
        if fresh is None:
            return
        if self.leased:
            self.global_model.refresh()
        self.privacy.refresh()
        try:
            self.privacy.check_round()
        except PrivacyBudgetExceeded as exc:
            self._budget_refused(exc, now)
            return
        round_id = self.storage.next_round_id()
        rng = self._rng(round_id)
        share = self.config.enrollment.max_source_share
        sources = self.enrollment.sources(fresh) if share < 1.0 else None
        shape = round_shape(cfg, fresh, rng, dp=bool(self.mu), sources=sources, max_source_share=share)
        if shape is None:
            return  # the operator's (k, t) were validated for the full cohort only: wait for it
        self._open(now, round_id, rng, shape[0], shape[1:])

    def _ready_pool(self, now: float) -> list[int] | None:
        """The waiting devices a cohort is drawn from, or None while too few wait; devices gone quiet or
        revoked leave the pool first."""
        cfg = self.config.rounds
        ttl = 10 * self.retry_after
        for d in [d for d, t in self._pool.items() if now - t > ttl]:  # gone quiet: forget them
            del self._pool[d]
            self._pool_since.pop(d, None)
        revoked = self.enrollment.revoked_devices()
        for d in revoked.intersection(self._pool):  # revoked after registering: never drawn again
            del self._pool[d]
            self._pool_since.pop(d, None)
        fresh = sorted(self._pool)
        if len(fresh) < cfg.min_cohort:
            return None
        oldest = min(self._pool_since[d] for d in fresh)
        if len(fresh) < cfg.cohort_size and now - oldest < 5 * self.retry_after:
            return None  # give the pool a moment to fill
        return fresh

    def _open(
        self, now: float, round_id: int, rng: np.random.Generator, cohort: tuple[int, ...], shape: tuple[int, ...]
    ) -> None:
        """Record round ``round_id`` of ``cohort`` (reserving its ε) and start its SecAgg+ session; ``shape`` =
        (k, t, t_min, f) from `round_shape`."""
        k, t, t_min, colluders = shape
        cfg = self.config.rounds
        timeouts = (
            cfg.advertise_timeout,
            cfg.share_keys_timeout,
            cfg.masked_input_timeout,
            cfg.unmask_timeout,
        )
        d0, d1, d2, d3 = (now + t for t in itertools.accumulate(timeouts))
        deadlines = (d0, d1, d2, d3)
        params = round_parameters(
            round_id,
            self.vector_length,
            (k, t, t_min, colluders),
            self.quantization,
            self.mu,
            deadlines=deadlines,
            authority_key=self.enrollment.authority,
        )
        roster = self.enrollment.roster(cohort)  # signed rounds: each device's certified identity key
        session = ServerSecAggSession(params, cohort, rng=rng, defer_finish=self.defer_finish, identities=roster)
        plan = round_plan(
            self.strategy, self.model_version, example_cap=cfg.example_cap, clip_norm=self.quantization.clip_norm
        )
        # Called inside start_round's transaction, under the rounds lock: the ledger every instance shares.
        reservation = self.privacy.reservation(round_id)
        try:
            self.storage.start_round(
                round_id,
                self.model_version,
                cohort,
                {"k": k, "t": t, "mu": self.mu, "t_min": t_min, "colluders": colluders}
                | {"deadlines": list(deadlines), **plan.record()},
                now,
                fence=self.fence,
                reserve=reservation,
            )
        except PrivacyBudgetExceeded as exc:
            self._budget_refused(exc, now)
            return
        except LeaseLost as exc:
            self.lose_lease(now, str(exc))
            return
        except StorageError as exc:
            # Another instance took this round id first (or the database hiccuped): try again shortly.
            log.warning("round %d could not be opened: %s", round_id, exc)
            self._next_open = now + max(0.2, cfg.round_interval)
            return
        self.privacy.adopt(reservation)
        for d in cohort:
            self._pool.pop(d, None)
            self._pool_since.pop(d, None)
        self._round = _OpenRound(
            round_id=round_id,
            session=session,
            cohort=cohort,
            plan=plan,
            rng=rng,
            base_version=self.model_version,
            started=now,
            phase=Phase.ADVERTISE_KEYS,
            phase_started=now,
            alive=set(cohort),
            mu=self.mu,
            l1=self.l1,
            l2=self.l2,
        )
        self._rounds_run += 1
        self._emit("round_opened", {"round_id": round_id, "cohort": len(cohort)})
        log.info("round %d opened: %d devices, k=%d, t=%d, mu=%.4g", round_id, len(cohort), k, t, self.mu)

    def _budget_refused(self, exc: PrivacyBudgetExceeded, now: float) -> None:
        # Other cohorts' open rounds may still give their reservations back: then wait and retry.
        if self.leased and self.storage.round_counts().get("open", 0):
            log.info("no ε left for a new round while other rounds hold reservations: %s", exc)
            self._next_open = now + max(1.0, self.config.rounds.round_interval)
            return
        self.stopped_reason = f"privacy budget exhausted: {exc}"
        log.warning("%s", self.stopped_reason)

    # -- presence (`agg_server.presence`): phases close as soon as every device still there answered ------
    def _leave(self, r: _OpenRound, device_id: int, reason: str, now: float) -> None:
        """Drop a device that is evidently no longer taking part from the open phase (as if it had sent
        `Abort`), so the phase closes once everyone else has answered.  One that has answered this phase
        already is dropped when the next phase awaits it (`agg_server.presence.Presence._drop_gone`)."""
        if r.finishing or r.session.phase not in ACTIVE_PHASES:
            return
        if device_id not in r.session.expected():
            r.departed[device_id] = reason
            return
        r.gone.pop(device_id, None)
        r.departed.pop(device_id, None)
        log.info("round %d: device %d dropped from %s: %s", r.round_id, device_id, r.session.phase.value, reason)
        try:
            r.session.receive(device_id, Abort(round_id=r.round_id, device_id=device_id, reason=reason))
        except RoundClosed:
            pass  # it had left already
        except FedRecError:
            log.exception("round %d: could not drop device %d", r.round_id, device_id)
        finally:
            self._after_change(now, "drops_detected")

    def submit(
        self, device_id: int, round_id: int, message: Message, now: float, *, digest: bytes | None = None
    ) -> Phase:
        """Accept a device's upload for ``round_id``; returns the phase it belongs to.

        Raises
        ------
        StaleRound
            ``round_id`` is not the open round.
        PermissionDenied
            The message names another device.
        RemoteProtocolError, RoundClosed
            From the SecAgg session (wrong phase, replay, illegal content); the device is dropped
            from the round and everyone else goes on.
        """
        self.check_sender(device_id, message)
        r = self._current(round_id)
        phase = SERVER_EXPECTS.get(type(message))
        if isinstance(message, Abort):
            phase = r.session.phase
        elif phase is None:
            raise RemoteProtocolError(f"{type(message).__name__} is not a round upload")
        try:
            r.session.receive(device_id, message, digest=digest)
            if isinstance(message, MaskedInput) and message.bad_share_senders:
                # the reported devices are out of the round (the session excluded them)
                log.warning(
                    "round %d: device %d reported unusable share ciphertexts from %s; excluded from the round",
                    r.round_id,
                    device_id,
                    list(message.bad_share_senders),
                )
        finally:
            self._after_change(now)
        return phase

    def reply(self, device_id: int, round_id: int, after: Phase, *, consistency: bool = False) -> Message | None:
        """The answer to a long-poll of a device that uploaded in phase ``after``: the next phase's
        broadcast, a `RoundResult` when the round ended (or the device was dropped), or None while
        the phase is still open.  ``consistency``: the upload was a survivor-set signature, answered
        once the consistency sub-step of UNMASK closed (with the `UnmaskRequest`)."""
        done = self._finished.get(round_id)
        if done is not None:
            return done
        r = self._current(round_id)
        if device_id not in r.session.invited:
            raise RemoteProtocolError(f"device {device_id} is not part of round {round_id}")
        if r.session.phase is after and (not consistency or r.session.consistency_open):
            return None
        out = r.session.outbox(device_id)
        if out is None:
            return None  # DONE but not yet committed: the caller waits for the next change
        if isinstance(out, Abort):
            return RoundResult(round_id=round_id, committed=False, model_version=self.model_version, reason=out.reason)
        return out

    def check_open(self, round_id: int) -> None:
        """Raise `StaleRound` unless ``round_id`` is the open round (before a body is read: a late
        upload's body is sized for no round, and its answer must say the round is gone, not that the
        body is too large)."""
        self._current(round_id)

    def _current(self, round_id: int) -> _OpenRound:
        r = self._round
        if r is None or r.round_id != round_id:
            raise StaleRound(f"round {round_id} is not the open round")
        return r

    def tick(self, now: float) -> None:
        """Advance deadlines, finish rounds, and open the next round when devices are waiting."""
        if self._unrecorded:
            self._record_ends(now)
        r = self._round
        if r is not None and not r.finishing:
            try:
                r.session.advance(now)
            finally:
                self._after_change(now, "deadline")
            if self._round is r and (r.gone or r.departed):
                self._drop_gone(r, now)
        self._maybe_open(now)

    def _after_change(self, now: float, cause: str = "all_answered") -> None:
        """Record what an upload (``cause`` "all_answered"), a dropped device ("drops_detected") or the
        clock ("deadline") moved."""
        r = self._round
        if r is None:
            return
        if r.finishing:
            return
        phase = r.session.phase
        if r.session.finishing or phase is not r.phase:
            r.ended = {**closed_phase_endings(r.phase, r.session, cause), **r.ended}
        if phase is not r.phase:
            self._record_phases(r, phase, now)
        if not r.revealed and (phase in (Phase.UNMASK, Phase.DONE) or r.session.finishing):
            # Before any device hears of the UNMASK phase (devices are woken after this call returns):
            # from here on the sum can be learned, so the ε reservation must stay charged.
            try:
                self.storage.mark_revealed(r.round_id, fence=self.fence)
                r.revealed = True
            except StorageError as exc:
                log.error("round %d: could not record that it reveals its sum; aborting it: %s", r.round_id, exc)
                if r.session.phase in ACTIVE_PHASES:
                    r.session.abort(f"could not record the round: {exc}")
                    self._finish(r, now)
                    return
                if r.session.phase is Phase.DONE:
                    # Revealed already (the sum was computed inline): keep it charged, drop the round.
                    r.revealed = True
        if r.session.finishing:
            r.finishing = True
            self._job = FinishJob(round_id=r.round_id, _run=lambda: self.global_model.prepare_finishing(r))
            log.info("round %d: UNMASK closed, finishing", r.round_id)
        elif phase in TERMINAL_PHASES:
            self._finish(r, now)

    # -- finishing a round off the caller's loop --------------------------------------------------------
    def take_finish_job(self) -> FinishJob | None:
        """The job that finishes the open round, once (None when there is none)."""
        job, self._job = self._job, None
        return job

    def complete_finish(self, job: FinishJob, now: float) -> None:
        """Commit (or abort) the round whose `FinishJob` ran: charge the ledger, store the model."""
        r = self._round
        if r is None or r.round_id != job.round_id or not r.finishing:
            raise LocalProtocolError(f"round {job.round_id} is not finishing")
        prepared = job.prepared if job.prepared is not None else Prepared(unmasked=False, error=None)
        if prepared.error is not None:
            log.error("round %d could not be finished: %s", r.round_id, prepared.error, exc_info=prepared.error)
        if r.session.phase is not r.phase:
            self._record_phases(r, r.session.phase, now)
        self._finish(r, now, prepared)

    def _record_phases(self, r: _OpenRound, phase: Phase, now: float) -> None:
        drops = r.session.dropouts
        order = list(ACTIVE_PHASES)
        start = order.index(r.phase) if r.phase in order else len(order)
        stop = order.index(phase) if phase in order else len(order)
        for p in order[start:stop]:
            dropped = sorted(drops.get(p, frozenset()) & r.alive)
            r.alive -= set(dropped)
            try:
                self.storage.record_phase(
                    r.round_id, p.value, sorted(r.alive), dropped, now - r.phase_started, now, fence=self.fence
                )
            except StorageError:
                log.exception("could not record phase %s of round %d", p.value, r.round_id)
            self._emit(
                "phase",
                {
                    "round_id": r.round_id,
                    "phase": p.value,
                    "seconds": now - r.phase_started,
                    "alive": len(r.alive),
                    "dropped": len(dropped),
                    "ended": r.ended.setdefault(p, "aborted"),
                },
            )
            self._phase_ends.setdefault(r.round_id, {})[p.value] = r.ended[p]
            r.phase_started = now
        r.phase = phase

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        for listener in list(self.listeners):
            try:
                listener(event, fields)
            except Exception:
                log.exception("round-event listener %r failed on %s", listener, event)

    def _finish(self, r: _OpenRound, now: float, prepared: Prepared | None = None) -> None:
        # Whatever fails below, the round is released exactly once: a failed commit must neither be
        # retried on the next tick (it would charge the privacy ledger again) nor wedge the server.
        session = r.session
        reason = str(session.abort_error or f"round failed ({session.phase.name})")
        outcome = RoundResult(round_id=r.round_id, committed=False, model_version=self.model_version, reason=reason)
        try:
            if prepared is not None and prepared.unmasked:
                outcome = self._commit(r, now, prepared)
            elif prepared is None and session.phase is Phase.DONE:
                outcome = self._commit(r, now, self.global_model.prepare(r))
            else:
                log.warning("round %d aborted: %s", r.round_id, reason)
                self.storage.finish_round(r.round_id, "aborted", reason=reason, now=now, fence=self.fence)
        except Exception as exc:
            log.exception("round %d could not be finished cleanly", r.round_id)
            if isinstance(exc, DatabaseUnavailable) and not outcome.committed:
                self._unrecorded[r.round_id] = ("aborted", outcome.reason)  # written once the database answers
        finally:
            self._finished[r.round_id] = outcome
            with contextlib.suppress(Exception):
                self.privacy.refresh()  # a reservation may have been given back
            self._emit_finished(
                r, now, "committed" if outcome.committed else "aborted", outcome.model_version, outcome.reason
            )
            while len(self._finished) > _KEEP_FINISHED:
                self._finished.pop(next(iter(self._finished)))
            while len(self._phase_ends) > _KEEP_FINISHED:
                self._phase_ends.pop(next(iter(self._phase_ends)))
            self._round = None
            self._next_open = now + self.config.rounds.round_interval

    def _record_ends(self, now: float) -> None:
        """Write the ends of rounds that could not be written when they ended (`_unrecorded`)."""
        for rid, (status, reason) in list(self._unrecorded.items()):
            try:
                self.storage.finish_round(rid, status, reason=reason, now=now, fence=self.fence)
            except DatabaseUnavailable:
                return  # still unreachable: the next tick tries again
            except StorageError as exc:  # the lease is lost, or the round was closed meanwhile
                log.warning("round %d: its end (%s) is not recorded: %s", rid, status, exc)
            del self._unrecorded[rid]

    def _emit_finished(self, r: _OpenRound, now: float, outcome: str, version: int, reason: str) -> None:
        self._emit(
            "round_finished",
            {
                "round_id": r.round_id,
                "outcome": outcome,
                "seconds": now - r.started,
                "survivors": len(r.alive),
                "epsilon_spent": self.privacy.spent(),
                "model_version": version,
                "reason": reason,
            },
        )

    def _commit(self, r: _OpenRound, now: float, prepared: Prepared) -> RoundResult:
        # The round's ε was reserved when it opened and it is marked revealed: the ledger stays charged
        # whatever happens below.
        self.privacy.refresh()
        return self.global_model.commit(r, now, prepared, epsilon=self.privacy.spent(), fence=self.fence)

    def shutdown(self, now: float) -> None:
        """Close an open round as abandoned (graceful stop): nothing is revealed, devices retry."""
        self.stopped_reason = "server shutting down"
        r = self._round
        if r is None:
            return
        if r.finishing:
            # Its job was not handed back (the app waits for it first): the sum never left this process.
            log.warning("round %d was finishing at shutdown; abandoned", r.round_id)
        elif r.session.phase in ACTIVE_PHASES:
            r.session.abort("server shutting down")
        self._finished[r.round_id] = RoundResult(
            round_id=r.round_id, committed=False, model_version=self.model_version, reason="server shut down"
        )
        self._round = None
        # An unrevealed round gives its ε reservation back (Storage.finish_round).
        self.storage.finish_round(r.round_id, "abandoned", reason="server shut down", now=now, fence=self.fence)
        self._emit_finished(r, now, "abandoned", self.model_version, "server shut down")
        log.info("round %d abandoned at shutdown", r.round_id)

    # -- introspection ------------------------------------------------------------------------------
    @property
    def open_round(self) -> _OpenRound | None:
        return self._round

    @property
    def waiting_devices(self) -> int:
        """Devices in the pool a round's cohort is drawn from."""
        return len(self._pool)

    @property
    def phase_ends(self) -> dict[int, dict[str, str]]:
        """How each phase of the recent rounds ended (round -> phase -> `agg_server.status.PHASE_ENDINGS`)."""
        return self._phase_ends

    def status(self, now: float) -> dict[str, Any]:
        """A JSON-able snapshot for `/v1/status` and the dashboard (`agg_server.status.coordinator_status`)."""
        return coordinator_status(self, now)
