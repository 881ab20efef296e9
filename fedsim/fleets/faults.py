"""Fault injection for load tests and simulations: devices that leave a round at a chosen phase.

`FaultyTransport` wraps a device's real `device_sdk.transport.Transport`; the device code is unchanged.
When the schedule says a device leaves a round before a phase, the wrapper does not send that phase's
message and raises `device_sdk.transport.LeftRound`, which `DeviceClient.run_round` reports as
"dropped".  The in-process simulators (`fedsim.private.coordinator_rounds`, `fedsim.private.simulator`) take
the same `DropoutAt` schedule and apply it to their devices directly.

Invariants:
- The schedule is asked once per round, when the check-in answers with the invitation, and its answer
  kept: a device re-invited to a round it left drops the same way.
- ``BEFORE_*`` leaves silently (a vanished phone says nothing) unless ``announce`` is set, when the
  wrapper first sends the `Abort` an app closed cleanly would.  ``DISCONNECT_MASKED`` sends the masked
  input, then closes the connection before the answer arrives (after ``disconnect_after`` seconds):
  if the body had not left by then the device is a MASKED_INPUT dropout instead; the round must go on
  without it either way.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable
from enum import Enum

from device_sdk.transport import LeftRound, Response, Transport
from protocol.messages import Abort, ConsistencyRequest, Message, RoundInvite, RoundResult
from protocol.spec import MAX_TEXT

__all__ = ["DropoutAt", "FaultyTransport"]


class DropoutAt(Enum):
    """Where a device stops taking part in a round.

    ``BEFORE_*`` stop right before sending that phase's message.  ``DISCONNECT_MASKED`` sends the masked
    input, then closes the connection before the answer arrives.
    """

    NONE = "none"
    BEFORE_KEYS = "before_keys"
    BEFORE_SHARES = "before_shares"
    BEFORE_MASKED = "before_masked"
    BEFORE_UNMASK = "before_unmask"
    DISCONNECT_MASKED = "disconnect_masked"
    BEFORE_CONSISTENCY = "before_consistency"  # protocol 1.3: before signing the survivor set


# Where each dropout leaves.  BEFORE_KEYS stops at the keys request (the device trained); the others
# leave once the device has the answer the next send would follow in hand, so it never reaches that
# send — nor, before the masked input, the charge of its own privacy ledger that precedes it.
# BEFORE_CONSISTENCY (protocol 1.3: before signing the survivor set) is the point right after the masked
# input's answer; in a round without the consistency check that is right before unmask.
_LEAVES_ON_ANSWER_TO = {
    DropoutAt.BEFORE_SHARES: ("keys",),
    DropoutAt.BEFORE_MASKED: ("shares",),
    DropoutAt.BEFORE_CONSISTENCY: ("masked",),
    DropoutAt.BEFORE_UNMASK: ("masked", "consistency"),
}
_PHASE_ROUTE = re.compile(r"^/v1/rounds/(\d+)/(keys|shares|masked|consistency|unmask)$")


class FaultyTransport:
    """A `Transport` that makes its device leave rounds as ``dropout`` says.

    Parameters
    ----------
    inner : the device's real transport (HTTP, or in memory).
    dropout : one `DropoutAt` for every round, or ``dropout(round_id) -> DropoutAt``.
    announce : with a ``BEFORE_*`` dropout, send an `Abort` first ("left before <phase>").
    disconnect_after : seconds the masked-input request of ``DISCONNECT_MASKED`` may run before the
        connection is closed (> 0).
    """

    def __init__(
        self,
        inner: Transport,
        dropout: DropoutAt | Callable[[int], DropoutAt] = DropoutAt.NONE,
        *,
        announce: bool = False,
        disconnect_after: float = 0.05,
    ) -> None:
        if not (isinstance(disconnect_after, int | float) and math.isfinite(disconnect_after) and disconnect_after > 0):
            raise ValueError(f"disconnect_after must be a positive number of seconds, got {disconnect_after!r}")
        if announce and dropout is DropoutAt.DISCONNECT_MASKED:
            raise ValueError("a broken connection says nothing: DISCONNECT_MASKED cannot be announced")
        self.inner = inner
        self.announce = announce
        self.disconnect_after = float(disconnect_after)
        self._dropout = dropout
        self._decided: dict[int, DropoutAt] = {}
        #: The last round invitation this device received (read by a fleet's seeded generators).
        self.last_invite: RoundInvite | None = None

    def dropout_of(self, round_id: int) -> DropoutAt:
        """Where this device leaves round ``round_id`` (decided once per round)."""
        if round_id not in self._decided:
            d = self._dropout(round_id) if callable(self._dropout) else self._dropout
            if not isinstance(d, DropoutAt):
                raise TypeError(f"the dropout schedule returned {d!r}, not a DropoutAt")
            self._decided[round_id] = d
        return self._decided[round_id]

    async def request(
        self,
        method: str,
        path: str,
        message: Message | None = None,
        *,
        token: str | None = None,
        if_none_match: str | None = None,
        timeout: float = 30.0,
    ) -> Response:
        route = _PHASE_ROUTE.match(path) if method == "POST" else None
        if route is not None:
            round_id, phase = int(route.group(1)), route.group(2)
            drop = self.dropout_of(round_id)
            if drop is DropoutAt.BEFORE_KEYS and phase == "keys":
                await self._leave(round_id, message, phase, token)
                raise LeftRound(f"fault injection: {drop.value}")
            if phase == "masked" and drop is DropoutAt.DISCONNECT_MASKED:
                answer = await self._send_and_disconnect(path, message, token, timeout)
                raise LeftRound(
                    "fault injection: disconnect_masked (closed the connection after the masked input)", answer
                )
        response = await self.inner.request(
            method, path, message, token=token, if_none_match=if_none_match, timeout=timeout
        )
        if path == "/v1/checkin" and isinstance(response.message, RoundInvite):
            self.last_invite = response.message
            self.dropout_of(response.message.round_id)  # decided once the invitation arrived
        if route is not None and phase in _LEAVES_ON_ANSWER_TO.get(drop, ()):
            ends = response.status >= 400 or isinstance(response.message, RoundResult)
            consistency = isinstance(response.message, ConsistencyRequest)
            if not ends and not (drop is DropoutAt.BEFORE_UNMASK and consistency):
                upcoming = {"keys": "shares", "shares": "masked"}.get(phase) or (
                    "consistency" if consistency else "unmask"
                )
                await self._leave(round_id, message, upcoming, token)
                raise LeftRound(f"fault injection: {drop.value}", response)
        return response

    async def close(self) -> None:
        await self.inner.close()

    async def _leave(self, round_id: int, message: Message | None, phase: str, token: str | None) -> None:
        # Announced: best effort, as `DeviceClient` itself leaves (the server only waits longer if lost).
        if not self.announce or message is None:
            return
        device_id = int(getattr(message, "device_id", 0))
        reason = f"left before {phase}"
        abort = Abort(round_id=round_id, device_id=device_id, reason=reason[:MAX_TEXT])
        try:
            await self.inner.request("POST", f"/v1/rounds/{round_id}/abort", abort, token=token, timeout=5.0)
        except Exception:  # noqa: BLE001 - the device leaves either way
            pass

    async def _send_and_disconnect(
        self, path: str, message: Message | None, token: str | None, timeout: float
    ) -> Response | None:
        # The request runs as a task; after `disconnect_after` it is cancelled, which closes its connection.
        task = asyncio.ensure_future(self.inner.request("POST", path, message, token=token, timeout=timeout))
        done, _ = await asyncio.wait({task}, timeout=self.disconnect_after)
        if task in done:
            return task.result() if task.exception() is None else None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
