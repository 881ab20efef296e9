"""Codec: round trips for every message type, envelope rules, versioning, validation."""

from __future__ import annotations

import dataclasses
import inspect
import re

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import messages as messages_module
from protocol.codec import _SCHEMA, check_version, decode, encode, is_compatible
from protocol.errors import DecodeError, PayloadTooLarge, VersionMismatch
from protocol.messages import (
    Abort,
    CheckIn,
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
from protocol.plan import (
    FamilyParams,
    FELBParams,
    FNMFParams,
    IALSParams,
    LightFRParams,
    MFParams,
    known_wire_params,
    wire_params,
)
from protocol.spec import (
    MAX_ITEMS,
    MAX_LOCAL_STEPS,
    MAX_QUERY_PLANES,
    MAX_RANK,
    PROTOCOL_VERSION,
    USER_REG_RANGE,
    Aggregation,
    Alignment,
    ModelKind,
    StepRule,
)

from .secagg_helpers import sample_messages

ids = st.integers(0, 2**63 - 1)
small_ids = st.lists(ids, max_size=8).map(tuple)
key = st.binary(min_size=32, max_size=32)
blob = st.binary(max_size=200)
u32 = st.lists(st.integers(0, 2**32 - 1), max_size=50).map(lambda v: np.array(v, dtype=np.uint32))
text = st.text(max_size=50)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def family_params(draw: st.DrawFn, kind: ModelKind) -> FamilyParams:
    """Valid training parameters of family ``kind``, every parameter drawn."""
    non_negative = st.floats(0.0, 1e6)
    epochs = st.integers(1, MAX_LOCAL_STEPS)
    if kind == ModelKind.LIGHTFR:
        confidence = draw(st.floats(0.0, 100.0))
        w0 = draw(st.sampled_from([0.0, draw(st.floats(0.0, 1.0 + confidence))]))
        return LightFRParams(
            aggregation=Aggregation.GRAD if w0 > 0 else draw(st.sampled_from(list(Aggregation))),
            lam=draw(non_negative),
            negatives=draw(st.integers(0, 100)),
            local_epochs=draw(epochs),
            max_sweeps=draw(epochs),
            unobserved_weight=w0,
            confidence=confidence,
            counts_share=draw(st.floats(0.0, 1.0, exclude_max=True)) if w0 > 0 else 0.0,
            query_planes=draw(st.integers(0, MAX_QUERY_PLANES)) if w0 > 0 else 0,
            user_reg=draw(st.floats(*USER_REG_RANGE)),
        )
    if kind == ModelKind.MF:
        return MFParams(
            max_norm2=draw(st.floats(1e-6, 1e6)),
            learning_rate=draw(non_negative),
            reg=draw(non_negative),
            pretrain_epochs=draw(st.integers(0, MAX_LOCAL_STEPS)),
            local_epochs=draw(epochs),
            negatives=draw(st.integers(0, 100)),
        )
    if kind == ModelKind.IALS:
        return IALSParams(alpha=draw(st.floats(0.0, 1e6)), reg=draw(st.floats(1e-6, 1e6)))
    inertia = draw(st.floats(0.0, 1.0, exclude_max=True))
    if kind == ModelKind.FELB:
        return FELBParams(
            local_epochs=draw(epochs),
            reg=draw(non_negative),
            reg_growth=draw(st.floats(1.0, 10.0)),
            kappa=draw(non_negative),
            proximity=draw(non_negative),
            inertia=inertia,
            step_rule=draw(st.sampled_from(list(StepRule))),
        )
    return FNMFParams(
        local_steps=draw(epochs),
        proximity=draw(non_negative),
        inertia=inertia,
        alignment=draw(st.sampled_from(list(Alignment))),
    )


@st.composite
def invite_fields(draw: st.DrawFn) -> dict[str, object]:
    """Keyword arguments of a valid `RoundInvite` that draw every field (a test checks none is left out)."""
    k = draw(st.integers(1, 1000))
    deadlines = sorted(draw(st.lists(finite, min_size=4, max_size=4)))
    mu = draw(st.floats(0.0, 1e9))
    kind = draw(st.sampled_from(list(ModelKind)))
    params = draw(family_params(kind))
    vector_length = draw(st.integers(1, 2**28))
    bits = draw(st.integers(0, MAX_RANK))
    if bits and draw(st.booleans()):
        # A plan naming the catalogue: LightFR's update is exactly its upload layout (n_items × bits,
        # plus 2·n_items + bits² + bits under the all-items objective), the others' at least n_items × bits.
        n_items = draw(st.integers(1, max(1, min(MAX_ITEMS, (2**28) // bits - 2 * bits - 2))))
        lightfr = params.upload_length(n_items, bits)
        vector_length = lightfr if kind == ModelKind.LIGHTFR else draw(st.integers(n_items * bits, 2**28))
    else:
        n_items = 0 if bits else draw(st.integers(0, MAX_ITEMS))
    roster = tuple(sorted(draw(st.sets(ids, max_size=8))))  # protocol 1.8, empty = not stated
    keyed = bool(roster) and draw(st.booleans())
    t_min = draw(st.integers(1, 10**6)) if mu > 0 else 0
    return {
        "round_id": draw(ids),
        "device_id": draw(ids),
        "vector_length": vector_length,
        "graph_k": k,
        "graph_t": draw(st.integers(1, k)),
        "clip_norm": draw(st.floats(1e-9, 1e9)),
        "scale_bits": draw(st.integers(0, 30)),
        "dp_mu": mu,
        "dp_t_min": t_min,
        "dp_colluders": draw(st.integers(0, t_min - 1)) if t_min else 0,  # protocol 1.12
        "advertise_deadline": deadlines[0],
        "share_keys_deadline": deadlines[1],
        "masked_input_deadline": deadlines[2],
        "unmask_deadline": deadlines[3],
        "model_version": draw(ids),
        "model_kind": kind.value,
        "bits": bits,
        "n_items": n_items,
        "example_cap": draw(st.integers(0, 10**6)),
        "round_index": draw(st.integers(0, 10**6)),
        "cohort_size": len(roster) if roster else draw(st.integers(0, 10**6)),
        "roster_ids": roster,
        "roster_keys": tuple(draw(st.lists(key, min_size=len(roster), max_size=len(roster)))) if keyed else (),
        "params": params,
    }


def invites() -> st.SearchStrategy[RoundInvite]:
    return invite_fields().map(lambda kw: RoundInvite(**kw))  # type: ignore[arg-type]


@st.composite
def aligned(draw: st.DrawFn, elements: st.SearchStrategy[bytes]) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
    n = draw(st.integers(0, 8))
    return tuple(draw(st.lists(ids, min_size=n, max_size=n))), tuple(draw(st.lists(elements, min_size=n, max_size=n)))


@st.composite
def messages(draw: st.DrawFn) -> Message:
    kind = draw(st.integers(0, 16))
    r, d, sid = draw(ids), draw(ids), draw(key)
    if kind == 0:
        return draw(invites())
    if kind == 1:
        c, s = draw(key), draw(key.filter(lambda x: True))
        if c == s:
            s = bytes([c[0] ^ 1]) + c[1:]
        return PublicKeys(round_id=r, device_id=d, c_public_key=c, s_public_key=s)
    if kind == 2:
        n = draw(st.integers(0, 8))
        return ShareKeysBroadcast(
            round_id=r,
            device_id=d,
            session_id=sid,
            neighbour_ids=tuple(draw(st.lists(ids, min_size=n, max_size=n))),
            c_public_keys=tuple(draw(st.lists(key, min_size=n, max_size=n))),
            s_public_keys=tuple(draw(st.lists(key, min_size=n, max_size=n))),
        )
    if kind == 3:
        to, ct = draw(aligned(blob))
        return EncryptedShares(round_id=r, device_id=d, session_id=sid, recipient_ids=to, ciphertexts=ct)
    if kind == 4:
        fr, ct = draw(aligned(blob))
        return MaskedInputRequest(round_id=r, device_id=d, session_id=sid, sender_ids=fr, ciphertexts=ct)
    if kind == 5:
        y = draw(u32.filter(lambda a: a.size > 0))
        return MaskedInput(round_id=r, device_id=d, session_id=sid, masked=y)
    if kind == 6:
        return UnmaskRequest(
            round_id=r,
            device_id=d,
            session_id=sid,
            survivors=draw(small_ids),
            dropped=draw(small_ids),
            n_survivors=draw(ids),
        )
    if kind == 7:
        bi, bs = draw(aligned(blob))
        si, ss = draw(aligned(blob))
        return UnmaskResponse(
            round_id=r,
            device_id=d,
            session_id=sid,
            b_share_ids=bi,
            b_shares=bs,
            s_share_ids=si,
            s_shares=ss,
            dp_excess=draw(u32),
        )
    if kind == 8:
        return Abort(round_id=r, device_id=d, reason=draw(text))
    if kind == 10:
        return RegisterRequest(platform=draw(st.text(max_size=128)))
    if kind == 11:
        return RegisterResponse(device_id=d, token=draw(st.text(min_size=16, max_size=256)))
    if kind == 12:
        return CheckIn(device_id=d, model_version=draw(ids))
    if kind == 13:
        return Wait(retry_after=draw(st.floats(0, 1e6)), reason=draw(text))
    if kind == 14:
        f, m = draw(st.integers(1, 200)), draw(st.integers(1, 20))
        words = draw(st.binary(min_size=8 * ((f + 63) // 64) * m, max_size=8 * ((f + 63) // 64) * m))
        if not draw(st.booleans()):
            return ModelPayload(model_version=draw(ids), bits=f, n_items=m, words=words, dp_trained=draw(st.booleans()))
        # Protocol 1.7: an all-items model (levels) with the w0 and α it goes with.
        alpha = draw(st.floats(0.0, 40.0))
        return ModelPayload(
            model_version=draw(ids),
            bits=f,
            n_items=m,
            words=words,
            item_levels=draw(st.binary(min_size=m, max_size=m)),
            hamming_weight=draw(st.integers(1, 255)),
            unobserved_weight=draw(st.floats(0.0, 1.0 + alpha).filter(lambda w: 0.0 < w <= 1.0 + alpha)),
            confidence=alpha,
            dp_trained=draw(st.booleans()),
        )
    if kind == 15:
        return RoundResult(round_id=r, committed=draw(st.booleans()), model_version=draw(ids), reason=draw(text))
    if kind == 16:
        return RevocationListPayload(data=draw(blob))
    return ErrorMessage(
        code=draw(st.sampled_from(["decode_error", "round_closed", "crypto_error"])), message=draw(text)
    )


@settings(max_examples=300, deadline=None)
@given(message=messages())
def test_round_trip_every_message_type(message: Message) -> None:
    assert decode(encode(message)) == message


@settings(max_examples=50, deadline=None)
@given(fields=invite_fields())
def test_the_invite_generator_draws_every_field(fields: dict[str, object]) -> None:
    assert set(fields) == {f.name for f in dataclasses.fields(RoundInvite)}


def test_the_codec_schema_names_every_field_of_every_message() -> None:
    """A field the codec does not name would silently travel as its default: every dataclass field of every
    message type is in the schema, once, with a key no other field of that type uses."""
    classes = {
        c
        for _, c in inspect.getmembers(messages_module, inspect.isclass)
        if issubclass(c, Message) and c is not Message
    }
    assert {cls for cls, _ in _SCHEMA.values()} == classes
    for code, (cls, fields) in _SCHEMA.items():
        assert cls.TYPE == code
        named = [item for item in fields if not isinstance(item, str)]
        names = [name for name, _, _ in named]
        keys = [key for _, key, _ in named] + [item for item in fields if isinstance(item, str)]
        want = sorted(f.name for f in dataclasses.fields(cls))
        if cls is RoundInvite:  # ``params`` travels as its parameters' keys (the bare strings)
            want.remove("params")
        assert sorted(names) == want, cls.__name__
        assert len(set(names)) == len(names) and len(set(keys)) == len(keys), cls.__name__


def test_the_invites_plan_keys_are_the_parameter_types_keys() -> None:
    """The keys the schema lists for the invite's parameters are exactly those the four parameter types
    declare (`protocol.plan.param_field`); a key two families share means the same type and absence."""
    listed = {item for item in _SCHEMA[RoundInvite.TYPE][1] if isinstance(item, str)}
    declared: dict[str, tuple[type, object]] = {}
    for ptype in (LightFRParams, MFParams, FELBParams, FNMFParams, IALSParams):
        for w in wire_params(ptype):
            kind = (type(w.absent), w.absent)
            assert declared.setdefault(w.key, kind) == kind, (ptype.__name__, w)
    assert listed == set(declared) == set(known_wire_params())


def test_every_type_round_trips_and_has_a_distinct_code() -> None:
    samples = sample_messages()
    assert len({type(m).TYPE for m in samples}) == len(samples) == 16
    for m in samples:
        raw = encode(m)
        assert decode(raw) == m
        env = msgpack.unpackb(raw, raw=False)
        assert env["v"] == list(PROTOCOL_VERSION) and env["t"] == type(m).TYPE


def test_arrays_travel_as_little_endian_bin_with_dtype_and_shape() -> None:
    m = MaskedInput(round_id=1, device_id=2, session_id=b"s" * 32, masked=np.array([1, 2**32 - 1], dtype=np.uint32))
    body = msgpack.unpackb(encode(m), raw=False)["b"]["y"]
    assert body == {"dt": "<u4", "sh": [2], "by": b"\x01\x00\x00\x00\xff\xff\xff\xff"}


def test_masked_input_costs_about_four_bytes_per_element() -> None:
    m = MaskedInput(round_id=1, device_id=2, session_id=b"s" * 32, masked=np.zeros(100_000, dtype=np.uint32))
    assert 400_000 <= len(encode(m)) < 400_100


def test_messages_are_immutable_and_validated() -> None:
    m = MaskedInput(round_id=1, device_id=2, session_id=b"s" * 32, masked=np.zeros(3, dtype=np.uint32))
    with pytest.raises(AttributeError):
        m.round_id = 5  # type: ignore[misc]
    with pytest.raises(ValueError):
        m.masked[0] = 1
    for bad in (
        lambda: PublicKeys(round_id=1, device_id=1, c_public_key=b"a" * 31, s_public_key=b"b" * 32),
        lambda: PublicKeys(round_id=-1, device_id=1, c_public_key=b"a" * 32, s_public_key=b"b" * 32),
        lambda: PublicKeys(round_id=True, device_id=1, c_public_key=b"a" * 32, s_public_key=b"b" * 32),
        lambda: PublicKeys(round_id=1, device_id=1, c_public_key=b"a" * 32, s_public_key=b"a" * 32),
        lambda: MaskedInput(round_id=1, device_id=2, session_id=b"s" * 32, masked=np.zeros(3, dtype=np.int64)),
        lambda: MaskedInput(round_id=1, device_id=2, session_id=b"s" * 31, masked=np.zeros(3, dtype=np.uint32)),
        lambda: EncryptedShares(
            round_id=1, device_id=2, session_id=b"s" * 32, recipient_ids=(1, 2), ciphertexts=(b"x",)
        ),
        lambda: ErrorMessage(code="No Such Code!"),
        lambda: ErrorMessage(code=""),
        lambda: RoundInvite(
            round_id=1,
            device_id=0,
            vector_length=4,
            graph_k=3,
            graph_t=4,
            clip_norm=1.0,
            scale_bits=8,
            advertise_deadline=1.0,
            share_keys_deadline=2.0,
            masked_input_deadline=3.0,
            unmask_deadline=4.0,
        ),
        lambda: RoundInvite(
            round_id=1,
            device_id=0,
            vector_length=4,
            graph_k=3,
            graph_t=2,
            clip_norm=1.0,
            scale_bits=8,
            dp_mu=1.0,
            advertise_deadline=1.0,
            share_keys_deadline=2.0,
            masked_input_deadline=3.0,
            unmask_deadline=4.0,
        ),
        lambda: RoundInvite(
            round_id=1,
            device_id=0,
            vector_length=4,
            graph_k=3,
            graph_t=2,
            clip_norm=1.0,
            scale_bits=8,
            advertise_deadline=3.0,
            share_keys_deadline=2.0,
            masked_input_deadline=3.0,
            unmask_deadline=4.0,
        ),
    ):
        with pytest.raises(ValueError):
            bad()


def _env(t: int, body: object, v: object = None) -> bytes:
    return msgpack.packb({"v": v if v is not None else list(PROTOCOL_VERSION), "t": t, "b": body}, use_bin_type=True)


def test_unknown_keys_are_ignored_and_missing_defaults_filled() -> None:
    m = Abort(round_id=3, device_id=4, reason="x")
    env = msgpack.unpackb(encode(m), raw=False)
    env["b"]["future_field"] = [1, 2, 3]
    env["extra"] = "ignored"
    assert decode(msgpack.packb(env, use_bin_type=True)) == m
    del env["b"]["why"]  # has a default
    assert decode(msgpack.packb(env, use_bin_type=True)) == Abort(round_id=3, device_id=4)


def test_minor_versions_are_compatible_majors_are_not() -> None:
    assert is_compatible((PROTOCOL_VERSION[0], 99))
    assert not is_compatible((PROTOCOL_VERSION[0] + 1, 0))
    check_version((PROTOCOL_VERSION[0], 7))
    with pytest.raises(VersionMismatch):
        check_version((PROTOCOL_VERSION[0] + 1, 0))
    body = msgpack.unpackb(encode(sample_messages()[8]), raw=False)["b"]
    assert decode(_env(9, body, [PROTOCOL_VERSION[0], 5])) == sample_messages()[8]
    with pytest.raises(VersionMismatch):
        decode(_env(9, body, [PROTOCOL_VERSION[0] + 1, 0]))


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 2, 3]),
        _env(99, {}),
        _env(9, {"r": 1}),  # missing required field
        _env(9, {"r": "1", "d": 1}),
        _env(9, {"r": True, "d": 1}),
        _env(9, {"r": -1, "d": 1}),
        _env(9, []),
        _env(6, {"r": 1, "d": 1, "sid": b"s" * 32, "y": {"dt": "<u8", "sh": [1], "by": b"\x00" * 8}}),
        _env(6, {"r": 1, "d": 1, "sid": b"s" * 32, "y": {"dt": "<u4", "sh": [2], "by": b"\x00" * 4}}),
        _env(6, {"r": 1, "d": 1, "sid": b"s" * 32, "y": {"dt": "<u4", "sh": [1, 1], "by": b"\x00" * 4}}),
        _env(6, {"r": 1, "d": 1, "sid": b"s" * 32, "y": b"\x00" * 4}),
        _env(3, {"r": 1, "d": 1, "sid": b"s" * 32, "n": [1], "pc": ["not bytes"], "ps": [b"k" * 32]}),
        {"v": [1, 0], "t": 9, "b": {"r": 1, "d": 1}}.__repr__().encode(),
        msgpack.packb({"v": [1], "t": 9, "b": {}}),
        msgpack.packb({1: 2}),
        msgpack.packb({"v": [1, 0], "t": 9, "b": {"r": 1, "d": 1}}) + b"\x00",  # trailing bytes
    ],
)
def test_malformed_input_raises_decode_error(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        decode(raw)


def test_size_limit() -> None:
    raw = encode(MaskedInput(round_id=1, device_id=2, session_id=b"s" * 32, masked=np.zeros(1000, dtype=np.uint32)))
    with pytest.raises(PayloadTooLarge):
        decode(raw, max_size=1000)
    assert isinstance(decode(raw, max_size=len(raw)), MaskedInput)


def test_unknown_error_code_from_a_newer_minor_version_decodes_as_the_base_error() -> None:
    msg = decode(encode(ErrorMessage(code="quota_exceeded", message="slow down")))
    assert isinstance(msg, ErrorMessage)
    exc = msg.to_exception()
    assert type(exc).__name__ == "FedRecError" and "quota_exceeded" in str(exc) and "slow down" in str(exc)
    assert type(ErrorMessage(code="stale_round").to_exception()).__name__ == "StaleRound"


def test_float_matrix_wire_form_round_trips_and_refuses_bad_bytes() -> None:
    from protocol.codes import float_matrix_from_bytes, float_matrix_to_bytes

    m = np.arange(6, dtype=np.float64).reshape(2, 3) / 7
    raw = float_matrix_to_bytes(m)
    assert raw[:8] == np.float64(0).tobytes() and len(raw) == 48
    assert np.array_equal(float_matrix_from_bytes(raw, (2, 3)), m)
    with pytest.raises(ValueError, match="expected 48"):
        float_matrix_from_bytes(raw[:-1], (2, 3))
    with pytest.raises(ValueError, match="NaN"):
        float_matrix_from_bytes(float_matrix_to_bytes(np.array([[np.nan]])), (1, 1))


def test_long_byte_strings_are_decoded_without_msgpack_copying_them() -> None:
    # msgpack used to copy a masked vector while holding the interpreter (a 64 MiB vector
    # stalled the server's event loop 32-133 ms even though decoding runs in a worker thread).  A byte
    # string of SPLICE_BIN_BYTES or more is now handed over as a view of the caller's buffer: decoding
    # allocates the message's own copy of the vector and nothing else of its size.
    import tracemalloc

    from protocol.codec import SPLICE_BIN_BYTES

    length = 4 * 10**6
    message = MaskedInput(
        round_id=3,
        device_id=9,
        session_id=b"\x07" * 32,
        masked=np.arange(length, dtype=np.uint32),
        bad_share_senders=(2,),
    )
    body = bytearray(encode(message))
    tracemalloc.start()
    try:
        decoded = decode(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert decoded == message and not decoded.masked.flags.writeable
    assert peak < 1.25 * 4 * length, peak  # one copy (the message's), not two (msgpack's and the message's)
    body[-40:] = b"\xff" * 40  # the message owns its vector: later writes to the buffer do not reach it
    assert decoded == message
    assert decode(memoryview(bytes(encode(message)))) == message
    # a long byte string in a bytes field, a bytes list and at the end of the body decodes to the same bytes
    words = bytes(range(256)) * (SPLICE_BIN_BYTES // 128)
    payload = ModelPayload(model_version=1, model_kind="lightfr", bits=8, n_items=len(words) // 8, words=words)
    assert decode(encode(payload)).words == words
    blobs = (b"\x01" * SPLICE_BIN_BYTES, b"\x02" * 5, b"\x03" * (SPLICE_BIN_BYTES + 1))
    shares = EncryptedShares(
        round_id=1, device_id=1, session_id=b"\x00" * 32, recipient_ids=(1, 2, 3), ciphertexts=blobs
    )
    assert decode(encode(shares)) == shares


@pytest.mark.parametrize(
    "body, why",
    [
        # a long byte string where the schema wants an integer, a string, or a map key
        (
            {"v": [1, 4], "t": 16, "b": {"r": b"\x00" * (1 << 16), "ok": True, "mv": 1, "why": ""}},
            "'r' must be an integer",
        ),
        (
            {"v": [1, 4], "t": 16, "b": {"r": 1, "ok": True, "mv": 1, "why": b"\x00" * (1 << 17)}},
            "'why' must be a string",
        ),
        ({"v": [1, 4], "t": 16, "b": {b"\x00" * (1 << 16): 1}}, "malformed msgpack"),
        # extension types, including the stand-in decode uses for long byte strings, never come from a peer
        ({"v": [1, 4], "t": 16, "b": {"r": msgpack.ExtType(1, b"\x00" * 4)}}, "extension type"),
        ({"v": [1, 4], "t": 16, "b": {"r": msgpack.ExtType(7, b"\x00" * 300)}}, "extension type"),
    ],
)
def test_long_byte_strings_and_extension_types_out_of_place_are_refused(body: dict[object, object], why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        decode(msgpack.packb(body, use_bin_type=True))
    big = msgpack.packb({"v": [1, 4], "t": 6, "b": {"pad": b"\x00" * (1 << 16), "x": msgpack.ExtType(1, b"\0\0\0\0")}})
    with pytest.raises(DecodeError, match="extension type"):
        decode(big)


def _w0_payload(**fields: object) -> dict[str, object]:
    """The keyword arguments of a protocol 1.7 LightFR model (3 items, f = 4, levels), overridden by ``fields``."""
    base: dict[str, object] = {
        "model_version": 4,
        "bits": 4,
        "n_items": 3,
        "words": bytes(24),
        "item_levels": bytes([128, 130, 126]),
        "hamming_weight": 2,
        "unobserved_weight": 0.032,
        "confidence": 0.5,
        "dp_trained": True,
    }
    base.update(fields)
    return base


def test_model_payload_carries_w0_alpha_and_the_dp_flag() -> None:
    """Protocol 1.7: the w0 a model goes with, its α and the sticky DP flag travel as 'w0', 'al', 'dp'
    and come back exactly; a device's `set_global` receives them through `lightfr_extras`."""
    sent = ModelPayload(**_w0_payload())  # type: ignore[arg-type]
    body = msgpack.unpackb(encode(sent), raw=False)["b"]
    assert (body["w0"], body["al"], body["dp"]) == (0.032, 0.5, True)
    back = decode(encode(sent))
    assert back == sent and isinstance(back, ModelPayload)
    extras = back.lightfr_extras()
    assert (extras["unobserved_weight"], extras["confidence"], extras["dp_trained"]) == (0.032, 0.5, True)
    # An integer on the wire is accepted for the float fields (it is exact), as for every float field.
    body["w0"], body["al"] = 1, 0
    assert decode(_env(15, body)).unobserved_weight == 1.0  # type: ignore[union-attr]


def test_a_model_payload_of_protocol_1_6_decodes_with_the_new_fields_at_their_defaults() -> None:
    body = msgpack.unpackb(encode(ModelPayload(**_w0_payload())), raw=False)["b"]  # type: ignore[arg-type]
    for key in ("w0", "al", "dp"):
        del body[key]
    old = decode(_env(15, body, v=[1, 6]))
    assert isinstance(old, ModelPayload)
    assert (old.unobserved_weight, old.confidence, old.dp_trained) == (0.0, 0.0, False)
    assert old.item_levels == bytes([128, 130, 126]) and old.hamming_weight == 2


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"unobserved_weight": float("nan")}, "unobserved_weight must be a finite float"),
        ({"unobserved_weight": float("inf")}, "unobserved_weight must be a finite float"),
        ({"unobserved_weight": -0.01}, "unobserved_weight must be >= 0.0"),
        ({"unobserved_weight": 1.5001}, "unobserved_weight must be <= 1 + confidence = 1.5"),
        ({"unobserved_weight": 1.2, "confidence": 0.0}, "unobserved_weight must be <= 1 + confidence = 1.0"),
        ({"confidence": float("nan")}, "confidence must be a finite float"),
        ({"confidence": -1.0}, "confidence must be >= 0.0"),
        ({"unobserved_weight": 0.0}, "confidence goes with a stated unobserved_weight"),
        ({"item_levels": b""}, "unobserved_weight > 0 is for LightFR models of the all-items objective"),
        ({"dp_trained": 1}, "dp_trained must be a bool, got 1"),
        ({"dp_trained": "yes"}, "dp_trained must be a bool"),
        ({"unobserved_weight": "0.1"}, "unobserved_weight must be a finite float"),
        ({"unobserved_weight": True}, "unobserved_weight must be a finite float"),
    ],
)
def test_hostile_w0_and_dp_flag_are_refused_by_name(fields: dict[str, object], why: str) -> None:
    """Built in code: a ValueError naming the field; sent by a peer: a DecodeError naming it."""
    with pytest.raises(ValueError, match=re.escape(why)):
        ModelPayload(**_w0_payload(**fields))  # type: ignore[arg-type]
    body = msgpack.unpackb(encode(ModelPayload(**_w0_payload())), raw=False)["b"]  # type: ignore[arg-type]
    wire = {"unobserved_weight": "w0", "confidence": "al", "dp_trained": "dp", "item_levels": "lv"}
    for name, value in fields.items():
        body[wire[name]] = value
    with pytest.raises(DecodeError) as info:
        decode(_env(15, body))
    # A wrong wire type is named by its key; a wrong value by the field's name.
    key = wire[next(iter(fields))]
    assert why in str(info.value) or f"field {key!r}" in str(info.value), str(info.value)
