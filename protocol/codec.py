# Invariants: the wire format is the msgpack map {"v": [major, minor], "t": <type code>, "b": {<key>: ...}}.
# Type codes and body keys are stable: within a major version fields are only appended (each with a default
# in its dataclass), never renamed, retyped or reused; decoders ignore unknown keys.  Every failure to turn
# bytes into a valid message leaves this module as `DecodeError` (or `VersionMismatch` / `PayloadTooLarge`,
# both `RemoteProtocolError`s); no msgpack exception crosses the boundary.  The tables below are constants.
"""Versioned, table-driven msgpack codec for the round messages in `protocol.messages`.

Type codes: 1–10 are the SecAgg round messages; 11–16 registration, check-in, model download and the
round result (protocol 1.1); protocol 1.2 appended the model-family fields of `RoundInvite` and
`ModelPayload.values`; protocol 1.3 appended `RoundInvite.cohort_size`, the signed key advertisements
and the consistency check (20 ConsistencyRequest, 21 ConsistencySignature); protocol 1.5 added 22
RevocationListPayload (the signed revocation list a device fetches); protocol 1.6 appended asymmetric
scoring to `RoundInvite`; protocol 1.7 appended `ModelPayload`'s w0, α and DP flag; 17–19 reserved; 23+
are free.
Never reuse a code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from enum import Enum
from types import MappingProxyType
from typing import Any

import msgpack
import numpy as np

from protocol.errors import DecodeError, PayloadTooLarge, VersionMismatch
from protocol.messages import (
    Abort,
    CheckIn,
    ConsistencyRequest,
    ConsistencySignature,
    EncryptedShares,
    ErrorMessage,
    MaskedInput,
    MaskedInputRequest,
    Message,
    ModelPayload,
    PublicKeys,
    RegisterRequest,
    RegisterResponse,
    RevocationListPayload,
    RoundInvite,
    RoundResult,
    ShareKeysBroadcast,
    UnmaskRequest,
    UnmaskResponse,
    Wait,
)
from protocol.plan import known_wire_params, params_from_wire, params_to_wire
from protocol.spec import PROTOCOL_VERSION

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "is_compatible",
    "check_version",
    "encode",
    "decode",
    "decode_versioned",
    "body_fields",
    "check_shape",
    "MAX_OBJECTS",
    "MAX_DEPTH",
]

#: Default total size limit for one encoded message (a 10**6-element masked vector is 4 MB).
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Far above any legitimate list (neighbourhoods are at most a few thousand), far below what would hurt.
_MAX_ARRAY_LEN = 1 << 20
_MAX_MAP_LEN = 64
_MAX_STR_LEN = 1 << 16
#: Caps on the shape of any envelope, checked by `check_shape` before msgpack builds a single object: the
#: largest legitimate message (a ShareKeys broadcast or unmask response of a few thousand neighbours) has
#: well under 2**15 objects and a depth of 5.  Without them 63 MiB of nested or empty arrays decode into
#: gigabytes of Python lists.
MAX_OBJECTS = 1 << 16
MAX_DEPTH = 8

# Bytes that follow the type byte for fixed-size types, and the width of the length prefix of sized ones.
_FIXED_TAIL = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2}
_FIXED_TAIL.update({0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17})
_SIZED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1)}
_SIZED.update({0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0)})
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


class Kind(Enum):
    """How one body field travels."""

    INT = "int"
    FLOAT = "float"
    STR = "str"
    BOOL = "bool"
    BYTES = "bytes"
    INTS = "ints"  # msgpack array of ints  <-> tuple[int, ...]
    BYTES_LIST = "bytes_list"  # msgpack array of bin  <-> tuple[bytes, ...]
    U32 = "u32"  # {"dt": "<u4", "sh": [n], "by": bin little-endian}  <-> 1-D np.uint32


_U32_WIRE_DTYPE = "<u4"

# Wire keys are short and stable.
# type code -> (message class, entries): an entry is (field name, wire key, kind), or for `RoundInvite` a bare
# wire key: one of the family parameters that ``RoundInvite.params`` holds (`_plan_entries`).
_SCHEMA: Mapping[int, tuple[type[Message], tuple[tuple[str, str, Kind] | str, ...]]] = MappingProxyType(
    {
        RoundInvite.TYPE: (
            RoundInvite,
            (
                ("round_id", "r", Kind.INT),
                ("device_id", "d", Kind.INT),
                ("vector_length", "L", Kind.INT),
                ("graph_k", "k", Kind.INT),
                ("graph_t", "t", Kind.INT),
                ("clip_norm", "c", Kind.FLOAT),
                ("scale_bits", "sb", Kind.INT),
                ("dp_mu", "mu", Kind.FLOAT),
                ("dp_t_min", "tm", Kind.INT),
                ("advertise_deadline", "d0", Kind.FLOAT),
                ("share_keys_deadline", "d1", Kind.FLOAT),
                ("masked_input_deadline", "d2", Kind.FLOAT),
                ("unmask_deadline", "d3", Kind.FLOAT),
                # protocol 1.1: the training plan.  A bare string is a family parameter's key, at the place
                # it was appended; the parameter's type declares it (`protocol.plan.param_field`), and keys
                # declared there that are not listed here follow at the end (`_invite_layout`).
                ("model_version", "mv", Kind.INT),
                ("model_kind", "mk", Kind.STR),
                "ag",
                ("bits", "f", Kind.INT),
                ("n_items", "m", Kind.INT),
                "lam",
                "neg",
                "E",
                "sw",
                ("example_cap", "th", Kind.INT),
                # protocol 1.2: model families
                "lr",
                "rg",
                "rgg",
                "ka",
                "px",
                "bt",
                "R",
                "pe",
                "sr",
                "al",
                ("round_index", "ri", Kind.INT),
                # protocol 1.3: the device-side privacy floor
                ("cohort_size", "nc", Kind.INT),
                "w0",  # protocol 1.3
                "cf",  # protocol 1.3
                "cs",  # protocol 1.3
                # protocol 1.6: LightFR asymmetric scoring in the plan
                "qp",
                "ur",
                # protocol 1.8: the roster devices sign (omitted when empty)
                ("roster_ids", "ro", Kind.INTS),
                ("roster_keys", "rok", Kind.BYTES_LIST),
                # protocol 1.9: iALS's bounded upload for DP rounds
                "bd",
                "gw",
                # protocol 1.12: colluders the DP noise is calibrated against
                ("dp_colluders", "tc", Kind.INT),
            ),
        ),
        PublicKeys.TYPE: (
            PublicKeys,
            (
                ("round_id", "r", Kind.INT),
                ("device_id", "d", Kind.INT),
                ("c_public_key", "pc", Kind.BYTES),
                ("s_public_key", "ps", Kind.BYTES),
                # protocol 1.3: signed key advertisements
                ("certificate", "crt", Kind.BYTES),
                ("signature", "sig", Kind.BYTES),
            ),
        ),
        ShareKeysBroadcast.TYPE: (
            ShareKeysBroadcast,
            (
                ("round_id", "r", Kind.INT),
                ("device_id", "d", Kind.INT),
                ("session_id", "sid", Kind.BYTES),
                ("neighbour_ids", "n", Kind.INTS),
                ("c_public_keys", "pc", Kind.BYTES_LIST),
                ("s_public_keys", "ps", Kind.BYTES_LIST),
                # protocol 1.3
                ("certificates", "crt", Kind.BYTES_LIST),
                ("signatures", "sig", Kind.BYTES_LIST),
            ),
        ),
        EncryptedShares.TYPE: (
            EncryptedShares,
            (
                ("round_id", "r", Kind.INT),
                ("device_id", "d", Kind.INT),
                ("session_id", "sid", Kind.BYTES),
                ("recipient_ids", "to", Kind.INTS),
                ("ciphertexts", "ct", Kind.BYTES_LIST),
            ),
        ),
        MaskedInputRequest.TYPE: (
            MaskedInputRequest,
            (
                ("round_id", "r", Kind.INT),
                ("device_id", "d", Kind.INT),
                ("session_id", "sid", Kind.BYTES),
                ("sender_ids", "fr", Kind.INTS),
                ("ciphertexts", "ct", Kind.BYTES_LIST),
            ),
        ),
        MaskedInput.TYPE: (
            MaskedInput,
            (
                ("round_id", "r", Kind.INT),
                ("device_id", "d", Kind.INT),
                ("session_id", "sid", Kind.BYTES),
                ("masked", "y", Kind.U32),
                # protocol 1.3: neighbours whose share ciphertexts were unusable (docs/threat-model.md §3.6)
                ("bad_share_senders", "bad", Kind.INTS),
            ),
        ),
        UnmaskRequest.TYPE: (
            UnmaskRequest,
            (
                ("round_id", "r", Kind.INT),
                ("device_id", "d", Kind.INT),
                ("session_id", "sid", Kind.BYTES),
                ("survivors", "u3", Kind.INTS),
                ("dropped", "dr", Kind.INTS),
                ("n_survivors", "ns", Kind.INT),
                # protocol 1.3: the consistency check
                ("survivor_set", "u3s", Kind.INTS),
                ("signer_ids", "sgi", Kind.INTS),
                ("signer_certificates", "crt", Kind.BYTES_LIST),
                ("signatures", "sig", Kind.BYTES_LIST),
            ),
        ),
        ConsistencyRequest.TYPE: (
            ConsistencyRequest,
            (
                ("round_id", "r", Kind.INT),
                ("device_id", "d", Kind.INT),
                ("session_id", "sid", Kind.BYTES),
                ("survivor_set", "u3s", Kind.INTS),
            ),
        ),
        ConsistencySignature.TYPE: (
            ConsistencySignature,
            (
                ("round_id", "r", Kind.INT),
                ("device_id", "d", Kind.INT),
                ("session_id", "sid", Kind.BYTES),
                ("signature", "sig", Kind.BYTES),
            ),
        ),
        UnmaskResponse.TYPE: (
            UnmaskResponse,
            (
                ("round_id", "r", Kind.INT),
                ("device_id", "d", Kind.INT),
                ("session_id", "sid", Kind.BYTES),
                ("b_share_ids", "bi", Kind.INTS),
                ("b_shares", "bs", Kind.BYTES_LIST),
                ("s_share_ids", "si", Kind.INTS),
                ("s_shares", "ss", Kind.BYTES_LIST),
                ("dp_excess", "dp", Kind.U32),
            ),
        ),
        Abort.TYPE: (
            Abort,
            (
                ("round_id", "r", Kind.INT),
                ("device_id", "d", Kind.INT),
                ("reason", "why", Kind.STR),
            ),
        ),
        ErrorMessage.TYPE: (
            ErrorMessage,
            (
                ("code", "c", Kind.STR),
                ("message", "m", Kind.STR),
            ),
        ),
        RegisterRequest.TYPE: (
            RegisterRequest,
            (
                ("platform", "p", Kind.STR),
                ("certificate", "cert", Kind.BYTES),  # 1.4
                ("proof", "pf", Kind.BYTES),  # 1.4
                ("enrollment_token", "et", Kind.STR),  # 1.4
            ),
        ),
        RegisterResponse.TYPE: (RegisterResponse, (("device_id", "d", Kind.INT), ("token", "tok", Kind.STR))),
        CheckIn.TYPE: (CheckIn, (("device_id", "d", Kind.INT), ("model_version", "mv", Kind.INT))),
        Wait.TYPE: (Wait, (("retry_after", "ra", Kind.FLOAT), ("reason", "why", Kind.STR))),
        ModelPayload.TYPE: (
            ModelPayload,
            (
                ("model_version", "mv", Kind.INT),
                ("model_kind", "mk", Kind.STR),
                ("bits", "f", Kind.INT),
                ("n_items", "m", Kind.INT),
                ("words", "w", Kind.BYTES),
                ("values", "val", Kind.BYTES),  # protocol 1.2
                ("item_levels", "lv", Kind.BYTES),  # protocol 1.3
                ("hamming_weight", "hw", Kind.INT),  # protocol 1.3
                ("unobserved_weight", "w0", Kind.FLOAT),  # protocol 1.7
                ("confidence", "al", Kind.FLOAT),  # protocol 1.7
                ("dp_trained", "dp", Kind.BOOL),  # protocol 1.7
                ("level_weight", "lw", Kind.FLOAT),  # protocol 1.10
            ),
        ),
        RoundResult.TYPE: (
            RoundResult,
            (
                ("round_id", "r", Kind.INT),
                ("committed", "ok", Kind.BOOL),
                ("model_version", "mv", Kind.INT),
                ("reason", "why", Kind.STR),
            ),
        ),
        RevocationListPayload.TYPE: (RevocationListPayload, (("data", "crl", Kind.BYTES),)),  # protocol 1.5
    }
)


def _entries(listed: tuple[tuple[str, str, Kind] | str, ...]) -> tuple[tuple[str, str, Kind] | str, ...]:
    """A message's entries: those listed, then, for the invite, every family parameter key the parameter
    types declare that the list does not name yet (a parameter added after protocol 1.7 needs no entry)."""
    if not any(isinstance(item, str) for item in listed):
        return listed
    named = {item for item in listed if isinstance(item, str)}
    return listed + tuple(key for key in known_wire_params() if key not in named)


def _param_kind(key: str) -> Kind:
    """How a family parameter's key travels: the type of its ``absent`` value (`protocol.plan.param_field`)."""
    absent = known_wire_params()[key].absent
    if isinstance(absent, bool):
        return Kind.BOOL
    return Kind.INT if isinstance(absent, int) else Kind.FLOAT if isinstance(absent, float) else Kind.STR


