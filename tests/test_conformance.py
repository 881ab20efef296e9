"""Conformance: the implementation reproduces the committed test vectors in docs/test-vectors byte for byte.

Invariants:
- This module never imports docs/test-vectors/generate.py: it rebuilds every message, key and round from the
  JSON alone, and recomputes the byte layouts it can (HKDF info, session-id preimage, share plaintext,
  quantization rule, Shamir polynomial) with hashlib/hmac/struct instead of the code under test.
- The generator only ever runs as a separate process (`test_generator_is_deterministic_and_committed`), to
  show that a fresh run writes exactly the committed bytes.
- Each check is a function returning a list of mismatches, so the mutation tests can show that a changed
  wire key, type code or HKDF label makes the same checks report failures.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any

import msgpack
import numpy as np
import pytest

import protocol.messages as messages_module
from protocol import codec, codes, crypto, shamir
from protocol.errors import DecodeError, LocalProtocolError, VersionMismatch
from protocol.identity import (
    SigningKey,
    issue_certificate,
    issue_revocation_list,
    key_advertisement_payload,
    read_certificate,
    registration_payload,
    roster_digest,
    survivor_set_payload,
    verify_certificate,
    verify_revocation_list,
    verify_signature,
)
from protocol.messages import Message, ModelPayload, RoundInvite
from protocol.plan import known_wire_params, params_from_wire
from protocol.quantization import QuantizationConfig, dequantize_sum, quantize
from protocol.samplers import insecure_test_noise_stream
from protocol.session import DeviceSecAggSession, FixedDeviceSecrets, Phase, RoundParameters, ServerSecAggSession
from protocol.spec import PROTOCOL_VERSION

VECTORS = Path(__file__).resolve().parents[1] / "docs" / "test-vectors"
_PHASE_OF_STEP = {
    "advertise_keys": Phase.ADVERTISE_KEYS,
    "share_keys": Phase.SHARE_KEYS,
    "masked_input": Phase.MASKED_INPUT,
    "unmask": Phase.UNMASK,
}


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((VECTORS / name).read_text(encoding="utf-8"))
    return data


MESSAGES = _load("messages.json")
CRYPTO = _load("crypto.json")
ROUND = _load("round.json")


# ------------------------------------------------------------------------------------------------ helpers


def _value(kind: str, value: Any) -> Any:
    if kind == "bytes":
        return bytes.fromhex(value)
    if kind == "bytes_list":
        return tuple(bytes.fromhex(v) for v in value)
    if kind == "ints":
        return tuple(value)
    if kind == "u32":
        return np.array(value, dtype=np.uint32)
    return value


def _build(vector: dict[str, Any]) -> Message:
    cls = getattr(messages_module, vector["type"])
    fields = {f["name"]: _value(f["kind"], f["value"]) for f in vector["fields"]}
    if cls is RoundInvite:
        # A RoundInvite holds its family's parameters as one object: the fields under their keys build it.
        plan = {f["key"]: f["value"] for f in vector["fields"] if f["key"] in known_wire_params()}
        fields = {f["name"]: fields[f["name"]] for f in vector["fields"] if f["key"] not in plan}
        fields["params"] = params_from_wire(fields.get("model_kind", "lightfr"), plan)
    message: Message = cls(**fields)
    return message


def _field(message: Message, name: str) -> Any:
    """A field of ``message`` by its vector name (an invite's family parameters are in ``params``)."""
    if isinstance(message, RoundInvite) and not hasattr(message, name):
        return getattr(message.params, name)
    return getattr(message, name)


def _message_mismatches(vector: dict[str, Any]) -> list[str]:
    """Every way the implementation disagrees with one message vector (empty when it conforms)."""
    name = vector["type"]
    problems = []
    message = _build(vector)
    if type(message).TYPE != vector["type_code"]:
        problems.append(f"{name}: type code {type(message).TYPE} != {vector['type_code']}")
    data = bytes.fromhex(vector["hex"])
    if codec.encode(message) != data:
        problems.append(f"{name}: encoding differs")
    try:
        if codec.decode(data) != message:
            problems.append(f"{name}: decoded fields differ")
    except DecodeError as exc:
        problems.append(f"{name}: vector does not decode ({exc})")
    raw = msgpack.unpackb(data, raw=False)
    if raw["v"] != MESSAGES["protocol_version"] or raw["t"] != vector["type_code"]:
        problems.append(f"{name}: envelope header differs")
    if list(raw["b"]) != [f["key"] for f in vector["fields"]]:
        problems.append(f"{name}: wire keys differ")
    return problems


def _hkdf(ikm: bytes, info: bytes, length: int = 32) -> bytes:
    """RFC 5869 HKDF-SHA256 with an empty salt, written out with hmac (independent of `cryptography`)."""
    prk = hmac.new(bytes(32), ikm, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def _info(label: str, session: bytes, parties: list[int]) -> bytes:
    major = CRYPTO["protocol_version"][0]
    raw = label.encode()
    return (
        struct.pack(">I", len(raw))
        + raw
        + struct.pack(">HH", major, 0)  # only the major version is bound (docs/protocol.md §7.1)
        + struct.pack(">I", len(session))
        + session
        + struct.pack(">I", len(parties))
        + b"".join(struct.pack(">Q", p) for p in parties)
    )


_KEY_FUNCTIONS: dict[str, Callable[[bytes, bytes, list[int]], bytes]] = {
    "share_encryption": lambda ikm, sid, p: crypto.share_encryption_key(ikm, sid, p[0], p[1]),
    "pair_mask": lambda ikm, sid, p: crypto.pair_mask_key(ikm, sid, p[1], p[0]),  # order must not matter
    "self_mask": lambda ikm, sid, p: crypto.self_mask_key(ikm, sid, p[0]),
}


def _hkdf_mismatches() -> list[str]:
    problems = []
    raw = CRYPTO["hkdf"]["raw_rfc5869"]
    ikm, info = bytes.fromhex(raw["ikm"]), bytes.fromhex(raw["info"])
    if crypto.hkdf_sha256(ikm, info=info).hex() != raw["okm"] or _hkdf(ikm, info).hex() != raw["okm"]:
        problems.append("raw HKDF differs")
    for name, derive in _KEY_FUNCTIONS.items():
        v = CRYPTO["hkdf"][name]
        ikm, sid = bytes.fromhex(v["ikm"]), bytes.fromhex(v["session_id"])
        info = _info(v["label"], sid, v["parties"])
        if info.hex() != v["info"]:
            problems.append(f"{name}: info layout differs")
        if _hkdf(ikm, info).hex() != v["okm"]:
            problems.append(f"{name}: vector okm is not HKDF(ikm, info)")
        if derive(ikm, sid, v["parties"]).hex() != v["okm"]:
            problems.append(f"{name}: derived key differs")
    return problems


def _round_secrets(u: str) -> FixedDeviceSecrets:
    s = ROUND["device_secrets"][u]
    return FixedDeviceSecrets(
        c_private_key=bytes.fromhex(s["c_private_key"]),
        s_private_key=bytes.fromhex(s["s_private_key"]),
        self_mask_seed=bytes.fromhex(s["self_mask_seed"]),
        b_coefficients=tuple(int(c) for c in s["b_coefficients_int"]),
        s_coefficients=tuple(int(c) for c in s["s_coefficients_int"]),
        share_nonces={int(v): bytes.fromhex(n) for v, n in s["share_nonces"].items()},
    )


def _replay_round() -> tuple[list[str], ServerSecAggSession]:
    """Replay round.json through the real session classes; list every message that differs."""
    deadlines = tuple(ROUND["deadlines"])
    params = RoundParameters(
        round_id=ROUND["round_id"],
        vector_length=ROUND["vector_length"],
        k=ROUND["graph_k"],
        t=ROUND["graph_t"],
        clip_norm=1.0,
        scale_bits=16,
        deadlines=(deadlines[0], deadlines[1], deadlines[2], deadlines[3]),
    )
    server = ServerSecAggSession(params, ROUND["device_ids"], rng=np.random.default_rng(0))
    devices: dict[int, DeviceSecAggSession] = {}
    problems = []
    for i, entry in enumerate(ROUND["messages"]):
        u, wire = entry["device"], bytes.fromhex(entry["hex"])
        phase = _PHASE_OF_STEP[entry["step"]]
        while server.phase in _PHASE_OF_STEP.values() and server.phase is not phase:
            server.advance(deadlines[list(_PHASE_OF_STEP.values()).index(server.phase)])  # a quiet device
        if entry["direction"] == "server_to_device":
            produced = server.outbox(u)
            if produced is None or codec.encode(produced) != wire:
                problems.append(f"message {i}: server's {entry['type']} to {u} differs")
            received = codec.decode(wire)
            if u not in devices:
                if not isinstance(received, RoundInvite):
                    raise AssertionError("the first message to a device must be its invite")
                devices[u] = DeviceSecAggSession(
                    received, rng=insecure_test_noise_stream(u), fixed_secrets=_round_secrets(str(u))
                )
                devices[u].provide_input(np.array(ROUND["inputs_int32"][str(u)], dtype=np.int64).astype(np.uint32))
            else:
                devices[u].receive(received)
        else:
            produced = devices[u].send()
            if codec.encode(produced) != wire:
                problems.append(f"message {i}: device {u}'s {entry['type']} differs")
            server.receive(u, codec.decode(wire))
    return problems, server


# ------------------------------------------------------------------------------------------------ messages


def test_vectors_cover_every_message_type() -> None:
    assert sorted(v["type_code"] for v in MESSAGES["messages"]) == [*range(1, 17), 20, 21, 22]
    assert MESSAGES["protocol_version"] == list(PROTOCOL_VERSION)


@pytest.mark.parametrize("vector", MESSAGES["messages"] + MESSAGES["extra"], ids=lambda v: v["type"])
def test_message_encoding_matches_vector(vector: dict[str, Any]) -> None:
    assert _message_mismatches(vector) == []


@pytest.mark.parametrize("case", MESSAGES["rejected"], ids=lambda c: c["why"])
def test_rejected_envelopes(case: dict[str, Any]) -> None:
    with pytest.raises((DecodeError, VersionMismatch)):
        codec.decode(bytes.fromhex(case["hex"]))


def test_unknown_keys_of_a_newer_minor_are_ignored() -> None:
    case = MESSAGES["accepted_unknown_key"]
    decoded = codec.decode(bytes.fromhex(case["hex"]))
    expected = dict(case["decodes_to"])
    assert type(decoded).__name__ == expected.pop("type")
    assert {k: getattr(decoded, k) for k in expected} == expected


def test_fields_missing_from_an_older_minor_take_their_defaults() -> None:
    # A 1.5 server's LightFR invite: no query_planes / user_reg keys, so the plan keeps ±1 user codes.
    case = MESSAGES["accepted_older_minor"]
    decoded = codec.decode(bytes.fromhex(case["hex"]))
    expected = dict(case["decodes_to"])
    assert type(decoded).__name__ == expected.pop("type")
    assert {k: _field(decoded, k) for k in expected} == expected
    assert isinstance(decoded, RoundInvite) and decoded.plan.params.query_planes == 0  # type: ignore[union-attr]


def test_a_model_payload_of_an_older_minor_takes_the_defaults() -> None:
    # A 1.6 server's model: no w0 / al / dp keys, so the device keeps its own w0 and no DP flag is stated.
    case = MESSAGES["accepted_older_model"]
    decoded = codec.decode(bytes.fromhex(case["hex"]))
    expected = dict(case["decodes_to"])
    assert type(decoded).__name__ == expected.pop("type")
    assert {k: getattr(decoded, k) for k in expected} == expected


def test_an_ials_model_of_an_older_minor_has_no_item_term() -> None:
    # A 1.9 server's iALS model: no lv / lw keys, so the device ranks by u·v alone.
    case = MESSAGES["accepted_older_ials_model"]
    decoded = codec.decode(bytes.fromhex(case["hex"]))
    expected = dict(case["decodes_to"])
    assert type(decoded).__name__ == expected.pop("type")
    assert {k: getattr(decoded, k) for k in expected} == expected
    assert isinstance(decoded, ModelPayload) and decoded.item_levels == b""
    assert decoded.ials_extras() == {"item_levels": b"", "level_weight": 0.0}


def test_payload_layouts() -> None:
    codes_layout = MESSAGES["layouts"]["lightfr_codes"]
    words = codes.pack_signs(np.array(codes_layout["signs"], dtype=np.int8))
    assert words.tolist() == codes_layout["words_u64"]
    assert codes.to_bytes(words).hex() == codes_layout["words_hex"]
    # Independent reading of the layout: bit j of item i's code is bit j % 64 of LE word j // 64 of column i.
    raw = bytes.fromhex(codes_layout["words_hex"])
    m, f = codes_layout["n_items"], codes_layout["bits"]
    table = np.frombuffer(raw, dtype="<u8").reshape(-1, m)
    bits = [[int(table[j // 64, i]) >> (j % 64) & 1 for j in range(f)] for i in range(m)]
    assert bits == [[1 if s > 0 else 0 for s in row] for row in codes_layout["signs"]]
    values = MESSAGES["layouts"]["float64_values"]
    decoded = struct.unpack(f"<{len(values['values_hex']) // 16}d", bytes.fromhex(values["values_hex"]))
    assert list(decoded) == [x for row in values["values"] for x in row]
    payload = next(v for v in MESSAGES["extra"] if v["type"] == "ModelPayload")
    assert _build(payload).values.hex() == values["values_hex"]  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------------ crypto


def test_x25519() -> None:
    v = CRYPTO["x25519"]
    a = crypto.key_pair_from_private_bytes(bytes.fromhex(v["a_private"]))
    b = crypto.key_pair_from_private_bytes(bytes.fromhex(v["b_private"]))
    assert (a.public_key.hex(), b.public_key.hex()) == (v["a_public"], v["b_public"])
    assert crypto.x25519(a.private_key, b.public_key).hex() == v["shared_secret"]
    assert crypto.x25519(bytes.fromhex(v["b_private"]), a.public_key).hex() == v["shared_secret"]


def test_session_id() -> None:
    v = CRYPTO["session_id"]
    keys = {int(u): (bytes.fromhex(k["c"]), bytes.fromhex(k["s"])) for u, k in v["public_keys"].items()}
    major = CRYPTO["protocol_version"][0]
    label = b"fedrec/secagg/session"
    preimage = struct.pack(">I", len(label)) + label + struct.pack(">HHQI", major, 0, v["round_id"], len(keys))
    for u in sorted(keys):
        c, s = keys[u]
        preimage += struct.pack(">QI", u, len(c)) + c + struct.pack(">I", len(s)) + s
    assert preimage.hex() == v["hash_input"]
    assert hashlib.sha256(preimage).hexdigest() == v["session_id"]
    assert crypto.session_id(v["round_id"], keys).hex() == v["session_id"]


def test_hkdf_labels() -> None:
    assert _hkdf_mismatches() == []


def test_aead_share_encryption() -> None:
    v = CRYPTO["aead_share"]
    key, ad = bytes.fromhex(v["key"]), bytes.fromhex(v["associated_data"])
    plaintext = bytes.fromhex(v["plaintext"])
    assert plaintext == struct.pack(">QQ", v["src"], v["dst"]) + bytes.fromhex(v["b_share"] + v["s_share"])
    assert ad == bytes.fromhex(CRYPTO["session_id"]["session_id"]) + struct.pack(">QQ", v["src"], v["dst"])
    assert crypto.share_associated_data(bytes.fromhex(CRYPTO["session_id"]["session_id"]), v["src"], v["dst"]) == ad
    assert key.hex() == CRYPTO["hkdf"]["share_encryption"]["okm"]
    blob = crypto.aead_encrypt(key, plaintext, ad, nonce=bytes.fromhex(v["nonce"]))
    assert blob.hex() == v["blob"]
    assert blob[:12].hex() == v["nonce"] and len(blob) == 12 + len(plaintext) + 16
    assert crypto.aead_decrypt(key, blob, ad) == plaintext


def test_mask_prg() -> None:
    v = CRYPTO["prg"]
    key = bytes.fromhex(v["key"])
    assert crypto.prg_uint32(key, v["length"]).tolist() == v["uint32"]
    assert crypto.MaskPrg(v["length"]).expand(key).tolist() == v["uint32"]
    assert list(struct.unpack(f"<{v['length']}I", bytes.fromhex(v["keystream"]))) == v["uint32"]
    pair_key = bytes.fromhex(CRYPTO["hkdf"]["pair_mask"]["okm"])
    self_key = bytes.fromhex(CRYPTO["hkdf"]["self_mask"]["okm"])
    assert crypto.prg_uint32(pair_key, 8).tolist() == v["pair_mask_first_8"]
    assert crypto.prg_uint32(self_key, 8).tolist() == v["self_mask_first_8"]


def test_shamir(monkeypatch: pytest.MonkeyPatch) -> None:
    v = CRYPTO["shamir"]
    secret = bytes.fromhex(v["secret"])
    poly = [int.from_bytes(secret, "big"), *(int(c) for c in v["coefficients_int"])]
    assert str(poly[0]) == v["secret_int"] and shamir.PRIME == 2**521 - 1
    shares = [shamir.Share(s["index"], int(s["value_int"])) for s in v["shares"]]
    for share, raw in zip(shares, v["shares"], strict=True):
        assert share.value == sum(c * share.index**i for i, c in enumerate(poly)) % shamir.PRIME
        assert share.to_bytes().hex() == raw["bytes"]
        assert shamir.Share.from_bytes(bytes.fromhex(raw["bytes"])) == share
    for subset in v["reconstruct_from"]:
        assert shamir.reconstruct([shares[i - 1] for i in subset], v["t"]) == secret
    # shamir.split draws the coefficients from `secrets.randbelow`; fed the vector's, it gives the vector.
    coefficients = iter(poly[1:])
    monkeypatch.setattr(shamir, "secrets", SimpleNamespace(randbelow=lambda _bound: next(coefficients)))
    assert shamir.split(secret, v["t"], v["k"]) == shares
    # The known-answer injection of the device session evaluates the same polynomial.
    fixed = _round_secrets("10")
    assert fixed.shares(secret, tuple(poly[1:]), v["t"], v["k"]) == shares


def test_quantization() -> None:
    v = CRYPTO["quantization"]
    cfg = QuantizationConfig(clip_norm=v["clip_norm"], scale_bits=v["scale_bits"])
    x = np.array(v["x"], dtype=np.float64)
    q, stats = quantize(x, cfg, insecure_test_noise_stream(v["noise_stream_seed"]))
    assert q.tolist() == v["q_uint32"] and stats.clipped == v["was_clipped"]
    # The rule itself, from the recorded coins: q = floor(2^s x') + [u < frac(2^s x')], two's complement.
    scaled = np.array(v["clipped"]) * 2.0 ** v["scale_bits"]
    rule = np.floor(scaled).astype(np.int64) + (np.array(v["uniforms"]) < scaled - np.floor(scaled))
    assert rule.tolist() == v["q_int32"]
    assert [(n + 2**32) % 2**32 for n in v["q_int32"]] == v["q_uint32"]
    assert dequantize_sum(np.array(v["q_uint32"], dtype=np.uint32), cfg).tolist() == v["dequantized"]


# ------------------------------------------------------------------------------------------------ round


def test_full_round_replays_exactly() -> None:
    problems, server = _replay_round()
    assert problems == []
    assert server.phase is Phase.DONE
    assert server.session_id.hex() == ROUND["session_id"]
    result = server.result()
    assert sorted(result.survivors) == ROUND["survivors"]
    assert result.total.tolist() == ROUND["sum_uint32"]
    expected = sum(np.array(ROUND["inputs_int32"][str(u)], dtype=np.int64) for u in ROUND["survivors"])
    assert np.array_equal(result.total.view(np.int32), expected)
    assert result.dropouts[Phase.MASKED_INPUT] == {ROUND["dropped_before_masked_input"]}


# ------------------------------------------------------------------------------------------------ mutations


def _mutated_schema(type_code: int, field: str, *, key: str | None = None, kind: codec.Kind | None = None) -> Any:
    table = dict(codec._SCHEMA)
    cls, fields = table[type_code]
    table[type_code] = (
        cls,
        tuple(
            item if isinstance(item, str) else (item[0], key or item[1], kind or item[2]) if item[0] == field else item
            for item in fields
        ),
    )
    return MappingProxyType(table)


@pytest.mark.parametrize(
    ("type_code", "field", "key", "kind"),
    [
        (1, "round_id", "rid", None),  # a renamed wire key
        (6, "masked", "m", None),
        (15, "values", "v", None),  # a 1.2 field
        (1, "clip_norm", None, codec.Kind.INT),  # a changed Kind (float 2.5 packed as-is is still float)
        (13, "model_version", None, codec.Kind.STR),
    ],
)
def test_a_changed_codec_table_breaks_the_vectors(
    monkeypatch: pytest.MonkeyPatch, type_code: int, field: str, key: str | None, kind: codec.Kind | None
) -> None:
    vector = next(v for v in MESSAGES["messages"] if v["type_code"] == type_code)
    assert _message_mismatches(vector) == []
    monkeypatch.setattr(codec, "_SCHEMA", _mutated_schema(type_code, field, key=key, kind=kind))
    assert _message_mismatches(vector) != []


def test_a_changed_hkdf_label_breaks_the_vectors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(crypto, "LABEL_PAIR_MASK", b"fedrec/secagg/pair-mask-v2")
    assert any("pair_mask" in p for p in _hkdf_mismatches())
    problems, _ = _replay_round()
    assert any("MaskedInput" in p for p in problems)


def test_a_changed_type_code_breaks_the_vectors(monkeypatch: pytest.MonkeyPatch) -> None:
    vector = next(v for v in MESSAGES["messages"] if v["type"] == "Wait")
    monkeypatch.setattr(messages_module.Wait, "TYPE", 21)
    table = dict(codec._SCHEMA)
    table[21] = table.pop(14)
    monkeypatch.setattr(codec, "_SCHEMA", MappingProxyType(table))
    assert _message_mismatches(vector) != []


# ------------------------------------------------------------------------------------------------ injection


def _invite(device_id: int) -> RoundInvite:
    return RoundInvite(
        round_id=1,
        device_id=device_id,
        vector_length=4,
        graph_k=3,
        graph_t=2,
        clip_norm=1.0,
        scale_bits=8,
        advertise_deadline=1.0,
        share_keys_deadline=2.0,
        masked_input_deadline=3.0,
        unmask_deadline=4.0,
    )


def test_without_fixed_secrets_keys_are_fresh() -> None:
    first = DeviceSecAggSession(_invite(1), rng=insecure_test_noise_stream(0)).send()
    second = DeviceSecAggSession(_invite(1), rng=insecure_test_noise_stream(0)).send()
    assert codec.encode(first) != codec.encode(second)
    fixed = _round_secrets("10")
    again = [
        DeviceSecAggSession(_invite(1), rng=insecure_test_noise_stream(0), fixed_secrets=fixed).send() for _ in "ab"
    ]
    assert codec.encode(again[0]) == codec.encode(again[1])


def test_fixed_secrets_are_validated() -> None:
    fixed = _round_secrets("10")
    with pytest.raises(ValueError, match="self_mask_seed"):
        FixedDeviceSecrets(
            c_private_key=fixed.c_private_key,
            s_private_key=fixed.s_private_key,
            self_mask_seed=b"short",
            b_coefficients=(),
            s_coefficients=(),
            share_nonces={},
        )
    with pytest.raises(ValueError, match="field elements"):
        FixedDeviceSecrets(
            c_private_key=fixed.c_private_key,
            s_private_key=fixed.s_private_key,
            self_mask_seed=fixed.self_mask_seed,
            b_coefficients=(shamir.PRIME,),
            s_coefficients=(),
            share_nonces={},
        )
    with pytest.raises(ValueError, match="nonces"):
        FixedDeviceSecrets(
            c_private_key=fixed.c_private_key,
            s_private_key=fixed.s_private_key,
            self_mask_seed=fixed.self_mask_seed,
            b_coefficients=(),
            s_coefficients=(),
            share_nonces={2: bytes(11)},
        )
    with pytest.raises(LocalProtocolError, match="coefficients"):
        fixed.shares(fixed.self_mask_seed, (1, 2), 2, 3)
    with pytest.raises(TypeError):
        DeviceSecAggSession(_invite(1), rng=insecure_test_noise_stream(0), fixed_secrets=object())  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ generator


def test_generator_is_deterministic_and_committed(tmp_path: Path) -> None:
    # A fresh run must write exactly the committed bytes (which an earlier run wrote): the generator is
    # deterministic and the vectors are not stale.
    subprocess.run(
        [sys.executable, str(VECTORS / "generate.py"), "--out", str(tmp_path)], check=True, capture_output=True
    )
    for name in ("messages.json", "crypto.json", "round.json"):
        assert (tmp_path / name).read_bytes() == (VECTORS / name).read_bytes(), name


# -- protocol 1.3/1.4 identities (identity.json) -------------------------------------------------------------


def test_identity_vectors_reproduce_byte_for_byte() -> None:
    from protocol.enrollment import batch_id

    vec = _load("identity.json")

    def seed(label: str) -> bytes:
        return hashlib.sha256(b"fedrec test vector/" + label.encode()).digest()

    authority = SigningKey.from_private_bytes(seed(vec["authority_seed_label"]))
    device = SigningKey.from_private_bytes(seed(vec["device_seed_label"]))
    assert authority.public_key.hex() == vec["authority_public_key"]
    assert device.public_key.hex() == vec["device_public_key"]
    assert batch_id(vec["batch_name"]).hex() == vec["batch_id"]
    cert = issue_certificate(
        authority,
        device.public_key,
        batch=bytes.fromhex(vec["batch_id"]),
        serial=bytes.fromhex(vec["serial_tail"]),
    )
    assert cert.hex() == vec["certificate"]
    assert verify_certificate(cert, authority.public_key) == device.public_key
    assert registration_payload(cert).hex() == vec["registration_payload"]
    assert device.sign(registration_payload(cert)).hex() == vec["registration_proof"]
    v2 = vec["certificate_v2"]
    cert2 = issue_certificate(
        authority,
        device.public_key,
        batch=bytes.fromhex(vec["batch_id"]),
        serial=bytes.fromhex(vec["serial_tail"]),
        not_before=v2["not_before"],
        not_after=v2["not_after"],
    )
    assert cert2.hex() == v2["hex"]
    parsed = read_certificate(cert2, authority.public_key, now=v2["not_before"])
    assert parsed.subject == device.public_key
    assert (parsed.not_before, parsed.not_after) == (v2["not_before"], v2["not_after"])
    v3 = vec["certificate_v3"]  # protocol 1.8: the device id it was issued for
    cert3 = issue_certificate(
        authority,
        device.public_key,
        batch=bytes.fromhex(vec["batch_id"]),
        serial=bytes.fromhex(vec["serial_tail"]),
        not_before=v3["not_before"],
        not_after=v3["not_after"],
        device_id=v3["device_id"],
    )
    assert cert3.hex() == v3["hex"] and cert3[:-72] == cert2[:-64].replace(b"FRC2", b"FRC3", 1)
    assert read_certificate(cert3, authority.public_key, now=v3["not_before"]).device_id == v3["device_id"]
    crl = vec["revocation_list"]
    keys = [bytes.fromhex(k) for k in crl["device_keys"]]
    data = issue_revocation_list(authority, crl["number"], crl["issued_at"], keys)
    assert data.hex() == crl["hex"]
    checked = verify_revocation_list(data, authority.public_key)
    assert (checked.number, checked.issued_at, checked.device_keys) == (crl["number"], crl["issued_at"], set(keys))
    ka = vec["key_advertisement"]
    payload = key_advertisement_payload(
        ka["round_id"], ka["device_id"], bytes.fromhex(ka["c_public_key"]), bytes.fromhex(ka["s_public_key"])
    )
    assert payload.hex() == ka["payload"] and device.sign(payload).hex() == ka["signature"]
    ss = vec["survivor_set"]
    payload = survivor_set_payload(ss["round_id"], bytes.fromhex(ss["session_id"]), ss["survivors"])
    assert payload.hex() == ss["payload"] and device.sign(payload).hex() == ss["signature"]
    verify_signature(device.public_key, bytes.fromhex(ss["signature"]), payload)
    ro = vec["roster"]  # protocol 1.8: the payloads bind (n, roster digest)
    keys = [bytes.fromhex(k) for k in ro["identity_keys"]]
    assert roster_digest(ro["ids"], keys).hex() == ro["digest"] and device.public_key in keys
    cohort = (len(ro["ids"]), bytes.fromhex(ro["digest"]))
    payload = key_advertisement_payload(
        ka["round_id"], ka["device_id"], bytes.fromhex(ka["c_public_key"]), bytes.fromhex(ka["s_public_key"]), cohort
    )
    assert (
        payload.hex() == ro["key_advertisement_payload"]
        and device.sign(payload).hex() == ro["key_advertisement_signature"]
    )
    payload = survivor_set_payload(ss["round_id"], bytes.fromhex(ss["session_id"]), ss["survivors"], cohort)
    assert payload.hex() == ro["survivor_set_payload"] and device.sign(payload).hex() == ro["survivor_set_signature"]
    for vector in vec["messages"].values():
        message = _build(vector)
        assert codec.encode(message).hex() == vector["hex"]
        assert not _message_mismatches(vector)
