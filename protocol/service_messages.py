"""Messages around the rounds (protocol 1.1 and later): registration, check-in, model download, the round
result and the signed revocation list (type codes 11–16 and 22), the bodies of the aggregation service's
HTTP API outside a round's SecAgg phases (docs/http-api.md).

Import them from `protocol.messages`, the one place every protocol message is imported from; the `Message`
base and the field validators are `protocol.message_base`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from protocol.message_base import Message, check_bytes, check_float, check_id, check_text, fail
from protocol.spec import MAX_ITEMS, MAX_LEVEL_WEIGHT, MAX_RANK, MAX_TEXT

__all__ = [
    "MAX_REVOCATION_LIST_BYTES",
    "RegisterRequest",
    "RegisterResponse",
    "CheckIn",
    "Wait",
    "ModelPayload",
    "RoundResult",
    "RevocationListPayload",
]

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
        check_text(n, "platform", self.platform, 128)
        check_bytes(n, "certificate", self.certificate, max_len=256)
        check_bytes(n, "proof", self.proof, max_len=64)
        check_text(n, "enrollment_token", self.enrollment_token, _MAX_TOKEN)
        if bool(self.certificate) != bool(self.proof):
            fail(n, "certificate and proof go together")
        if self.certificate and self.enrollment_token:
            fail(n, "one credential per registration: a certificate or an enrollment token, not both")


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
        check_id("RegisterResponse", "device_id", self.device_id)
        check_text("RegisterResponse", "token", self.token, _MAX_TOKEN)
        if len(self.token) < 16:
            fail("RegisterResponse", "token must be at least 16 characters")


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
        check_id("CheckIn", "device_id", self.device_id)
        check_id("CheckIn", "model_version", self.model_version)


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
        check_float("Wait", "retry_after", self.retry_after, minimum=0.0)
        check_text("Wait", "reason", self.reason, MAX_TEXT)


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
        A device scores item i as (bits − Hamming)·hamming_weight + level_i.  Protocol 1.10, iALS: the
        same, the log-scale holder counts of the round that produced this model (`level_weight`).
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
    level_weight : float
        Protocol 1.10, iALS: w in [0, MAX_LEVEL_WEIGHT]; a device scores item i as u·v_i + w·level_i / 255.
        > 0 only for an ``ials`` model with ``item_levels``.  0 (the default, and what a 1.9 server's
        payload means): u·v alone.
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
    # Appended in protocol 1.10 (iALS item term).
    level_weight: float = 0.0

    def __post_init__(self) -> None:
        n = "ModelPayload"
        check_float(n, "confidence", self.confidence, minimum=0.0)
        check_float(n, "unobserved_weight", self.unobserved_weight, minimum=0.0)
        if self.unobserved_weight > 1.0 + self.confidence:
            fail(
                n,
                f"unobserved_weight must be <= 1 + confidence = {1.0 + self.confidence!r}, "
                f"got {self.unobserved_weight!r}",
            )
        if self.confidence > 0 and self.unobserved_weight == 0:
            fail(n, "confidence goes with a stated unobserved_weight (> 0)")
        if type(self.dp_trained) is not bool:
            fail(n, f"dp_trained must be a bool, got {self.dp_trained!r}")
        check_id(n, "model_version", self.model_version)
        check_text(n, "model_kind", self.model_kind, 32)
        check_id(n, "bits", self.bits)
        check_id(n, "n_items", self.n_items)
        if not (1 <= self.bits <= MAX_RANK and 1 <= self.n_items <= MAX_ITEMS):
            fail(n, f"bits must be in [1, {MAX_RANK}] and n_items in [1, 2**26], got {self.bits}, {self.n_items}")
        if self.model_kind == "lightfr":
            expected = 8 * ((self.bits + 63) // 64) * self.n_items
            check_bytes(n, "words", self.words, expected, max_len=1 << 31)
            check_bytes(n, "values", self.values, 0)
        else:
            check_bytes(n, "words", self.words, 0)
            check_bytes(n, "values", self.values, 8 * self.bits * self.n_items, max_len=1 << 31)
        check_id(n, "hamming_weight", self.hamming_weight)
        if not 1 <= self.hamming_weight <= 255:
            fail(n, f"hamming_weight must be in [1, 255], got {self.hamming_weight}")
        if self.item_levels:
            if self.model_kind not in ("lightfr", "ials"):
                fail(n, "item_levels are for LightFR and iALS models only")
            check_bytes(n, "item_levels", self.item_levels, self.n_items, max_len=1 << 27)
        check_float(n, "level_weight", self.level_weight, minimum=0.0)
        if self.level_weight > MAX_LEVEL_WEIGHT:
            fail(n, f"level_weight must be <= {MAX_LEVEL_WEIGHT:g}, got {self.level_weight!r}")
        if self.level_weight > 0 and not (self.model_kind == "ials" and self.item_levels):
            fail(n, "level_weight > 0 is for iALS models with item_levels")
        if self.unobserved_weight > 0 and not (self.model_kind == "lightfr" and self.item_levels):
            fail(n, "unobserved_weight > 0 is for LightFR models of the all-items objective (with item_levels)")

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

    def ials_extras(self) -> dict[str, Any]:
        """Keyword arguments an iALS device model's ``set_global`` takes beyond words and values (the item
        term, protocol 1.10); empty for the other families."""
        if self.model_kind != "ials":
            return {}
        return {"item_levels": self.item_levels, "level_weight": self.level_weight}

    def family_extras(self) -> dict[str, Any]:
        """`lightfr_extras` or `ials_extras`, whichever this payload's family takes (empty for the others)."""
        return self.lightfr_extras() or self.ials_extras()


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
        check_id("RoundResult", "round_id", self.round_id)
        if type(self.committed) is not bool:
            fail("RoundResult", "committed must be a bool")
        check_id("RoundResult", "model_version", self.model_version)
        check_text("RoundResult", "reason", self.reason, MAX_TEXT)


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
        check_bytes("RevocationListPayload", "data", self.data, max_len=MAX_REVOCATION_LIST_BYTES)