def _plan_values(invite: RoundInvite) -> dict[str, Any]:
    return {} if invite.params is None else params_to_wire(invite.params)


def _check_plan_keys() -> None:
    """Every bare key in the schema is a declared family parameter (run once, at import)."""
    known = known_wire_params()
    for _, entries in _SCHEMA.values():
        for item in entries:
            if isinstance(item, str) and item not in known:
                raise RuntimeError(f"codec schema names {item!r}, which no family parameter declares")


_check_plan_keys()


def is_compatible(version: tuple[int, int]) -> bool:
    """Decide whether a peer speaking ``version`` can be understood (the one place this is decided).

    Parameters
    ----------
    version : tuple of int
        The peer's ``(major, minor)``.

    Returns
    -------
    bool
        True when the majors agree: within a major version fields are only appended with defaults, so
        any minor works both ways.
    """
    return version[0] == PROTOCOL_VERSION[0]


def check_version(version: tuple[int, int]) -> None:
    """Raise unless `is_compatible` accepts ``version``.

    Raises
    ------
    VersionMismatch
        The majors differ.
    """
    if not is_compatible(version):
        raise VersionMismatch(
            f"peer speaks protocol {version[0]}.{version[1]}, we speak {PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}"
        )


def _encode_value(kind: Kind, value: Any) -> Any:
    if kind is Kind.INTS or kind is Kind.BYTES_LIST:
        return list(value)
    if kind is Kind.U32:
        arr = np.asarray(value)
        raw = arr.astype(_U32_WIRE_DTYPE, copy=False).tobytes()
        return {"dt": _U32_WIRE_DTYPE, "sh": list(arr.shape), "by": raw}
    return value


