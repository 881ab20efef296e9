# Invariants:
# - The only async code of the SDK.  It talks to the server through a `Transport` only and never imports
#   aiohttp at module level (`DeviceClient.connect` imports `device_sdk.http` lazily).
# - Store files under ``store_dir`` are written atomically by `device_sdk.store`: the identity once, at
#   registration; the model right after local training (so an app restart mid-round loses no training
#   and corrupts nothing), at commit, and at the first contact when the server's model is newer than the
#   one held; the ETag record ("sync") only after the model it describes is on disk, so it never vouches
#   for item codes that are not stored.  A LightFR model's ranking vectors are re-solved against a model
#   when it is adopted (`LightFRModel.refresh_ranking`) and live in the same file as its item codes, so no
#   store file pairs the codes of one version with vectors solved against another.
# - A model is adopted only after its shape (family, rank, n_items) was checked against this device's; a
#   server model of another shape leaves every store file as it is.
# - A corrupt model or ETag record is moved aside by the store and replaced by a fresh one (with a
#   warning); a file the store could not move aside is never overwritten: the error propagates.
# - The plaintext update lives only between local training and the SecAgg session; every way out of a
#   round (commit, abort, dropout, error) leaves the session finished, so its secrets are dropped.
# - Randomness: the training generator and the DP-noise stream come from ``rng_for_round`` (default: keyed
#   from ``secrets`` every round); the stochastic-rounding coins are the noise stream's first words (read
#   in the training thread before the session draws its noise); key material is generated inside
#   `protocol` only.
"""`DeviceClient`: one device taking part in federated rounds over a `Transport` (docs/design.md §4, §7).

This module holds the client's public surface (its settings, its outcome, its constructor and the calls an
app makes); the steps behind them live in mixins over one shared state (`device_sdk.client_core`): the
round driver with the four SecAgg+ phases (`device_sdk.participation`), the model download and adoption
(`device_sdk.model_sync`), registration and revocation lists (`device_sdk.enrollment`).  Elsewhere: store
files (`device_sdk.persistence`), the transport and its retry policy (`device_sdk.transport`,
`device_sdk.http`), fault injection (`fedsim.fleets.faults`).  Every part logs as ``device_sdk.client``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Required, TypedDict, Unpack

import numpy as np
from numpy.typing import ArrayLike, NDArray

from device_sdk.client_core import RoundRngs
from device_sdk.family import FederatedModel, LocalRatings
from device_sdk.models import LightFRConfig
from device_sdk.outcome import RoundOutcome, RoundStatus, Tally
from device_sdk.participation import RoundParticipation
from device_sdk.persistence import (
    IDENTITY_FILE,
    MODEL_FILE,
    SYNC_FILE,
    StoredRevocations,
    load_identity,
    load_ledger,
    load_revocations,
    load_sync,
    secret_generator,
)
from device_sdk.transport import AsyncClosing, Transport
from protocol.errors import ConfigError, StorageError
from protocol.identity import RevocationList, SigningKey
from protocol.policy import PrivacyPolicy
from protocol.samplers import NoiseStream, insecure_test_noise_stream

__all__ = [
    "MODEL_FILE",
    "IDENTITY_FILE",
    "SYNC_FILE",
    "ClientConfig",
    "ClientOptions",
    "RoundStatus",
    "RoundOutcome",
    "DeviceClient",
    "RoundRngs",
    "insecure_seeded_rngs",
]


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Settings of one device client.

    Attributes
    ----------
    store_dir : Path
        Folder of the device's store files (identity, model, ETag record); created if missing.
    platform : str
        Sent at registration, for operators.
    request_timeout : float
        Seconds per attempt of a short request (register, check-in, model download, abort).
    long_poll_timeout : float
        Seconds per attempt of a SecAgg phase request, which the server holds until the phase closes.
    privacy : PrivacyPolicy
        The device's privacy floor (`protocol.policy`): rounds below it are refused and the device sits
        them out (`RoundStatus.REFUSED`).  The default is the safe one; a deployment without DP must set
        ``PrivacyPolicy(require_noise=False)``; `PrivacyPolicy.no_floor()` is for simulations only.
    authority_key : bytes, optional
        The pinned 32-byte Ed25519 public key of the enrollment authority (protocol 1.3/1.4).  When set,
        the device registers only with a certificate of this authority for its own identity key, signs
        its key advertisements and survivor sets, and refuses any round whose neighbours' keys are not
        certified by it or that skips the consistency check.  Protocol 1.5: before each round it fetches
        the authority's revocation list from the server (``If-None-Match``: usually a 304), checks it
        against this key, keeps the newest in the store (``revocations.fedrec``) and refuses a round whose
        ShareKeys broadcast names a revoked neighbour.

    Raises
    ------
    ConfigError
        A timeout is not a positive number, or ``platform`` is longer than 128 characters.
    """

    store_dir: Path
    platform: str = "fedrec-python"
    request_timeout: float = 30.0
    long_poll_timeout: float = 300.0
    privacy: PrivacyPolicy = field(default_factory=PrivacyPolicy)
    authority_key: bytes | None = None

    def __post_init__(self) -> None:
        if self.authority_key is not None and (type(self.authority_key) is not bytes or len(self.authority_key) != 32):
            raise ConfigError("authority_key must be the enrollment authority's 32-byte Ed25519 public key")
        if not isinstance(self.privacy, PrivacyPolicy):
            raise ConfigError(f"privacy must be a PrivacyPolicy, got {type(self.privacy).__name__}")
        object.__setattr__(self, "store_dir", Path(self.store_dir))
        for name in ("request_timeout", "long_poll_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if len(self.platform) > 128:
            raise ConfigError("platform must be at most 128 characters")


def insecure_seeded_rngs(seed: int, round_id: int, device_id: int) -> tuple[np.random.Generator, NoiseStream]:
    """TEST HOOK: reproducible per-round generators of one device, ``(training_rng, noise_stream)``.

    The noise stream (DP noise, thinning and stochastic-rounding coins) is
    `protocol.samplers.insecure_test_noise_stream(seed, round_id, device_id)`: anyone who knows the seed
    predicts every device's noise and rounding, so the ε of a run that uses this hook is NOT a
    privacy guarantee (callers that report ε must say so).  The in-process simulator and devices driven
    over HTTP both use exactly this function so that they produce bit-identical updates and noise.  Pass
    it to `DeviceClient` once the device id is known, e.g.
    ``rng_for_round=lambda r: insecure_seeded_rngs(seed, r, client.device_id)``.

    Parameters
    ----------
    seed : int
        Root seed of the simulation (>= 0).
    round_id, device_id : int
        The round and the device (>= 0).

    Returns
    -------
    tuple
        Child 0 of ``np.random.SeedSequence([seed, round_id, device_id])`` as the training generator, and
        the test noise stream.

    Raises
    ------
    ValueError
        A negative or non-integer argument.
    """
    for name, value in (("seed", seed), ("round_id", round_id), ("device_id", device_id)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    training, _ = np.random.SeedSequence([int(seed), int(round_id), int(device_id)]).spawn(2)
    return np.random.default_rng(training), insecure_test_noise_stream(int(seed), int(round_id), int(device_id))


def _secret_round_rngs(round_id: int) -> tuple[np.random.Generator, NoiseStream]:
    # Training randomness from a secrets-seeded numpy generator; DP noise and rounding coins from a
    # secrets-keyed ChaCha20 stream.
    return secret_generator(), NoiseStream.from_os()


class ClientOptions(TypedDict, total=False):
    """The keyword arguments of `DeviceClient` after its transport and config (documented there), which
    `DeviceClient.connect` passes on as they are; the defaults are `DeviceClient`'s."""

    items: Required[ArrayLike]
    ratings: Required[ArrayLike | None]
    n_items: Required[int]
    bits: int
    rating_range: tuple[float, float] | None
    binary_positives: bool
    rng_for_round: RoundRngs | None
    model: FederatedModel | None
    data: LocalRatings | None


class DeviceClient(RoundParticipation, AsyncClosing):
    """One device: registers once, checks in, trains locally and takes part in SecAgg+ rounds.

    On construction the client loads ``store_dir/model.fedrec`` when present.  A corrupt model file is
    moved aside by the store; the client logs a warning and starts from a fresh model (random user code,
    no global model: it downloads the current one at its next round).  A corrupt identity file likewise
    leads to a new registration.

    Parameters
    ----------
    transport : Transport
        Connection to the server (`device_sdk.http.HttpTransport`, or a fake in tests).
    config : ClientConfig
        Store folder and timeouts.
    items : array_like of int
        Ids of the items this device's user rated (in ``[0, n_items)``).
    ratings : array_like of float or None
        Raw ratings aligned with ``items``; None for implicit feedback.
    n_items : int
        Catalogue size m.
    bits : int
        Code length f.
    rating_range : (float, float) or None
        Range used to normalise raw ratings (None: already in [0, 1]).
    binary_positives : bool
        Fit every observed rating as 1.
    rng_for_round : callable, optional
        ``rng_for_round(round_id) -> (training_rng, noise_stream)``; default: both freshly keyed from
        ``secrets`` each round (the only setting whose ε means anything).  Simulations pass the test hook
        `insecure_seeded_rngs` (see there).
    model : FederatedModel, optional
        A fresh model of another family (`device_sdk.mf.MFModel`, `device_sdk.felb.FELBModel`,
        `device_sdk.fnmf.FNMFModel`) used when the store holds none; its class also loads the store.
        Default: a `LightFRModel` built from ``bits``, ``rating_range`` and ``binary_positives``.
    data : LocalRatings, optional
        Several local users' ratings (cross-silo client) instead of ``items``/``ratings``.

    Raises
    ------
    ValueError
        ``items``/``ratings`` have different lengths or an item id is out of range.
    ConfigError
        The stored model was built for another catalogue size or code length.
    StorageError
        A store file is unreadable and could not be moved aside (it is never overwritten).
    """

    def __init__(
        self,
        transport: Transport,
        config: ClientConfig,
        *,
        items: ArrayLike,
        ratings: ArrayLike | None,
        n_items: int,
        bits: int = 64,
        rating_range: tuple[float, float] | None = (1.0, 5.0),
        binary_positives: bool = True,
        rng_for_round: RoundRngs | None = None,
        model: FederatedModel | None = None,
        data: LocalRatings | None = None,
    ) -> None:
        if n_items <= 0:
            raise ValueError(f"n_items must be positive, got {n_items}")
        item_ids = np.array(items, dtype=np.int64).ravel()
        if item_ids.size and (item_ids.min() < 0 or item_ids.max() >= n_items):
            raise ValueError(f"item id out of range [0, {n_items})")
        values: NDArray[np.float64] | None = None
        if ratings is not None:
            values = np.array(ratings, dtype=np.float64).ravel()
            if values.shape != item_ids.shape:
                raise ValueError(f"{item_ids.size} items but {values.size} ratings")
        self.config = config
        self._transport = transport
        self._owns_transport = False
        self._items = item_ids
        self._ratings = values
        self._n_items = n_items
        self._lightfr = LightFRConfig(bits=bits, rating_range=rating_range, binary_positives=binary_positives)
        if model is not None and model.n_items != n_items:
            raise ValueError(f"the model is for {model.n_items} items, n_items is {n_items}")
        if data is not None:
            data.check_items(n_items)
        self._template = model
        self._data = data if data is not None else LocalRatings.single_user(item_ids, values)
        self._rng_for_round: RoundRngs = rng_for_round if rng_for_round is not None else _secret_round_rngs
        self._lock = asyncio.Lock()
        try:
            config.store_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the store folder {config.store_dir}: {exc}") from exc
        self._identity = load_identity(config.store_dir)
        self._signing_key: SigningKey | None = None
        self._sync = load_sync(config.store_dir)
        self._ledger = load_ledger(config.store_dir)
        self._revocations: StoredRevocations | None = (
            load_revocations(config.store_dir, config.authority_key) if config.authority_key is not None else None
        )
        self._model = self._load_model()
        #: Whether this client has checked the server's model (`_first_contact`, at the first `run_round`).
        self._server_model_checked = False

    @classmethod
    def connect(
        cls,
        base_url: str | Sequence[str],
        config: ClientConfig,
        *,
        retries: int = 5,
        **options: Unpack[ClientOptions],
    ) -> DeviceClient:
        """A client over `device_sdk.http.HttpTransport` (imported here, so aiohttp loads only now).

        Parameters
        ----------
        base_url : str or sequence of str
            Server root, e.g. ``http://127.0.0.1:8080``, or the roots of several instances of one server
            (a device whose instance dies goes on with the next one at once; `HttpTransport`).
        config, **options
            As for `DeviceClient` (``items``, ``ratings`` and ``n_items`` required; `ClientOptions`).
        retries : int
            Retries of the HTTP transport.

        Returns
        -------
        DeviceClient
            It owns the transport: `close` closes it.
        """
        from device_sdk.http import HttpTransport  # lazy: `import device_sdk` must not import aiohttp

        client = cls(
            HttpTransport(base_url, retries=retries),
            config,
            **options,
        )
        client._owns_transport = True
        return client

    async def close(self) -> None:
        """Close the transport if this client created it (`connect`); otherwise it stays the caller's."""
        if self._owns_transport:
            await self._transport.close()

    # -- state ------------------------------------------------------------------------------------

    @property
    def model(self) -> Any:
        """The on-device model (a `LightFRModel` unless another family was passed); ``recommend``
        works offline."""
        return self._model

    @property
    def device_id(self) -> int | None:
        """The registered device id, None before `register`."""
        return None if self._identity is None else self._identity.device_id

    @property
    def identity_public_key(self) -> bytes:
        """The device's long-term Ed25519 public key (32 bytes), for its operator's enrollment authority
        to certify.  The key is created on first use and kept in the store (``signing-key.fedrec``)."""
        return self._signing().public_key

    # -- protocol ---------------------------------------------------------------------------------

    async def register(self, *, certificate: bytes | None = None, enrollment_token: str | None = None) -> int:
        """Get an identity from the server once (``POST /v1/devices``) and persist it.

        Later calls, and later runs with the same ``store_dir``, reuse the stored identity.

        Parameters
        ----------
        certificate : bytes, optional
            The enrollment authority's certificate of `identity_public_key` (protocol 1.4); the device
            adds a proof that it holds the key.  Checked against ``config.authority_key`` first.
        enrollment_token : str, optional
            An operator-issued one-time enrollment token (test fleets).  Without either credential the
            registration is open, which a server accepts only in development.

        Returns
        -------
        int
            The device id.

        Raises
        ------
        EnrollmentRefused
            The server refused the credential (missing, forged, reused).
        RateLimited
            The credential source registers too fast (after the transport's own retries).
        ConfigError, CryptoError
            A certificate with both credentials, or one that the pinned authority did not issue for this
            device's key; a pinned authority but no certificate.
        FedRecError
            The error the server answered with, `TransportError` when it cannot be reached, or
            `StorageError` when the identity cannot be written.
        """
        async with self._lock:
            return (await self._ensure_identity(Tally(), certificate or b"", enrollment_token or "")).device_id

    async def run_round(self) -> RoundOutcome:
        """Check in and, when invited, take part in one round.

        The first call of a client first fetches the server's model (``GET /v1/model``, ``If-None-Match``
        the stored ETag: a 304 when the device holds the current one) and checks that it is the family,
        rank and catalogue size this device runs; a mismatch raises `ConfigError` naming both shapes then,
        instead of at the first invitation, and leaves the stored state untouched.  A model that fits is
        adopted and stored (the device recommends from the newest model; a round of that version then
        downloads nothing).  A LightFR device that ranks with a vector (``rank_planes``) re-solves it for
        its own ratings against every model it adopts, once, and stores it with that model.

        Check in with the model version held; a `Wait` ends the call ("waited").  On a `RoundInvite`:
        download the round's model if it differs from the stored one (``If-None-Match`` with the stored
        ETag), train locally as the invite's plan says, save the model, then drive the SecAgg+ session
        through the keys, shares, masked and unmask long-polls.  A `RoundResult` at any phase ends the
        round; `RoundError`s from the server (round closed, stale round, not enough participants)
        become an "aborted" outcome with the reason.  A transport that raises
        `device_sdk.transport.LeftRound` takes the device out of the round ("dropped"; how load tests
        inject dropouts: `fedsim.fleets.faults.FaultyTransport`).

        Returns
        -------
        RoundOutcome

        Raises
        ------
        AuthError, PrivacyBudgetExceeded, VersionMismatch, ...
            Any other error the server answered with.
        TransportError
            The server could not be reached.
        RemoteProtocolError, CryptoError
            The server broke the protocol (the device leaves the round, telling the server if it can).
        ConfigError
            The server's model, or the round's, is not the family, rank or catalogue size this device is
            configured for (the message names both).
        StorageError
            The model could not be saved.
        """
        async with self._lock:
            tally = Tally()
            start = time.perf_counter()
            try:
                return await self._round(tally)
            finally:
                tally.timings["total"] = time.perf_counter() - start

    async def run(self, *, rounds: int | None = None, stop: asyncio.Event | None = None) -> list[RoundOutcome]:
        """Take part in rounds until ``rounds`` were joined or ``stop`` is set.

        Parameters
        ----------
        rounds : int, optional
            Stop after this many rounds joined (committed, aborted or dropped); waits do not count.
            None: until ``stop`` is set.
        stop : asyncio.Event, optional
            Checked between rounds and while waiting to check in again (a round in progress finishes).

        Returns
        -------
        list of RoundOutcome
            Every outcome, waits included.
        """
        if rounds is not None and rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {rounds}")
        outcomes: list[RoundOutcome] = []
        joined = 0
        while rounds is None or joined < rounds:
            if stop is not None and stop.is_set():
                break
            outcome = await self.run_round()
            outcomes.append(outcome)
            if outcome.status is RoundStatus.WAITED:
                await _pause(outcome.retry_after or 0.0, stop)
            else:
                joined += 1
        return outcomes

    # -- privacy and revocation (protocol 1.5) -------------------------------------------------------

    @property
    def privacy_spent(self) -> float:
        """ε this device has been charged so far, by its own ledger, at its policy's δ."""
        return self._ledger.epsilon(self.config.privacy.delta)

    @property
    def revocation_list(self) -> RevocationList | None:
        """The newest revocation list of the pinned authority this device holds (None: none seen yet)."""
        return None if self._revocations is None else self._revocations.revocation_list

    async def refresh_revocations(self) -> RevocationList | None:
        """Fetch the server's revocation list now (``GET /v1/enrollment/revocations``), check it against
        the pinned authority and keep it if it is newer than the one held; `run_round` does this before
        every round of a device that pins an authority.  Calling it at start-up closes the window before
        the first round.

        Returns
        -------
        RevocationList or None
            The list this device now enforces (None: it has seen none).

        Raises
        ------
        ConfigError
            The device pins no enrollment authority.
        RevocationListInvalid
            A list not signed by the pinned authority, malformed, or older than the one held (rollback).
        FedRecError
            The error the server answered with, or `TransportError`.
        """
        if self.config.authority_key is None:
            raise ConfigError("a device checks revocation lists only when it pins an enrollment authority")
        async with self._lock:
            return await self._refresh_revocations(self.config.authority_key, Tally())


async def _pause(seconds: float, stop: asyncio.Event | None) -> None:
    if stop is None:
        await asyncio.sleep(seconds)
        return
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass
