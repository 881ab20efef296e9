# Invariants:
# - Store files under a device's ``store_dir`` are written atomically by `device_sdk.store`: the identity
#   once, at registration; the model right after local training and at commit; the ETag record ("sync")
#   only after the model it describes is on disk, so it never vouches for item codes that are not stored.
# - A corrupt model or ETag record is moved aside by the store and replaced by a fresh one (with a
#   warning); a file the store could not move aside is never overwritten: the error propagates.
"""On-device persistence of a `DeviceClient`: identity, global-model sync record and the model itself."""

from __future__ import annotations

import copy
import logging
import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from device_sdk.family import FederatedModel
from device_sdk.models import LightFRConfig, LightFRModel
from device_sdk.store import load_store, save_store
from protocol.errors import ConfigError, CryptoError, RevocationListInvalid, StorageError
from protocol.identity import RevocationList, SigningKey, verify_revocation_list
from protocol.policy import DeviceLedger

__all__ = [
    "MODEL_FILE",
    "IDENTITY_FILE",
    "SYNC_FILE",
    "Identity",
    "Sync",
    "secret_generator",
    "load_identity",
    "save_identity",
    "load_sync",
    "save_model",
    "fresh_model",
    "load_model",
    "LEDGER_FILE",
    "load_ledger",
    "save_ledger",
    "SIGNING_KEY_FILE",
    "load_or_create_signing_key",
    "REVOCATIONS_FILE",
    "StoredRevocations",
    "load_revocations",
    "save_revocations",
]

MODEL_FILE = "model.fedrec"
IDENTITY_FILE = "identity.fedrec"
SYNC_FILE = "sync.fedrec"
LEDGER_FILE = "privacy.fedrec"
SIGNING_KEY_FILE = "signing-key.fedrec"
REVOCATIONS_FILE = "revocations.fedrec"
_REVOCATIONS_KIND = "revocation-list"
_SIGNING_KEY_KIND = "signing-key"
_LEDGER_KIND = "privacy-ledger"
_IDENTITY_KIND = "identity"
_SYNC_KIND = "sync"

_log = logging.getLogger(__name__)


def secret_generator() -> np.random.Generator:
    """A numpy generator seeded from ``secrets`` (model initialisation and training only, never DP noise)."""
    return np.random.default_rng(secrets.randbits(128))


@dataclass(frozen=True, slots=True)
class Identity:
    """The device id and bearer token the server issued at registration, and the enrollment certificate
    the device registered with (protocol 1.4; empty when it enrolled by token or openly)."""

    device_id: int
    token: str
    certificate: bytes = b""


@dataclass(frozen=True, slots=True)
class Sync:
    """The ETag the server gave for the global model version this device stores."""

    etag: str | None
    model_version: int


def _load_small(store_dir: Path, name: str, kind: str) -> dict[str, Any] | None:
    path = store_dir / name
    if not path.exists():
        return None
    try:
        return load_store(path, kind)
    except StorageError as exc:
        if path.exists():  # not moved aside: leave it alone and let the caller see why
            raise
        _log.warning("%s store is corrupt and was moved aside; starting without it: %s", kind, exc)
        return None


def load_identity(store_dir: Path) -> Identity | None:
    """The stored identity, None when the device never registered.

    Raises
    ------
    StorageError
        The identity file is malformed (it is never overwritten).
    """
    state = _load_small(store_dir, IDENTITY_FILE, _IDENTITY_KIND)
    if state is None:
        return None
    device_id, token = state.get("device_id"), state.get("token")
    certificate = state.get("certificate", b"")
    if type(device_id) is not int or device_id < 0 or not isinstance(token, str) or not token:
        raise StorageError(f"{store_dir / IDENTITY_FILE} holds a malformed identity")
    if type(certificate) is not bytes:
        raise StorageError(f"{store_dir / IDENTITY_FILE} holds a malformed certificate")
    return Identity(device_id=device_id, token=token, certificate=certificate)


def save_identity(store_dir: Path, identity: Identity) -> None:
    """Persist the identity (atomically)."""
    state: dict[str, Any] = {"device_id": identity.device_id, "token": identity.token}
    if identity.certificate:
        state["certificate"] = identity.certificate
    save_store(store_dir / IDENTITY_FILE, _IDENTITY_KIND, state, private=True)  # the token is a credential


def load_or_create_signing_key(store_dir: Path) -> SigningKey:
    """The device's long-term Ed25519 identity key (protocol 1.3), created from the OS CSPRNG and
    written atomically on first use.

    Raises
    ------
    StorageError
        The key file is corrupt or malformed (the store moves a corrupt file aside and raises).  A later
        call then creates a new key, which no longer matches the device's certificate: its rounds fail
        with `CryptoError` until the operator re-enrolls it.
    """
    path = store_dir / SIGNING_KEY_FILE
    if path.exists():
        state = load_store(path, _SIGNING_KEY_KIND)  # a corrupt file raises (moved aside by the store)
        seed = state.get("seed")
        try:
            return SigningKey.from_private_bytes(seed)  # type: ignore[arg-type]
        except CryptoError as exc:
            raise StorageError(f"{path} holds a malformed identity key: {exc}") from exc
    key = SigningKey.generate()
    save_store(path, _SIGNING_KEY_KIND, {"seed": key.private_bytes()}, private=True)  # mode 0600
    return key