#: Fields written only when non-empty (or non-zero): an honest device's message keeps the bytes it had before the field
#: existed (the committed test vectors, peers of the same major that predate it).
_OMITTED_WHEN_EMPTY = frozenset(
    {(MaskedInput.TYPE, "bad"), (RoundInvite.TYPE, "ro"), (RoundInvite.TYPE, "rok"), (RoundInvite.TYPE, "tc")}
)


def encode(message: Message) -> bytes:
    """Encode a message into its versioned msgpack envelope.

    Parameters
    ----------
    message : Message
        Any message class in the codec table.

    Returns
    -------
    bytes

    Raises
    ------
    TypeError
        ``message`` is not a registered message type (a programming error, not a wire error).
    """
    entry = _SCHEMA.get(getattr(type(message), "TYPE", -1))
    if entry is None or entry[0] is not type(message):
        raise TypeError(f"no codec entry for {type(message).__name__}")
    body = {
        key: _encode_value(kind, value)
        for _, key, kind, value in body_fields(message)
        if (message.TYPE, key) not in _OMITTED_WHEN_EMPTY or value
    }
    envelope = {"v": list(PROTOCOL_VERSION), "t": message.TYPE, "b": body}
    packed: bytes = msgpack.packb(envelope, use_bin_type=True)
    return packed


