# Invariants: every message is an immutable value; `__post_init__` rejects anything whose types, ranges or
# lengths are wrong, so an invalid message can be built neither by a peer's bytes nor by our own code.
# Arrays are stored as read-only, C-contiguous copies, so a message cannot change after it was built.
"""What every message of `protocol.messages` is built on: the `Message` base, the wire size constants and
the field validators each ``__post_init__`` calls (one home for each check and its error text).

Every check raises ``ValueError("<MessageClass>: <text>")``, not a `FedRecError`: building an invalid
message is a programming or decoding error; the codec translates it into `DecodeError` at the wire boundary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, NoReturn

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "KEY_BYTES",
    "SESSION_ID_BYTES",
    "MAX_ID",
    "Message",
    "fail",
    "check_id",
    "check_ids",
    "check_bytes",
    "check_bytes_tuple",
    "check_text",
    "check_float",
    "check_addressed",
    "check_in_session",
    "check_ciphertexts",
    "frozen_u32",
    "set_field",
]

KEY_BYTES = 32
SESSION_ID_BYTES = 32
MAX_ID = 2**63 - 1


def fail(cls_name: str, text: str) -> NoReturn:
    """Refuse a message: ``ValueError("<cls_name>: <text>")``."""
    raise ValueError(f"{cls_name}: {text}")


def check_id(owner: str, name: str, value: object) -> None:
    """``value`` is an int in [0, 2**63) (a device or round id, a count, a version)."""
    if type(value) is not int or not 0 <= value <= MAX_ID:
        fail(owner, f"{name} must be an int in [0, 2**63), got {value!r}")


def check_ids(owner: str, name: str, values: object) -> None:
    """``values`` is a tuple of ids (`check_id`)."""
    if type(values) is not tuple:
        fail(owner, f"{name} must be a tuple of ints")
    for v in values:
        check_id(owner, name, v)


def check_bytes(owner: str, name: str, value: object, length: int | None = None, max_len: int = 1 << 20) -> None:
    """``value`` is bytes of exactly ``length`` (if given) and at most ``max_len`` bytes."""
    if type(value) is not bytes:
        fail(owner, f"{name} must be bytes, got {type(value).__name__}")
    n = len(value)
    if length is not None and n != length:
        fail(owner, f"{name} must be {length} bytes, got {n}")
    if n > max_len:
        fail(owner, f"{name} is {n} bytes, limit {max_len}")


def check_bytes_tuple(owner: str, name: str, values: object, length: int | None = None) -> None:
    """``values`` is a tuple of byte strings (`check_bytes`)."""
    if type(values) is not tuple:
        fail(owner, f"{name} must be a tuple of bytes")
    for v in values:
        check_bytes(owner, name, v, length)


def check_text(owner: str, name: str, value: object, max_len: int) -> None:
    """``value`` is a str of at most ``max_len`` characters."""
    if type(value) is not str or len(value) > max_len:
        fail(owner, f"{name} must be a str of at most {max_len} characters")


def check_float(owner: str, name: str, value: object, *, minimum: float | None = None) -> None:
    """``value`` is a finite float, at least ``minimum`` if given."""
    if type(value) is not float or not math.isfinite(value):
        fail(owner, f"{name} must be a finite float, got {value!r}")
    if minimum is not None and value < minimum:
        fail(owner, f"{name} must be >= {minimum}, got {value!r}")


def check_addressed(owner: str, message: Any) -> None:
    """The ``round_id`` and ``device_id`` of a message addressed to (or sent by) one device in one round."""
    check_id(owner, "round_id", message.round_id)
    check_id(owner, "device_id", message.device_id)


def check_in_session(owner: str, message: Any) -> None:
    """`check_addressed` plus the 32-byte ``session_id`` of a message inside a round's session."""
    check_addressed(owner, message)
    check_bytes(owner, "session_id", message.session_id, SESSION_ID_BYTES)


def check_ciphertexts(owner: str, ids_name: str, ids: object, ciphertexts: object) -> None:
    """Share ciphertexts: a tuple of ids (named ``ids_name``) aligned with a tuple of byte strings."""
    check_ids(owner, ids_name, ids)
    check_bytes_tuple(owner, "ciphertexts", ciphertexts)
    if len(ids) != len(ciphertexts):  # type: ignore[arg-type]
        fail(owner, f"{ids_name} and ciphertexts must have equal lengths")


def frozen_u32(owner: str, name: str, value: object) -> NDArray[np.uint32]:
    """A read-only, C-contiguous copy of ``value``, which must be a 1-D numpy uint32 array."""
    if not isinstance(value, np.ndarray) or value.dtype != np.uint32 or value.ndim != 1:
        fail(owner, f"{name} must be a 1-D numpy uint32 array")
    arr: NDArray[np.uint32] = np.array(value, dtype=np.uint32, order="C", copy=True)
    arr.setflags(write=False)
    return arr


def set_field(obj: object, name: str, value: object) -> None:
    """Set a field of a frozen message from its ``__post_init__`` (a normalised copy of what was passed)."""
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
