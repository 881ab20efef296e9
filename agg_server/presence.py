"""Which devices of the open round are still there: the part of `agg_server.coordinator.RoundCoordinator`
that lets a phase close as soon as every device still taking part has answered (`Presence`).

Invariants:
- A device is there while a phase request of it is open (its body arriving, or its long-poll waiting), or
  while its connection has been gone for less than ``rounds.disconnect_grace`` seconds; after that, a
  device still awaited is dropped from the phase.
- A device that left while nothing was awaited from it (its long-poll broke, or it checked in again,
  after its upload for the phase) is remembered and dropped as soon as a later phase awaits it: a
  held check-in must not hide it until the hold ends.
- A device whose invitation reached it (the answer left on a connection still open) and that checks in
  again before sending its keys has left the round (`RoundCoordinator.check_in`); an invitation whose
  answer was lost is handed out again.  A device that only trains, without a word and without a
  connection, cannot be told from a slow one: it is waited for until the phase's deadline.
- Nothing here reads a clock: ``now`` is passed in, as everywhere in the coordinator.
"""

from __future__ import annotations

from typing import Any, Protocol

from protocol.session import ServerSecAggSession

__all__ = ["Presence"]


class _RoundView(Protocol):
    round_id: int
    session: ServerSecAggSession
    finishing: bool
    handed_out: set[int]
    delivered: set[int]
    polling: dict[int, int]
    gone: dict[int, float]
    departed: dict[int, str]


class Presence:
    """Long-polls, broken connections and delivered invitations of the open round (a mixin of the
    coordinator, which provides ``_round``, ``config`` and ``_leave``)."""

    _round: Any
    config: Any

    def _leave(self, r: Any, device_id: int, reason: str, now: float) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _open_round_of(self, round_id: int) -> _RoundView | None:
        r: _RoundView | None = self._round
        return r if r is not None and r.round_id == round_id else None

    def poll_started(self, device_id: int, round_id: int) -> None:
        """A device's phase request on ``round_id`` is open: its body is arriving, or it waits for the next
        phase (a long-poll); either way it is connected."""
        r = self._open_round_of(round_id)
        if r is None:
            return
        r.polling[device_id] = r.polling.get(device_id, 0) + 1
        r.gone.pop(device_id, None)

    def invitation_delivered(self, device_id: int, round_id: int) -> None:
        """The answer carrying the invitation to ``round_id`` left on a connection that was still open: a
        later check-in of this device in ADVERTISE_KEYS means it left (one whose answer was lost, and that
        is not marked, gets the same invitation again)."""
        r = self._open_round_of(round_id)
        if r is not None and device_id in r.handed_out:
            r.delivered.add(device_id)

    def poll_ended(self, device_id: int, round_id: int, now: float, *, answered: bool) -> None:
        """A device's phase request ended: ``answered`` (it got its next message) or not (its connection
        closed first, maybe before its body had arrived).  A device whose connection is gone and that does
        not come back within ``rounds.disconnect_grace`` seconds is dropped from the phase (`_drop_gone`,
        on each tick)."""
        r = self._open_round_of(round_id)
        if r is None:
            return
        left = r.polling.get(device_id, 0) - 1
        if left > 0:
            r.polling[device_id] = left
            return
        r.polling.pop(device_id, None)
        if not answered:
            r.gone[device_id] = now

    def _drop_gone(self, r: _RoundView, now: float) -> None:
        # A device gone, or departed (it checked in again), while nothing is awaited from it (it had
        # uploaded for this phase) stays listed until the next phase awaits it.
        grace = self.config.rounds.disconnect_grace
        late = [(d, f"connection gone for {now - since:.1f} s") for d, since in r.gone.items() if now - since >= grace]
        late += list(r.departed.items())
        if not late:
            return
        expected = r.session.expected()
        for device_id, reason in late:
            if self._round is not r or r.finishing:
                return
            if device_id in expected:
                self._leave(r, device_id, reason, now)
