"""Registration, the device's identity key and the enrollment authority's revocation lists: the part of
`DeviceClient` that deals with the enrollment authority (protocol 1.3–1.5, docs/design.md §7)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from device_sdk.client_core import ClientCore, message_name
from device_sdk.outcome import Tally
from device_sdk.persistence import (
    Identity,
    StoredRevocations,
    load_or_create_signing_key,
    save_identity,
    save_revocations,
)
from protocol.errors import ConfigError, RemoteProtocolError, RevocationListInvalid
from protocol.identity import (
    RevocationList,
    SigningKey,
    read_certificate,
    registration_payload,
    verify_certificate,
    verify_revocation_list,
)
from protocol.messages import RegisterRequest, RegisterResponse, RevocationListPayload

__all__ = ["EnrollmentMixin"]

_log = logging.getLogger("device_sdk.client")  # one logger for every line the client logs


class EnrollmentMixin(ClientCore):
    """`DeviceClient`'s identity: registering once, signing with the identity key, revocation lists."""

    def _signing(self) -> SigningKey:
        if self._signing_key is None:
            self._signing_key = load_or_create_signing_key(self.config.store_dir)
        return self._signing_key

    async def _signed_session_options(self, tally: Tally) -> dict[str, Any]:
        """What a SecAgg+ session of a device that pins an enrollment authority signs and checks with (its
        identity key and certificate, the authority, the revocation list in force, fetched now); nothing
        for a device that pins none."""
        if self.config.authority_key is None:
            return {}
        certificate = self._identity.certificate if self._identity is not None else b""
        if not certificate:
            raise ConfigError("this device pins an enrollment authority but registered without a certificate")
        with tally.step("revocations"):
            revoked = await self._refresh_revocations(self.config.authority_key, tally)
        return {
            "identity": self._signing(),
            "certificate": certificate,
            "authority_key": self.config.authority_key,
            "revoked": revoked,
        }

    async def _ensure_identity(self, tally: Tally, certificate: bytes = b"", enrollment_token: str = "") -> Identity:
        if self._identity is not None:
            return self._identity
        if certificate and enrollment_token:
            raise ConfigError("register with a certificate or an enrollment token, not both")
        authority = self.config.authority_key
        if authority is not None and not certificate:
            raise ConfigError("this device pins an enrollment authority: register it with a certificate")
        request = RegisterRequest(platform=self.config.platform, enrollment_token=enrollment_token)
        if certificate:
            key = self._signing()
            if authority is not None and verify_certificate(certificate, authority) != key.public_key:
                raise ConfigError("the certificate does not certify this device's identity key")
            proof = key.sign(registration_payload(certificate))
            request = RegisterRequest(platform=self.config.platform, certificate=certificate, proof=proof)
        with tally.step("register"):
            response = await self._call(
                "POST", "/v1/devices", request, tally, timeout=self.config.request_timeout, authorized=False
            )
        message = response.message
        if not isinstance(message, RegisterResponse):
            raise RemoteProtocolError(f"registration answered with {message_name(message)}")
        named = read_certificate(certificate, authority).device_id if certificate and authority is not None else None
        if named is not None and message.device_id != named:
            raise RemoteProtocolError(
                f"registered as device {message.device_id}, but the certificate was issued for device {named}"
            )
        identity = Identity(device_id=message.device_id, token=message.token, certificate=certificate)
        save_identity(self.config.store_dir, identity)
        self._identity = identity
        _log.info("registered as device %d", identity.device_id)
        return identity

    async def _refresh_revocations(self, authority: bytes, tally: Tally) -> RevocationList | None:
        """Fetch the server's revocation list (``If-None-Match`` the one held), check it and keep the newer.

        Raises
        ------
        RevocationListInvalid
            The server's list is not signed by the pinned authority, is malformed, has a lower number than
            the list this device holds (a rollback), or differs from it under the same number.
        StorageError
            The newer list could not be stored.
        """
        held = self._revocations
        response = await self._call(
            "GET",
            "/v1/enrollment/revocations",
            None,
            tally,
            timeout=self.config.request_timeout,
            if_none_match=held.etag if held is not None else None,
            authorized=False,
        )
        if response.status == 304:
            if held is None:
                raise RemoteProtocolError("the revocation list route answered 304 to a device that holds none")
            return held.revocation_list
        payload = response.message
        if not isinstance(payload, RevocationListPayload):
            raise RemoteProtocolError(f"the revocation list route answered with {message_name(payload)}")
        if not payload.data:
            # The server enforces no list: the device goes on enforcing the newest it has seen.
            return None if held is None else held.revocation_list
        try:
            # Off the loop: a list of 10^6 keys takes ~0.6 s to check (10^5: ~36 ms).
            crl = await asyncio.to_thread(verify_revocation_list, payload.data, authority)
        except RevocationListInvalid as exc:
            raise RevocationListInvalid(f"the server's revocation list is refused: {exc}") from None
        if held is not None:
            old = held.revocation_list
            if crl.number < old.number:
                raise RevocationListInvalid(
                    f"the server's revocation list #{crl.number} is older than #{old.number} this device holds "
                    "(a rollback): refused"
                )
            if crl.number == old.number and payload.data != held.data:
                raise RevocationListInvalid(
                    f"the server's revocation list #{crl.number} differs from the list #{old.number} this device "
                    "holds: refused"
                )
            if payload.data == held.data and response.etag == held.etag:
                return old
        stored = StoredRevocations(data=payload.data, revocation_list=crl, etag=response.etag)
        await asyncio.to_thread(save_revocations, self.config.store_dir, stored)
        self._revocations = stored
        if held is None or crl.number != held.revocation_list.number:
            _log.info("revocation list #%d in force on this device (%d keys)", crl.number, len(crl.device_keys))
        return crl
