"""Report a model version's quality to the aggregation server (``POST /v1/admin/quality``).

The server never sees users' data, so it cannot evaluate its own model: an operator's evaluation job
(on a held-out set the operator owns, or aggregated from devices' own evaluations) measures a model
version and reports the figure here; the dashboard shows it beside the version.

Invariants:
- The admin token travels only in the ``Authorization`` header, over the URL given (use https
  outside loopback); it is never logged or put in an exception message.
- A refusal comes back as the `protocol.errors` class the server named (401 `AuthError`,
  403 `PermissionDenied`, 400 `RemoteProtocolError`/`DecodeError`), with the server's message.
"""

from __future__ import annotations

import json
import math
import ssl as ssl_module
from typing import Any

import aiohttp

from protocol.codec import decode
from protocol.errors import FedRecError, RemoteProtocolError
from protocol.messages import ErrorMessage

__all__ = ["report_quality"]


async def report_quality(
    server_url: str,
    admin_token: str,
    model_version: int,
    metric: str,
    value: float,
    dataset: str,
    *,
    session: aiohttp.ClientSession | None = None,
    ssl: ssl_module.SSLContext | None = None,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Send one quality figure of ``model_version`` to the server.

    Parameters
    ----------
    server_url : str
        Server root, e.g. ``https://fedrec.example.org:8443``.
    admin_token : str
        The operator's admin token (the server stores only its SHA-256 in ``server.admin_token_sha256``).
    model_version : int
        The version evaluated (1 … the server's current version).
    metric : str
        What was measured, e.g. "hr@10" (1–64 printable characters).
    value : float
        The figure (finite).
    dataset : str
        What it was measured on, e.g. "ml-100k leave-one-out, 99 negatives" (1–128 characters).
    session : aiohttp.ClientSession, optional
        A session to use (stays the caller's); by default one is made for this call.
    ssl : ssl.SSLContext, optional
        TLS context (e.g. one trusting the server's private CA) when this call makes its own session.
    timeout : float
        Seconds for the whole request.

    Returns
    -------
    dict
        The stored report as the server echoes it: ``model_version``, ``metric``, ``value``, ``dataset``.

    Raises
    ------
    ValueError
        ``value`` is not finite (checked before sending).
    FedRecError
        The server refused: the `protocol.errors` class it named, with its message.
    aiohttp.ClientError
        The server could not be reached.
    """
    if isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"value must be a finite number, got {value!r}")
    body = {"model_version": model_version, "metric": metric, "value": float(value), "dataset": dataset}
    headers = {"Authorization": f"Bearer {admin_token}"}
    url = server_url.rstrip("/") + "/v1/admin/quality"
    own = session is None
    client = session or aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl) if ssl is not None else None)
    try:
        async with client.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            raw = await resp.read()
            status = resp.status
            content_type = resp.content_type
    finally:
        if own:
            await client.close()
    if status == 201 and content_type == "application/json":
        answer: dict[str, Any] = json.loads(raw)
        return answer
    if content_type == "application/msgpack":
        try:
            msg = decode(raw)
        except FedRecError:
            msg = None
        if isinstance(msg, ErrorMessage):
            raise msg.to_exception()
    raise RemoteProtocolError(f"the server answered HTTP {status} ({content_type or 'no content type'})")
