# Invariants (h11-style):
# - `TRANSITIONS` lists every legal (role, phase, direction, message type) and the phase it leads to; both
#   `send` and `receive` consult it before doing anything.  Inside a device phase the order is fixed:
#   receive the server's message once, then send the reply once (tracked by `_reply_ready`).
# - Device: any exception moves the session to ERROR and every later call raises LocalProtocolError; on a
#   failed check nothing is released (the reply is built only after every check passed).  The device never
#   releases both the b-share and the s-share for one id: only one UnmaskRequest is ever accepted and it
#   is refused when its lists overlap.
# - Server: a misbehaving device is isolated (it is excluded from the round and the error is raised to the
#   caller); the server session itself moves to ERROR only when its own processing fails.  It never asks
#   for s-shares of devices that dropped before sharing keys: "dropped" is exactly U2 ∖ U3 (pitfall 2).
#   Fewer than t survivors (or fewer than t_min with DP) aborts before any share is requested.
# - No clock, no sockets, no global RNG: deadlines are compared with the `now` the caller passes; key
#   material comes from the OS CSPRNG (via protocol.crypto); noise from the caller's np.random.Generator.
#   The one exception is `FixedDeviceSecrets`, an explicit keyword-only injection for known-answer test
#   vectors (docs/test-vectors); without it (the default) nothing changes.
"""SecAgg+ device and server state machines (DESIGN.md §4–5; Bonawitz et al. 2017; Bell et al. 2020)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import NoReturn

import numpy as np
from numpy.typing import NDArray

from protocol import crypto
from protocol.codec import encode
from protocol.errors import (
    CryptoError,
    FedRecError,
    LocalProtocolError,
    NotEnoughParticipants,
    RemoteProtocolError,
    RoundClosed,
    StaleRound,
)
from protocol.graph import harary_graph
from protocol.masking import MaskedSumAccumulator, mask_input, pair_mask_keys
from protocol.messages import (
    Abort,
    EncryptedShares,
    ErrorMessage,
    MaskedInput,
    MaskedInputRequest,
    Message,
    PublicKeys,
    RoundInvite,
    ShareKeysBroadcast,
    UnmaskRequest,
    UnmaskResponse,
)
from protocol.noise import SkellamDraw, sample_skellam, thin, to_ring
from protocol.shamir import PRIME, SHARE_BYTES, Share, reconstruct, split

__all__ = [
    "ACTIVE_PHASES",
    "Phase",
    "Role",
    "Direction",
    "TRANSITIONS",
    "RoundParameters",
    "SecAggResult",
    "FixedDeviceSecrets",
    "DeviceSecAggSession",
    "ServerSecAggSession",
]


class Phase(Enum):
    """Protocol phase of a session."""

    ADVERTISE_KEYS = "advertise_keys"
    SHARE_KEYS = "share_keys"
    MASKED_INPUT = "masked_input"
    UNMASK = "unmask"
    DONE = "done"
    ABORTED = "aborted"
    ERROR = "error"


class Role(Enum):
    """Which side a transition belongs to."""

    DEVICE = "device"
    SERVER = "server"


class Direction(Enum):
    """Whether the session's owner sends or receives the message."""

    SEND = "send"
    RECEIVE = "receive"


ACTIVE_PHASES = (Phase.ADVERTISE_KEYS, Phase.SHARE_KEYS, Phase.MASKED_INPUT, Phase.UNMASK)
_TERMINAL = frozenset({Phase.DONE, Phase.ABORTED, Phase.ERROR})


def _build_transitions() -> Mapping[tuple[Role, Phase, Direction, type[Message]], Phase]:
    d, s = Role.DEVICE, Role.SERVER
    snd, rcv = Direction.SEND, Direction.RECEIVE
    a, sk, mi, um = ACTIVE_PHASES
    table: dict[tuple[Role, Phase, Direction, type[Message]], Phase] = {
        # device: receive the server's message of the phase, then send its reply, which ends the phase
        (d, a, snd, PublicKeys): sk,
        (d, sk, rcv, ShareKeysBroadcast): sk,
        (d, sk, snd, EncryptedShares): mi,
        (d, mi, rcv, MaskedInputRequest): mi,
        (d, mi, snd, MaskedInput): um,
        (d, um, rcv, UnmaskRequest): um,
        (d, um, snd, UnmaskResponse): Phase.DONE,
        # server: the phase broadcast goes out and the devices' replies come in; phases close on quorum
        # or deadline (`advance`), not on a message
        (s, a, snd, RoundInvite): a,
        (s, a, rcv, PublicKeys): a,
        (s, sk, snd, ShareKeysBroadcast): sk,
        (s, sk, rcv, EncryptedShares): sk,
        (s, mi, snd, MaskedInputRequest): mi,
        (s, mi, rcv, MaskedInput): mi,
        (s, um, snd, UnmaskRequest): um,
        (s, um, rcv, UnmaskResponse): um,
        (s, Phase.ABORTED, snd, Abort): Phase.ABORTED,
    }
    for phase in ACTIVE_PHASES:
        table[(d, phase, rcv, Abort)] = Phase.ABORTED
        table[(d, phase, rcv, ErrorMessage)] = Phase.ABORTED
        table[(d, phase, snd, Abort)] = Phase.ABORTED
        # a device leaving (Abort) or reporting an error is a dropout; the round goes on
        table[(s, phase, rcv, Abort)] = phase
        table[(s, phase, rcv, ErrorMessage)] = phase
        table[(s, phase, snd, Abort)] = phase  # to a device that was dropped from the round
    return MappingProxyType(table)


#: Every legal (role, phase, direction, message type) → the phase after it.
TRANSITIONS: Mapping[tuple[Role, Phase, Direction, type[Message]], Phase] = _build_transitions()

