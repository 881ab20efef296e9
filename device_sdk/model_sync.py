"""Downloading the server's model, checking its shape and adopting it: the model part of `DeviceClient`
(docs/design.md §4; the store invariants are in `device_sdk.client`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from device_sdk.client_core import ClientCore, message_name
from device_sdk.outcome import Tally
from device_sdk.persistence import Sync, fresh_model, load_model, save_model
from protocol.errors import ConfigError, RemoteProtocolError, StaleRound
from protocol.messages import ModelPayload, RoundInvite

__all__ = ["ModelSyncMixin"]

_log = logging.getLogger("device_sdk.client")  # one logger for every line the client logs


class ModelSyncMixin(ClientCore):
    """`DeviceClient`'s model: the first contact, the round's model, adoption and the model store file."""

    async def _first_contact(self, tally: Tally) -> None:
        """The server's model, before the first check-in: its shape checked, adopted when newer."""
        fetched = await self._fetch_model(tally)
        if fetched is not None:
            payload, etag = fetched
            await asyncio.to_thread(self._adopt, payload, etag)  # off the loop: unpacking, the item Gram
            await asyncio.to_thread(self._save_model)  # off the loop: an atomic write with fsyncs
            _log.info("adopted the server's model version %d", payload.model_version)
        self._server_model_checked = True

    async def _fetch_model(self, tally: Tally) -> tuple[ModelPayload, str | None] | None:
        """``GET /v1/model`` with the stored ETag: None when the server answers 304 (the model held is its
        current one), else the payload, whose shape has been checked against this device's, and its ETag."""
        held = self._held_version()
        etag = self._sync.etag if held is not None and self._sync is not None else None
        response = await self._call(
            "GET", "/v1/model", None, tally, timeout=self.config.request_timeout, if_none_match=etag
        )
        if response.status == 304:
            return None
        payload = response.message
        if not isinstance(payload, ModelPayload):
            raise RemoteProtocolError(f"model download answered with {message_name(payload)}")
        ours = (self._model.KIND, self._model.rank, self._n_items)
        if (payload.model_kind, payload.bits, payload.n_items) != ours:
            message = (
                f"the server's model is {_shape(payload.model_kind, payload.bits, payload.n_items)}; this device "
                f"runs {_shape(*ours)}: build the DeviceClient for the server's model (nothing was stored)"
            )
            _log.error("%s", message)
            raise ConfigError(message)
        return payload, response.etag

    def _adopt(self, payload: ModelPayload, etag: str | None) -> None:
        """Install the downloaded model (runs in a worker thread: at 10^6 items and 64 bits, measured 0.5 s to
        unpack and 0.4–0.8 s for the item Gram of the ranking refresh on the shared 2-core machine)."""
        try:
            self._model.set_global(payload.words, payload.values, payload.model_version, **payload.family_extras())
        except ValueError as exc:
            raise RemoteProtocolError(f"model {payload.model_version}: {exc}") from exc
        self._model.adopted(self._data)  # e.g. LightFR re-solves its ranking vectors against the new codes
        # Persisted after the model itself (`_save_model`), never before.
        self._sync = Sync(etag=etag, model_version=payload.model_version)

    def _check_plan(self, invite: RoundInvite) -> None:
        ours = (self._model.KIND, self._model.rank, self._n_items)
        if (invite.model_kind, invite.bits, invite.n_items) != ours:
            raise ConfigError(
                f"round {invite.round_id} trains {_shape(invite.model_kind, invite.bits, invite.n_items)}; "
                f"this device runs {_shape(*ours)}"
            )

    def _held_version(self) -> int | None:
        """Version of the global model stored on the device; None if its item codes are not global."""
        sync = self._sync
        if sync is None or sync.model_version != self._model.model_version:
            return None
        return sync.model_version

    async def _sync_model(self, invite: RoundInvite, tally: Tally) -> None:
        """The round's model: nothing to do when the device holds it (no "model" step is timed then, so a
        load test's model latencies are downloads only), else downloaded and adopted under the "model" step."""
        held = self._held_version()
        if held == invite.model_version:
            return
        with tally.step("model"):
            fetched = await self._fetch_model(tally)
            if fetched is None:
                # The server's current model is the one we hold; it must be the round's.
                raise StaleRound(
                    f"round {invite.round_id} trains model {invite.model_version}, the server serves {held}"
                )
            payload, etag = fetched
            if payload.model_version != invite.model_version:
                raise StaleRound(
                    f"round {invite.round_id} trains model {invite.model_version}, "
                    f"the server serves {payload.model_version}"
                )
            await asyncio.to_thread(self._adopt, payload, etag)  # off the loop: unpacking, the item Gram

    def _save_model(self) -> None:
        save_model(self.config.store_dir, self._model, self._sync)

    def _fresh_model(self) -> Any:
        self._sync = None  # a fresh model holds no global item codes
        return fresh_model(self._n_items, self._lightfr, self._template)

    def _load_model(self) -> Any:
        model = load_model(self.config.store_dir, self._n_items, self._lightfr, self._template)
        return self._fresh_model() if model is None else model


def _shape(kind: str, rank: int, n_items: int) -> str:
    # What a device must match: LightFR's rank is its code length (DeviceClient's ``bits``).
    return f"{kind!r} with {'bits' if kind == 'lightfr' else 'rank'} {rank} and n_items {n_items}"
