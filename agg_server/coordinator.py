"""`RoundCoordinator`: registration, check-in, cohort selection, the SecAgg+ round, aggregation and
commit — without aiohttp, time or global randomness (``now`` is passed in; HTTP handlers and the
in-process simulator drive the very same object).

Invariants:
- At most one round is open.  A round's devices were sampled from the devices that checked in
  recently; they learn of the round at their next check-in (a `RoundInvite` carrying the training
  plan) and then speak the phases in order.  A device that misses a deadline is dropped by the
  `ServerSecAggSession`; fewer than t survivors abort the round with nothing revealed.
- The only thing the coordinator learns from devices' updates is the secure sum of the survivors'
  quantized updates plus their DP noise; the strategy turns that sum into the new item codes.
- Every committed model is on disk (checkpoint + database row) before any device is told "committed".
- The privacy ledger reserves a round's ε in the transaction that opens it (`Storage.start_round`), so
  rounds of several cohorts on several instances can never overspend; the round is marked revealed
  before its UNMASK phase is announced, and a round that ends without committing gives its reservation
  back only if it was never revealed (docs/dp-accounting.md §5).
- Several cohorts (docs/operations.md): with ``leased=True`` the coordinator opens rounds only while it
  holds a cohort lease (`take_lease`), writes every round row with its fencing token, and commits with a
  compare-and-set on the model version: a sum computed against version v whose commit finds a newer
  head h is applied to h (rebased) and committed as h + 1.
- All server-side randomness of round r (cohort, graph, damping) comes from one generator seeded by
  ``SeedSequence([seed, r])`` when the operator set a seed (reproducible simulations), else from
  `secrets`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import logging
import math
import resource
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from agg_server.config import ServerConfig
from agg_server.enrollment import Enrollment, capped_cohort
from agg_server.storage import HeadMoved, LeaseLost, Storage
from agg_server.strategy import build_strategy
from agg_server.strategy.base import Strategy, round_plan
from protocol.accounting import PrivacyLedger, calibrate_mu
from protocol.codec import decode, encode
from protocol.errors import (
    AuthError,
    ConfigError,
    EnrollmentRefused,
    FedRecError,
    LocalProtocolError,
    PermissionDenied,
    PrivacyBudgetExceeded,
    RemoteProtocolError,
    RoundClosed,
    StaleRound,
    StorageError,
)
from protocol.graph import find_parameters, validate_parameters
from protocol.messages import (
    Abort,
    ConsistencySignature,
    EncryptedShares,
    MaskedInput,
    Message,
    ModelPayload,
    PublicKeys,
    RegisterResponse,
    RoundInvite,
    RoundResult,
    UnmaskResponse,
    Wait,
)
from protocol.noise import minimum_survivors
from protocol.plan import TrainingPlan
from protocol.quantization import check_bit_budget, dequantize_sum, sensitivity
from protocol.session import ACTIVE_PHASES, Phase, RoundParameters, ServerSecAggSession

__all__ = ["RoundCoordinator", "PHASE_OF_MESSAGE", "token_digest"]

log = logging.getLogger("agg_server.coordinator")

#: The phase in which each device upload is legal (and after which its long-poll is answered).
PHASE_OF_MESSAGE: dict[type[Message], Phase] = {
    PublicKeys: Phase.ADVERTISE_KEYS,
    EncryptedShares: Phase.SHARE_KEYS,
    MaskedInput: Phase.MASKED_INPUT,
    ConsistencySignature: Phase.UNMASK,  # protocol 1.3: the first sub-step of UNMASK
    UnmaskResponse: Phase.UNMASK,
}

_KEEP_FINISHED = 64  # outcomes of recent rounds kept for late long-polls
_REBASES = 16  # commit attempts of one round when other cohorts keep committing first
CHECKIN_RATE = 400.0  # target check-ins per second from waiting devices


def round_shape(
    cfg: Any,
    fresh: list[int],
    rng: np.random.Generator,
    *,
    dp: bool,
    sources: dict[int, str] | None = None,
    max_source_share: float = 1.0,
) -> tuple[tuple[int, ...], int, int, int] | None:
    """A round's cohort (drawn from ``fresh`` with the round generator), graph degree k, threshold t and
    DP survivor floor t_min, by the `[rounds]` config ``cfg``; None when the operator fixed (k, t) and fewer
    devices than the full cohort are available (those values were validated for that cohort only), or
    when the per-source cap leaves fewer than ``cfg.min_cohort`` devices.
    The one rule for the coordinator and the private-round simulator (`fedsim.privsim`).

    With ``max_source_share`` < 1, no credential source (``sources[device]``) fills more than that share
    of the cohort (`agg_server.enrollment.capped_cohort`)."""
    n = min(cfg.cohort_size, len(fresh))
    if max_source_share < 1.0 and sources is not None:
        cohort = capped_cohort(fresh, n, sources, max_source_share, rng)
        n = len(cohort)
        if n < cfg.min_cohort:
            return None
    else:
        cohort = tuple(sorted(int(d) for d in rng.choice(np.array(fresh), size=n, replace=False)))
    if cfg.k is not None and cfg.t is not None:
        if n < cfg.cohort_size:
            return None
        k, t = cfg.k, cfg.t
        validate_parameters(n, k, t, cfg.dropout_rate, cfg.adversary_rate)
    else:
        gp = find_parameters(n, cfg.dropout_rate, cfg.adversary_rate)
        k, t = gp.k, gp.t
    return cohort, k, t, minimum_survivors(n, cfg.dropout_rate) if dp else 0


def token_digest(token: str) -> bytes:
    """SHA-256 of a bearer token: the only form in which the server stores it."""
    return hashlib.sha256(token.encode("utf-8")).digest()


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


@dataclass
class FinishJob:
    """The CPU-heavy end of a round, runnable in another thread: remove the masks, aggregate, encode.

    `run` touches only the round's session (which refuses every other change while it finishes),
    the round's generator and the current model state, which no one changes meanwhile (one round at a
    time).  Hand the job back with `RoundCoordinator.complete_finish` on the coordinator's own thread.
    """

    round_id: int
    _run: Callable[[], _Prepared]
    prepared: _Prepared | None = None

    def run(self) -> None:
        self.prepared = self._run()


@dataclass
class _Prepared:
    unmasked: bool  # the sum was revealed (the privacy ledger must be charged whatever happens next)
    survivors: int = 0
    state: Any = None
    payload: bytes = b""
    error: BaseException | None = None
    total: Any = None  # the dequantized sum (a rebase applies it to a newer head)
    sum_sha256: bytes | None = None  # SHA-256 of the unmasked ring sum, little-endian uint32


class RoundCoordinator:
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
        self._load_or_create_model(now)
        self.enrollment = Enrollment(config, storage)
        if self.enrollment.open:
            log.warning(
                "open registration: any client may register any number of devices (Sybils); set "
                "enrollment.authority_key or issue enrollment tokens for anything but local development"
            )
        self.ledger: PrivacyLedger | None = None
        self.mu = 0.0
        self.l2, self.l1 = sensitivity(self.quantization, self.vector_length)
        if config.privacy.enabled:
            saved = storage.load_ledger()
            self.ledger = (
                PrivacyLedger.from_dict(saved)
                if saved is not None
                else PrivacyLedger(epsilon_budget=config.privacy.epsilon, delta=config.privacy.delta)
            )
            if (self.ledger.epsilon_budget, self.ledger.delta) != (config.privacy.epsilon, config.privacy.delta):
                raise ConfigError(
                    f"privacy.epsilon/delta ({config.privacy.epsilon:g}, {config.privacy.delta:g}) differ from the "
                    f"ledger in {config.data_dir} ({self.ledger.epsilon_budget:g}, {self.ledger.delta:g}); a budget "
                    "cannot change during a run (start a new data_dir for a new run)"
                )
            self.mu = calibrate_mu(
                config.privacy.epsilon, config.privacy.delta, config.privacy.planned_rounds, self.l1, self.l2
            )
        self._check_bit_budget()
        self._pool: dict[int, float] = {}  # waiting device -> last check-in
        self._pool_since: dict[int, float] = {}  # waiting device -> first check-in of this wait
        self._round: _OpenRound | None = None
        self._finished: dict[int, RoundResult] = {}
        self._next_open = now
        self._rounds_run = 0
        self.stopped_reason = ""
        #: Observers of round events, called as ``listener(event, fields)`` (metrics, dashboards).
        #: Events: "round_opened" {round_id, cohort}; "phase" {round_id, phase, seconds, alive,
        #: dropped}; "round_finished" {round_id, outcome: "committed" | "aborted" | "abandoned",
        #: seconds, survivors, epsilon_spent, model_version, reason}.  A listener that raises is
        #: logged and otherwise ignored: observers never break a round.
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []

    # -- model --------------------------------------------------------------------------------------
    def _load_or_create_model(self, now: float) -> None:
        st = self.strategy
        loaded = self.storage.load_latest_model()
        if loaded is not None:
            version, payload = loaded
            msg = decode(payload, max_size=len(payload) + 1)
            held = (msg.model_kind, msg.bits, msg.n_items) if isinstance(msg, ModelPayload) else ("?", "?", "?")
            if held != (st.kind, st.rank, st.n_items):
                raise ConfigError(
                    f"the checkpoint in {self.config.data_dir} is a {held[0]!r} model with rank {held[1]}, "
                    f"m={held[2]}; the configuration says {st.kind!r}, rank {st.rank}, m={st.n_items} "
                    "(start a new data_dir for a different model)"
                )
            assert isinstance(msg, ModelPayload)
            levels = (msg.item_levels,) if msg.item_levels else ()  # LightFR's item term (protocol 1.3)
            state = st.from_wire(msg.words, msg.values, *levels)
            self._resume_strategy(version)
            # The DP flag travels in the stored payload (protocol 1.7), so it is back with the model.  A
            # checkpoint written before 1.7 holds none: a ledger that charged rounds says DP noise trained it.
            dp_trained = msg.dp_trained or (version > 1 and self._ledger_charged())
            # Served as this server would write it: the same bytes for a checkpoint of this configuration; a
            # pre-1.7 checkpoint, or one whose w0 the configuration no longer gives, gets the 1.7 fields now
            # rather than at the next commit.  The stored file is left as it is.
            served = self._payload(version, state, dp_trained=dp_trained)
            if served != payload:
                log.info("model version %d is served with this configuration's w0 and DP flag", version)
            self._set_model(version, state, served, dp_trained)
            log.info("resumed from model version %d", version)
            return
        rng = self._rng(0)
        state = st.initialize(rng)
        payload = self._payload(1, state, dp_trained=False)
        try:
            self.storage.commit_model(1, None, payload, now, base_version=None)
        except StorageError:
            # Another instance on the same database initialised it first: use theirs.
            head = self.storage.head_version()
            if head is None:
                raise
            payload = self.storage.load_model(head)
            state, dp_trained = self._decode_model(head, payload)
            self._set_model(head, state, payload, dp_trained)
            return
        self._set_model(1, state, payload, False)
        log.info("initialised %s model version 1 (rank %d, m=%d)", st.kind, st.rank, st.n_items)

    def _ledger_charged(self) -> bool:
        """Whether the stored privacy ledger charged any round (DP noise was released in this data_dir)."""
        ledger = self.storage.load_ledger()
        return bool(ledger and ledger.get("rounds"))

    def _decode_model(self, version: int, payload: bytes) -> tuple[NDArray[Any], bool]:
        """The state in ``payload`` (stored model ``version``) and its DP flag (`ModelPayload.dp_trained`)."""
        st = self.strategy
        msg = decode(payload, max_size=len(payload) + 1)
        if not isinstance(msg, ModelPayload) or (msg.model_kind, msg.bits, msg.n_items) != (
            st.kind,
            st.rank,
            st.n_items,
        ):
            raise ConfigError(f"model version {version} in the database is not a {st.kind!r} model of this shape")
        levels = (msg.item_levels,) if msg.item_levels else ()
        return st.from_wire(msg.words, msg.values, *levels), msg.dp_trained

    def _refresh_model(self) -> None:
        """Follow the head (another cohort may have committed): the next round trains the newest model."""
        head = self.storage.head_version()
        if head is None or head == self.model_version:
            return
        payload = self.storage.load_model(head)
        state, dp_trained = self._decode_model(head, payload)
        self._set_model(head, state, payload, dp_trained)
        self._resume_strategy(head)
        log.info("model version %d (committed by another cohort) is the head now", head)

    def _resume_strategy(self, version: int) -> None:
        """Give the strategy back what it stored with ``version`` (e.g. LightFR's density-derived w0),
        so the first round after a restart, or after another instance's commit, plans as the
        uninterrupted server would have.  Strategies without `restore_state` keep nothing."""
        restore = getattr(self.strategy, "restore_state", None)
        if callable(restore):
            restore(self.storage.strategy_state(version))

    def _refresh_ledger(self) -> None:
        if self.ledger is None:
            return
        saved = self.storage.load_ledger()
        if saved is not None:
            self.ledger = PrivacyLedger.from_dict(saved)

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

    def _payload(self, version: int, state: NDArray[Any], *, dp_trained: bool) -> bytes:
        """Model ``version`` as served and stored: the strategy's wire fields (LightFR's include the w0 and
        α its next plan carries, protocol 1.7) and ``dp_trained``, whether any round that led to it added
        DP noise."""
        st = self.strategy
        wire = {"words": b"", "values": b"", **st.to_wire(state)}
        return encode(
            ModelPayload(
                model_version=version,
                model_kind=st.kind,
                bits=st.rank,
                n_items=st.n_items,
                dp_trained=dp_trained,
                **wire,
            )
        )

    def _set_model(self, version: int, state: NDArray[Any], payload: bytes, dp_trained: bool) -> None:
        #: Sticky: set when a round with DP noise committed this model or one it was trained from.
        self.model_dp_trained = dp_trained
        self.model_version = version
        self.model_state = state
        self.model_bytes = payload
        self.model_sha256 = hashlib.sha256(payload).hexdigest()
        self.model_etag = f'"{version}-{self.model_sha256[:16]}"'

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
        n = self.config.rounds.cohort_size
        t_min = minimum_survivors(n, self.config.rounds.dropout_rate) if self.mu else 1
        # Before correction every device carries μ/t_min, so n of them carry n·μ/t_min.
        check_bit_budget(n, self.quantization, self.vector_length, n * self.mu / t_min)

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
        """Create a device identity; the token is returned once and stored only as its SHA-256.

        The registration's enrollment credential is checked first, then the credential source's rate
        (``peer`` keys the rate of open registrations); the certificate's identity key or the one-time
        token is consumed with the new device in one transaction.

        Raises
        ------
        EnrollmentRefused
            Missing, forged, foreign or reused credential (`agg_server.enrollment.Enrollment.check`).
        RateLimited
            The credential source registers faster than ``enrollment.registrations_per_second``.
        """
        credential = self.enrollment.check(certificate=certificate, proof=proof, token=enrollment_token, peer=peer)
        self.enrollment.admit(credential, now)
        token = secrets.token_urlsafe(32)
        device_id = self.storage.add_device(
            token_digest(token),
            platform,
            now,
            source=credential.source,
            identity_key=credential.identity_key,
            enrollment_token_sha256=credential.token_sha256,
        )
        self.enrollment.remember(device_id, credential.source)
        return RegisterResponse(device_id=device_id, token=token)

    def authenticate(self, token: str | None) -> int:
        """The device a bearer token belongs to.

        Raises
        ------
        AuthError
            Missing or unknown token.
        EnrollmentRefused
            (403) The token's device is revoked: its certified key is on the revocation list in force.
        """
        if not token:
            raise AuthError("missing bearer token")
        device = self.storage.device_for_token(token_digest(token))
        if device is None:
            raise AuthError("unknown bearer token")
        self._refuse_revoked(device, "its bearer token is refused on every route")
        return device

    def _refuse_revoked(self, device_id: int, consequence: str) -> None:
        if device_id in self.enrollment.revoked_devices():
            crl = self.enrollment.revocation_list
            number = f" #{crl.number}" if crl is not None else ""
            raise EnrollmentRefused(
                f"revocation check: device {device_id}'s certified key is on the enrollment authority's "
                f"revocation list{number}; {consequence}"
            )

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
        self._refuse_revoked(device_id, "it takes part in no round")
        r = self._round
        if r is not None and device_id in r.session.invited:
            # The invitation is handed out while the round collects keys and the device has sent
            # none: a device whose answer was lost (a timeout, a failover to another instance) gets
            # the same invitation again.  It cannot take part twice: the session accepts one key
            # advertisement per device, and the device charges its ledger only when its masked
            # input leaves.
            if r.session.phase is Phase.ADVERTISE_KEYS and device_id in r.session.expected():
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
            return
        oldest = min(self._pool_since[d] for d in fresh)
        if len(fresh) < cfg.cohort_size and now - oldest < 5 * self.retry_after:
            return  # give the pool a moment to fill
        if self.leased:
            self._refresh_model()
        self._refresh_ledger()
        if self.ledger is not None:
            try:
                self.ledger.check_round(self.mu, self.l1, self.l2)
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
        cohort, k, t, t_min = shape
        timeouts = (
            cfg.advertise_timeout,
            cfg.share_keys_timeout,
            cfg.masked_input_timeout,
            cfg.unmask_timeout,
        )
        d0, d1, d2, d3 = (now + t for t in itertools.accumulate(timeouts))
        deadlines = (d0, d1, d2, d3)
        params = RoundParameters(
            round_id=round_id,
            vector_length=self.vector_length,
            k=k,
            t=t,
            clip_norm=float(self.quantization.clip_norm),
            scale_bits=self.quantization.scale_bits,
            dp_mu=float(self.mu),
            dp_t_min=t_min,
            deadlines=deadlines,
            authority_key=self.enrollment.authority,
        )
        session = ServerSecAggSession(params, cohort, rng=rng, defer_finish=self.defer_finish)
        plan = round_plan(
            self.strategy, self.model_version, example_cap=cfg.example_cap, clip_norm=self.quantization.clip_norm
        )
        reserved: list[PrivacyLedger] = []

        def reserve(stored: dict[str, Any] | None) -> dict[str, Any]:
            # Inside start_round's transaction, under the rounds lock: the ledger every instance shares.
            assert self.ledger is not None
            ledger = (
                PrivacyLedger.from_dict(stored)
                if stored is not None
                else PrivacyLedger(epsilon_budget=self.ledger.epsilon_budget, delta=self.ledger.delta)
            )
            ledger.record_round(self.mu, self.l1, self.l2, round_id=round_id)
            reserved.append(ledger)
            return ledger.to_dict()

        try:
            self.storage.start_round(
                round_id,
                self.model_version,
                cohort,
                {"k": k, "t": t, "mu": self.mu, "t_min": t_min, "deadlines": list(deadlines), **plan.record()},
                now,
                fence=self.fence,
                reserve=reserve if self.ledger is not None else None,
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
        if reserved:
            self.ledger = reserved[-1]
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

    # -- presence: phases close as soon as every device still there has answered ---------------------
    def poll_started(self, device_id: int, round_id: int) -> None:
        """A device's long-poll on ``round_id`` is open (it is connected and waiting for the next phase)."""
        r = self._round
        if r is None or r.round_id != round_id:
            return
        r.polling[device_id] = r.polling.get(device_id, 0) + 1
        r.gone.pop(device_id, None)

    def poll_ended(self, device_id: int, round_id: int, now: float, *, answered: bool) -> None:
        """A device's long-poll ended: ``answered`` (it got its next message) or not (its connection
        closed first).  A device whose connection is gone and that does not come back within
        ``rounds.disconnect_grace`` seconds is dropped from the phase (`tick`)."""
        r = self._round
        if r is None or r.round_id != round_id:
            return
        left = r.polling.get(device_id, 0) - 1
        if left > 0:
            r.polling[device_id] = left
            return
        r.polling.pop(device_id, None)
        if not answered:
            r.gone[device_id] = now

    def _leave(self, r: _OpenRound, device_id: int, reason: str, now: float) -> None:
        """Drop a device that is evidently no longer taking part from the open phase (as if it had sent
        `Abort`), so the phase closes once everyone else has answered."""
        r.gone.pop(device_id, None)
        if r.finishing or r.session.phase not in ACTIVE_PHASES or device_id not in r.session.expected():
            return
        log.info("round %d: device %d dropped from %s: %s", r.round_id, device_id, r.session.phase.value, reason)
        try:
            r.session.receive(device_id, Abort(round_id=r.round_id, device_id=device_id, reason=reason))
        except RoundClosed:
            pass  # it had left already
        except FedRecError:
            log.exception("round %d: could not drop device %d", r.round_id, device_id)
        finally:
            self._after_change(now)

    def _drop_gone(self, r: _OpenRound, now: float) -> None:
        # A device gone while nothing is awaited from it (it had uploaded for this phase) stays listed
        # until the next phase awaits it.
        grace = self.config.rounds.disconnect_grace
        late = [(d, since) for d, since in r.gone.items() if now - since >= grace]
        if not late:
            return
        expected = r.session.expected()
        for device_id, since in late:
            if self._round is not r or r.finishing:
                return
            if device_id in expected:
                self._leave(r, device_id, f"connection gone for {now - since:.1f} s", now)

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
        phase = PHASE_OF_MESSAGE.get(type(message))
        if isinstance(message, Abort):
            phase = r.session.phase
        elif phase is None:
            raise RemoteProtocolError(f"{type(message).__name__} is not a round upload")
        try:
            r.session.receive(device_id, message, digest=digest)
            if isinstance(message, MaskedInput) and message.bad_share_senders:
                # issue 15 item 5: the reported devices are out of the round (the session excluded them)
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
        r = self._round
        if r is not None and not r.finishing:
            try:
                r.session.advance(now)
            finally:
                self._after_change(now)
            if self._round is r and r.gone:
                self._drop_gone(r, now)
        self._maybe_open(now)

    def _after_change(self, now: float) -> None:
        r = self._round
        if r is None:
            return
        if r.finishing:
            return
        phase = r.session.phase
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
            self._job = FinishJob(round_id=r.round_id, _run=lambda: self._prepare(r))
            log.info("round %d: UNMASK closed, finishing", r.round_id)
        elif phase in (Phase.DONE, Phase.ABORTED, Phase.ERROR):
            self._finish(r, now)

    # -- finishing a round off the caller's loop --------------------------------------------------------
    def take_finish_job(self) -> FinishJob | None:
        """The job that finishes the open round, once (None when there is none)."""
        job, self._job = self._job, None
        return job

    def _prepare(self, r: _OpenRound) -> _Prepared:
        """Unmask, aggregate and encode (thread-safe as `FinishJob` explains)."""
        try:
            r.session.finish()
        except Exception as exc:
            return _Prepared(unmasked=False, error=exc)
        if r.session.phase is not Phase.DONE:
            return _Prepared(unmasked=False)
        return self._prepare_done(r)

    def complete_finish(self, job: FinishJob, now: float) -> None:
        """Commit (or abort) the round whose `FinishJob` ran: charge the ledger, store the model."""
        r = self._round
        if r is None or r.round_id != job.round_id or not r.finishing:
            raise LocalProtocolError(f"round {job.round_id} is not finishing")
        prepared = job.prepared if job.prepared is not None else _Prepared(unmasked=False, error=None)
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
                },
            )
            r.phase_started = now
        r.phase = phase

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        for listener in list(self.listeners):
            try:
                listener(event, fields)
            except Exception:
                log.exception("round-event listener %r failed on %s", listener, event)

    def _finish(self, r: _OpenRound, now: float, prepared: _Prepared | None = None) -> None:
        # Whatever fails below, the round is released exactly once: a failed commit must neither be
        # retried on the next tick (it would charge the privacy ledger again) nor wedge the server.
        session = r.session
        reason = str(session.abort_error or f"round failed ({session.phase.name})")
        outcome = RoundResult(round_id=r.round_id, committed=False, model_version=self.model_version, reason=reason)
        try:
            if prepared is not None and prepared.unmasked:
                outcome = self._commit(r, now, prepared)
            elif prepared is None and session.phase is Phase.DONE:
                outcome = self._commit(r, now, self._prepare_done(r))
            else:
                log.warning("round %d aborted: %s", r.round_id, reason)
                self.storage.finish_round(r.round_id, "aborted", reason=reason, now=now, fence=self.fence)
        except Exception:
            log.exception("round %d could not be finished cleanly", r.round_id)
        finally:
            self._finished[r.round_id] = outcome
            with contextlib.suppress(Exception):
                self._refresh_ledger()  # a reservation may have been given back
            self._emit_finished(
                r, now, "committed" if outcome.committed else "aborted", outcome.model_version, outcome.reason
            )
            while len(self._finished) > _KEEP_FINISHED:
                self._finished.pop(next(iter(self._finished)))
            self._round = None
            self._next_open = now + self.config.rounds.round_interval

    def _emit_finished(self, r: _OpenRound, now: float, outcome: str, version: int, reason: str) -> None:
        self._emit(
            "round_finished",
            {
                "round_id": r.round_id,
                "outcome": outcome,
                "seconds": now - r.started,
                "survivors": len(r.alive),
                "epsilon_spent": self.ledger.spent() if self.ledger is not None else None,
                "model_version": version,
                "reason": reason,
            },
        )

    def _prepare_done(self, r: _OpenRound) -> _Prepared:
        # Aggregate the unmasked sum onto the round's base model (in the finishing thread, or inline in
        # the caller's call without defer_finish).
        try:
            result = r.session.result()
            survivors = len(result.survivors)
            digest = hashlib.sha256(np.asarray(result.total, dtype="<u4").tobytes()).digest()
            total = dequantize_sum(result.total, self.quantization)
            state = self.strategy.aggregate(self.model_state, total, survivors, r.rng, round_index=r.plan.round_index)
            payload = self._payload(self.model_version + 1, state, dp_trained=self.model_dp_trained or r.mu > 0)
        except Exception as exc:
            return _Prepared(unmasked=True, error=exc)
        return _Prepared(
            unmasked=True, survivors=survivors, state=state, payload=payload, total=total, sum_sha256=digest
        )

    def _commit(self, r: _OpenRound, now: float, prepared: _Prepared) -> RoundResult:
        # The round's ε was reserved when it opened and it is marked revealed: the ledger stays charged
        # whatever happens below.
        self._refresh_ledger()
        epsilon = self.ledger.spent() if self.ledger is not None else None
        if prepared.error is not None:
            log.error("round %d: aggregation failed after unmasking: %s", r.round_id, prepared.error)
            self.storage.finish_round(
                r.round_id, "aborted", reason=f"aggregation failed: {prepared.error}", now=now, fence=self.fence
            )
            return RoundResult(
                round_id=r.round_id, committed=False, model_version=self.model_version, reason="aggregation failed"
            )
        survivors, state, payload = prepared.survivors, prepared.state, prepared.payload
        base, rebased = self.model_version, 0
        update: dict[str, Any] = {"survivors": survivors, "epsilon_spent": epsilon, "sum_sha256": prepared.sum_sha256}
        carry = getattr(self.strategy, "carry_state", None)
        if callable(carry):
            update["strategy_state"] = carry()
        while True:
            try:
                self.storage.commit_model(
                    base + 1, r.round_id, payload, now, round_update=update, fence=self.fence, base_version=base
                )
                break
            except HeadMoved as moved:
                # Another cohort committed first: apply this round's sum to the newest head and try again.
                rebased += 1
                error: Exception | None = None
                if rebased <= _REBASES and prepared.total is not None:
                    try:
                        head_bytes = self.storage.load_model(moved.head)
                        head_state, head_dp = self._decode_model(moved.head, head_bytes)
                        state = self.strategy.aggregate(
                            head_state, prepared.total, survivors, r.rng, round_index=r.plan.round_index
                        )
                        payload = self._payload(moved.head + 1, state, dp_trained=head_dp or r.mu > 0)
                        base = moved.head
                        self._set_model(moved.head, head_state, head_bytes, head_dp)
                        continue
                    except Exception as exc:
                        error = exc
                reason = f"commit failed after {rebased} rebases: {error or moved}"
                log.error("round %d: %s", r.round_id, reason)
                self.storage.finish_round(r.round_id, "aborted", reason=reason, now=now, fence=self.fence)
                return RoundResult(
                    round_id=r.round_id, committed=False, model_version=self.model_version, reason=reason
                )
            except LeaseLost as exc:
                log.error("round %d: not committed, the cohort's lease is lost: %s", r.round_id, exc)
                return RoundResult(
                    round_id=r.round_id, committed=False, model_version=self.model_version, reason=str(exc)
                )
            except StorageError as exc:
                log.error("round %d: could not commit model version %d: %s", r.round_id, base + 1, exc)
                self.storage.finish_round(
                    r.round_id, "aborted", reason=f"commit failed: {exc}", now=now, fence=self.fence
                )
                return RoundResult(
                    round_id=r.round_id, committed=False, model_version=self.model_version, reason=str(exc)
                )
        if rebased:
            log.info("round %d: sum applied to model version %d (rebased %d times)", r.round_id, base, rebased)
        version = base + 1
        change = self.strategy.describe(self.model_state, state)
        self._set_model(version, state, payload, self.model_dp_trained or r.mu > 0)
        log.info(
            "round %d committed model version %d: %d survivors, %s%s",
            r.round_id,
            version,
            survivors,
            change,
            f", epsilon spent {epsilon:.4g}" if epsilon is not None else "",
        )
        return RoundResult(round_id=r.round_id, committed=True, model_version=version)

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

    def status(self, now: float) -> dict[str, Any]:
        """A JSON-able snapshot for `/v1/status` and the dashboard."""
        r = self._round
        current = None
        if r is not None:
            current = {
                "round_id": r.round_id,
                "phase": "finishing" if r.finishing else r.session.phase.value,
                "cohort": len(r.cohort),
                "alive": len(r.alive),
                "awaiting": len(r.session.expected()) if r.session.phase in ACTIVE_PHASES and not r.finishing else 0,
                "seconds": round(now - r.started, 3),
                "dropouts": {p.value: len(v) for p, v in r.session.dropouts.items()},
            }
        privacy = None
        if self.ledger is not None:
            privacy = {
                "epsilon_spent": self.ledger.spent(),
                "epsilon_budget": self.ledger.epsilon_budget,
                "delta": self.ledger.delta,
                "mu": self.mu,
                "rounds_charged": len(self.ledger.rounds),
            }
        return {
            "model": {
                "version": self.model_version,
                "kind": self.strategy.kind,
                "bits": self.strategy.rank,
                "n_items": self.strategy.n_items,
                "sha256": self.model_sha256,  # of the served ModelPayload: tells two runs' models apart
            },
            "round": current,
            "waiting_devices": len(self._pool),
            "registered_devices": self.storage.device_count(),
            "rounds": self.storage.round_counts(),
            "recent_rounds": [
                {**rec, "phases": _records(self.storage.phase_stats(rec["round_id"]))}
                for rec in _records(self.storage.recent_rounds(10))
            ],
            "process": _process_stats(),
            "privacy": privacy,
            "stopped": self.stopped_reason or None,
            "abandoned_at_start": list(self.abandoned),
        }


def _process_stats() -> dict[str, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    # ru_maxrss is in kilobytes on Linux.
    return {"cpu_seconds": usage.ru_utime + usage.ru_stime, "max_rss_mb": usage.ru_maxrss / 1024.0}


def _records(records: Any) -> list[dict[str, Any]]:
    out = []
    for rec in records:
        d = dataclasses.asdict(rec) if dataclasses.is_dataclass(rec) and not isinstance(rec, type) else dict(rec)
        out.append({k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in d.items()})
    return out
