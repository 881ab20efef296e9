# Invariants: every message is an immutable value (`protocol.message_base`); `__post_init__` rejects anything
# whose types, ranges or lengths are wrong, so an invalid message can be built neither by a peer's bytes nor
# by our own code.  Relational rules that need session context (an id listed twice, an id in both lists, an
# id outside the neighbourhood, keys not distinct) are protocol rules: the receiving session checks them and
# raises `RemoteProtocolError`, which keeps those malicious-server defences testable on their own.
"""SecAgg+ round messages (docs/design.md §4), and the one place every protocol message is imported from.

Device ids are non-negative integers below 2**63; round ids likewise.  Byte strings are raw: X25519 public
keys are 32 bytes, the session id is a 32-byte SHA-256 digest.  Ring vectors are 1-D ``np.uint32`` arrays
(arithmetic mod 2**32).  Deadlines are absolute times on the coordinator's clock, in seconds.

This module defines the messages of a round's phases (type codes 1–10, 20, 21), side by side so that part
of the wire format reads in one place.  The registration, check-in, model download, round result and
revocation list messages (11–16, 22) live in `protocol.service_messages`, the `Message` base and the
field validators in `protocol.message_base`; both are re-exported here, so the codec's table, the test
vectors and every caller import any message from this one module.  The training plan's typed form lives
in `protocol.plan`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from numpy.typing import NDArray

from protocol.errors import FedRecError, error_class_for_code
from protocol.message_base import (
    KEY_BYTES,
    MAX_ID,
    SESSION_ID_BYTES,
    Message,
    check_addressed,
    check_bytes,
    check_bytes_tuple,
    check_ciphertexts,
    check_float,
    check_id,
    check_ids,
    check_in_session,
    check_text,
    fail,
    frozen_u32,
    set_field,
)
from protocol.plan import (
    FamilyParams,
    FELBParams,
    FNMFParams,
    IALSParams,
    LightFRParams,
    MFParams,
    TrainingPlan,
    params_from_wire,
)
from protocol.quantization import QuantizationConfig
from protocol.service_messages import *  # noqa: F403
from protocol.service_messages import __all__ as _service_all
from protocol.spec import MAX_TEXT, MAX_VECTOR_LENGTH, ModelKind

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
    *_service_all,
]

_MAX_CODE = 64


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
    dp_colluders : int
        Protocol 1.12: f, how many devices of the cohort the noise assumes may collude with the server and
        add none; each device adds mu / (dp_t_min - f) and a survivor keeps mu / (s - f), so the honest
        survivors alone carry mu.  0 without DP, and absent (0) from an older server, which a device whose
        policy assumes colluders refuses (`protocol.policy`).
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
    roster_ids, roster_keys : tuple of int, tuple of bytes
        Protocol 1.8: the invited cohort, every device id in increasing order (``cohort_size`` of them)
        and, in a signed round, each one's certified 32-byte identity key.  A device that pins an
        enrollment authority signs n and `protocol.identity.roster_digest` of them in its key
        advertisement and its survivor set; empty = not stated (an older server), which such a device
        refuses.
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
    # Appended in protocol 1.8 (a cohort the server cannot shrink): the roster the devices sign.
    roster_ids: tuple[int, ...] = ()
    roster_keys: tuple[bytes, ...] = ()
    # Appended in protocol 1.12 (noise that colluding devices cannot thin): f of the noise calibration.
    dp_colluders: int = 0
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
            if not isinstance(self.params, LightFRParams | MFParams | FELBParams | FNMFParams | IALSParams):
                fail(n, f"params must be a family's training parameters (protocol.plan), got {self.params!r}")
            if self.params.KIND != self.model_kind:
                fail(n, f"params are {self.params.KIND.value!r} parameters, model_kind is {self.model_kind!r}")
        check_id(n, "cohort_size", self.cohort_size)
        check_id(n, "round_index", self.round_index)
        if self.roster_ids or self.roster_keys:
            _check_roster(self)
        for name in ("model_version", "bits", "n_items", "example_cap"):
            check_id(n, name, getattr(self, name))
        check_text(n, "model_kind", self.model_kind, 32)
        if self.bits and self.n_items:
            size = self.bits * self.n_items
            if self.model_kind == ModelKind.LIGHTFR and self.params is not None:
                want = self.params.upload_length(self.n_items, self.bits)
                if want != self.vector_length:
                    fail(n, f"vector_length {self.vector_length} != {want}, the LightFR upload for this plan")
            if size > self.vector_length:
                fail(n, f"vector_length {self.vector_length} < n_items {self.n_items} × bits {self.bits}")
        check_addressed(n, self)
        for name in ("vector_length", "graph_k", "graph_t", "scale_bits", "dp_t_min", "dp_colluders"):
            check_id(n, name, getattr(self, name))
        if not 1 <= self.vector_length <= MAX_VECTOR_LENGTH:
            fail(n, f"vector_length must be in [1, 2**28], got {self.vector_length}")
        if not 1 <= self.graph_t <= self.graph_k:
            fail(n, f"need 1 <= graph_t <= graph_k, got t={self.graph_t}, k={self.graph_k}")
        check_float(n, "clip_norm", self.clip_norm)
        if self.clip_norm <= 0.0:
            fail(n, f"clip_norm must be > 0, got {self.clip_norm}")
        if self.scale_bits > 30:
            fail(n, f"scale_bits must be <= 30 (the quantizer's limit), got {self.scale_bits}")
        self._check_dp()
        deadlines = self.deadlines
        for name, d in zip(("advertise", "share_keys", "masked_input", "unmask"), deadlines, strict=True):
            check_float(n, f"{name}_deadline", d)
        if any(b < a for a, b in zip(deadlines, deadlines[1:], strict=False)):
            fail(n, "phase deadlines must be non-decreasing")

    def _check_dp(self) -> None:
        n = "RoundInvite"
        check_float(n, "dp_mu", self.dp_mu, minimum=0.0)
        if (self.dp_mu == 0.0) != (self.dp_t_min == 0):
            fail(n, "dp_mu and dp_t_min must both be zero (no DP) or both positive")
        if self.dp_colluders and self.dp_colluders >= self.dp_t_min:
            fail(n, f"dp_colluders {self.dp_colluders} must be below dp_t_min {self.dp_t_min} (0 without DP)")

    @property
    def plan(self) -> TrainingPlan:
        """The typed training plan this invite carries (`protocol.plan.TrainingPlan.from_invite`); ValueError
        if it carries none, or not a valid one."""
        return TrainingPlan.from_invite(self)

    def with_plan(self, plan: TrainingPlan) -> RoundInvite:
        """This invite carrying ``plan`` (`TrainingPlan.invite_fields`); ValueError if the plan's upload is
        not ``vector_length`` entries."""
        if plan.vector_length != self.vector_length:
            fail("RoundInvite", f"vector_length {self.vector_length} != {plan.vector_length}, the plan's upload")
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


#: The roster tuples last found valid (held, so their ids cannot be reused): a server builds one invite per
#: device around the same two tuples, and checking them again for each would cost O(n²).  Tuples of ints
#: and bytes never change, so a hit is exactly the answer a fresh check would give.
_CHECKED_ROSTER: list[object] = [None, None, -1]


def _check_roster(invite: RoundInvite) -> None:
    n, ids = "RoundInvite", invite.roster_ids
    if _CHECKED_ROSTER[0] is ids and _CHECKED_ROSTER[1] is invite.roster_keys and _CHECKED_ROSTER[2] == len(ids):
        if len(ids) != invite.cohort_size:
            fail(n, f"the roster lists {len(ids)} devices, cohort_size is {invite.cohort_size}")
        return
    check_ids(n, "roster_ids", ids)
    if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        fail(n, "roster_ids must be in increasing order, each id once")
    if len(ids) != invite.cohort_size:
        fail(n, f"the roster lists {len(ids)} devices, cohort_size is {invite.cohort_size}")
    check_bytes_tuple(n, "roster_keys", invite.roster_keys, KEY_BYTES)
    if invite.roster_keys and len(invite.roster_keys) != len(ids):
        fail(n, "roster_keys must have one identity key per roster id, or none")
    _CHECKED_ROSTER[:] = [ids, invite.roster_keys, len(ids)]


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
        check_addressed(n, self)
        check_bytes(n, "c_public_key", self.c_public_key, KEY_BYTES)
        check_bytes(n, "s_public_key", self.s_public_key, KEY_BYTES)
        check_bytes(n, "certificate", self.certificate, max_len=256)
        check_bytes(n, "signature", self.signature, max_len=64)
        if self.c_public_key == self.s_public_key:
            fail(n, "c_public_key and s_public_key must differ")


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
        check_in_session(n, self)
        check_ids(n, "neighbour_ids", self.neighbour_ids)
        check_bytes_tuple(n, "c_public_keys", self.c_public_keys, KEY_BYTES)
        check_bytes_tuple(n, "s_public_keys", self.s_public_keys, KEY_BYTES)
        if not len(self.neighbour_ids) == len(self.c_public_keys) == len(self.s_public_keys):
            fail(n, "neighbour_ids, c_public_keys and s_public_keys must have equal lengths")
        check_bytes_tuple(n, "certificates", self.certificates)
        check_bytes_tuple(n, "signatures", self.signatures)
        if self.certificates or self.signatures:
            if not len(self.certificates) == len(self.signatures) == len(self.neighbour_ids):
                fail(n, "certificates and signatures must have one entry per neighbour")


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
        check_in_session(n, self)
        check_ciphertexts(n, "recipient_ids", self.recipient_ids, self.ciphertexts)


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
        check_in_session(n, self)
        check_ciphertexts(n, "sender_ids", self.sender_ids, self.ciphertexts)


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
        check_in_session(n, self)
        set_field(self, "masked", frozen_u32(n, "masked", self.masked))
        if self.masked.size == 0:
            fail(n, "masked must not be empty")
        check_ids(n, "bad_share_senders", self.bad_share_senders)
        if list(self.bad_share_senders) != sorted(set(self.bad_share_senders)):
            fail(n, "bad_share_senders must be sorted and list each device once")
        if self.device_id in self.bad_share_senders:
            fail(n, "bad_share_senders must not name the sender itself")


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
        check_in_session(n, self)
        check_ids(n, "survivors", self.survivors)
        check_ids(n, "dropped", self.dropped)
        check_id(n, "n_survivors", self.n_survivors)
        check_ids(n, "survivor_set", self.survivor_set)
        check_ids(n, "signer_ids", self.signer_ids)
        check_bytes_tuple(n, "signer_certificates", self.signer_certificates)
        check_bytes_tuple(n, "signatures", self.signatures)
        if not len(self.signer_ids) == len(self.signer_certificates) == len(self.signatures):
            fail(n, "signer_ids, signer_certificates and signatures must have equal lengths")


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
        check_in_session(n, self)
        check_ids(n, "survivor_set", self.survivor_set)


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
        check_in_session(n, self)
        check_bytes(n, "signature", self.signature, 64)


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
        check_in_session(n, self)
        check_ids(n, "b_share_ids", self.b_share_ids)
        check_bytes_tuple(n, "b_shares", self.b_shares)
        check_ids(n, "s_share_ids", self.s_share_ids)
        check_bytes_tuple(n, "s_shares", self.s_shares)
        if len(self.b_share_ids) != len(self.b_shares) or len(self.s_share_ids) != len(self.s_shares):
            fail(n, "share id lists and share lists must have equal lengths")
        set_field(self, "dp_excess", frozen_u32(n, "dp_excess", self.dp_excess))


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
        check_addressed(n, self)
        check_text(n, "reason", self.reason, MAX_TEXT)


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
        check_text(n, "code", self.code, _MAX_CODE)
        check_text(n, "message", self.message, MAX_TEXT)
        code = self.code
        if (
            not code
            or not code[0].isascii()
            or not code[0].islower()
            or not all(c == "_" or (c.isascii() and (c.islower() or c.isdigit())) for c in code)
        ):
            fail(n, f"error code must match [a-z][a-z0-9_]*, got {code!r}")

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
