# Invariants: this module is the seam between the device client and the network, and it imports no HTTP
# library (`import device_sdk.transport` never imports aiohttp).  A `Response` carries at most one decoded,
# validated message; an error body is turned into an exception exactly once, by `raise_for_error`, into
# the class the server raised.  Nothing here holds state.
"""Transport protocol of the device client: how one request reaches the server and what comes back."""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, Self

from protocol.errors import RemoteProtocolError
from protocol.messages import ErrorMessage, Message

__all__ = [
    "MSGPACK_CONTENT_TYPE",
    "AsyncClosing",
    "LeftRound",
    "Response",
    "Transport",
    "TransportError",
    "raise_for_error",
]

#: Content type of every request and response body of the `/v1` API (docs/http-api.md).
MSGPACK_CONTENT_TYPE = "application/msgpack"


class TransportError(RemoteProtocolError):
    """The server could not be reached, or kept failing, after every retry.

    A subclass of `RemoteProtocolError` for now; it keeps its parent's wire ``code`` on purpose: a code of
    its own would make `protocol.errors.error_class_for_code` depend on whether this module was imported.
    """


class LeftRound(Exception):  # noqa: N818 - a signal, not an error: the device left on purpose
    """Raised by a transport instead of sending a round's message: the device leaves the round there
    (the app was closed, the OS cut the connection).  `DeviceClient.run_round` then ends "dropped" with
    this reason and sends nothing more for the round; the transport has said whatever it wanted to the
    server (an `Abort`, or nothing: a vanished phone says nothing).  Load tests inject their dropouts
    this way (`fedsim.fleets.faults.FaultyTransport`).

    Attributes
    ----------
    response : Response or None
        The answer to a request that did leave before the device did (its bytes are counted).
    """

    def __init__(self, reason: str, response: Response | None = None) -> None:
        super().__init__(reason)
        self.response = response


@dataclass(frozen=True, slots=True)
class Response:
    """One answer from the server.

    Attributes
    ----------
    status : int
        HTTP status (or the equivalent of a fake transport).
    message : Message or None
        The decoded body; None only for a body-less answer (304 Not Modified).
    etag : str or None
        The ``ETag`` header, verbatim (quotes included), when present.
    retry_after : float or None
        The ``Retry-After`` header in seconds, when present and numeric.
    bytes_up, bytes_down : int
        Encoded body bytes sent and received for this request, every retry included.
    """

    status: int
    message: Message | None
    etag: str | None = None
    retry_after: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0


class Transport(Protocol):
    """What the device client needs from a connection to the aggregation server.

    Implementations: `device_sdk.http.HttpTransport` (aiohttp), and in-memory fakes in tests.  They
    retry transient failures themselves and raise only exceptions of the `protocol.errors` tree.
    """

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
        """Send one request and return the server's answer.

        Parameters
        ----------
        method : str
            HTTP method ("GET" or "POST").
        path : str
            Absolute path under the server's base URL, e.g. ``/v1/checkin``.
        message : Message, optional
            Request body, encoded with `protocol.codec.encode`.
        token : str, optional
            Bearer token of the device.
        if_none_match : str, optional
            An ETag; the server answers 304 with no body when its resource still has that tag.
        timeout : float
            Seconds to wait for the whole answer of one attempt (long-polls pass up to a phase deadline).

        Returns
        -------
        Response
            Error answers are returned too (with an `ErrorMessage`); see `raise_for_error`.

        Raises
        ------
        TransportError
            The server could not be reached after the configured retries.
        RemoteProtocolError
            The answer is not a fedrec message (e.g. an HTML error page); `DecodeError` when its body
            does not decode.
        """
        ...

    async def close(self) -> None:
        """Release connections; the transport must not be used afterwards."""
        ...


class AsyncClosing:
    """What the SDK's closable objects (`device_sdk.http.HttpTransport`, `device_sdk.client.DeviceClient`)
    share: ``async with x:`` returns ``x`` and awaits ``x.close()`` on the way out, whatever happened."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Release what the object holds; every subclass says what that is."""
        raise NotImplementedError


def raise_for_error(response: Response) -> Response:
    """Turn an error answer into the exception the server raised.

    Parameters
    ----------
    response : Response

    Returns
    -------
    Response
        ``response`` itself when it is not an error.

    Raises
    ------
    FedRecError
        The class named by the `ErrorMessage` body (e.g. `RoundClosed` for a 409 ``round_closed``).
    RemoteProtocolError
        A status of 400 or more without an `ErrorMessage` body.
    """
    message = response.message
    if isinstance(message, ErrorMessage):
        raise message.to_exception()
    if response.status >= 400:
        kind = type(message).__name__ if message is not None else "no body"
        raise RemoteProtocolError(f"HTTP {response.status} answered with {kind} instead of an ErrorMessage")
    return response
