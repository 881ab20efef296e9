"""Taking part in one round: check-in, training, the SecAgg+ phases and every way out of a round (docs/design.md
§4, §7).  The round-driving part of `DeviceClient`; its invariants are stated in `device_sdk.client`."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
from numpy.typing import NDArray

from device_sdk.client_core import message_name
from device_sdk.enrollment import EnrollmentMixin
from device_sdk.model_sync import ModelSyncMixin
from device_sdk.outcome import RoundOutcome, RoundStatus, Tally
from device_sdk.persistence import save_ledger
from device_sdk.training import local_round
from device_sdk.transport import LeftRound, TransportError
from protocol.device_session import DeviceSecAggSession
from protocol.errors import (
    FedRecError,
    LocalProtocolError,
    PrivacyFloorViolation,
    RemoteProtocolError,
    RoundError,
    StaleRound,
)
from protocol.messages import (
    Abort,
    CheckIn,
    ConsistencyRequest,
    MaskedInputRequest,
    Message,
    RoundInvite,
    RoundResult,
    ShareKeysBroadcast,
    UnmaskRequest,
    Wait,
)
from protocol.phases import ACTIVE_PHASES
from protocol.samplers import NoiseStream
from protocol.spec import MAX_TEXT

__all__ = ["RoundParticipation"]

_log = logging.getLogger("device_sdk.client")  # one logger for every line the client logs

# (step name = path segment, the answer expected unless the round ends)
_STEPS: tuple[tuple[str, type[Message]], ...] = (
    ("keys", ShareKeysBroadcast),
    ("shares", MaskedInputRequest),
    ("masked", UnmaskRequest),
    ("unmask", RoundResult),
)
#: Protocol 1.3: inserted after "masked" when the server answers with a `ConsistencyRequest`.
_CONSISTENCY_STEP: tuple[str, type[Message]] = ("consistency", UnmaskRequest)


class RoundParticipation(EnrollmentMixin, ModelSyncMixin):
    """`DeviceClient`'s round driver: one check-in and, when invited, one round."""

    async def _round(self, tally: Tally) -> RoundOutcome:
        identity = await self._ensure_identity(tally)
        try:
            if not self._server_model_checked:
                # A RoundError here (503: no instance leads this device's cohort now) ends the call as a
                # check-in's would; the next call tries again.
                with tally.step("model"):
                    await self._first_contact(tally)
            with tally.step("checkin"):
                checkin = CheckIn(device_id=identity.device_id, model_version=self._held_version() or 0)
                response = await self._call("POST", "/v1/checkin", checkin, tally, timeout=self.config.request_timeout)
        except RoundError as exc:
            return self._outcome(RoundStatus.ABORTED, None, tally, reason=str(exc))
        message = response.message
        if isinstance(message, Wait):
            return self._outcome(RoundStatus.WAITED, None, tally, retry_after=message.retry_after)
        if not isinstance(message, RoundInvite):
            raise RemoteProtocolError(f"check-in answered with {message_name(message)}, expected RoundInvite or Wait")
        if message.device_id != identity.device_id:
            raise RemoteProtocolError(f"invite addressed to device {message.device_id}")
        return await self._join(message, tally)

    async def _join(self, invite: RoundInvite, tally: Tally) -> RoundOutcome:
        rid = invite.round_id
        session: DeviceSecAggSession | None = None
        try:
            self._check_plan(invite)
            try:
                await self._sync_model(invite, tally)  # times a "model" step only when it downloads
            except StaleRound as exc:
                # Found out locally: tell the server, which would otherwise wait for us until the deadline.
                await self._leave(invite, str(exc))
                raise
            training_rng, noise_rng = self._rng_for_round(rid)
            signed = await self._signed_session_options(tally)
            try:
                session = DeviceSecAggSession(
                    invite, rng=noise_rng, policy=self.config.privacy, ledger=self._ledger, **signed
                )
            except PrivacyFloorViolation as exc:
                # Below this device's floor: sit the round out (before training), and say why.
                _log.warning("refusing round %d: %s", rid, exc)
                await self._leave(invite, f"refused: {exc}")
                return self._outcome(RoundStatus.REFUSED, rid, tally, reason=str(exc))
            # The session admitted the round id into the ledger's history: persisted before any key leaves,
            # so a restarted device still refuses a second session of this round.
            save_ledger(self.config.store_dir, self._ledger)
            with tally.step("train"):
                # Off the app's event loop: training is the device's long CPU step.
                update = await asyncio.to_thread(self._train, invite, training_rng, noise_rng)
            session.provide_input(update)
            del update  # the session holds the only copy until it is masked
            return await self._exchange(session, invite, tally)
        except LeftRound as exc:
            if exc.response is not None:
                tally.count(exc.response)
            return self._dropped(session, rid, tally, str(exc))
        except RoundError as exc:
            return self._outcome(RoundStatus.ABORTED, rid, tally, reason=str(exc))
        except Exception as exc:
            _forget(session)
            if not isinstance(exc, TransportError):
                await self._leave(invite, f"device error: {type(exc).__name__}: {exc}")
            raise
        finally:
            _forget(session)  # every exit, cancellation included, drops the session's secrets

    async def _exchange(self, session: DeviceSecAggSession, invite: RoundInvite, tally: Tally) -> RoundOutcome:
        """The SecAgg+ phases of a round whose session holds the update: keys, shares, masked (and the
        consistency check of protocol 1.3), unmask, until a `RoundResult` ends the round."""
        steps = list(_STEPS)
        while steps:
            name, answer_type = steps.pop(0)
            # On the loop (not in `asyncio.to_thread`): in a fleet, a masking job queued behind other
            # devices' training in the shared executor missed its phase (measured: MASKED_INPUT ran to
            # its 150 s deadline with 1,000 devices).
            outgoing = session.send()
            path = f"/v1/rounds/{invite.round_id}/{name}"
            if name == "shares":
                # The ledger's history now names this round's session id: persisted before any share leaves.
                save_ledger(self.config.store_dir, self._ledger)
            if name == "masked":
                self._charge(invite)  # the masked input may leave now: charge the device's own ledger first
            with tally.step(name):
                response = await self._call("POST", path, outgoing, tally, timeout=self.config.long_poll_timeout)
            # Sent: not kept through the next phase's wait (the masked input is 4 bytes per coordinate).
            del outgoing
            answer = response.message
            if isinstance(answer, RoundResult):
                return await self._finish(session, invite, answer, tally)
            if name == "masked" and isinstance(answer, ConsistencyRequest):
                # Protocol 1.3: sign the survivor set before the unmask request (§6.3).
                steps.insert(0, _CONSISTENCY_STEP)
                answer_type = ConsistencyRequest
            if not isinstance(answer, answer_type):
                raise RemoteProtocolError(
                    f"{name} answered with {message_name(answer)}, expected {answer_type.__name__}"
                )
            session.receive(answer)
        raise LocalProtocolError("the unmask phase must end with a RoundResult")  # pragma: no cover

    def _train(self, invite: RoundInvite, rng: np.random.Generator, coins: NoiseStream) -> NDArray[np.uint32]:
        """Local training and saving the trained model (runs in a worker thread; the session does not touch
        ``coins`` until the update is provided)."""
        update, _ = local_round(self._model, invite, self._data, None, rng, coins=coins)
        self._save_model()
        return update

    async def _finish(
        self, session: DeviceSecAggSession, invite: RoundInvite, result: RoundResult, tally: Tally
    ) -> RoundOutcome:
        if result.round_id != invite.round_id:
            raise StaleRound(f"result of round {result.round_id} while taking part in round {invite.round_id}")
        _forget(session)
        if not result.committed:
            return self._outcome(
                RoundStatus.ABORTED,
                invite.round_id,
                tally,
                model_version=result.model_version,
                reason=result.reason,
            )
        await asyncio.to_thread(self._save_model)  # off the loop: an atomic write with fsyncs
        _log.info("round %d committed; global model is now version %d", invite.round_id, result.model_version)
        return self._outcome(RoundStatus.COMMITTED, invite.round_id, tally, model_version=result.model_version)

    def _dropped(self, session: DeviceSecAggSession | None, rid: int, tally: Tally, reason: str) -> RoundOutcome:
        _forget(session)
        return self._outcome(RoundStatus.DROPPED, rid, tally, reason=reason)

    async def _leave(self, invite: RoundInvite, reason: str) -> None:
        # Best effort: tell the server this device leaves, so it need not wait for the deadline.
        if self._identity is None:  # pragma: no cover - a round needs an identity
            return
        abort = Abort(round_id=invite.round_id, device_id=invite.device_id, reason=reason[:MAX_TEXT])
        try:
            await self._transport.request(
                "POST",
                f"/v1/rounds/{invite.round_id}/abort",
                abort,
                token=self._identity.token,
                timeout=self.config.request_timeout,
            )
        except FedRecError as exc:
            _log.debug("could not tell the server this device left round %d: %s", invite.round_id, exc)

    def _charge(self, invite: RoundInvite) -> None:
        # Saved with or without DP: the ledger's session history now names the round's session id.
        self._ledger.charge(invite)
        save_ledger(self.config.store_dir, self._ledger)


def _forget(session: DeviceSecAggSession | None) -> None:
    # Finish the session locally so it drops its secrets and the plaintext input; nothing is sent.
    if session is not None and session.phase in ACTIVE_PHASES:
        session.abort("left the round")