# The message each device phase sends, and each server phase broadcasts.
_DEVICE_REPLY: Mapping[Phase, type[Message]] = MappingProxyType(
    {
        Phase.ADVERTISE_KEYS: PublicKeys,
        Phase.SHARE_KEYS: EncryptedShares,
        Phase.MASKED_INPUT: MaskedInput,
        Phase.UNMASK: UnmaskResponse,
    }
)
_SERVER_BROADCAST: Mapping[Phase, type[Message]] = MappingProxyType(
    {
        Phase.ADVERTISE_KEYS: RoundInvite,
        Phase.SHARE_KEYS: ShareKeysBroadcast,
        Phase.MASKED_INPUT: MaskedInputRequest,
        Phase.UNMASK: UnmaskRequest,
    }
)
_SERVER_EXPECTS: Mapping[type[Message], Phase] = MappingProxyType(
    {
        PublicKeys: Phase.ADVERTISE_KEYS,
        EncryptedShares: Phase.SHARE_KEYS,
        MaskedInput: Phase.MASKED_INPUT,
        UnmaskResponse: Phase.UNMASK,
    }
)

_ID_BYTES = 8
_SHARE_PLAINTEXT_BYTES = 2 * _ID_BYTES + 2 * SHARE_BYTES


# --------------------------------------------------------------------------------------------- device


@dataclass(frozen=True, slots=True, kw_only=True)
class FixedDeviceSecrets:
    """Every secret a device session would draw from the OS CSPRNG, fixed: for known-answer vectors ONLY.

    A session given these is fully deterministic, which is what `docs/test-vectors` needs to publish
    byte-exact rounds; a production device must never pass them (reused keys, seeds or nonces across
    rounds destroy the privacy of every round that shares them).

    Attributes
    ----------
    c_private_key, s_private_key : bytes
        Raw 32-byte X25519 private scalars of the share-encryption and mask key pairs.
    self_mask_seed : bytes
        The 32-byte self-mask seed b_u.
    b_coefficients, s_coefficients : tuple of int
        The t - 1 non-constant Shamir coefficients a_1..a_{t-1} (field elements below 2**521 - 1) of the
        polynomials that share b_u and the s private key; the constant term is the secret itself.
    share_nonces : mapping of int to bytes
        Recipient id → 12-byte AES-GCM nonce of the share ciphertext addressed to it.
    """

    c_private_key: bytes
    s_private_key: bytes
    self_mask_seed: bytes
    b_coefficients: tuple[int, ...]
    s_coefficients: tuple[int, ...]
    share_nonces: Mapping[int, bytes]

    def __post_init__(self) -> None:
        for name in ("c_private_key", "s_private_key", "self_mask_seed"):
            value = getattr(self, name)
            if type(value) is not bytes or len(value) != crypto.KEY_BYTES:
                raise ValueError(f"{name} must be {crypto.KEY_BYTES} bytes")
        for name in ("b_coefficients", "s_coefficients"):
            values = getattr(self, name)
            if type(values) is not tuple or not all(type(c) is int and 0 <= c < PRIME for c in values):
                raise ValueError(f"{name} must be a tuple of field elements")
        if any(type(n) is not bytes or len(n) != crypto.NONCE_BYTES for n in self.share_nonces.values()):
            raise ValueError(f"share nonces must be {crypto.NONCE_BYTES} bytes")

    def shares(self, secret: bytes, coefficients: tuple[int, ...], t: int, count: int) -> list[Share]:
        """Evaluate secret + a_1 x + ... + a_{t-1} x^{t-1} at x = 1..count (what `shamir.split` returns).

        Raises
        ------
        LocalProtocolError
            The number of coefficients does not match the threshold.
        """
        if len(coefficients) != t - 1:
            raise LocalProtocolError(f"fixed secrets carry {len(coefficients)} coefficients, t={t} needs {t - 1}")
        top_down = (int.from_bytes(secret, "big"), *coefficients)[::-1]
        out = []
        for x in range(1, count + 1):
            y = 0
            for c in top_down:
                y = (y * x + c) % PRIME
            out.append(Share(x, y))
        return out


