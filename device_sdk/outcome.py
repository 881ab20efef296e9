"""What one `DeviceClient.run_round` call did (`RoundOutcome`), and the tally it is built from."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum

from device_sdk.transport import Response

__all__ = ["RoundStatus", "RoundOutcome", "Tally"]


class RoundStatus(StrEnum):
    """How `DeviceClient.run_round` ended (equal to its string value)."""

    WAITED = "waited"
    COMMITTED = "committed"
    ABORTED = "aborted"
    DROPPED = "dropped"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    """What one `DeviceClient.run_round` call did.

    Attributes
    ----------
    status : RoundStatus
        "waited" (no round now), "committed", "aborted" (by the server, or the round closed/went
        stale) or "dropped" (fault injection).
    round_id : int or None
        The round joined, None when told to wait.
    model_version : int
        Global model version after the round (from the `RoundResult`), else the version the device
        holds.
    retry_after : float or None
        Seconds to wait before checking in again ("waited" only).
    timings : dict of str to float
        Seconds per step: "register", "checkin", "model" (only when the call asked the server for the model: its
        first contact, or a round of a model the device did not hold), "revocations" (protocol 1.5, pinned
        authority only), "train", "keys", "shares", "masked", "unmask" (the phase steps include the long-poll
        wait), and "total".
    bytes_up, bytes_down : int
        Encoded message bytes sent and received during the call, retries included.
    reason : str
        Why the round aborted or the device dropped.
    """

    status: RoundStatus
    round_id: int | None
    model_version: int
    retry_after: float | None
    timings: dict[str, float]
    bytes_up: int
    bytes_down: int
    reason: str = ""


@dataclass(slots=True)
class Tally:
    """Seconds per step and encoded bytes up and down of one client call (retries included)."""

    timings: dict[str, float] = field(default_factory=dict)
    bytes_up: int = 0
    bytes_down: int = 0

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start

    def count(self, response: Response) -> None:
        self.bytes_up += response.bytes_up
        self.bytes_down += response.bytes_down
