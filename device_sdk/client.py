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

Why one module of ~800 lines: it is one class, the round driver, whose steps (check-in, model sync,
training, the four SecAgg+ phases, leaving) share the client's lock, store and tally; about half of it
is docstrings.  What could leave has left: store files (`device_sdk.persistence`), the transport and its
retry policy (`device_sdk.transport`, `device_sdk.http`), fault injection (`fedsim.fleets.faults`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from device_sdk.family import FederatedModel, LocalRatings
from device_sdk.models import LightFRConfig, LightFRModel
from device_sdk.persistence import (
    IDENTITY_FILE,
    MODEL_FILE,
    SYNC_FILE,
    Identity,
    StoredRevocations,
    Sync,
    fresh_model,
    load_identity,
    load_ledger,
    load_model,
    load_or_create_signing_key,
    load_revocations,
    load_sync,
    save_identity,
    save_ledger,
    save_model,
    save_revocations,
    secret_generator,
)
from device_sdk.training import local_round
from device_sdk.transport import LeftRound, Response, Transport, TransportError, raise_for_error
from protocol.device_session import DeviceSecAggSession
from protocol.errors import (
    ConfigError,
    FedRecError,
    LocalProtocolError,
    PrivacyFloorViolation,
    RemoteProtocolError,
    RevocationListInvalid,
    RoundError,
    StaleRound,
    StorageError,
)
from protocol.identity import (
    RevocationList,
    SigningKey,
    registration_payload,
    verify_certificate,
    verify_revocation_list,
)
from protocol.messages import (
    Abort,
    CheckIn,
    ConsistencyRequest,
    MaskedInputRequest,
    Message,
    ModelPayload,
    RegisterRequest,
    RegisterResponse,
    RevocationListPayload,
    RoundInvite,
    RoundResult,
    ShareKeysBroadcast,
    UnmaskRequest,
    Wait,
)
from protocol.phases import ACTIVE_PHASES
from protocol.policy import PrivacyPolicy
from protocol.samplers import NoiseStream, insecure_test_noise_stream
from protocol.spec import MAX_TEXT

__all__ = [
    "MODEL_FILE",
    "IDENTITY_FILE",
    "SYNC_FILE",
    "ClientConfig",
    "RoundStatus",
    "RoundOutcome",
    "DeviceClient",
    "RoundRngs",
    "insecure_seeded_rngs",
]


_log = logging.getLogger(__name__)

#: ``rng_for_round(round_id) -> (training_rng, noise_stream)``.
RoundRngs = Callable[[int], tuple[np.random.Generator, NoiseStream]]


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
        Seconds per step: "register", "checkin", "model", "revocations" (protocol 1.5, pinned authority
        only), "train", "keys", "shares", "masked", "unmask" (the phase steps include the long-poll wait),
        and "total".
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


@dataclass(slots=True)
class _Tally:
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


# (step name = path segment, the answer expected unless the round ends)
_STEPS: tuple[tuple[str, type[Message]], ...] = (
    ("keys", ShareKeysBroadcast),
    ("shares", MaskedInputRequest),
    ("masked", UnmaskRequest),
    ("unmask", RoundResult),
)
#: Protocol 1.3: inserted after "masked" when the server answers with a `ConsistencyRequest`.
_CONSISTENCY_STEP: tuple[str, type[Message]] = ("consistency", UnmaskRequest)


class DeviceClient:
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
        base_url: str,
        config: ClientConfig,
        *,
        items: ArrayLike,
        ratings: ArrayLike | None,
        n_items: int,
        bits: int = 64,
        rating_range: tuple[float, float] | None = (1.0, 5.0),
        binary_positives: bool = True,
        rng_for_round: RoundRngs | None = None,
        retries: int = 5,
        model: FederatedModel | None = None,
        data: LocalRatings | None = None,
    ) -> DeviceClient:
        """A client over `device_sdk.http.HttpTransport` (imported here, so aiohttp loads only now).

        Parameters
        ----------
        base_url : str
            Server root, e.g. ``http://127.0.0.1:8080``.
        config, items, ratings, n_items, bits, rating_range, binary_positives, rng_for_round, model, data
            As for `DeviceClient`.
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
            items=items,
            ratings=ratings,
            n_items=n_items,
            bits=bits,
            rating_range=rating_range,
            binary_positives=binary_positives,
            rng_for_round=rng_for_round,
            model=model,
            data=data,
        )
        client._owns_transport = True
        return client

    async def __aenter__(self) -> DeviceClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

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

    def _signing(self) -> SigningKey:
        if self._signing_key is None:
            self._signing_key = load_or_create_signing_key(self.config.store_dir)
        return self._signing_key

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
            return (await self._ensure_identity(_Tally(), certificate or b"", enrollment_token or "")).device_id

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
            tally = _Tally()
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

    # -- one round --------------------------------------------------------------------------------

    async def _round(self, tally: _Tally) -> RoundOutcome:
        identity = await self._ensure_identity(tally)
        try:
            if not self._server_model_checked:
                # A RoundError here (503: no instance leads this device's cohort now) ends the call as a
                # check-in's would; the next call tries again.
                with tally.step("model"):
                    await self._first_contact(tally)
            with tally.step("checkin"):
                checkin = CheckIn(device_id=identity.device_id, model_version=self._held_version() or 0)
                response = await self._call("POST", "/v1/checkin", checkin, tally, timeout=self.config.request_timeout)
        except RoundError as exc:
            return self._outcome(RoundStatus.ABORTED, None, tally, reason=str(exc))
        message = response.message
        if isinstance(message, Wait):
            return self._outcome(RoundStatus.WAITED, None, tally, retry_after=message.retry_after)
        if not isinstance(message, RoundInvite):
            raise RemoteProtocolError(f"check-in answered with {_name(message)}, expected RoundInvite or Wait")
        if message.device_id != identity.device_id:
            raise RemoteProtocolError(f"invite addressed to device {message.device_id}")
        return await self._join(message, tally)

    async def _join(self, invite: RoundInvite, tally: _Tally) -> RoundOutcome:
        rid = invite.round_id
        session: DeviceSecAggSession | None = None
        try:
            self._check_plan(invite)
            try:
                with tally.step("model"):
                    await self._sync_model(invite, tally)
            except StaleRound as exc:
                # Found out locally: tell the server, which would otherwise wait for us until the deadline.
                await self._leave(invite, str(exc))
                raise
            training_rng, noise_rng = self._rng_for_round(rid)
            signed: dict[str, Any] = {}
            if self.config.authority_key is not None:
                certificate = self._identity.certificate if self._identity is not None else b""
                if not certificate:
                    raise ConfigError("this device pins an enrollment authority but registered without a certificate")
                with tally.step("revocations"):
                    revoked = await self._refresh_revocations(self.config.authority_key, tally)
                signed = {
                    "identity": self._signing(),
                    "certificate": certificate,
                    "authority_key": self.config.authority_key,
                    "revoked": revoked,
                }
            try:
                session = DeviceSecAggSession(
                    invite, rng=noise_rng, policy=self.config.privacy, ledger=self._ledger, **signed
                )
            except PrivacyFloorViolation as exc:
                # Below this device's floor: sit the round out (before training), and say why.
                _log.warning("refusing round %d: %s", rid, exc)
                await self._leave(invite, f"refused: {exc}")
                return self._outcome(RoundStatus.REFUSED, rid, tally, reason=str(exc))
            with tally.step("train"):
                # Off the app's event loop: training is the device's long CPU step.
                update = await asyncio.to_thread(self._train, invite, training_rng, noise_rng)
            session.provide_input(update)
            del update  # the session holds the only copy until it is masked
            steps = list(_STEPS)
            while steps:
                name, answer_type = steps.pop(0)
                # On the loop (not in `asyncio.to_thread`): in a fleet, a masking job queued behind other
                # devices' training in the shared executor missed its phase (measured: MASKED_INPUT ran to
                # its 150 s deadline with 1,000 devices).
                outgoing = session.send()
                path = f"/v1/rounds/{rid}/{name}"
                if name == "masked":
                    self._charge(invite)  # the masked input may leave now: charge the device's own ledger first
                with tally.step(name):
                    response = await self._call("POST", path, outgoing, tally, timeout=self.config.long_poll_timeout)
                # Sent: not kept through the next phase's wait (the masked input is 4 bytes per coordinate).
                del outgoing
                answer = response.message
                if isinstance(answer, RoundResult):
                    return await self._finish(session, invite, answer, tally)
                if name == "masked" and isinstance(answer, ConsistencyRequest):
                    # Protocol 1.3: sign the survivor set before the unmask request (§6.3).
                    steps.insert(0, _CONSISTENCY_STEP)
                    answer_type = ConsistencyRequest
                if not isinstance(answer, answer_type):
                    raise RemoteProtocolError(f"{name} answered with {_name(answer)}, expected {answer_type.__name__}")
                session.receive(answer)
            raise LocalProtocolError("the unmask phase must end with a RoundResult")  # pragma: no cover
        except LeftRound as exc:
            if exc.response is not None:
                tally.count(exc.response)
            return self._dropped(session, rid, tally, str(exc))
        except RoundError as exc:
            return self._outcome(RoundStatus.ABORTED, rid, tally, reason=str(exc))
        except Exception as exc:
            _forget(session)
            if not isinstance(exc, TransportError):
                await self._leave(invite, f"device error: {type(exc).__name__}: {exc}")
            raise
        finally:
            _forget(session)  # every exit, cancellation included, drops the session's secrets

    def _train(self, invite: RoundInvite, rng: np.random.Generator, coins: NoiseStream) -> NDArray[np.uint32]:
        """Local training and saving the trained model (runs in a worker thread; the session does not touch
        ``coins`` until the update is provided)."""
        update, _ = local_round(self._model, invite, self._data, None, rng, coins=coins)
        self._save_model()
        return update

    async def _finish(
        self, session: DeviceSecAggSession, invite: RoundInvite, result: RoundResult, tally: _Tally
    ) -> RoundOutcome:
        if result.round_id != invite.round_id:
            raise StaleRound(f"result of round {result.round_id} while taking part in round {invite.round_id}")
        _forget(session)
        if not result.committed:
            return self._outcome(
                RoundStatus.ABORTED,
                invite.round_id,
                tally,
                model_version=result.model_version,
                reason=result.reason,
            )
        await asyncio.to_thread(self._save_model)  # off the loop: an atomic write with fsyncs
        _log.info("round %d committed; global model is now version %d", invite.round_id, result.model_version)
        return self._outcome(RoundStatus.COMMITTED, invite.round_id, tally, model_version=result.model_version)

    def _dropped(self, session: DeviceSecAggSession | None, rid: int, tally: _Tally, reason: str) -> RoundOutcome:
        _forget(session)
        return self._outcome(RoundStatus.DROPPED, rid, tally, reason=reason)

    async def _leave(self, invite: RoundInvite, reason: str) -> None:
        # Best effort: tell the server this device leaves, so it need not wait for the deadline.
        if self._identity is None:  # pragma: no cover - a round needs an identity
            return
        abort = Abort(round_id=invite.round_id, device_id=invite.device_id, reason=reason[:MAX_TEXT])
        try:
            await self._transport.request(
                "POST",
                f"/v1/rounds/{invite.round_id}/abort",
                abort,
                token=self._identity.token,
                timeout=self.config.request_timeout,
            )
        except FedRecError as exc:
            _log.debug("could not tell the server this device left round %d: %s", invite.round_id, exc)

    def _charge(self, invite: RoundInvite) -> None:
        if invite.dp_mu <= 0.0:
            return
        self._ledger.charge(invite)
        save_ledger(self.config.store_dir, self._ledger)

    @property
    def privacy_spent(self) -> float:
        """ε this device has been charged so far, by its own ledger, at its policy's δ."""
        return self._ledger.epsilon(self.config.privacy.delta)

    # -- model ------------------------------------------------------------------------------------

    async def _first_contact(self, tally: _Tally) -> None:
        """The server's model, before the first check-in: its shape checked, adopted when newer."""
        fetched = await self._fetch_model(tally)
        if fetched is not None:
            payload, etag = fetched
            await asyncio.to_thread(self._adopt, payload, etag)  # off the loop: unpacking, the item Gram
            await asyncio.to_thread(self._save_model)  # off the loop: an atomic write with fsyncs
            _log.info("adopted the server's model version %d", payload.model_version)
        self._server_model_checked = True

    async def _fetch_model(self, tally: _Tally) -> tuple[ModelPayload, str | None] | None:
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
            raise RemoteProtocolError(f"model download answered with {_name(payload)}")
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
            self._model.set_global(payload.words, payload.values, payload.model_version, **payload.lightfr_extras())
        except ValueError as exc:
            raise RemoteProtocolError(f"model {payload.model_version}: {exc}") from exc
        if isinstance(self._model, LightFRModel):
            # Once per adopted version: the ranking vectors solved against the previous item codes are
            # re-solved against these, in memory, so the next `_save_model` writes codes and vectors in one
            # atomic store file (a crash before it leaves the old model with its old vectors).
            self._model.refresh_ranking(self._data)
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

    async def _sync_model(self, invite: RoundInvite, tally: _Tally) -> None:
        held = self._held_version()
        if held == invite.model_version:
            return
        fetched = await self._fetch_model(tally)
        if fetched is None:
            # The server's current model is the one we hold; it must be the round's.
            raise StaleRound(f"round {invite.round_id} trains model {invite.model_version}, the server serves {held}")
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

    # -- revocation (protocol 1.5) ------------------------------------------------------------------

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
            return await self._refresh_revocations(self.config.authority_key, _Tally())

    async def _refresh_revocations(self, authority: bytes, tally: _Tally) -> RevocationList | None:
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
            raise RemoteProtocolError(f"the revocation list route answered with {_name(payload)}")
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

    # -- identity ---------------------------------------------------------------------------------

    async def _ensure_identity(self, tally: _Tally, certificate: bytes = b"", enrollment_token: str = "") -> Identity:
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
            raise RemoteProtocolError(f"registration answered with {_name(message)}")
        identity = Identity(device_id=message.device_id, token=message.token, certificate=certificate)
        save_identity(self.config.store_dir, identity)
        self._identity = identity
        _log.info("registered as device %d", identity.device_id)
        return identity

    # -- plumbing ---------------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        message: Message | None,
        tally: _Tally,
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
        tally: _Tally,
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


def _forget(session: DeviceSecAggSession | None) -> None:
    # Finish the session locally so it drops its secrets and the plaintext input; nothing is sent.
    if session is not None and session.phase in ACTIVE_PHASES:
        session.abort("left the round")


def _shape(kind: str, rank: int, n_items: int) -> str:
    # What a device must match: LightFR's rank is its code length (DeviceClient's ``bits``).
    return f"{kind!r} with {'bits' if kind == 'lightfr' else 'rank'} {rank} and n_items {n_items}"


def _name(message: Message | None) -> str:
    return "no body" if message is None else type(message).__name__


async def _pause(seconds: float, stop: asyncio.Event | None) -> None:
    if stop is None:
        await asyncio.sleep(seconds)
        return
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass
