"""The global model one `RoundCoordinator` trains and serves, and the path that commits a round into it:
unmask the survivors' sum, aggregate it onto the model, and store the new version — without aiohttp, time
or global randomness.

Invariants:
- Every committed model is on disk (checkpoint + database row) before any device is told "committed":
  `GlobalModel.commit` returns the `RoundResult` only after `Storage.commit_model` returned.
- Several cohorts (docs/operations.md): a commit is a compare-and-set on the model version; a sum
  computed against version v whose commit finds a newer head h is applied to h (rebased) and committed
  as h + 1, at most `REBASES` times.
- `FinishJob.run` (another thread) touches only the round's session, which refuses every other change
  while it finishes, the round's generator and the current model, which no one changes meanwhile (one
  round at a time).  Everything else here runs on the coordinator's own thread.
- The model's DP flag (`ModelPayload.dp_trained`, protocol 1.7) is sticky: set once a round with DP noise
  committed this model or one it was trained from.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from agg_server.config import ServerConfig
from agg_server.ledger import ledger_charged
from agg_server.storage import HeadMoved, LeaseLost, Storage
from agg_server.strategy.base import Strategy
from protocol.codec import decode, encode
from protocol.errors import ConfigError, StorageError
from protocol.messages import ModelPayload, RoundResult
from protocol.phases import Phase
from protocol.plan import TrainingPlan
from protocol.quantization import QuantizationConfig, dequantize_sum
from protocol.session import ServerSecAggSession

__all__ = ["GlobalModel", "FinishJob", "Prepared", "FinishingRound", "REBASES"]

log = logging.getLogger("agg_server.coordinator")

REBASES = 16  # commit attempts of one round when other cohorts keep committing first


class FinishingRound(Protocol):
    """What the commit path reads of the coordinator's open round."""

    round_id: int
    session: ServerSecAggSession
    plan: TrainingPlan
    rng: np.random.Generator
    mu: float


@dataclass
class FinishJob:
    """The CPU-heavy end of a round, runnable in another thread: remove the masks, aggregate, encode.

    `run` touches only the round's session (which refuses every other change while it finishes),
    the round's generator and the current model state, which no one changes meanwhile (one round at a
    time).  Hand the job back with `RoundCoordinator.complete_finish` on the coordinator's own thread.
    """

    round_id: int
    _run: Callable[[], Prepared]
    prepared: Prepared | None = None

    def run(self) -> None:
        self.prepared = self._run()


@dataclass
class Prepared:
    unmasked: bool  # the sum was revealed (the privacy ledger must be charged whatever happens next)
    survivors: int = 0
    state: Any = None
    payload: bytes = b""
    error: BaseException | None = None
    total: Any = None  # the dequantized sum (a rebase applies it to a newer head)
    sum_sha256: bytes | None = None  # SHA-256 of the unmasked ring sum, little-endian uint32