class DeviceSecAggSession:
    """One device's side of one SecAgg+ round.

    Drive it with `send` (returns the next message to upload) and `receive` (a message from the server);
    give it the quantized update with `provide_input` any time before the masked-input reply.

    Parameters
    ----------
    invite : RoundInvite
        The round's parameters, addressed to this device.
    rng : np.random.Generator
        Source of the DP noise and thinning coins (seeded by the caller from ``secrets``).
    fixed_secrets : FixedDeviceSecrets, optional
        Known-answer vectors and tests only: use these keys, seed, Shamir coefficients and nonces instead
        of the OS CSPRNG.  Leave None (the default) everywhere else.
    """

    def __init__(
        self, invite: RoundInvite, *, rng: np.random.Generator, fixed_secrets: FixedDeviceSecrets | None = None
    ) -> None:
        if not isinstance(invite, RoundInvite):
            raise TypeError("invite must be a RoundInvite")
        if fixed_secrets is not None and not isinstance(fixed_secrets, FixedDeviceSecrets):
            raise TypeError("fixed_secrets must be a FixedDeviceSecrets")
        self.invite = invite
        self._rng = rng
        self._fixed = fixed_secrets
        self._phase = Phase.ADVERTISE_KEYS
        self._reply_ready = True  # the invite is the ADVERTISE_KEYS request
        if fixed_secrets is None:
            self._c = crypto.generate_key_pair()
            self._s = crypto.generate_key_pair()
        else:
            self._c = crypto.key_pair_from_private_bytes(fixed_secrets.c_private_key)
            self._s = crypto.key_pair_from_private_bytes(fixed_secrets.s_private_key)
        self._session: bytes | None = None
        self._seed = b""
        self._neighbours: dict[int, tuple[bytes, bytes]] = {}
        self._index: dict[int, int] = {}  # neighbour id -> Shamir index of the shares we sent it
        self._held_b: dict[int, Share] = {}
        self._held_s: dict[int, Share] = {}
        self._u2: tuple[int, ...] = ()
        self._input: NDArray[np.uint32] | None = None
        self._noise: SkellamDraw | None = None
        self._kept_after_reply: SkellamDraw | None = None
        self._pending: Message | None = None
        self.abort_reason: str | None = None

    # -- public API -----------------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """Current phase."""
        return self._phase

    @property
    def device_id(self) -> int:
        """This device's id."""
        return self.invite.device_id

    @property
    def session_id(self) -> bytes | None:
        """The session id, once the ShareKeys broadcast arrived."""
        return self._session

    def provide_input(self, x: NDArray[np.uint32]) -> None:
        """Set q(x_u), the quantized update (uint32 ring elements, length L).

        Raises
        ------
        LocalProtocolError
            Wrong dtype/shape, or the masked input was already sent.
        """
        self._guard()
        if self._phase not in (Phase.ADVERTISE_KEYS, Phase.SHARE_KEYS, Phase.MASKED_INPUT):
            self._fail(LocalProtocolError(f"input can no longer be changed in phase {self._phase.name}"))
        if not isinstance(x, np.ndarray) or x.dtype != np.uint32 or x.shape != (self.invite.vector_length,):
            self._fail(LocalProtocolError(f"input must be a uint32 vector of length {self.invite.vector_length}"))
        self._input = x.copy()

    def send(self) -> Message:
        """Return the next message to upload and advance the phase.

        Returns
        -------
        Message
            PublicKeys, EncryptedShares, MaskedInput or UnmaskResponse, by phase.

        Raises
        ------
        LocalProtocolError
            Nothing to send yet (the server's message of the phase has not arrived, or no input), or the
            session is finished or in ERROR.
        """
        self._guard()
        reply_type = _DEVICE_REPLY.get(self._phase)
        if reply_type is None:  # pragma: no cover - _guard handles the terminal phases
            self._fail(LocalProtocolError(f"nothing to send in phase {self._phase.name}"))
        key = (Role.DEVICE, self._phase, Direction.SEND, reply_type)
        if key not in TRANSITIONS:  # pragma: no cover - every active phase has its reply in the table
            self._fail(LocalProtocolError(f"{reply_type.__name__} cannot be sent in {self._phase.name}"))
        if not self._reply_ready:
            self._fail(
                LocalProtocolError(
                    f"cannot send {reply_type.__name__}: the server's {self._phase.name} message is missing"
                )
            )
        try:
            if self._phase is Phase.ADVERTISE_KEYS:
                message: Message = PublicKeys(
                    round_id=self.invite.round_id,
                    device_id=self.device_id,
                    c_public_key=self._c.public_key,
                    s_public_key=self._s.public_key,
                )
            elif self._phase is Phase.MASKED_INPUT:
                message = self._masked_input()
            else:
                if self._pending is None:  # pragma: no cover - _reply_ready implies a pending reply
                    raise LocalProtocolError("no reply prepared")
                message = self._pending
        except Exception as exc:
            self._fail(exc)
        self._pending = None
        self._reply_ready = False
        if self._kept_after_reply is not None:
            self._noise, self._kept_after_reply = self._kept_after_reply, None
        self._phase = TRANSITIONS[key]
        return message

    def receive(self, message: Message) -> None:
        """Process a message from the server.

        Raises
        ------
        RemoteProtocolError
            The message is not legal in this phase, or fails one of the device's checks (DESIGN.md §4).
        StaleRound
            The message belongs to another round or session (replay).
        CryptoError
            A share ciphertext failed authentication.
        LocalProtocolError
            The session already failed.
        """
        self._guard()
        key = (Role.DEVICE, self._phase, Direction.RECEIVE, type(message))
        if key not in TRANSITIONS:
            self._fail(RemoteProtocolError(f"{type(message).__name__} is not allowed in phase {self._phase.name}"))
        try:
            if isinstance(message, Abort | ErrorMessage):
                self._check_round(message.round_id if isinstance(message, Abort) else None)
                self.abort_reason = message.reason if isinstance(message, Abort) else message.message
                self._drop_secrets()
                self._phase = TRANSITIONS[key]
                return
            if self._reply_ready:
                raise RemoteProtocolError(f"{type(message).__name__} received twice in phase {self._phase.name}")
            if isinstance(message, ShareKeysBroadcast):
                self._pending = self._on_share_keys(message)
            elif isinstance(message, MaskedInputRequest):
                self._on_masked_input_request(message)
            elif isinstance(message, UnmaskRequest):
                self._pending = self._on_unmask_request(message)
        except Exception as exc:
            self._fail(exc)
        self._reply_ready = True
        self._phase = TRANSITIONS[key]

    def abort(self, reason: str = "") -> Abort:
        """Leave the round; returns the Abort to send (best effort).

        Raises
        ------
        LocalProtocolError
            The session is already finished or failed.
        """
        self._guard()
        if (Role.DEVICE, self._phase, Direction.SEND, Abort) not in TRANSITIONS:
            self._fail(LocalProtocolError(f"cannot abort in phase {self._phase.name}"))
        self._drop_secrets()
        self.abort_reason = reason
        self._phase = Phase.ABORTED
        return Abort(round_id=self.invite.round_id, device_id=self.device_id, reason=reason)

    def kept_noise(self) -> NDArray[np.int64]:
        """The DP noise this device's masked input currently carries (local only; for simulations).

        Returns
        -------
        ndarray of int64, shape (L,)
            Zeros without DP or before the masked input was built.
        """
        if self._noise is None:
            return np.zeros(self.invite.vector_length, dtype=np.int64)
        return self._noise.value()

    # -- internals ------------------------------------------------------------------------------------

    def _guard(self) -> None:
        if self._phase is Phase.ERROR:
            raise LocalProtocolError("the session failed earlier and cannot be used")
        if self._phase in _TERMINAL:
            self._fail(LocalProtocolError(f"the session is finished ({self._phase.name})"))

    def _fail(self, exc: BaseException) -> NoReturn:
        self._phase = Phase.ERROR
        self._pending = None
        self._drop_secrets()
        raise exc

    def _drop_secrets(self) -> None:
        self._held_b.clear()
        self._held_s.clear()
        self._input = None

    def _check_round(self, round_id: int | None) -> None:
        if round_id is not None and round_id != self.invite.round_id:
            raise StaleRound(f"message for round {round_id}, this session is round {self.invite.round_id}")

    def _check_addressing(self, message: ShareKeysBroadcast | MaskedInputRequest | UnmaskRequest) -> None:
        self._check_round(message.round_id)
        if message.device_id != self.device_id:
            raise RemoteProtocolError(f"message addressed to device {message.device_id}, we are {self.device_id}")
        if self._session is not None and message.session_id != self._session:
            raise StaleRound("session id mismatch: the message belongs to another session (replay?)")

    def _on_share_keys(self, msg: ShareKeysBroadcast) -> EncryptedShares:
        self._check_addressing(msg)
        me, inv = self.device_id, self.invite
        ids = msg.neighbour_ids
        if len(set(ids)) != len(ids):
            raise RemoteProtocolError("ShareKeys broadcast lists a device twice")
        if me not in ids:
            raise RemoteProtocolError("ShareKeys broadcast omits this device")
        keys = dict(zip(ids, zip(msg.c_public_keys, msg.s_public_keys, strict=True), strict=True))
        if keys[me] != (self._c.public_key, self._s.public_key):
            raise RemoteProtocolError("ShareKeys broadcast altered this device's own public keys")
        all_keys = [*msg.c_public_keys, *msg.s_public_keys]
        if len(set(all_keys)) != len(all_keys):
            raise RemoteProtocolError("ShareKeys broadcast contains repeated public keys")
        if len(ids) < inv.graph_t:
            raise RemoteProtocolError(f"neighbourhood of {len(ids)} is below the threshold t={inv.graph_t}")
        if len(ids) > inv.graph_k:
            raise RemoteProtocolError(f"neighbourhood of {len(ids)} exceeds k={inv.graph_k}")
        self._session = msg.session_id
        self._neighbours = keys
        order = sorted(ids)
        self._index = {v: i + 1 for i, v in enumerate(order)}
        # Self-mask seed b_u and the s private key, shared t-of-|N(u)| (Bonawitz et al. 2017, round 1).
        fixed = self._fixed
        if fixed is None:
            seed = crypto.random_seed()
            b_shares = split(seed, inv.graph_t, len(order))
            s_shares = split(self._s.private_bytes(), inv.graph_t, len(order))
        else:
            seed = fixed.self_mask_seed
            b_shares = fixed.shares(seed, fixed.b_coefficients, inv.graph_t, len(order))
            s_shares = fixed.shares(self._s.private_bytes(), fixed.s_coefficients, inv.graph_t, len(order))
        self._seed = seed
        recipients, ciphertexts = [], []
        for v, b_share, s_share in zip(order, b_shares, s_shares, strict=True):
            if v == me:
                self._held_b[me], self._held_s[me] = b_share, s_share
                continue
            plaintext = (
                me.to_bytes(_ID_BYTES, "big") + v.to_bytes(_ID_BYTES, "big") + b_share.to_bytes() + s_share.to_bytes()
            )
            key = crypto.share_encryption_key(crypto.x25519(self._c.private_key, keys[v][0]), msg.session_id, me, v)
            recipients.append(v)
            nonce = None if fixed is None else fixed.share_nonces[v]
            ciphertexts.append(
                crypto.aead_encrypt(key, plaintext, crypto.share_associated_data(msg.session_id, me, v), nonce=nonce)
            )
        return EncryptedShares(
            round_id=inv.round_id,
            device_id=me,
            session_id=msg.session_id,
            recipient_ids=tuple(recipients),
            ciphertexts=tuple(ciphertexts),
        )

    def _on_masked_input_request(self, msg: MaskedInputRequest) -> None:
        self._check_addressing(msg)
        me, session = self.device_id, self._session
        if session is None:  # pragma: no cover - the table only allows this after ShareKeys
            raise LocalProtocolError("no session id")
        senders = msg.sender_ids
        if len(set(senders)) != len(senders):
            raise RemoteProtocolError("MaskedInputRequest lists a sender twice")
        for v in senders:
            if v == me or v not in self._neighbours:
                raise RemoteProtocolError(f"MaskedInputRequest carries shares from non-neighbour {v}")
        if len(senders) + 1 < self.invite.graph_t:
            raise RemoteProtocolError(
                f"only {len(senders) + 1} neighbours shared keys, below the threshold t={self.invite.graph_t}"
            )
        held_b: dict[int, Share] = {}
        held_s: dict[int, Share] = {}
        for v, blob in zip(senders, msg.ciphertexts, strict=True):
            key = crypto.share_encryption_key(
                crypto.x25519(self._c.private_key, self._neighbours[v][0]), session, v, me
            )
            plaintext = crypto.aead_decrypt(key, blob, crypto.share_associated_data(session, v, me))
            if len(plaintext) != _SHARE_PLAINTEXT_BYTES:
                raise CryptoError(f"share plaintext from {v} has the wrong length")
            src = int.from_bytes(plaintext[:_ID_BYTES], "big")
            dst = int.from_bytes(plaintext[_ID_BYTES : 2 * _ID_BYTES], "big")
            if (src, dst) != (v, me):
                raise CryptoError(f"share from {v} names src={src}, dst={dst}")
            held_b[v] = Share.from_bytes(plaintext[2 * _ID_BYTES : 2 * _ID_BYTES + SHARE_BYTES])
            held_s[v] = Share.from_bytes(plaintext[2 * _ID_BYTES + SHARE_BYTES :])
        self._held_b.update(held_b)
        self._held_s.update(held_s)
        self._u2 = tuple(sorted((*senders, me)))

    def _masked_input(self) -> MaskedInput:
        inv, me, session = self.invite, self.device_id, self._session
        if self._input is None:
            raise LocalProtocolError("provide_input() must be called before the masked input is sent")
        if session is None:  # pragma: no cover
            raise LocalProtocolError("no session id")
        value = self._input
        if inv.dp_mu > 0.0:
            # Skellam(mu / t_min): enough noise even if only t_min devices survive (DESIGN.md §5).
            self._noise = sample_skellam(inv.dp_mu / inv.dp_t_min, inv.vector_length, self._rng)
            value = value + to_ring(self._noise.value())
        peers = {v: self._neighbours[v][1] for v in self._u2 if v != me}
        y = mask_input(
            value,
            device_id=me,
            self_key=crypto.self_mask_key(self._seed, session, me),
            pair_keys=pair_mask_keys(self._s.private_bytes(), peers, session, me),
        )
        self._input = None  # the update is no longer needed on this path
        return MaskedInput(round_id=inv.round_id, device_id=me, session_id=session, masked=y)

    def _on_unmask_request(self, msg: UnmaskRequest) -> UnmaskResponse:
        self._check_addressing(msg)
        me, inv, session = self.device_id, self.invite, self._session
        survivors, dropped = msg.survivors, msg.dropped
        # Malicious-server checks (Bonawitz et al. 2017 round 4; FCP client R3; pitfall 3).
        if me in dropped:
            raise RemoteProtocolError("UnmaskRequest lists this device as dropped")
        if len(set(survivors)) != len(survivors) or len(set(dropped)) != len(dropped):
            raise RemoteProtocolError("UnmaskRequest lists a device twice")
        both = set(survivors) & set(dropped)
        if both:
            raise RemoteProtocolError(f"UnmaskRequest lists {sorted(both)} as both survivor and dropped")
        u2 = set(self._u2)
        outside = [v for v in (*survivors, *dropped) if v not in u2]
        if outside:
            raise RemoteProtocolError(
                f"UnmaskRequest names {sorted(outside)}, not neighbours that shared keys with this device"
            )
        if me not in survivors:
            raise RemoteProtocolError("UnmaskRequest does not list this device as a survivor")
        if len(survivors) < inv.graph_t:
            raise RemoteProtocolError(
                f"only {len(survivors)} surviving neighbours, below the threshold t={inv.graph_t}"
            )
        if msg.n_survivors < len(survivors):
            raise RemoteProtocolError("n_survivors is smaller than the survivor list")
        excess = np.zeros(0, dtype=np.uint32)
        if inv.dp_mu > 0.0:
            if msg.n_survivors < inv.dp_t_min:
                raise RemoteProtocolError(
                    f"{msg.n_survivors} survivors is below t_min={inv.dp_t_min}: the noise would not cover mu"
                )
            if self._noise is None:  # pragma: no cover - set when the masked input was built
                raise LocalProtocolError("no noise to correct")
            # Keep Skellam(mu / s) by binomial thinning; the excess is independent of what stays (§5).
            kept, revealed = thin(self._noise, inv.dp_t_min / msg.n_survivors, self._rng)
            self._kept_after_reply = kept  # takes effect only once the excess is actually sent
            excess = to_ring(revealed)
        b_ids = tuple(sorted(survivors))
        s_ids = tuple(sorted(dropped))
        response = UnmaskResponse(
            round_id=inv.round_id,
            device_id=me,
            session_id=session or b"",
            b_share_ids=b_ids,
            b_shares=tuple(self._held_b[v].to_bytes() for v in b_ids),
            s_share_ids=s_ids,
            s_shares=tuple(self._held_s[v].to_bytes() for v in s_ids),
            dp_excess=excess,
        )
        # After answering, nothing else may ever be released.
        self._held_b.clear()
        self._held_s.clear()
        return response


# --------------------------------------------------------------------------------------------- server


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundParameters:
    """Server-side parameters of one round (what every `RoundInvite` carries).

    Attributes
    ----------
    round_id, vector_length, k, t, clip_norm, scale_bits, dp_mu, dp_t_min
        As in `RoundInvite` (k = graph_k, t = graph_t).
    deadlines : tuple of 4 floats
        Absolute deadlines of ADVERTISE_KEYS, SHARE_KEYS, MASKED_INPUT and UNMASK.
    """

    round_id: int
    vector_length: int
    k: int
    t: int
    clip_norm: float = 1.0
    scale_bits: int = 16
    dp_mu: float = 0.0
    dp_t_min: int = 0
    deadlines: tuple[float, float, float, float]

    def invite(self, device_id: int) -> RoundInvite:
        """The invite for one device.

        Raises
        ------
        ValueError
            The parameters do not make a valid invite.
        """
        d0, d1, d2, d3 = self.deadlines
        return RoundInvite(
            round_id=self.round_id,
            device_id=device_id,
            vector_length=self.vector_length,
            graph_k=self.k,
            graph_t=self.t,
            clip_norm=float(self.clip_norm),
            scale_bits=self.scale_bits,
            dp_mu=float(self.dp_mu),
            dp_t_min=self.dp_t_min,
            advertise_deadline=d0,
            share_keys_deadline=d1,
            masked_input_deadline=d2,
            unmask_deadline=d3,
        )