def load_sync(store_dir: Path) -> Sync | None:
    """The stored ETag record, None when absent or malformed (a malformed one is ignored with a warning)."""
    state = _load_small(store_dir, SYNC_FILE, _SYNC_KIND)
    if state is None:
        return None
    etag, version = state.get("etag"), state.get("model_version")
    if not (etag is None or isinstance(etag, str)) or type(version) is not int or version < 0:
        _log.warning("ignoring a malformed ETag record in %s", store_dir / SYNC_FILE)
        return None
    return Sync(etag=etag, model_version=version)


def save_model(store_dir: Path, model: Any, sync: Sync | None) -> None:
    """Persist the model, then (never before) the ETag record describing it."""
    model.save(store_dir / MODEL_FILE)
    if sync is not None:
        save_store(store_dir / SYNC_FILE, _SYNC_KIND, {"etag": sync.etag, "model_version": sync.model_version})


def fresh_model(n_items: int, lightfr: LightFRConfig, template: FederatedModel | None) -> Any:
    """A new model: a copy of ``template``, or a LightFR model with random user codes."""
    if template is not None:
        return copy.deepcopy(template)
    return LightFRModel(n_items, lightfr, rng=secret_generator())


def load_model(store_dir: Path, n_items: int, lightfr: LightFRConfig, template: FederatedModel | None) -> Any | None:
    """The stored model, or None when there is none (or it was corrupt and moved aside).

    Raises
    ------
    ConfigError
        The stored model was built for another family, catalogue size or rank.
    StorageError
        The file is unreadable and could not be moved aside.
    """
    path = store_dir / MODEL_FILE
    if not path.exists():
        return None
    if template is not None:
        return _load_family_model(path, template)
    try:
        model = LightFRModel.load(path, rng=secret_generator())
    except StorageError as exc:
        if path.exists():  # not moved aside (e.g. written by a newer format): never overwrite it
            raise
        _log.warning("device model store is corrupt, starting with a fresh model: %s", exc)
        return None
    if model.n_items != n_items or model.config.bits != lightfr.bits:
        raise ConfigError(
            f"{path} holds a model with m={model.n_items}, f={model.config.bits}; "
            f"this device is configured for m={n_items}, f={lightfr.bits}"
        )
    model.config = replace(model.config, rating_range=lightfr.rating_range, binary_positives=lightfr.binary_positives)
    return model


def _load_family_model(path: Path, template: FederatedModel) -> Any | None:
    loader = getattr(type(template), "load", None)
    if loader is None:
        raise ConfigError(f"{type(template).__name__} has no load(); it cannot keep a store")
    try:
        model = loader(path)
    except StorageError as exc:
        if path.exists():
            raise
        _log.warning("device model store is corrupt, starting with a fresh model: %s", exc)
        return None
    if (model.KIND, model.n_items, model.rank) != (template.KIND, template.n_items, template.rank):
        raise ConfigError(
            f"{path} holds a {model.KIND!r} model with m={model.n_items}, rank {model.rank}; this device "
            f"is configured for {template.KIND!r} with m={template.n_items}, rank {template.rank}"
        )
    return model


def load_ledger(store_dir: Path) -> DeviceLedger:
    """The device's own privacy ledger (empty when none is stored).

    Raises
    ------
    StorageError
        The stored ledger is malformed: never silently reset a privacy budget.
    """
    path = store_dir / LEDGER_FILE
    if not path.exists():
        return DeviceLedger()
    # Not `_load_small`: a corrupt ledger is moved aside but never forgiven (that would reset ε to 0).
    state = load_store(path, _LEDGER_KIND)
    try:
        return DeviceLedger.from_dict(state)
    except ConfigError as exc:
        raise StorageError(f"{store_dir / LEDGER_FILE}: {exc}") from exc


def save_ledger(store_dir: Path, ledger: DeviceLedger) -> None:
    """Persist the privacy ledger (atomically)."""
    save_store(store_dir / LEDGER_FILE, _LEDGER_KIND, ledger.to_dict())


@dataclass(frozen=True, slots=True)
class StoredRevocations:
    """The newest revocation list of the pinned enrollment authority this device has seen (protocol 1.5):
    the signed bytes, the checked list, and the server's ETag for them."""

    data: bytes
    revocation_list: RevocationList
    etag: str | None


def load_revocations(store_dir: Path, authority_key: bytes) -> StoredRevocations | None:
    """The stored revocation list, checked against the pinned authority; None when none is stored.

    Raises
    ------
    StorageError
        The file is corrupt (moved aside by the store), malformed, or holds a list the pinned authority
        did not sign: never silently dropped, which would let a server roll the device back to an
        older list.
    """
    path = store_dir / REVOCATIONS_FILE
    if not path.exists():
        return None
    state = load_store(path, _REVOCATIONS_KIND)
    data, etag = state.get("list"), state.get("etag")
    if type(data) is not bytes or not (etag is None or isinstance(etag, str)):
        raise StorageError(f"{path} holds a malformed revocation list record")
    try:
        crl = verify_revocation_list(data, authority_key)
    except RevocationListInvalid as exc:
        raise StorageError(f"{path}: {exc} (a list of another authority? re-provision the device)") from exc
    return StoredRevocations(data=data, revocation_list=crl, etag=etag)


def save_revocations(store_dir: Path, stored: StoredRevocations) -> None:
    """Persist the newest revocation list (atomically: the old record or the new one, never part)."""
    save_store(store_dir / REVOCATIONS_FILE, _REVOCATIONS_KIND, {"list": stored.data, "etag": stored.etag})