class GlobalModel:
    """The newest model a coordinator trains and serves (``version``, ``state``, ``payload`` — the encoded
    `ModelPayload` as served — its ``sha256`` and HTTP ``etag``, and the sticky ``dp_trained`` flag), and
    the path that commits a round's sum into it.

    Parameters
    ----------
    config : the server configuration (``data_dir`` names the checkpoints in errors).
    storage : the opened storage (checkpoints, rounds).
    strategy : the round's aggregation strategy.
    quantization : the rounds' clipping and scale (dequantizes the unmasked sum).
    now : the caller's clock at start-up.
    rng : the generator of round r is ``rng(r)``; a new model is drawn from ``rng(0)``.

    Raises
    ------
    ConfigError
        The newest checkpoint holds another kind or shape of model than the configuration.
    """

    version: int
    state: NDArray[Any]
    payload: bytes
    sha256: str
    etag: str
    dp_trained: bool

    def __init__(
        self,
        config: ServerConfig,
        storage: Storage,
        strategy: Strategy,
        quantization: QuantizationConfig,
        *,
        now: float,
        rng: Callable[[int], np.random.Generator],
    ) -> None:
        self.config = config
        self.storage = storage
        self.strategy = strategy
        self.quantization = quantization
        self._load_or_create(now, rng)

    # -- loading -------------------------------------------------------------------------------------
    def _load_or_create(self, now: float, rng: Callable[[int], np.random.Generator]) -> None:
        # Resume from the newest intact checkpoint, or initialise and commit version 1.
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
            self.resume_strategy(version)
            # The DP flag travels in the stored payload (protocol 1.7), so it is back with the model.  A
            # checkpoint written before 1.7 holds none: a ledger that charged rounds says DP noise trained it.
            dp_trained = msg.dp_trained or (version > 1 and ledger_charged(self.storage))
            # Served as this server would write it: the same bytes for a checkpoint of this configuration; a
            # pre-1.7 checkpoint, or one whose w0 the configuration no longer gives, gets the 1.7 fields now
            # rather than at the next commit.  The stored file is left as it is.
            served = self.encode(version, state, dp_trained=dp_trained)
            if served != payload:
                log.info("model version %d is served with this configuration's w0 and DP flag", version)
            self.set(version, state, served, dp_trained)
            log.info("resumed from model version %d", version)
            return
        state = st.initialize(rng(0))
        payload = self.encode(1, state, dp_trained=False)
        try:
            self.storage.commit_model(1, None, payload, now, base_version=None)
        except StorageError:
            # Another instance on the same database initialised it first: use theirs.
            head = self.storage.head_version()
            if head is None:
                raise
            payload = self.storage.load_model(head)
            state, dp_trained = self.decode(head, payload)
            self.set(head, state, payload, dp_trained)
            return
        self.set(1, state, payload, False)
        log.info("initialised %s model version 1 (rank %d, m=%d)", st.kind, st.rank, st.n_items)

    def decode(self, version: int, payload: bytes) -> tuple[NDArray[Any], bool]:
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

    def refresh(self) -> None:
        """Follow the head (another cohort may have committed): the next round trains the newest model."""
        head = self.storage.head_version()
        if head is None or head == self.version:
            return
        payload = self.storage.load_model(head)
        state, dp_trained = self.decode(head, payload)
        self.set(head, state, payload, dp_trained)
        self.resume_strategy(head)
        self.storage.prune_checkpoint_files()  # that commit may have pruned rows of this instance's files
        log.info("model version %d (committed by another cohort) is the head now", head)

    def resume_strategy(self, version: int) -> None:
        """Give the strategy back what it stored with ``version`` (e.g. LightFR's density-derived w0),
        so the first round after a restart, or after another instance's commit, plans as the
        uninterrupted server would have.  Strategies without `restore_state` keep nothing."""
        restore = getattr(self.strategy, "restore_state", None)
        if callable(restore):
            restore(self.storage.strategy_state(version))

    def encode(self, version: int, state: NDArray[Any], *, dp_trained: bool) -> bytes:
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

    def set(self, version: int, state: NDArray[Any], payload: bytes, dp_trained: bool) -> None:
        """Make ``version`` the model trained and served from now on."""
        self.dp_trained = dp_trained
        self.version = version
        self.state = state
        self.payload = payload
        self.sha256 = hashlib.sha256(payload).hexdigest()
        self.etag = f'"{version}-{self.sha256[:16]}"'

    # -- committing a round --------------------------------------------------------------------------
    def prepare_finishing(self, r: FinishingRound) -> Prepared:
        """Unmask, aggregate and encode (thread-safe as `FinishJob` explains)."""
        try:
            r.session.finish()
        except Exception as exc:
            return Prepared(unmasked=False, error=exc)
        if r.session.phase is not Phase.DONE:
            return Prepared(unmasked=False)
        return self.prepare(r)

    def prepare(self, r: FinishingRound) -> Prepared:
        """Aggregate the unmasked sum onto the round's base model (in the finishing thread, or inline in
        the caller's call without ``defer_finish``)."""
        try:
            result = r.session.result()
            survivors = len(result.survivors)
            digest = hashlib.sha256(np.asarray(result.total, dtype="<u4").tobytes()).digest()
            total = dequantize_sum(result.total, self.quantization)
            state = self.strategy.aggregate(self.state, total, survivors, r.rng, round_index=r.plan.round_index)
            payload = self.encode(self.version + 1, state, dp_trained=self.dp_trained or r.mu > 0)
        except Exception as exc:
            return Prepared(unmasked=True, error=exc)
        return Prepared(
            unmasked=True, survivors=survivors, state=state, payload=payload, total=total, sum_sha256=digest
        )

    def commit(
        self,
        r: FinishingRound,
        now: float,
        prepared: Prepared,
        *,
        epsilon: float | None,
        fence: tuple[int, int] | None,
    ) -> RoundResult:
        """Store the round's new model (rebased onto a newer head if another cohort committed first) and
        close the round as committed, or as aborted when that fails; ``epsilon`` is the ledger's ε spent.

        Raises
        ------
        StorageError
            Closing the round as aborted failed (the caller logs it and releases the round).
        """
        if prepared.error is not None:
            log.error("round %d: aggregation failed after unmasking: %s", r.round_id, prepared.error)
            self.storage.finish_round(
                r.round_id, "aborted", reason=f"aggregation failed: {prepared.error}", now=now, fence=fence
            )
            return RoundResult(
                round_id=r.round_id, committed=False, model_version=self.version, reason="aggregation failed"
            )
        survivors, state, payload = prepared.survivors, prepared.state, prepared.payload
        base, rebased = self.version, 0
        update: dict[str, Any] = {"survivors": survivors, "epsilon_spent": epsilon, "sum_sha256": prepared.sum_sha256}
        carry = getattr(self.strategy, "carry_state", None)
        if callable(carry):
            update["strategy_state"] = carry()
        while True:
            try:
                self.storage.commit_model(
                    base + 1, r.round_id, payload, now, round_update=update, fence=fence, base_version=base
                )
                break
            except HeadMoved as moved:
                # Another cohort committed first: apply this round's sum to the newest head and try again.
                rebased += 1
                error: Exception | None = None
                if rebased <= REBASES and prepared.total is not None:
                    try:
                        head_bytes = self.storage.load_model(moved.head)
                        head_state, head_dp = self.decode(moved.head, head_bytes)
                        state = self.strategy.aggregate(
                            head_state, prepared.total, survivors, r.rng, round_index=r.plan.round_index
                        )
                        payload = self.encode(moved.head + 1, state, dp_trained=head_dp or r.mu > 0)
                        base = moved.head
                        self.set(moved.head, head_state, head_bytes, head_dp)
                        continue
                    except Exception as exc:
                        error = exc
                reason = f"commit failed after {rebased} rebases: {error or moved}"
                log.error("round %d: %s", r.round_id, reason)
                self.storage.finish_round(r.round_id, "aborted", reason=reason, now=now, fence=fence)
                return RoundResult(round_id=r.round_id, committed=False, model_version=self.version, reason=reason)
            except LeaseLost as exc:
                log.error("round %d: not committed, the cohort's lease is lost: %s", r.round_id, exc)
                return RoundResult(round_id=r.round_id, committed=False, model_version=self.version, reason=str(exc))
            except StorageError as exc:
                log.error("round %d: could not commit model version %d: %s", r.round_id, base + 1, exc)
                self.storage.finish_round(r.round_id, "aborted", reason=f"commit failed: {exc}", now=now, fence=fence)
                return RoundResult(round_id=r.round_id, committed=False, model_version=self.version, reason=str(exc))
        if rebased:
            log.info("round %d: sum applied to model version %d (rebased %d times)", r.round_id, base, rebased)
        version = base + 1
        change = self.strategy.describe(self.state, state)
        self.set(version, state, payload, self.dp_trained or r.mu > 0)
        log.info(
            "round %d committed model version %d: %d survivors, %s%s",
            r.round_id,
            version,
            survivors,
            change,
            f", epsilon spent {epsilon:.4g}" if epsilon is not None else "",
        )
        return RoundResult(round_id=r.round_id, committed=True, model_version=version)