def body_fields(message: Message) -> list[tuple[str, str, Kind, Any]]:
    """``(name, wire key, kind, value)`` of every body field of ``message``, in wire order.  A `RoundInvite`'s
    family parameters are named as their parameter type names them, with the invite's value, or for a key
    that its family does not use the value an invite without the key means.

    Raises
    ------
    TypeError
        ``message`` is not a registered message type.
    """
    entry = _SCHEMA.get(getattr(type(message), "TYPE", -1))
    if entry is None or entry[0] is not type(message):
        raise TypeError(f"no codec entry for {type(message).__name__}")
    plan = _plan_values(message) if isinstance(message, RoundInvite) else {}
    out: list[tuple[str, str, Kind, Any]] = []
    for item in _entries(entry[1]):
        if isinstance(item, str):  # a family parameter
            param = known_wire_params()[item]
            out.append((param.name, item, _param_kind(item), plan.get(item, param.absent)))
        else:
            name, key, kind = item
            out.append((name, key, kind, getattr(message, name)))
    return out


def _want(ok: bool, what: str) -> None:
    if not ok:
        raise DecodeError(what)


def _decode_int(value: Any, key: str) -> int:
    _want(type(value) is int, f"field {key!r} must be an integer")
    return int(value)


def _decode_value(kind: Kind, value: Any, key: str) -> Any:
    if kind is Kind.INT:
        return _decode_int(value, key)
    if kind is Kind.FLOAT:
        # msgpack gives float for float32/64; an integer is accepted for a float field (it is exact).
        _want(type(value) in (float, int), f"field {key!r} must be a number")
        return float(value)
    if kind is Kind.STR:
        _want(type(value) is str, f"field {key!r} must be a string")
        return value
    if kind is Kind.BOOL:
        _want(type(value) is bool, f"field {key!r} must be a boolean")
        return value
    if kind is Kind.BYTES:
        if type(value) is _Spliced:
            return value.view.tobytes()
        _want(type(value) is bytes, f"field {key!r} must be binary")
        return value
    if kind is Kind.INTS:
        _want(type(value) is list, f"field {key!r} must be an array")
        return tuple(_decode_int(v, key) for v in value)
    if kind is Kind.BYTES_LIST:
        _want(type(value) is list, f"field {key!r} must be binaries")
        value = [v.view.tobytes() if type(v) is _Spliced else v for v in value]
        _want(all(type(v) is bytes for v in value), f"field {key!r} must be binaries")
        return tuple(value)
    # Kind.U32
    _want(type(value) is dict, f"field {key!r} must be an array map")
    _want(value.get("dt") == _U32_WIRE_DTYPE, f"field {key!r}: dtype must be {_U32_WIRE_DTYPE}")
    shape, raw = value.get("sh"), value.get("by")
    _want(
        type(shape) is list and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0,
        f"field {key!r}: shape must be [n]",
    )
    if type(raw) is _Spliced:
        raw = raw.view  # a view of the caller's buffer: the message class copies it, without the interpreter lock
    _want(
        type(raw) in (bytes, memoryview) and len(raw) == 4 * shape[0],
        f"field {key!r}: byte length does not match shape",
    )
    return np.frombuffer(raw, dtype=_U32_WIRE_DTYPE).astype(np.uint32, copy=False)


