"""The state every part of `DeviceClient` shares, and the two steps they all use: one request (`_call`)
and one outcome (`_outcome`).

`DeviceClient` (`device_sdk.client`) builds this state; the round driver (`device_sdk.participation`), the
model sync (`device_sdk.model_sync`) and registration and revocation lists (`device_sdk.enrollment`) are
mixins over it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from device_sdk.family import FederatedModel, LocalRatings
from device_sdk.models import LightFRConfig
from device_sdk.outcome import RoundOutcome, RoundStatus, Tally
from device_sdk.persistence import Identity, StoredRevocations, Sync
from device_sdk.transport import Response, Transport, raise_for_error
from protocol.errors import LocalProtocolError
from protocol.identity import SigningKey
from protocol.messages import Message
from protocol.policy import DeviceLedger
from protocol.samplers import NoiseStream

if TYPE_CHECKING:
    from device_sdk.client import ClientConfig

__all__ = ["ClientCore", "RoundRngs", "message_name"]

#: ``rng_for_round(round_id) -> (training_rng, noise_stream)``.
RoundRngs = Callable[[int], tuple[np.random.Generator, NoiseStream]]


class ClientCore:
    """The attributes `DeviceClient.__init__` sets, and the request and outcome helpers."""

    config: ClientConfig
    _transport: Transport
    _owns_transport: bool
    _items: NDArray[np.int64]
    _ratings: NDArray[np.float64] | None
    _n_items: int
    _lightfr: LightFRConfig
    _template: FederatedModel | None
    _data: LocalRatings
    _rng_for_round: RoundRngs
    _lock: asyncio.Lock
    _identity: Identity | None
    _signing_key: SigningKey | None
    _sync: Sync | None
    _ledger: DeviceLedger
    _revocations: StoredRevocations | None
    _model: Any
    #: Whether this client has checked the server's model (`_first_contact`, at the first `run_round`).
    _server_model_checked: bool

    async def _call(
        self,
        method: str,
        path: str,
        message: Message | None,
        tally: Tally,
        *,
        timeout: float,
        if_none_match: str | None = None,
        authorized: bool = True,
    ) -> Response:
        token = None
        if authorized:
            if self._identity is None:  # pragma: no cover - every authorized call follows registration
                raise LocalProtocolError("not registered")
            token = self._identity.token
        response = await self._transport.request(
            method, path, message, token=token, if_none_match=if_none_match, timeout=timeout
        )
        tally.count(response)
        return raise_for_error(response)

    def _outcome(
        self,
        status: RoundStatus,
        round_id: int | None,
        tally: Tally,
        *,
        model_version: int | None = None,
        retry_after: float | None = None,
        reason: str = "",
    ) -> RoundOutcome:
        # `timings` is the tally's own dict: run_round adds "total" to it after this returns.
        return RoundOutcome(
            status=status,
            round_id=round_id,
            model_version=self._model.model_version if model_version is None else model_version,
            retry_after=retry_after,
            timings=tally.timings,
            bytes_up=tally.bytes_up,
            bytes_down=tally.bytes_down,
            reason=reason,
        )


def message_name(message: Message | None) -> str:
    """The type of an answer, for error messages ("no body" for none)."""
    return "no body" if message is None else type(message).__name__