@dataclass(frozen=True, slots=True)
class SecAggResult:
    """Outcome of a completed round.

    Attributes
    ----------
    total : ndarray of uint32, shape (L,)
        Σ_{u ∈ U3} (q(x_u) + kept noise_u) mod 2**32.
    survivors : frozenset of int
        U3, the devices whose input is in ``total``.
    dropouts : mapping of Phase to frozenset of int
        Devices lost in each phase (missed the deadline, left, or were excluded after an error).
    corrected : frozenset of int
        Survivors whose DP excess was revealed and removed.
    """

    total: NDArray[np.uint32]
    survivors: frozenset[int]
    dropouts: Mapping[Phase, frozenset[int]]
    corrected: frozenset[int]


class ServerSecAggSession:
    """The server's side of one SecAgg+ round (semi-honest server).

    Call `receive` from request handlers, `advance` from a ticker, and read each device's next message
    with `outbox`.

    Parameters
    ----------
    params : RoundParameters
        Round parameters.
    device_ids : sequence of int
        The invited cohort.
    rng : np.random.Generator
        Randomness for the Harary graph placement.

    Raises
    ------
    ConfigError, ValueError
        Invalid parameters (k even and below n, t > k, bad invite fields, duplicate ids).
    """

    def __init__(
        self,
        params: RoundParameters,
        device_ids: Sequence[int],
        *,
        rng: np.random.Generator,
        defer_finish: bool = False,
    ) -> None:
        ids = [int(i) for i in device_ids]
        if len(set(ids)) != len(ids):
            raise ValueError("device ids must be distinct")
        self.params = params
        self._invites = {u: params.invite(u) for u in ids}  # validates every field once
        if params.k < len(ids) and params.k % 2 == 0:
            harary_graph(ids, params.k, rng)  # raises the graph module's ConfigError
        self._rng = rng
        self._phase = Phase.ADVERTISE_KEYS
        self.invited: frozenset[int] = frozenset(ids)
        self._keys: dict[int, tuple[bytes, bytes]] = {}
        self._used_keys: set[bytes] = set()
        self._defer_finish = defer_finish
        self._finishing = False
        self._failed: set[int] = set()
        self._left: set[int] = set()
        self._dropouts: dict[Phase, set[int]] = {p: set() for p in ACTIVE_PHASES}
        self._graph: dict[int, tuple[int, ...]] = {}
        self._session: bytes = b""
        self._u1: frozenset[int] = frozenset()
        self._u2: frozenset[int] = frozenset()
        self._u3: frozenset[int] = frozenset()
        self._shares_out: dict[int, dict[int, bytes]] = {}  # dst -> src -> ciphertext
        self._sent_shares: set[int] = set()
        self._masked_from: set[int] = set()
        self._digests: dict[int, bytes] = {}  # device -> fingerprint of its message in the current phase
        self._acc: MaskedSumAccumulator | None = None
        self._b_shares: dict[int, list[Share]] = {}
        self._s_shares: dict[int, list[Share]] = {}
        self._responded: set[int] = set()
        self._corrected: set[int] = set()
        self._result: SecAggResult | None = None
        self._abort_error: FedRecError | None = None

    # -- public API -----------------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """Current phase."""
        return self._phase

    @property
    def session_id(self) -> bytes:
        """Session id (empty until ADVERTISE_KEYS closed)."""
        return self._session

    @property
    def dropouts(self) -> Mapping[Phase, frozenset[int]]:
        """Devices lost per phase so far."""
        return MappingProxyType({p: frozenset(s) for p, s in self._dropouts.items()})

    @property
    def abort_error(self) -> FedRecError | None:
        """Why the round aborted (None unless ABORTED)."""
        return self._abort_error

    @property
    def finishing(self) -> bool:
        """UNMASK has closed and the mask removal waits for `finish` (only with ``defer_finish``)."""
        return self._finishing

    def expected(self) -> frozenset[int]:
        """Devices whose message for the current phase is still awaited."""
        return frozenset(self._expected_set() - self._done_set())

    def receive(self, device_id: int, message: Message, *, digest: bytes | None = None) -> None:
        """Accept one device's message.

        A device whose message is illegal is excluded from the round (a dropout) and the error is raised
        for the caller to report; the round itself goes on.  An identical retransmission is ignored.
        ``digest`` identifies the message's bytes (the SHA-256 of the request body, say); without it
        the message is encoded again to be hashed.

        Raises
        ------
        RoundClosed
            The message is for a phase that already closed, or the round is over.
        RemoteProtocolError
            Unknown or excluded device, sender mismatch, message illegal in this phase, wrong session,
            or contents that break the protocol.
        LocalProtocolError
            The server session is in ERROR.
        """
        self._guard()
        if device_id not in self.invited:
            raise RemoteProtocolError(f"device {device_id} is not part of round {self.params.round_id}")
        if device_id in self._failed:
            raise RemoteProtocolError(f"device {device_id} was excluded from this round after a protocol error")
        if self._phase in (Phase.DONE, Phase.ABORTED):
            raise RoundClosed(f"round {self.params.round_id} is {self._phase.name}")
        if self._finishing:
            raise RoundClosed(f"round {self.params.round_id} closed UNMASK and is finishing")
        if device_id in self._left:
            raise RoundClosed(f"device {device_id} left the round")
        key = (Role.SERVER, self._phase, Direction.RECEIVE, type(message))
        if key not in TRANSITIONS:
            target = _SERVER_EXPECTS.get(type(message))
            if target is not None and ACTIVE_PHASES.index(target) < ACTIVE_PHASES.index(self._phase):
                raise RoundClosed(f"{type(message).__name__} arrived after {target.name} closed")
            self._exclude(device_id)
            raise RemoteProtocolError(f"{type(message).__name__} is not allowed in phase {self._phase.name}")
        if isinstance(message, Abort | ErrorMessage):
            self._left.add(device_id)
            self._maybe_close()
            return
        if getattr(message, "device_id", device_id) != device_id:
            self._exclude(device_id)
            raise RemoteProtocolError(
                f"message claims device {getattr(message, 'device_id', None)}, sent by {device_id}"
            )
        if device_id not in self._expected_set():
            raise RoundClosed(f"device {device_id} is not part of phase {self._phase.name}")
        if digest is None:
            digest = hashlib.sha256(encode(message)).digest()
        if device_id in self._done_set():
            if self._digests.get(device_id) == digest:
                return  # idempotent retry (e.g. an HTTP retransmission)
            # The first message stands (a masked input is already in the sum and cannot be taken out).
            raise RemoteProtocolError(f"device {device_id} sent a second, different {type(message).__name__}")
        try:
            self._accept(device_id, message)
        except FedRecError:
            self._exclude(device_id)
            raise
        self._digests[device_id] = digest
        self._maybe_close()

    def advance(self, now: float) -> Phase:
        """Close every phase whose deadline has passed at ``now``.

        Parameters
        ----------
        now : float
            The caller's clock, same timebase as the deadlines.

        Returns
        -------
        Phase
            The phase after advancing.
        """
        self._guard()
        while (
            self._phase in ACTIVE_PHASES
            and not self._finishing
            and now >= self.params.deadlines[ACTIVE_PHASES.index(self._phase)]
        ):
            self._close_phase()
        return self._phase

    def outbox(self, device_id: int) -> Message | None:
        """The message a device should receive now.

        Returns
        -------
        Message or None
            The current phase's broadcast for a device that is part of it, `Abort` for a device that is
            not (dropped, excluded) or when the round aborted, None when the round is DONE.

        Raises
        ------
        RemoteProtocolError
            Unknown device.
        LocalProtocolError
            The server session is in ERROR.
        """
        self._guard()
        if device_id not in self.invited:
            raise RemoteProtocolError(f"device {device_id} is not part of round {self.params.round_id}")
        rid = self.params.round_id
        if self._phase is Phase.DONE or self._finishing:
            return None
        if self._phase is Phase.ABORTED:
            return Abort(round_id=rid, device_id=device_id, reason=str(self._abort_error or "aborted"))
        if device_id in self._failed or device_id in self._left or device_id not in self._expected_set():
            return Abort(round_id=rid, device_id=device_id, reason=f"dropped before {self._phase.name}")
        message = self._broadcast(device_id)
        if (Role.SERVER, self._phase, Direction.SEND, type(message)) not in TRANSITIONS:  # pragma: no cover
            raise LocalProtocolError(f"{type(message).__name__} cannot be sent in {self._phase.name}")
        return message

    def abort(self, reason: str) -> None:
        """Abort the round from the coordinator's side (nothing further is revealed)."""
        self._guard()
        if self._finishing:
            raise LocalProtocolError("the round is finishing; it cannot be aborted now")
        if self._phase in ACTIVE_PHASES:
            self._abort(RoundClosed(reason))

    def finish(self) -> Phase:
        """Remove the masks after UNMASK closed (``defer_finish``): the CPU-heavy part of a round.

        While `finishing`, nothing else changes this session (receive refuses, advance and abort
        wait), so a caller may run this in another thread.

        Returns
        -------
        Phase
            DONE, or ABORTED when too few shares came back.

        Raises
        ------
        LocalProtocolError
            Not finishing.
        CryptoError
            A reconstructed key does not match its advertised key (the session moves to ERROR).
        """
        self._guard()
        if not self._finishing:
            raise LocalProtocolError(f"nothing to finish in phase {self._phase.name}")
        try:
            self._remove_masks()
        except NotEnoughParticipants as exc:
            self._abort(exc)
        except Exception:
            self._phase = Phase.ERROR
            raise
        finally:
            self._finishing = False
        return self._phase

    def result(self) -> SecAggResult:
        """The aggregate of a completed round.

        Raises
        ------
        NotEnoughParticipants
            The round aborted for lack of survivors.
        RoundClosed
            The round aborted for another reason.
        LocalProtocolError
            The round is not finished, or the session is in ERROR.
        """
        self._guard()
        if self._phase is Phase.ABORTED:
            raise self._abort_error or RoundClosed("round aborted")
        if self._result is None:
            raise LocalProtocolError(f"no result yet: phase {self._phase.name}")
        return self._result

    # -- internals ------------------------------------------------------------------------------------

    def _guard(self) -> None:
        if self._phase is Phase.ERROR:
            raise LocalProtocolError("the server session failed earlier and cannot be used")

    def _exclude(self, device_id: int) -> None:
        self._failed.add(device_id)
        self._maybe_close()

    def _abort(self, error: FedRecError) -> None:
        self._abort_error = error
        self._phase = Phase.ABORTED
        # Forget everything that could help reconstruct anything.
        self._b_shares.clear()
        self._s_shares.clear()
        self._shares_out.clear()
        self._acc = None

    def _expected_set(self) -> frozenset[int]:
        phase = self._phase
        if phase is Phase.ADVERTISE_KEYS:
            return self.invited
        if phase is Phase.SHARE_KEYS:
            return self._u1
        if phase is Phase.MASKED_INPUT:
            return self._u2
        if phase is Phase.UNMASK:
            return self._u3
        return frozenset()

    def _done_set(self) -> set[int] | frozenset[int]:
        phase = self._phase
        if phase is Phase.ADVERTISE_KEYS:
            return frozenset(self._keys)
        if phase is Phase.SHARE_KEYS:
            return self._sent_shares
        if phase is Phase.MASKED_INPUT:
            return self._masked_from
        if phase is Phase.UNMASK:
            return self._responded
        return frozenset()

    def _maybe_close(self) -> None:
        if self._phase not in ACTIVE_PHASES or self._finishing:
            return
        waiting = self._expected_set() - self._done_set() - self._failed - self._left
        if not waiting:
            self._close_phase()

    def _close_phase(self) -> None:
        try:
            {
                Phase.ADVERTISE_KEYS: self._close_advertise,
                Phase.SHARE_KEYS: self._close_share_keys,
                Phase.MASKED_INPUT: self._close_masked_input,
                Phase.UNMASK: self._close_unmask,
            }[self._phase]()
        except NotEnoughParticipants as exc:
            self._abort(exc)
        except Exception:
            self._phase = Phase.ERROR
            raise

    def _need(self, count: int, what: str) -> None:
        p = self.params
        if count < p.t:
            raise NotEnoughParticipants(f"{count} {what}, below the threshold t={p.t}; round aborted unrevealed")
        if p.dp_mu > 0.0 and count < p.dp_t_min:
            raise NotEnoughParticipants(f"{count} {what}, below t_min={p.dp_t_min} needed for the DP guarantee")

    def _accept(self, u: int, message: Message) -> None:
        p = self.params
        round_id = getattr(message, "round_id", None)
        if round_id != p.round_id:
            raise StaleRound(f"message for round {round_id}, this is round {p.round_id}")
        if isinstance(message, PublicKeys):
            pair = (message.c_public_key, message.s_public_key)
            if pair[0] in self._used_keys or pair[1] in self._used_keys:
                raise RemoteProtocolError(f"device {u} advertised a key another device already uses")
            self._keys[u] = pair
            self._used_keys.update(pair)
            return
        if getattr(message, "session_id", self._session) != self._session:
            raise StaleRound("session id mismatch: the message belongs to another session")
        if isinstance(message, EncryptedShares):
            expected = tuple(v for v in self._graph[u] if v != u)
            if message.recipient_ids != expected:
                raise RemoteProtocolError(f"device {u} must send one ciphertext to each of {expected}")
            for v, blob in zip(message.recipient_ids, message.ciphertexts, strict=True):
                self._shares_out.setdefault(v, {})[u] = blob
            self._sent_shares.add(u)
        elif isinstance(message, MaskedInput):
            if message.masked.shape != (p.vector_length,):
                raise RemoteProtocolError(
                    f"masked input has length {message.masked.shape[0]}, expected {p.vector_length}"
                )
            if self._acc is None:  # pragma: no cover - created when SHARE_KEYS closed
                raise LocalProtocolError("no accumulator")
            self._acc.add(message.masked)  # streaming: the vector is not kept
            self._masked_from.add(u)
        elif isinstance(message, UnmaskResponse):
            self._accept_unmask(u, message)

    def _accept_unmask(self, u: int, message: UnmaskResponse) -> None:
        p = self.params
        want_b = tuple(v for v in self._graph[u] if v in self._u3)
        want_s = tuple(v for v in self._graph[u] if v in self._u2 and v not in self._u3)
        if message.b_share_ids != want_b or message.s_share_ids != want_s:
            raise RemoteProtocolError(f"device {u} released shares for other devices than requested")
        expected_excess = p.vector_length if p.dp_mu > 0.0 else 0
        if message.dp_excess.shape != (expected_excess,):
            raise RemoteProtocolError(f"DP excess of length {message.dp_excess.shape[0]}, expected {expected_excess}")
        parsed_b = [Share.from_bytes(b) for b in message.b_shares]
        parsed_s = [Share.from_bytes(b) for b in message.s_shares]
        for owner, share in (*zip(want_b, parsed_b, strict=True), *zip(want_s, parsed_s, strict=True)):
            # The holder's index in the owner's sorted neighbourhood is the x-coordinate it was given.
            if share.index != self._graph[owner].index(u) + 1:
                raise RemoteProtocolError(f"device {u} returned a share with a wrong index for {owner}")
        for owner, share in zip(want_b, parsed_b, strict=True):
            self._b_shares.setdefault(owner, []).append(share)
        for owner, share in zip(want_s, parsed_s, strict=True):
            self._s_shares.setdefault(owner, []).append(share)
        if expected_excess and self._acc is not None:
            self._acc.subtract(message.dp_excess)
            self._corrected.add(u)
        self._responded.add(u)

    def _record_dropouts(self, phase: Phase, arrived: Iterable[int]) -> None:
        self._dropouts[phase] |= set(self._expected_set()) - set(arrived)

    def _close_advertise(self) -> None:
        u1 = frozenset(self._keys) - self._failed - self._left
        self._record_dropouts(Phase.ADVERTISE_KEYS, u1)
        self._u1 = u1
        self._digests.clear()
        self._need(len(u1), "devices advertised keys")
        keys = {u: self._keys[u] for u in u1}
        self._session = crypto.session_id(self.params.round_id, keys)
        self._graph = harary_graph(sorted(u1), self.params.k, self._rng)
        self._phase = Phase.SHARE_KEYS

    def _close_share_keys(self) -> None:
        u2 = set(self._sent_shares) - self._failed - self._left
        # A device whose neighbourhood kept fewer than t sharers cannot be unmasked; drop it (and repeat,
        # since dropping it shrinks its neighbours' counts).
        changed = True
        while changed:
            changed = False
            for u in sorted(u2):
                if sum(1 for v in self._graph[u] if v in u2) < self.params.t:
                    u2.discard(u)
                    changed = True
        self._record_dropouts(Phase.SHARE_KEYS, u2)
        self._u2 = frozenset(u2)
        self._need(len(u2), "devices shared keys")
        self._acc = MaskedSumAccumulator(self.params.vector_length)
        self._digests.clear()
        self._phase = Phase.MASKED_INPUT

    def _close_masked_input(self) -> None:
        # Every accumulated input is in U3, even if its sender left afterwards: its masks must come off.
        u3 = frozenset(self._masked_from)
        self._record_dropouts(Phase.MASKED_INPUT, u3)
        self._u3 = u3
        self._need(len(u3), "masked inputs arrived")
        self._shares_out.clear()  # routed already; no longer needed
        self._digests.clear()
        self._phase = Phase.UNMASK

    def _close_unmask(self) -> None:
        # The checks close the phase; the mask removal (`_remove_masks`) is the heavy part, run at once
        # or, with ``defer_finish``, by `finish` (the server runs it off its event loop).
        p = self.params
        self._record_dropouts(Phase.UNMASK, self._responded)
        dropped = sorted(self._u2 - self._u3)
        for owner in sorted(self._u3):
            if len(self._b_shares.get(owner, ())) < p.t:
                raise NotEnoughParticipants(f"too few neighbours of {owner} answered the unmask request")
        for owner in dropped:
            if len(self._s_shares.get(owner, ())) < p.t:
                raise NotEnoughParticipants(f"too few neighbours of dropped {owner} answered the unmask request")
        self._finishing = True
        if not self._defer_finish:
            self._finishing = False
            self._remove_masks()

    def _remove_masks(self) -> None:
        p, acc = self.params, self._acc
        if acc is None:  # pragma: no cover
            raise LocalProtocolError("no accumulator")
        dropped = sorted(self._u2 - self._u3)
        session = self._session
        for owner in sorted(self._u3):
            acc.remove_self_mask(reconstruct(self._b_shares[owner], p.t), session, owner)
        for owner in dropped:
            # Parsed once per dropped device (its public key is derived once for the check, too).
            pair = crypto.key_pair_from_private_bytes(reconstruct(self._s_shares[owner], p.t))
            if pair.public_key != self._keys[owner][1]:
                raise CryptoError(f"reconstructed mask key of {owner} does not match its advertised key")
            peers = {u: self._keys[u][1] for u in self._graph[owner] if u in self._u3}
            for u, key in pair_mask_keys(pair.private_key, peers, session, owner).items():
                acc.remove_pair_mask(u, owner, key)
        self._result = SecAggResult(
            total=acc.total(),
            survivors=self._u3,
            dropouts=self.dropouts,
            corrected=frozenset(self._corrected),
        )
        self._b_shares.clear()
        self._s_shares.clear()
        self._phase = Phase.DONE

    def _broadcast(self, u: int) -> Message:
        rid, session = self.params.round_id, self._session
        phase = self._phase
        if phase is Phase.ADVERTISE_KEYS:
            return self._invites[u]
        if phase is Phase.SHARE_KEYS:
            ids = self._graph[u]
            return ShareKeysBroadcast(
                round_id=rid,
                device_id=u,
                session_id=session,
                neighbour_ids=ids,
                c_public_keys=tuple(self._keys[v][0] for v in ids),
                s_public_keys=tuple(self._keys[v][1] for v in ids),
            )
        if phase is Phase.MASKED_INPUT:
            inbound = self._shares_out.get(u, {})
            senders = tuple(v for v in self._graph[u] if v in self._u2 and v != u and v in inbound)
            return MaskedInputRequest(
                round_id=rid,
                device_id=u,
                session_id=session,
                sender_ids=senders,
                ciphertexts=tuple(inbound[v] for v in senders),
            )
        ids = self._graph[u]
        return UnmaskRequest(
            round_id=rid,
            device_id=u,
            session_id=session,
            survivors=tuple(v for v in ids if v in self._u3),
            dropped=tuple(v for v in ids if v in self._u2 and v not in self._u3),
            n_survivors=len(self._u3),
        )