def check_shape(
    data: bytes | bytearray | memoryview, *, max_objects: int = MAX_OBJECTS, max_depth: int = MAX_DEPTH
) -> None:
    """Walk the msgpack headers of ``data`` (payloads skipped) and refuse too many objects or too deep nesting.

    Costs one step per object, so at most ``max_objects`` steps whatever the size of ``data``; strings and
    byte strings are skipped by their length prefix.

    Raises
    ------
    DecodeError
        More than ``max_objects`` objects, nesting deeper than ``max_depth``, an extension type (the
        protocol uses none) or an invalid type byte.  Truncation is left to the parser that follows.
    """
    _walk(memoryview(data), max_objects, max_depth)


#: A byte string at least this long is not copied by msgpack: `decode` hands the field a view of the
#: caller's buffer instead (docs/threat-model.md §3.5: msgpack copies a bin while holding the interpreter, 32–35 ms
#: for a 64 MiB masked input on an idle machine, far more under load, during which the server's event
#: loop cannot run even though decoding happens in a worker thread).
SPLICE_BIN_BYTES = 1 << 16
_EXT_TYPES = frozenset({0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8})
_BIN_TYPES = frozenset({0xC4, 0xC5, 0xC6})
#: The extension type of the stand-in `decode` puts where a long byte string was (never on the wire).
_SPLICE_EXT = 1


def _walk(view: memoryview, max_objects: int, max_depth: int) -> list[tuple[int, int, int]]:
    """`check_shape`'s walk; returns ``(header, payload start, payload end)`` of every byte string of at
    least `SPLICE_BIN_BYTES` that lies wholly inside ``view``."""
    end = len(view)
    pos = 0
    count = 0
    spans: list[tuple[int, int, int]] = []
    pending = [1]  # objects still to read in each open container; the outermost "container" holds one
    while pending:
        if pending[-1] == 0:
            pending.pop()
            continue
        pending[-1] -= 1
        if pos >= end:
            return spans  # truncated: msgpack reports it
        b = view[pos]
        start = pos
        pos += 1
        count += 1
        if count > max_objects:
            raise DecodeError(f"message has more than {max_objects} msgpack objects")
        if b <= 0x7F or b >= 0xE0:
            continue
        if b <= 0x9F:  # fixmap 0x80-0x8f, fixarray 0x90-0x9f
            items = (b & 0x0F) * (2 if b <= 0x8F else 1)
        elif b <= 0xBF:  # fixstr
            pos += b & 0x1F
            continue
        elif b in _EXT_TYPES:
            raise DecodeError(f"msgpack extension type (byte 0x{b:02x}) at offset {start}: the protocol uses none")
        elif b in _FIXED_TAIL:
            pos += _FIXED_TAIL[b]
            continue
        elif b in _SIZED:
            width, extra = _SIZED[b]
            length = int.from_bytes(view[pos : pos + width], "big")
            pos += width + extra
            if b in _BIN_TYPES and length >= SPLICE_BIN_BYTES and pos + length <= end:
                spans.append((start, pos, pos + length))
            pos += length
            continue
        elif b in _CONTAINERS:
            width, per = _CONTAINERS[b]
            items = int.from_bytes(view[pos : pos + width], "big") * per
            pos += width
        else:  # 0xc1, never used
            raise DecodeError(f"invalid msgpack type byte 0x{b:02x}")
        if items:
            if len(pending) > max_depth:
                raise DecodeError(f"message nests deeper than {max_depth} levels")
            pending.append(items)
    return spans


class _Spliced:
    """Where a long byte string stood in the envelope `decode` hands to msgpack: a view of the caller's
    buffer, never copied by msgpack (the field decoder copies it only for `Kind.BYTES` fields)."""

    __slots__ = ("view",)

    def __init__(self, view: memoryview) -> None:
        self.view = view


def _splice(view: memoryview, spans: list[tuple[int, int, int]]) -> tuple[bytes, list[memoryview]]:
    """``view`` with each long byte string replaced by a 6-byte stand-in (a fixext 4 of type
    `_SPLICE_EXT` holding its index), and the views of those byte strings."""
    pieces: list[bytes] = []
    views: list[memoryview] = []
    last = 0
    for index, (header, start, stop) in enumerate(spans):
        pieces.append(bytes(view[last:header]))
        pieces.append(b"\xd6" + bytes([_SPLICE_EXT]) + index.to_bytes(4, "big"))
        views.append(view[start:stop])
        last = stop
    pieces.append(bytes(view[last:]))
    return b"".join(pieces), views


def decode(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_MESSAGE_BYTES, max_objects: int = MAX_OBJECTS
) -> Message:
    """Decode and validate one envelope.

    Parameters
    ----------
    data : bytes
        Bytes from the peer.
    max_size : int
        Refuse larger inputs before parsing.
    max_objects : int
        Refuse inputs of more msgpack objects (at most `MAX_OBJECTS`; a route whose messages are small
        passes less, which bounds the parser's uninterruptible time).

    Returns
    -------
    Message
        A validated, immutable message.

    Raises
    ------
    PayloadTooLarge
        ``len(data) > max_size``.
    VersionMismatch
        The envelope is well-formed but its major version differs from ours.
    DecodeError
        Anything else: malformed msgpack, more than `MAX_OBJECTS` objects or deeper than `MAX_DEPTH`,
        wrong types or shapes, unknown type code, missing fields, or values the message class refuses.
    """
    return decode_versioned(data, max_size=max_size, max_objects=max_objects)[0]


