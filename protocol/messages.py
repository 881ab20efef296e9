# Invariants: every message is an immutable value; `__post_init__` rejects anything whose types, ranges or
# lengths are wrong, so an invalid message can be built neither by a peer's bytes nor by our own code.
# Relational rules that need session context (an id listed twice, an id in both lists, an id outside the
# neighbourhood, keys not distinct) are protocol rules: the receiving session checks them and raises
# `RemoteProtocolError`, which keeps those malicious-server defences testable on their own.
# Arrays are stored as read-only, C-contiguous copies, so a message cannot change after it was built.
"""SecAgg+ round messages (docs/design.md §4).

Device ids are non-negative integers below 2**63; round ids likewise.  Byte strings are raw: X25519 public
keys are 32 bytes, the session id is a 32-byte SHA-256 digest.  Ring vectors are 1-D ``np.uint32`` arrays
(arithmetic mod 2**32).  Deadlines are absolute times on the coordinator's clock, in seconds.

Why one module of ~1,000 lines: every message of the protocol, each a frozen dataclass with its field
docs and its validation, side by side so the wire format reads in one place; the training plan's typed
form lives in `protocol.plan`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from protocol.errors import FedRecError, error_class_for_code
from protocol.plan import FamilyParams, FELBParams, FNMFParams, LightFRParams, MFParams, TrainingPlan, params_from_wire
from protocol.quantization import QuantizationConfig
from protocol.spec import (
    MAX_ITEMS,
    MAX_RANK,
    MAX_TEXT,
    MAX_VECTOR_LENGTH,
    ModelKind,
)

__all__ = [
    "KEY_BYTES",
    "SESSION_ID_BYTES",
    "MAX_ID",
    "Message",
    "RoundInvite",
    "PublicKeys",
    "ShareKeysBroadcast",
    "EncryptedShares",
    "MaskedInputRequest",
    "MaskedInput",
    "UnmaskRequest",
    "UnmaskResponse",
    "ConsistencyRequest",
    "ConsistencySignature",
    "Abort",
    "ErrorMessage",
    "RegisterRequest",
    "RegisterResponse",
    "CheckIn",
    "Wait",
    "ModelPayload",
    "RoundResult",
    "RevocationListPayload",
]

KEY_BYTES = 32
SESSION_ID_BYTES = 32
MAX_ID = 2**63 - 1
_MAX_CODE = 64


def _fail(cls_name: str, text: str) -> None:
    # ValueError, not a FedRecError: building an invalid message is a programming or decoding error; the
    # codec translates it into DecodeError at the wire boundary.
    raise ValueError(f"{cls_name}: {text}")


def _check_id(owner: str, name: str, value: object) -> None:
    if type(value) is not int or not 0 <= value <= MAX_ID:
        _fail(owner, f"{name} must be an int in [0, 2**63), got {value!r}")


def _check_ids(owner: str, name: str, values: object) -> None:
    if type(values) is not tuple:
        _fail(owner, f"{name} must be a tuple of ints")
    for v in values:  # type: ignore[attr-defined]
        _check_id(owner, name, v)


def _check_bytes(owner: str, name: str, value: object, length: int | None = None, max_len: int = 1 << 20) -> None:
    if type(value) is not bytes:
        _fail(owner, f"{name} must be bytes, got {type(value).__name__}")
    n = len(value)  # type: ignore[arg-type]
    if length is not None and n != length:
        _fail(owner, f"{name} must be {length} bytes, got {n}")
    if n > max_len:
        _fail(owner, f"{name} is {n} bytes, limit {max_len}")


def _check_bytes_tuple(owner: str, name: str, values: object, length: int | None = None) -> None:
    if type(values) is not tuple:
        _fail(owner, f"{name} must be a tuple of bytes")
    for v in values:  # type: ignore[attr-defined]
        _check_bytes(owner, name, v, length)


def _check_text(owner: str, name: str, value: object, max_len: int) -> None:
    if type(value) is not str or len(value) > max_len:
        _fail(owner, f"{name} must be a str of at most {max_len} characters")


def _check_float(owner: str, name: str, value: object, *, minimum: float | None = None) -> None:
    if type(value) is not float or not math.isfinite(value):
        _fail(owner, f"{name} must be a finite float, got {value!r}")
    if minimum is not None and value < minimum:  # type: ignore[operator]
        _fail(owner, f"{name} must be >= {minimum}, got {value!r}")


def _frozen_u32(owner: str, name: str, value: object) -> NDArray[np.uint32]:
    if not isinstance(value, np.ndarray) or value.dtype != np.uint32 or value.ndim != 1:
        _fail(owner, f"{name} must be a 1-D numpy uint32 array")
    arr: NDArray[np.uint32] = np.array(value, dtype=np.uint32, order="C", copy=True)
    arr.setflags(write=False)
    return arr


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)


class Message:
    """Base of every round message: equality that compares numpy fields by value.

    Dataclass equality would compare arrays with ``==`` and fail on truth-testing; messages holding
    arrays are therefore unhashable and compared field by field here.
    """

    __slots__ = ()
    #: Stable wire type code (never reused); the codec table is keyed by it.
    TYPE: ClassVar[int]

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            a: Any = getattr(self, f.name)
            b: Any = getattr(other, f.name)
            if isinstance(a, np.ndarray):
                if not (isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RoundInvite(Message):
    """Server → device, before ADVERTISE_KEYS: the round's session parameters.

    Attributes
    ----------
    round_id : int
        Round number chosen by the coordinator.
    device_id : int
        The invited device (the recipient).
    vector_length : int
        L, number of uint32 ring elements in the masked input (>= 1).
    graph_k : int
        Neighbourhood size including the device itself (Bell et al. 2020 self-edge convention).
    graph_t : int
        Shamir threshold, 1 <= t <= k.
    clip_norm : float
        L2 clipping norm C of the update, in model units (> 0).
    scale_bits : int
        Quantization scale s: values are multiplied by 2**s before rounding (0..31).
    dp_mu : float
        Aggregate Skellam noise variance in quantized units; 0.0 disables DP noise.
    dp_t_min : int
        Worst-case survivor count the noise is calibrated for; 0 iff ``dp_mu == 0``.
    advertise_deadline, share_keys_deadline, masked_input_deadline, unmask_deadline : float
        Absolute phase deadlines in seconds on the coordinator's clock, non-decreasing.
    model_version : int
        Version of the global model this round trains (download it from the model endpoint).
    model_kind : str
        Model family (`protocol.spec.ModelKind` value), "lightfr" by default.
    bits, n_items : int
        Code length f (a family's rank) and catalogue size m; 0 in a 1.0 invite, which carries no plan.
    example_cap : int
        θ: at most this many of the device's ratings are used this round (0 = all); bounds each
        device's contribution for differential privacy.
    round_index : int
        0 for the round that trains model version 1, then 1, 2, ... (drives schedules).
    cohort_size : int
        Protocol 1.3: the number of devices invited to the round (n), which the device's privacy floor
        (`protocol.policy`) checks k, t and t_min against; 0 = not stated (a 1.2 server), which a device
        with a privacy floor refuses.
    params : FamilyParams or None
        The family's training parameters (`protocol.plan.LightFRParams`, `MFParams`, `FELBParams` or
        `FNMFParams`, whose type must be ``model_kind``'s and which validated them), None for a family
        this build does not know.  On the wire each parameter is one body key of this message (protocol
        1.1–1.3 and 1.6 appended them), declared beside the parameter (`protocol.plan.param_field`); a key
        an older peer leaves out means that field's ``absent`` value.  Built without parameters, an invite
        takes those ``absent`` values where they are valid parameters of its family (a 1.0 invite's), and
        otherwise keeps None and encodes every key at its ``absent`` value.
    """

    TYPE: ClassVar[int] = 1
    round_id: int
    device_id: int
    vector_length: int
    graph_k: int
    graph_t: int
    clip_norm: float
    scale_bits: int
    dp_mu: float = 0.0
    dp_t_min: int = 0
    advertise_deadline: float
    share_keys_deadline: float
    masked_input_deadline: float
    unmask_deadline: float
    # Appended in protocol 1.1 (training plan); every field has a default, as the evolution rule asks.
    model_version: int = 0
    model_kind: str = "lightfr"
    bits: int = 0
    n_items: int = 0
    example_cap: int = 0
    # Appended in protocol 1.2.
    round_index: int = 0
    # Appended in protocol 1.3 (device-side privacy floor).
    cohort_size: int = 0
    # The family's parameters (protocol 1.1-1.3 and 1.6 appended their keys; `protocol.plan.param_field`).
    params: FamilyParams | None = None

    def __post_init__(self) -> None:
        n = "RoundInvite"
        if self.params is None:
            # Built without parameters: what a decoder reads from such an invite's bytes, the family's
            # parameters at their ``absent`` values, where those are valid (a 1.0 invite, LightFR's).
            try:
                object.__setattr__(self, "params", params_from_wire(self.model_kind, {}))
            except ValueError:
                pass
        if self.params is not None:
            if not isinstance(self.params, LightFRParams | MFParams | FELBParams | FNMFParams):
                _fail(n, f"params must be a family's training parameters (protocol.plan), got {self.params!r}")
            if self.params.KIND != self.model_kind:
                _fail(n, f"params are {self.params.KIND.value!r} parameters, model_kind is {self.model_kind!r}")
        _check_id(n, "cohort_size", self.cohort_size)
        _check_id(n, "round_index", self.round_index)
        for name in ("model_version", "bits", "n_items", "example_cap"):
            _check_id(n, name, getattr(self, name))
        _check_text(n, "model_kind", self.model_kind, 32)
        if self.bits and self.n_items:
            size = self.bits * self.n_items
            if self.model_kind == ModelKind.LIGHTFR and self.params is not None:
                want = self.params.upload_length(self.n_items, self.bits)
                if want != self.vector_length:
                    _fail(n, f"vector_length {self.vector_length} != {want}, the LightFR upload for this plan")
            if size > self.vector_length:
                _fail(n, f"vector_length {self.vector_length} < n_items {self.n_items} × bits {self.bits}")
        _check_id(n, "round_id", self.round_id)
        _check_id(n, "device_id", self.device_id)
        for name in ("vector_length", "graph_k", "graph_t", "scale_bits", "dp_t_min"):
            _check_id(n, name, getattr(self, name))
        if not 1 <= self.vector_length <= MAX_VECTOR_LENGTH:
            _fail(n, f"vector_length must be in [1, 2**28], got {self.vector_length}")
        if not 1 <= self.graph_t <= self.graph_k:
            _fail(n, f"need 1 <= graph_t <= graph_k, got t={self.graph_t}, k={self.graph_k}")
        _check_float(n, "clip_norm", self.clip_norm)
        if self.clip_norm <= 0.0:
            _fail(n, f"clip_norm must be > 0, got {self.clip_norm}")
        if self.scale_bits > 30:
            _fail(n, f"scale_bits must be <= 30 (the quantizer's limit), got {self.scale_bits}")
        _check_float(n, "dp_mu", self.dp_mu, minimum=0.0)
        if (self.dp_mu == 0.0) != (self.dp_t_min == 0):
            _fail(n, "dp_mu and dp_t_min must both be zero (no DP) or both positive")
        deadlines = self.deadlines
        for name, d in zip(("advertise", "share_keys", "masked_input", "unmask"), deadlines, strict=True):
            _check_float(n, f"{name}_deadline", d)
        if any(b < a for a, b in zip(deadlines, deadlines[1:], strict=False)):
            _fail(n, "phase deadlines must be non-decreasing")

    @property
    def plan(self) -> TrainingPlan:
        """The typed training plan this invite carries (`protocol.plan.TrainingPlan.from_invite`); ValueError
        if it carries none, or not a valid one."""
        return TrainingPlan.from_invite(self)

    def with_plan(self, plan: TrainingPlan) -> RoundInvite:
        """This invite carrying ``plan`` (`TrainingPlan.invite_fields`); ValueError if the plan's upload is
        not ``vector_length`` entries."""
        if plan.vector_length != self.vector_length:
            _fail("RoundInvite", f"vector_length {self.vector_length} != {plan.vector_length}, the plan's upload")
        return dataclasses.replace(self, **plan.invite_fields())

    def quantization(self) -> QuantizationConfig:
        """How this round's uploads become ring elements (``clip_norm``, ``scale_bits``): the one place a
        device, a simulator or a policy check builds it from an invite."""
        return QuantizationConfig(clip_norm=self.clip_norm, scale_bits=self.scale_bits)

    @property
    def deadlines(self) -> tuple[float, float, float, float]:
        """The four phase deadlines in protocol order."""
        return (
            self.advertise_deadline,
            self.share_keys_deadline,
            self.masked_input_deadline,
            self.unmask_deadline,
        )


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PublicKeys(Message):
    """Device → server, ADVERTISE_KEYS: the device's two fresh X25519 public keys for this round.

    Attributes
    ----------
    round_id, device_id : int
        Round and sender.
    c_public_key : bytes
        32 raw bytes; key agreement for encrypting Shamir shares.
    s_public_key : bytes
        32 raw bytes; key agreement for the pairwise masks. Must differ from ``c_public_key``.
    certificate : bytes
        Protocol 1.3: the device's enrollment certificate (`protocol.identity.issue_certificate`), or empty.
    signature : bytes
        Protocol 1.3: the device's Ed25519 signature of
        `protocol.identity.key_advertisement_payload` (round, device id, both keys), or empty.
    """

    TYPE: ClassVar[int] = 2
    round_id: int
    device_id: int
    c_public_key: bytes
    s_public_key: bytes
    certificate: bytes = b""
    signature: bytes = b""

    def __post_init__(self) -> None:
        n = "PublicKeys"
        _check_id(n, "round_id", self.round_id)
        _check_id(n, "device_id", self.device_id)
        _check_bytes(n, "c_public_key", self.c_public_key, KEY_BYTES)
        _check_bytes(n, "s_public_key", self.s_public_key, KEY_BYTES)
        _check_bytes(n, "certificate", self.certificate, max_len=256)
        _check_bytes(n, "signature", self.signature, max_len=64)
        if self.c_public_key == self.s_public_key:
            _fail(n, "c_public_key and s_public_key must differ")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ShareKeysBroadcast(Message):
    """Server → device, start of SHARE_KEYS: the recipient's neighbourhood N(u) ∩ U1 and its keys.

    Attributes
    ----------
    round_id, device_id : int
        Round and recipient.
    session_id : bytes
        32-byte SHA-256 over the round id and every advertised key (see `protocol.crypto.session_id`).
    neighbour_ids : tuple of int
        Ids of the neighbourhood, the recipient included.  The server sends them in increasing
        order; devices do not rely on the order (they sort a copy), and the session refuses a
        repeated id.
    c_public_keys, s_public_keys : tuple of bytes
        32-byte keys aligned with ``neighbour_ids``.
    """

    TYPE: ClassVar[int] = 3
    round_id: int
    device_id: int
    session_id: bytes
    neighbour_ids: tuple[int, ...]
    c_public_keys: tuple[bytes, ...]
    s_public_keys: tuple[bytes, ...]
    # Protocol 1.3: each neighbour's certificate and key-advertisement signature (empty: not signed).
    certificates: tuple[bytes, ...] = ()
    signatures: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        n = "ShareKeysBroadcast"
        _check_id(n, "round_id", self.round_id)
        _check_id(n, "device_id", self.device_id)
        _check_bytes(n, "session_id", self.session_id, SESSION_ID_BYTES)
        _check_ids(n, "neighbour_ids", self.neighbour_ids)
        _check_bytes_tuple(n, "c_public_keys", self.c_public_keys, KEY_BYTES)
        _check_bytes_tuple(n, "s_public_keys", self.s_public_keys, KEY_BYTES)
        if not len(self.neighbour_ids) == len(self.c_public_keys) == len(self.s_public_keys):
            _fail(n, "neighbour_ids, c_public_keys and s_public_keys must have equal lengths")
        _check_bytes_tuple(n, "certificates", self.certificates)
        _check_bytes_tuple(n, "signatures", self.signatures)
        if self.certificates or self.signatures:
            if not len(self.certificates) == len(self.signatures) == len(self.neighbour_ids):
                _fail(n, "certificates and signatures must have one entry per neighbour")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class EncryptedShares(Message):
    """Device → server, SHARE_KEYS: one AES-256-GCM ciphertext per neighbour (the sender excluded).

    Attributes
    ----------
    round_id, device_id : int
        Round and sender.
    session_id : bytes
        32-byte session id from the broadcast.
    recipient_ids : tuple of int
        Neighbour each ciphertext is addressed to.
    ciphertexts : tuple of bytes
        nonce (12 B) ‖ AEAD(src ‖ dst ‖ b-share ‖ s-share) ‖ tag (16 B), aligned with ``recipient_ids``.
    """

    TYPE: ClassVar[int] = 4
    round_id: int
    device_id: int
    session_id: bytes
    recipient_ids: tuple[int, ...]
    ciphertexts: tuple[bytes, ...]

    def __post_init__(self) -> None:
        n = "EncryptedShares"
        _check_id(n, "round_id", self.round_id)
        _check_id(n, "device_id", self.device_id)
        _check_bytes(n, "session_id", self.session_id, SESSION_ID_BYTES)
        _check_ids(n, "recipient_ids", self.recipient_ids)
        _check_bytes_tuple(n, "ciphertexts", self.ciphertexts)
        if len(self.recipient_ids) != len(self.ciphertexts):
            _fail(n, "recipient_ids and ciphertexts must have equal lengths")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class MaskedInputRequest(Message):
    """Server → device, start of MASKED_INPUT: the ciphertexts addressed to the recipient.

    The senders are exactly the recipient's neighbours in U2 (those whose shares reached the server), so
    they also tell the device which pairwise masks to add.

    Attributes
    ----------
    round_id, device_id : int
        Round and recipient.
    session_id : bytes
        32-byte session id.
    sender_ids : tuple of int
        Neighbour that produced each ciphertext.
    ciphertexts : tuple of bytes
        As in `EncryptedShares`, aligned with ``sender_ids``.
    """

    TYPE: ClassVar[int] = 5
    round_id: int
    device_id: int
    session_id: bytes
    sender_ids: tuple[int, ...]
    ciphertexts: tuple[bytes, ...]

    def __post_init__(self) -> None:
        n = "MaskedInputRequest"
        _check_id(n, "round_id", self.round_id)
        _check_id(n, "device_id", self.device_id)
        _check_bytes(n, "session_id", self.session_id, SESSION_ID_BYTES)
        _check_ids(n, "sender_ids", self.sender_ids)
        _check_bytes_tuple(n, "ciphertexts", self.ciphertexts)
        if len(self.sender_ids) != len(self.ciphertexts):
            _fail(n, "sender_ids and ciphertexts must have equal lengths")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class MaskedInput(Message):
    """Device → server, MASKED_INPUT: y_u = q(x_u) + noise_u + PRG(b_u) + Σ ±PRG(s_uv) mod 2**32.

    Attributes
    ----------
    round_id, device_id : int
        Round and sender.
    session_id : bytes
        32-byte session id.
    masked : ndarray of uint32, shape (L,)
        The masked ring vector (4 bytes per element on the wire).
    bad_share_senders : tuple of int
        Neighbours whose share ciphertext failed authentication or decrypted to malformed content: this
        device holds no share of theirs and left them out of its pairwise masks (it treated them as dropped
        for this round); the server excludes them.  Sorted, distinct; empty (and omitted on the wire) in an
        honest round.
    """

    TYPE: ClassVar[int] = 6
    round_id: int
    device_id: int
    session_id: bytes
    masked: NDArray[np.uint32]
    bad_share_senders: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = "MaskedInput"
        _check_id(n, "round_id", self.round_id)
        _check_id(n, "device_id", self.device_id)
        _check_bytes(n, "session_id", self.session_id, SESSION_ID_BYTES)
        _set(self, "masked", _frozen_u32(n, "masked", self.masked))
        if self.masked.size == 0:
            _fail(n, "masked must not be empty")
        _check_ids(n, "bad_share_senders", self.bad_share_senders)
        if list(self.bad_share_senders) != sorted(set(self.bad_share_senders)):
            _fail(n, "bad_share_senders must be sorted and list each device once")
        if self.device_id in self.bad_share_senders:
            _fail(n, "bad_share_senders must not name the sender itself")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class UnmaskRequest(Message):
    """Server → device, start of UNMASK: who survived (U3) and who dropped after sharing (U2 ∖ U3).

    Both lists are restricted to the recipient's neighbourhood.

    Attributes
    ----------
    round_id, device_id : int
        Round and recipient.
    session_id : bytes
        32-byte session id.
    survivors : tuple of int
        Neighbours in U3 (the recipient included); their self-mask (b) shares are requested.
    dropped : tuple of int
        Neighbours in U2 ∖ U3; their mask-key (s) shares are requested.
    n_survivors : int
        |U3| over the whole cohort, for the DP correction (section 5).  With the consistency check the
        device uses the number of valid signatures instead and refuses a larger claim.
    survivor_set : tuple of int
        Protocol 1.3: the whole signed set U3 (sorted), empty without the consistency check.
    signer_ids, signer_certificates, signatures : tuples
        Protocol 1.3: survivors' Ed25519 signatures of `protocol.identity.survivor_set_payload` over
        ``survivor_set``, with their enrollment certificates, aligned.
    """

    TYPE: ClassVar[int] = 7
    round_id: int
    device_id: int
    session_id: bytes
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    n_survivors: int
    survivor_set: tuple[int, ...] = ()
    signer_ids: tuple[int, ...] = ()
    signer_certificates: tuple[bytes, ...] = ()
    signatures: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        n = "UnmaskRequest"
        _check_id(n, "round_id", self.round_id)
        _check_id(n, "device_id", self.device_id)
        _check_bytes(n, "session_id", self.session_id, SESSION_ID_BYTES)
        _check_ids(n, "survivors", self.survivors)
        _check_ids(n, "dropped", self.dropped)
        _check_id(n, "n_survivors", self.n_survivors)
        _check_ids(n, "survivor_set", self.survivor_set)
        _check_ids(n, "signer_ids", self.signer_ids)
        _check_bytes_tuple(n, "signer_certificates", self.signer_certificates)
        _check_bytes_tuple(n, "signatures", self.signatures)
        if not len(self.signer_ids) == len(self.signer_certificates) == len(self.signatures):
            _fail(n, "signer_ids, signer_certificates and signatures must have equal lengths")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ConsistencyRequest(Message):
    """Server → device, protocol 1.3, start of UNMASK when identities are in use: the survivor set U3 to sign.

    Attributes
    ----------
    round_id, device_id : int
        Round and recipient.
    session_id : bytes
        32-byte session id.
    survivor_set : tuple of int
        The whole set U3 (sorted): every device whose masked input the server holds.
    """

    TYPE: ClassVar[int] = 20
    round_id: int
    device_id: int
    session_id: bytes
    survivor_set: tuple[int, ...]

    def __post_init__(self) -> None:
        n = "ConsistencyRequest"
        _check_id(n, "round_id", self.round_id)
        _check_id(n, "device_id", self.device_id)
        _check_bytes(n, "session_id", self.session_id, SESSION_ID_BYTES)
        _check_ids(n, "survivor_set", self.survivor_set)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ConsistencySignature(Message):
    """Device → server, protocol 1.3: the device's Ed25519 signature of the survivor set it was shown.

    Attributes
    ----------
    round_id, device_id : int
        Round and sender.
    session_id : bytes
        32-byte session id.
    signature : bytes
        64 bytes over `protocol.identity.survivor_set_payload(round_id, session_id, survivor_set)`.
    """

    TYPE: ClassVar[int] = 21
    round_id: int
    device_id: int
    session_id: bytes
    signature: bytes

    def __post_init__(self) -> None:
        n = "ConsistencySignature"
        _check_id(n, "round_id", self.round_id)
        _check_id(n, "device_id", self.device_id)
        _check_bytes(n, "session_id", self.session_id, SESSION_ID_BYTES)
        _check_bytes(n, "signature", self.signature, 64)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class UnmaskResponse(Message):
    """Device → server, UNMASK: Shamir shares for reconstruction and the DP correction.

    Attributes
    ----------
    round_id, device_id : int
        Round and sender.
    session_id : bytes
        32-byte session id.
    b_share_ids : tuple of int
        Survivors whose self-mask seed share is released (never also in ``s_share_ids``).
    b_shares : tuple of bytes
        Serialised Shamir shares (`protocol.shamir.Share.to_bytes`), aligned with ``b_share_ids``.
    s_share_ids : tuple of int
        Dropped devices whose mask-key share is released.
    s_shares : tuple of bytes
        Serialised Shamir shares, aligned with ``s_share_ids``.
    dp_excess : ndarray of uint32, shape (L,) or (0,)
        The revealed noise excess mod 2**32 (pure noise, independent of the input); empty without DP.
    """

    TYPE: ClassVar[int] = 8
    round_id: int
    device_id: int
    session_id: bytes
    b_share_ids: tuple[int, ...]
    b_shares: tuple[bytes, ...]
    s_share_ids: tuple[int, ...]
    s_shares: tuple[bytes, ...]
    dp_excess: NDArray[np.uint32]

    def __post_init__(self) -> None:
        n = "UnmaskResponse"
        _check_id(n, "round_id", self.round_id)
        _check_id(n, "device_id", self.device_id)
        _check_bytes(n, "session_id", self.session_id, SESSION_ID_BYTES)
        _check_ids(n, "b_share_ids", self.b_share_ids)
        _check_bytes_tuple(n, "b_shares", self.b_shares)
        _check_ids(n, "s_share_ids", self.s_share_ids)
        _check_bytes_tuple(n, "s_shares", self.s_shares)
        if len(self.b_share_ids) != len(self.b_shares) or len(self.s_share_ids) != len(self.s_shares):
            _fail(n, "share id lists and share lists must have equal lengths")
        _set(self, "dp_excess", _frozen_u32(n, "dp_excess", self.dp_excess))


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Abort(Message):
    """Either direction, any phase: the sender leaves (device) or ends (server) the round.

    Attributes
    ----------
    round_id : int
        The round being aborted.
    device_id : int
        The device that leaves, or the device the server tells.
    reason : str
        Human-readable reason (at most 4096 characters).
    """

    TYPE: ClassVar[int] = 9
    round_id: int
    device_id: int
    reason: str = ""

    def __post_init__(self) -> None:
        n = "Abort"
        _check_id(n, "round_id", self.round_id)
        _check_id(n, "device_id", self.device_id)
        _check_text(n, "reason", self.reason, MAX_TEXT)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ErrorMessage(Message):
    """Either direction: an error from the `protocol.errors` tree, by its stable code.

    Attributes
    ----------
    code : str
        ``FedRecError.code`` of a class in `protocol.errors`: lower-case letters, digits and "_",
        starting with a letter, at most 64 characters.  A well-formed code this peer does not know
        (added by a later 1.x minor version) is accepted and rebuilt as the base `FedRecError`, as
        the append-only evolution rule requires.
    message : str
        Human-readable detail (at most 4096 characters).
    """

    TYPE: ClassVar[int] = 10
    code: str
    message: str = ""

    def __post_init__(self) -> None:
        n = "ErrorMessage"
        _check_text(n, "code", self.code, _MAX_CODE)
        _check_text(n, "message", self.message, MAX_TEXT)
        code = self.code
        if (
            not code
            or not code[0].isascii()
            or not code[0].islower()
            or not all(c == "_" or (c.isascii() and (c.islower() or c.isdigit())) for c in code)
        ):
            _fail(n, f"error code must match [a-z][a-z0-9_]*, got {code!r}")

    @classmethod
    def from_exception(cls, exc: FedRecError) -> ErrorMessage:
        """Wrap an exception of the fedrec tree for the wire.

        Parameters
        ----------
        exc : FedRecError
            The error to report.

        Returns
        -------
        ErrorMessage
        """
        return cls(code=exc.code, message=str(exc)[:MAX_TEXT])

    def to_exception(self) -> FedRecError:
        """Rebuild the exception class named by ``code`` with ``message``; a code this peer does not
        know becomes a plain `FedRecError` whose text names the code.

        Returns
        -------
        FedRecError
        """
        cls = error_class_for_code(self.code)
        if cls.code != self.code:
            return FedRecError(f"[{self.code}] {self.message}")
        return cls(self.message)


# -- registration, check-in and model distribution (type codes 11–16) -------------------------------

_MAX_TOKEN = 256


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RegisterRequest(Message):
    """Device → server: ask for an identity (``POST /v1/devices``).

    Attributes
    ----------
    platform : str
        Free-form description of the device software (at most 128 characters), for operators.
    certificate : bytes
        Protocol 1.4: the device's enrollment certificate (`protocol.identity.issue_certificate`), or empty.
    proof : bytes
        Protocol 1.4: with a certificate, the device's Ed25519 signature of
        `protocol.identity.registration_payload` (proof that it holds the certified key), else empty.
    enrollment_token : str
        Protocol 1.4: an operator-issued one-time enrollment token (test fleets), or empty.
    """

    TYPE: ClassVar[int] = 11
    platform: str = ""
    certificate: bytes = b""
    proof: bytes = b""
    enrollment_token: str = ""

    def __post_init__(self) -> None:
        n = "RegisterRequest"
        _check_text(n, "platform", self.platform, 128)
        _check_bytes(n, "certificate", self.certificate, max_len=256)
        _check_bytes(n, "proof", self.proof, max_len=64)
        _check_text(n, "enrollment_token", self.enrollment_token, _MAX_TOKEN)
        if bool(self.certificate) != bool(self.proof):
            _fail(n, "certificate and proof go together")
        if self.certificate and self.enrollment_token:
            _fail(n, "one credential per registration: a certificate or an enrollment token, not both")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RegisterResponse(Message):
    """Server → device: the new device id and its bearer token (shown once; the server keeps a hash).

    Attributes
    ----------
    device_id : int
    token : str
        Opaque bearer token (URL-safe text, 16..256 characters).
    """

    TYPE: ClassVar[int] = 12
    device_id: int
    token: str

    def __post_init__(self) -> None:
        _check_id("RegisterResponse", "device_id", self.device_id)
        _check_text("RegisterResponse", "token", self.token, _MAX_TOKEN)
        if len(self.token) < 16:
            _fail("RegisterResponse", "token must be at least 16 characters")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CheckIn(Message):
    """Device → server: "I am available" (``POST /v1/checkin``).

    The answer is a `RoundInvite` (join the round now) or a `Wait`.

    Attributes
    ----------
    device_id : int
    model_version : int
        Version of the global model the device holds (0 = none).
    """

    TYPE: ClassVar[int] = 13
    device_id: int
    model_version: int = 0

    def __post_init__(self) -> None:
        _check_id("CheckIn", "device_id", self.device_id)
        _check_id("CheckIn", "model_version", self.model_version)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Wait(Message):
    """Server → device: no round for you now; check in again after ``retry_after`` seconds.

    Attributes
    ----------
    retry_after : float
        Seconds (>= 0) before the next check-in.
    reason : str
        Why (e.g. "no round open", "round abandoned after a restart").
    """

    TYPE: ClassVar[int] = 14
    retry_after: float
    reason: str = ""

    def __post_init__(self) -> None:
        _check_float("Wait", "retry_after", self.retry_after, minimum=0.0)
        _check_text("Wait", "reason", self.reason, MAX_TEXT)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ModelPayload(Message):
    """Server → device: the global model (``GET /v1/model``).

    Attributes
    ----------
    model_version : int
    model_kind : str
    bits, n_items : int
        Code length f (LightFR) or rank (factors / components of the other families), and the
        catalogue size m.
    words : bytes
        LightFR item codes in the wire form of `protocol.codes` (little-endian (w, m) uint64 words,
        ``8 * ceil(f / 64) * m`` bytes); empty for the other families.
    values : bytes
        Protocol 1.2, the real-valued families (MF, FELB, FNMF): the item matrix as ``bits * n_items``
        little-endian float64 in C order — MF's V is (n_items, bits), FELB's and FNMF's V is
        (bits, n_items).  Empty for LightFR.
    item_levels : bytes
        Protocol 1.3, LightFR: one uint8 level per item (``n_items`` bytes) or empty (no item term).
        A device scores item i as (bits − Hamming)·hamming_weight + level_i.
    hamming_weight : int
        Protocol 1.3, LightFR: B in [1, 255] of that integer score.
    unobserved_weight : float
        Protocol 1.7, LightFR all-items objective: the w0 this model goes with, the one the server's next
        round plan carries (under the server's ``unobserved_weight = "auto"`` the w0 it derived from the
        density of the round that produced this model; round 1's is the density rule's floor).  A device
        ranks and folds in with it (`device_sdk.models.LightFRModel.set_global`).  In [0, 1 + confidence];
        > 0 only for a LightFR model with ``item_levels``.  0 (the default, and what a 1.6 server's
        payload means): not stated, the device keeps the w0 of the last plan it saw.
    confidence : float
        Protocol 1.7, LightFR: the α >= 0 that goes with ``unobserved_weight`` (observed items weigh
        1 + α); 0 when w0 is not stated.
    dp_trained : bool
        Protocol 1.7: True when any round that produced this model version (this one or an earlier
        one) added DP noise; the server keeps it with the model, so it is sticky.  A LightFR device
        holding such a model ranks with its ±1 code (`LightFRModel.private_model`).  False (the default,
        and what a 1.6 server's payload means): not stated.
    """

    TYPE: ClassVar[int] = 15
    model_version: int
    model_kind: str = "lightfr"
    bits: int
    n_items: int
    words: bytes
    values: bytes = b""
    # Appended in protocol 1.3 (LightFR item term).
    item_levels: bytes = b""
    hamming_weight: int = 1
    # Appended in protocol 1.7 (the w0 a model goes with, and whether DP noise trained it).
    unobserved_weight: float = 0.0
    confidence: float = 0.0
    dp_trained: bool = False

    def __post_init__(self) -> None:
        n = "ModelPayload"
        _check_float(n, "confidence", self.confidence, minimum=0.0)
        _check_float(n, "unobserved_weight", self.unobserved_weight, minimum=0.0)
        if self.unobserved_weight > 1.0 + self.confidence:
            _fail(
                n,
                f"unobserved_weight must be <= 1 + confidence = {1.0 + self.confidence!r}, "
                f"got {self.unobserved_weight!r}",
            )
        if self.confidence > 0 and self.unobserved_weight == 0:
            _fail(n, "confidence goes with a stated unobserved_weight (> 0)")
        if type(self.dp_trained) is not bool:
            _fail(n, f"dp_trained must be a bool, got {self.dp_trained!r}")
        _check_id(n, "model_version", self.model_version)
        _check_text(n, "model_kind", self.model_kind, 32)
        _check_id(n, "bits", self.bits)
        _check_id(n, "n_items", self.n_items)
        if not (1 <= self.bits <= MAX_RANK and 1 <= self.n_items <= MAX_ITEMS):
            _fail(n, f"bits must be in [1, {MAX_RANK}] and n_items in [1, 2**26], got {self.bits}, {self.n_items}")
        if self.model_kind == "lightfr":
            expected = 8 * ((self.bits + 63) // 64) * self.n_items
            _check_bytes(n, "words", self.words, expected, max_len=1 << 31)
            _check_bytes(n, "values", self.values, 0)
        else:
            _check_bytes(n, "words", self.words, 0)
            _check_bytes(n, "values", self.values, 8 * self.bits * self.n_items, max_len=1 << 31)
        _check_id(n, "hamming_weight", self.hamming_weight)
        if not 1 <= self.hamming_weight <= 255:
            _fail(n, f"hamming_weight must be in [1, 255], got {self.hamming_weight}")
        if self.item_levels:
            if self.model_kind != "lightfr":
                _fail(n, "item_levels are for LightFR models only")
            _check_bytes(n, "item_levels", self.item_levels, self.n_items, max_len=1 << 27)
        if self.unobserved_weight > 0 and not (self.model_kind == "lightfr" and self.item_levels):
            _fail(n, "unobserved_weight > 0 is for LightFR models of the all-items objective (with item_levels)")

    def lightfr_extras(self) -> dict[str, Any]:
        """Keyword arguments a LightFR device model's ``set_global`` takes beyond words and values
        (the item term, protocol 1.3; the w0, α and DP flag, protocol 1.7); empty for the other families."""
        if self.model_kind != "lightfr":
            return {}
        return {
            "item_levels": self.item_levels,
            "hamming_weight": self.hamming_weight,
            "unobserved_weight": self.unobserved_weight,
            "confidence": self.confidence,
            "dp_trained": self.dp_trained,
        }


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RoundResult(Message):
    """Server → device, answering the last phase: how the round ended.

    Attributes
    ----------
    round_id : int
    committed : bool
        True if a new model was committed from this round.
    model_version : int
        The global model version after the round.
    reason : str
        Why the round aborted, if it did.
    """

    TYPE: ClassVar[int] = 16
    round_id: int
    committed: bool
    model_version: int
    reason: str = ""

    def __post_init__(self) -> None:
        _check_id("RoundResult", "round_id", self.round_id)
        if type(self.committed) is not bool:
            _fail("RoundResult", "committed must be a bool")
        _check_id("RoundResult", "model_version", self.model_version)
        _check_text("RoundResult", "reason", self.reason, MAX_TEXT)


#: The largest signed revocation list a `RevocationListPayload` carries: 2**20 device keys (``"FRL1"``,
#: number, issued_at, count, the keys and the signature).
MAX_REVOCATION_LIST_BYTES = 4 + 8 + 8 + 4 + 32 * (1 << 20) + 64


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RevocationListPayload(Message):
    """Server → device (protocol 1.5): the enrollment authority's signed revocation list the server
    enforces (``GET /v1/enrollment/revocations``).

    The server only relays it: a device checks the signature against its pinned authority key and never
    goes back to a lower list number than the one it holds (`protocol.identity.verify_revocation_list`).

    Attributes
    ----------
    data : bytes
        The signed list exactly as the authority wrote it (``"FRL1"`` ‖ number ‖ issued_at ‖ count ‖ keys ‖
        signature, protocol.md §1.3), or empty when the server enforces none.
    """

    TYPE: ClassVar[int] = 22
    data: bytes = b""

    def __post_init__(self) -> None:
        _check_bytes("RevocationListPayload", "data", self.data, max_len=MAX_REVOCATION_LIST_BYTES)