def decode_versioned(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_MESSAGE_BYTES, max_objects: int = MAX_OBJECTS
) -> tuple[Message, tuple[int, int]]:
    """`decode`, and the ``(major, minor)`` the sender wrote in the envelope (a server that needs a feature
    of a later minor refuses an older peer by it; the major is already checked).  Raises as `decode`."""
    obj = _unpack(data, max_size=max_size, max_objects=max_objects)
    try:
        cls, fields, body, version = _open_envelope(obj)
        return _build_message(cls, fields, body), version
    except (DecodeError, VersionMismatch):
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
        raise DecodeError(f"invalid message: {exc}") from None


def _unpack(data: bytes | bytearray | memoryview, *, max_size: int, max_objects: int) -> Any:
    """`decode`'s first step: size and shape checks, then msgpack, with long byte strings left in place
    (`_Spliced`); any parse failure becomes `DecodeError`."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_size:
        raise PayloadTooLarge(f"message of {len(data)} bytes exceeds the limit of {max_size}")
    view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
    spans = _walk(view, min(max_objects, MAX_OBJECTS), MAX_DEPTH)
    parse: bytes | bytearray | memoryview = data
    views: list[memoryview] = []
    if spans:
        # Long byte strings (a masked vector) stay where they are: msgpack parses the envelope around them.
        parse, views = _splice(view, spans)

    def stand_in(code: int, payload: bytes) -> _Spliced:
        index = int.from_bytes(payload, "big")
        if code != _SPLICE_EXT or len(payload) != 4 or index >= len(views):
            raise ValueError("extension types are not part of the protocol")
        return _Spliced(views[index])

    try:
        return msgpack.unpackb(
            parse,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_bin_len=max_size,
            max_str_len=min(max_size, _MAX_STR_LEN),
            max_array_len=_MAX_ARRAY_LEN,
            max_map_len=_MAX_MAP_LEN,
            max_ext_len=4 if views else 0,
            ext_hook=stand_in,
        )
    except Exception as exc:  # msgpack raises several unrelated types; all mean "not a message"
        raise DecodeError(f"malformed msgpack: {exc}") from None


def _open_envelope(
    obj: Any,
) -> tuple[type[Message], tuple[tuple[str, str, Kind] | str, ...], dict[str, Any], tuple[int, int]]:
    """`decode`'s second step: check the envelope map and its version; the message class and table entries of
    its type code, its body and the sender's version."""
    _want(type(obj) is dict, "envelope must be a map")
    version = obj.get("v")
    _want(
        type(version) is list and len(version) == 2 and all(type(x) is int for x in version),
        "envelope version must be [major, minor]",
    )
    check_version((version[0], version[1]))
    type_code, body = obj.get("t"), obj.get("b")
    _want(type(type_code) is int, "envelope type must be an integer")
    entry = _SCHEMA.get(type_code)
    if entry is None:
        raise DecodeError(f"unknown message type {type_code}")
    cls, fields = entry
    _want(type(body) is dict, "envelope body must be a map")
    return cls, fields, body, (version[0], version[1])


def _build_message(
    cls: type[Message], fields: tuple[tuple[str, str, Kind] | str, ...], body: dict[str, Any]
) -> Message:
    """`decode`'s last step: decode each body field the table lists (unknown keys ignored, a missing field
    with a default takes it) and build the message, whose class validates it."""
    defaults = {
        f.name
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.default is not dataclasses.MISSING
    }
    kwargs: dict[str, Any] = {}
    plan: dict[str, Any] = {}
    for item in _entries(fields):
        if isinstance(item, str):
            if item in body:
                plan[item] = _decode_value(_param_kind(item), body[item], item)
            continue
        name, key, kind = item
        if key in body:
            kwargs[name] = _decode_value(kind, body[key], key)
        elif name not in defaults:
            raise DecodeError(f"{cls.__name__}: missing field {key!r}")
    if cls is RoundInvite:
        kwargs["params"] = params_from_wire(kwargs.get("model_kind", "lightfr"), plan)
    return cls(**kwargs)
