# Invariants:
# - Deterministic: every secret, key, seed, nonce and coefficient below is derived from a fixed label with
#   SHA-256/SHA-512, every numpy generator is seeded here, and the JSON is written with a fixed layout, so
#   two runs write byte-identical files.
# - Bytes appear as lowercase hex strings; ring vectors as lists of uint32 integers; field elements too large
#   for JSON numbers as decimal strings (*_int); floats in Python's shortest round-trip form.
# - The script checks its own output against the session results (`_check`), so it refuses to write vectors
#   of a broken round.
# - Only the public API of `protocol` is used (`codec.body_fields` lists the wire keys); the conformance test
#   (tests/test_conformance.py) checks the committed output without importing this script.
"""Generate the fedrec protocol test vectors (docs/test-vectors/*.json).

Run ``python docs/test-vectors/generate.py`` from the repository root; it rewrites ``messages.json``,
``crypto.json`` and ``round.json`` next to this script.  Commit the output together with any protocol
change that alters it (a change in a vector is a wire-format change: bump the protocol version).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from protocol import codec, codes, crypto, shamir  # noqa: E402
from protocol.identity import (  # noqa: E402
    BATCH_BYTES,
    SigningKey,
    certificate_batch,
    issue_certificate,
    issue_revocation_list,
    key_advertisement_payload,
    registration_payload,
    roster_digest,
    survivor_set_payload,
    verify_certificate,
    verify_revocation_list,
    verify_signature,
)
from protocol.messages import (  # noqa: E402
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
from protocol.plan import LightFRParams, MFParams  # noqa: E402
from protocol.quantization import QuantizationConfig, dequantize_sum, quantize  # noqa: E402
from protocol.samplers import insecure_test_noise_stream  # noqa: E402
from protocol.session import (  # noqa: E402
    DeviceSecAggSession,
    FixedDeviceSecrets,
    Phase,
    RoundParameters,
    ServerSecAggSession,
)
from protocol.spec import PROTOCOL_VERSION  # noqa: E402

OUT = Path(__file__).resolve().parent
PREFIX = b"fedrec test vector/"
#: `protocol.samplers.insecure_test_noise_stream`'s key label (the quantization vector's coins).
NOISE_LABEL = b"fedrec/INSECURE-test-only/noise-stream"

# Protocol version that introduced each field (fields not listed: 1.0 for types 1-10, 1.1 for 11-16, 1.3 for
# the consistency check's types 20-21, 1.5 for type 22, RevocationListPayload).
_SINCE_1_1 = {
    "RoundInvite": (
        "model_version",
        "model_kind",
        "aggregation",
        "bits",
        "n_items",
        "lam",
        "negatives",
        "local_epochs",
        "max_sweeps",
        "example_cap",
    ),
}
_SINCE_1_2 = {
    "RoundInvite": (
        "learning_rate",
        "reg",
        "reg_growth",
        "kappa",
        "proximity",
        "inertia",
        "max_norm2",
        "pretrain_epochs",
        "step_rule",
        "alignment",
        "round_index",
    ),
    "ModelPayload": ("values",),
}
_SINCE_1_3 = {
    "RoundInvite": ("cohort_size", "unobserved_weight", "confidence", "counts_share"),
    "ModelPayload": ("item_levels", "hamming_weight"),
    "PublicKeys": ("certificate", "signature"),
    "ShareKeysBroadcast": ("certificates", "signatures"),
    "MaskedInput": ("bad_share_senders",),
    "UnmaskRequest": ("survivor_set", "signer_ids", "signer_certificates", "signatures"),
}


_SINCE_1_4 = {"RegisterRequest": ("certificate", "proof", "enrollment_token")}
_SINCE_1_6 = {"RoundInvite": ("query_planes", "user_reg")}
_SINCE_1_7 = {"ModelPayload": ("unobserved_weight", "confidence", "dp_trained")}
_SINCE_1_8 = {"RoundInvite": ("roster_ids", "roster_keys")}
_SINCE_1_9 = {"RoundInvite": ("theta", "gram_weight")}
_SINCE_1_10 = {"ModelPayload": ("level_weight",)}
_SINCE_1_12 = {"RoundInvite": ("dp_colluders",)}


def _check(condition: bool) -> None:
    if not condition:
        raise RuntimeError("the implementation disagrees with itself; no vectors written")


def fixed_bytes(label: str, n: int = 32) -> bytes:
    """``n`` bytes named by ``label``: SHA-256(PREFIX ‖ label) (n <= 32)."""
    return hashlib.sha256(PREFIX + label.encode()).digest()[:n]


def fixed_field_element(label: str) -> int:
    """A GF(2**521 - 1) element named by ``label``: SHA-512(PREFIX ‖ label) as a big-endian integer."""
    return int.from_bytes(hashlib.sha512(PREFIX + label.encode()).digest(), "big") % shamir.PRIME


def _since(cls_name: str, type_code: int, field: str) -> str:
    if field in _SINCE_1_12.get(cls_name, ()):
        return "1.12"
    if field in _SINCE_1_10.get(cls_name, ()):
        return "1.10"
    if field in _SINCE_1_9.get(cls_name, ()):
        return "1.9"
    if field in _SINCE_1_8.get(cls_name, ()):
        return "1.8"
    if field in _SINCE_1_7.get(cls_name, ()):
        return "1.7"
    if field in _SINCE_1_6.get(cls_name, ()):
        return "1.6"
    if type_code == 22:
        return "1.5"
    if field in _SINCE_1_4.get(cls_name, ()):
        return "1.4"
    if field in _SINCE_1_3.get(cls_name, ()) or type_code in (20, 21):
        return "1.3"
    if field in _SINCE_1_2.get(cls_name, ()):
        return "1.2"
    if field in _SINCE_1_1.get(cls_name, ()) or type_code >= 11:
        return "1.1"
    return "1.0"


def _present(value: Any) -> bool:
    """Whether an omitted-when-empty field is written: a non-empty sequence or a non-zero number."""
    return bool(len(value)) if hasattr(value, "__len__") else bool(value)


def _json_value(kind: codec.Kind, value: Any) -> Any:
    if kind is codec.Kind.BYTES:
        return value.hex()
    if kind is codec.Kind.BYTES_LIST:
        return [v.hex() for v in value]
    if kind is codec.Kind.INTS:
        return list(value)
    if kind is codec.Kind.U32:
        return [int(v) for v in value]
    return value


def describe(message: Message) -> dict[str, Any]:
    """Type code, fields (name, wire key, kind, version, value) and the encoded hex of one message."""
    cls = type(message)
    return {
        "type": cls.__name__,
        "type_code": cls.TYPE,
        "fields": [
            {
                "name": name,
                "key": key,
                "kind": kind.value,
                "since": _since(cls.__name__, cls.TYPE, name),
                "value": _json_value(kind, value),
            }
            for name, key, kind, value in codec.body_fields(message)
            if (cls.TYPE, key) not in codec._OMITTED_WHEN_EMPTY or _present(value)  # absent when empty or zero
        ],
        "hex": codec.encode(message).hex(),
    }


# --------------------------------------------------------------------------------------------- messages


def message_vectors() -> dict[str, Any]:
    """One encoding per message type (1-16, 20-22), plus the LightFR and float64 model payload layouts."""
    sid = fixed_bytes("session id")
    pk = [crypto.key_pair_from_private_bytes(fixed_bytes(f"msg key {i}")).public_key for i in range(6)]
    share_ct = [fixed_bytes(f"ct {i}") + fixed_bytes(f"ct tail {i}") for i in range(2)]
    invite = RoundInvite(
        round_id=7,
        device_id=300,
        vector_length=8,
        graph_k=5,
        graph_t=3,
        clip_norm=2.5,
        scale_bits=16,
        dp_mu=1024.0,
        dp_t_min=40,
        advertise_deadline=1000.0,
        share_keys_deadline=1030.0,
        masked_input_deadline=1090.5,
        unmask_deadline=1120.25,
        model_version=3,
        model_kind="mf",
        bits=4,
        n_items=2,
        example_cap=200,
        round_index=2,
        cohort_size=3,
        roster_ids=(100, 300, 500),  # protocol 1.8, written only when non-empty
        roster_keys=tuple(fixed_bytes(f"roster key {v}") for v in (100, 300, 500)),
        dp_colluders=2,  # protocol 1.12, written only when non-zero
        # The keys of the other families' parameters travel at their ``absent`` values.
        params=MFParams(max_norm2=4.0, learning_rate=0.125, reg=0.0625, pretrain_epochs=5, local_epochs=2, negatives=0),
    )
    signs = np.array([[1, -1, 1, 1, -1], [-1, -1, 1, -1, 1], [1, 1, 1, 1, 1]], dtype=np.int8)  # m=3, f=5
    words = codes.pack_signs(signs)
    mf_values = np.array([[0.5, -0.25], [1.0, 0.0], [-2.0, 0.125]], dtype=np.float64)  # MF V: (n_items, bits)
    messages: list[Message] = [
        invite,
        PublicKeys(round_id=7, device_id=300, c_public_key=pk[0], s_public_key=pk[1]),
        ShareKeysBroadcast(
            round_id=7,
            device_id=300,
            session_id=sid,
            neighbour_ids=(100, 300, 500),
            c_public_keys=(pk[2], pk[0], pk[4]),
            s_public_keys=(pk[3], pk[1], pk[5]),
        ),
        EncryptedShares(
            round_id=7, device_id=300, session_id=sid, recipient_ids=(100, 500), ciphertexts=tuple(share_ct)
        ),
        MaskedInputRequest(
            round_id=7, device_id=300, session_id=sid, sender_ids=(100, 500), ciphertexts=tuple(share_ct)
        ),
        MaskedInput(
            round_id=7,
            device_id=300,
            session_id=sid,
            masked=np.array([0, 1, 2**31, 2**32 - 1, 0x01020304, 7, 8, 9], dtype=np.uint32),
            bad_share_senders=(500,),  # written only when non-empty: round.json has the honest encoding
        ),
        UnmaskRequest(round_id=7, device_id=300, session_id=sid, survivors=(100, 300), dropped=(500,), n_survivors=41),
        UnmaskResponse(
            round_id=7,
            device_id=300,
            session_id=sid,
            b_share_ids=(100, 300),
            b_shares=(shamir.Share(2, 12345).to_bytes(), shamir.Share(2, shamir.PRIME - 1).to_bytes()),
            s_share_ids=(500,),
            s_shares=(shamir.Share(2, 1).to_bytes(),),
            dp_excess=np.array([1, 2**32 - 1, 0, 3, 2**32 - 2, 0, 0, 5], dtype=np.uint32),
        ),
        Abort(round_id=7, device_id=300, reason="battery low"),
        ErrorMessage(code="round_closed", message="MaskedInput arrived after SHARE_KEYS closed"),
        RegisterRequest(platform="android-14/fedrec-kt 0.1"),
        RegisterResponse(device_id=300, token="tok_0123456789abcdefghijKLMNOP"),
        CheckIn(device_id=300, model_version=3),
        Wait(retry_after=12.5, reason="no round open"),
        ModelPayload(model_version=3, model_kind="lightfr", bits=5, n_items=3, words=codes.to_bytes(words)),
        RoundResult(round_id=7, committed=True, model_version=4, reason=""),
        # protocol 1.3: the consistency check
        ConsistencyRequest(round_id=7, device_id=300, session_id=sid, survivor_set=(100, 300, 700)),
        ConsistencySignature(round_id=7, device_id=300, session_id=sid, signature=bytes(range(64))),
        # protocol 1.5: the revocation list a device fetches (identity.json's revocation_list vector)
        RevocationListPayload(data=_revocation_list_bytes()),
    ]
    extra: list[Message] = [
        ModelPayload(model_version=3, model_kind="mf", bits=2, n_items=3, words=b"", values=mf_values.tobytes()),
        UnmaskResponse(
            round_id=7,
            device_id=300,
            session_id=sid,
            b_share_ids=(100, 300),
            b_shares=(shamir.Share(2, 12345).to_bytes(), shamir.Share(2, 1).to_bytes()),
            s_share_ids=(),
            s_shares=(),
            dp_excess=np.zeros(0, dtype=np.uint32),
        ),
        _PLANES_INVITE,  # protocol 1.6: a LightFR plan asking for asymmetric scoring
        _W0_MODEL,  # protocol 1.7: a LightFR model with the w0 and α it goes with, trained with DP noise
        _LEVELS_MODEL,  # protocol 1.10: an iALS model with its item levels and their weight
        RoundInvite(  # a 1.0-style invite: every appended field at its default
            round_id=1,
            device_id=2,
            vector_length=3,
            graph_k=3,
            graph_t=2,
            clip_norm=1.0,
            scale_bits=0,
            advertise_deadline=0.0,
            share_keys_deadline=0.0,
            masked_input_deadline=0.0,
            unmask_deadline=0.0,
        ),
    ]
    return {
        "description": "One encoding per message type (type codes 1-16, 20-22), then extra cases: a float64 model "
        "payload (MF), an UnmaskResponse without DP (empty dp_excess), a LightFR invite whose plan asks for "
        "asymmetric scoring (protocol 1.6: query_planes, user_reg), a LightFR model with its w0, alpha and DP "
        "flag (1.7), an iALS model with item levels and their weight (1.10: score u.v + w*level/255) and an "
        "invite with every appended field at its default.  Envelope: msgpack map {v: [major, minor], t: type code, "
        "b: body}.",
        "protocol_version": list(PROTOCOL_VERSION),
        "messages": [describe(m) for m in messages],
        "extra": [describe(m) for m in extra],
        "layouts": {
            "lightfr_codes": {
                "description": "ModelPayload.words of the LightFR payload above: item i's code is row i of signs "
                "(+1 -> bit 1); bit k of a code lives in little-endian uint64 word k // 64 at position k % 64; "
                "words are stored word-major (w, m) and serialised row after row.",
                "bits": 5,
                "n_items": 3,
                "signs": signs.tolist(),
                "words_u64": [[int(x) for x in row] for row in words],
                "words_hex": codes.to_bytes(words).hex(),
            },
            "float64_values": {
                "description": "ModelPayload.values of the MF payload above: MF's item matrix V (n_items x bits) "
                "as little-endian IEEE-754 float64 in C (row-major) order; FELB and FNMF send V as (bits x n_items).",
                "shape": list(mf_values.shape),
                "values": mf_values.tolist(),
                "values_hex": mf_values.astype("<f8").tobytes().hex(),
            },
        },
        "rejected": [
            {"why": "major version 2", "hex": _raw_envelope([2, 0], 13, {"d": 1}).hex()},
            {"why": "unknown type code 17", "hex": _raw_envelope([1, 2], 17, {}).hex()},
            {"why": "CheckIn without its required key d", "hex": _raw_envelope([1, 2], 13, {"mv": 1}).hex()},
            {
                "why": "u32 byte length does not match shape",
                "hex": _raw_envelope(
                    [1, 2], 6, {"r": 1, "d": 1, "sid": bytes(32), "y": {"dt": "<u4", "sh": [2], "by": bytes(4)}}
                ).hex(),
            },
        ],
        "accepted_older_minor": {
            "why": "a 1.5 server's LightFR invite has no qp/ur keys: they take their defaults (query_planes 0: "
            "+-1 user codes), the plan a 1.5 server means",
            "hex": _raw_envelope([1, 5], 1, _older_body(_PLANES_INVITE, ("qp", "ur"))).hex(),
            "decodes_to": {"type": "RoundInvite", "query_planes": 0, "user_reg": 1.0, "unobserved_weight": 0.25},
        },
        "accepted_older_model": {
            "why": "a 1.6 server's LightFR model has no w0/al/dp keys: they take their defaults (w0 0: not "
            "stated, the device keeps its own; dp_trained false)",
            "hex": _raw_envelope([1, 6], 15, _older_body(_W0_MODEL, ("w0", "al", "dp"))).hex(),
            "decodes_to": {
                "type": "ModelPayload",
                "unobserved_weight": 0.0,
                "confidence": 0.0,
                "dp_trained": False,
                "hamming_weight": 2,
            },
        },
        "accepted_older_ials_model": {
            "why": "a 1.9 server's iALS model has no lv/lw keys: no item term (level_weight 0), the device ranks "
            "by u.v alone",
            "hex": _raw_envelope([1, 9], 15, _older_body(_LEVELS_MODEL, ("lv", "lw"))).hex(),
            "decodes_to": {"type": "ModelPayload", "model_kind": "ials", "bits": 2, "level_weight": 0.0},
        },
        "accepted_unknown_key": {
            "why": "a newer minor version adds key zz: decoders ignore unknown keys",
            "hex": _raw_envelope([1, 9], 13, {"d": 5, "mv": 2, "zz": "later field"}).hex(),
            "decodes_to": {"type": "CheckIn", "device_id": 5, "model_version": 2},
        },
    }


#: A LightFR round (m = 3 items, f = 4 bits, all-items objective: L = m·f + 2m + f² + f = 38) whose plan asks
#: the devices for asymmetric scoring with 2 bit-planes and ridge weight 30 (protocol 1.6).
_PLANES_INVITE = RoundInvite(
    round_id=9,
    device_id=300,
    vector_length=38,
    graph_k=5,
    graph_t=3,
    clip_norm=4.0,
    scale_bits=16,
    advertise_deadline=2000.0,
    share_keys_deadline=2030.0,
    masked_input_deadline=2090.0,
    unmask_deadline=2120.0,
    model_version=5,
    model_kind="lightfr",
    bits=4,
    n_items=3,
    cohort_size=40,
    params=LightFRParams(negatives=0, unobserved_weight=0.25, query_planes=2, user_reg=30.0),
)


#: A LightFR model of the all-items objective (m = 3 items, f = 4 bits, levels, B = 2) that goes with w0 = 0.03125
#: and α = 0.5, from a run whose rounds added DP noise (protocol 1.7).
_W0_MODEL = ModelPayload(
    model_version=4,
    model_kind="lightfr",
    bits=4,
    n_items=3,
    words=bytes(range(8)) * 3,
    item_levels=bytes([128, 131, 120]),
    hamming_weight=2,
    unobserved_weight=0.03125,
    confidence=0.5,
    dp_trained=True,
)


#: An iALS model (m = 3 items, d = 2) with the uint8 levels of its round's holder counts and their weight
#: w = 0.03: a device ranks by u·v_i + w·level_i / 255 (protocol 1.10).
_LEVELS_MODEL = ModelPayload(
    model_version=6,
    model_kind="ials",
    bits=2,
    n_items=3,
    words=b"",
    values=np.array([[0.5, -0.25], [0.125, 1.0], [-1.5, 0.75]], dtype="<f8").tobytes(),
    item_levels=bytes([255, 0, 161]),
    level_weight=0.03,
)


def _older_body(message: Message, drop: tuple[str, ...]) -> dict[str, Any]:
    """``message``'s encoded body without the wire keys ``drop`` (what an older minor version sends)."""
    import msgpack

    body: dict[str, Any] = msgpack.unpackb(codec.encode(message), raw=False)["b"]
    return {k: v for k, v in body.items() if k not in drop}


def _raw_envelope(version: list[int], type_code: int, body: dict[str, Any]) -> bytes:
    import msgpack

    packed: bytes = msgpack.packb({"v": version, "t": type_code, "b": body}, use_bin_type=True)
    return packed


# --------------------------------------------------------------------------------------------- crypto


def crypto_vectors() -> dict[str, Any]:
    """X25519, session id, HKDF per label, AES-GCM share encryption, mask PRG, Shamir, quantization."""
    a = crypto.key_pair_from_private_bytes(fixed_bytes("x25519 a"))
    b = crypto.key_pair_from_private_bytes(fixed_bytes("x25519 b"))
    shared = crypto.x25519(a.private_key, b.public_key)
    _check(shared == crypto.x25519(b.private_key, a.public_key))
    keys = {
        u: (
            crypto.key_pair_from_private_bytes(fixed_bytes(f"session c {u}")).public_key,
            crypto.key_pair_from_private_bytes(fixed_bytes(f"session s {u}")).public_key,
        )
        for u in (40, 10, 30)
    }
    sid = crypto.session_id(7, keys)
    src, dst = 10, 30
    enc_key = crypto.share_encryption_key(shared, sid, src, dst)
    pair_key = crypto.pair_mask_key(shared, sid, dst, src)  # order-independent: (lo, hi) = (10, 30)
    seed = fixed_bytes("self mask seed")
    self_key = crypto.self_mask_key(seed, sid, src)
    b_share = shamir.Share(2, fixed_field_element("aead b share"))
    s_share = shamir.Share(2, fixed_field_element("aead s share"))
    plaintext = src.to_bytes(8, "big") + dst.to_bytes(8, "big") + b_share.to_bytes() + s_share.to_bytes()
    ad = crypto.share_associated_data(sid, src, dst)
    nonce = fixed_bytes("aead nonce", 12)
    blob = crypto.aead_encrypt(enc_key, plaintext, ad, nonce=nonce)

    secret = fixed_bytes("shamir secret")
    coefficients = [fixed_field_element(f"shamir coefficient {i}") for i in (1, 2)]
    poly = [int.from_bytes(secret, "big"), *coefficients]
    shares = [shamir.Share(x, sum(c * x**i for i, c in enumerate(poly)) % shamir.PRIME) for x in range(1, 6)]
    _check(shamir.reconstruct(shares[2:], 3) == secret)

    x = np.array([0.3, -1.7, 2.25, 0.0, -0.001, 1.0 / 3.0, 5.0, -4.5], dtype=np.float64)
    qcfg = QuantizationConfig(clip_norm=4.0, scale_bits=8)
    q, stats = quantize(x, qcfg, insecure_test_noise_stream(20260101))
    uniforms = insecure_test_noise_stream(20260101).uniform(x.size)
    clipped = x * (qcfg.clip_norm / float(np.linalg.norm(x)))

    def hkdf_entry(label: bytes, ikm: bytes, parties: tuple[int, ...], out: bytes) -> dict[str, Any]:
        info = b"".join(
            (
                len(label).to_bytes(4, "big") + label,
                PROTOCOL_VERSION[0].to_bytes(2, "big") + (0).to_bytes(2, "big"),
                len(sid).to_bytes(4, "big") + sid,
                len(parties).to_bytes(4, "big"),
                *(p.to_bytes(8, "big") for p in parties),
            )
        )
        _check(crypto.hkdf_sha256(ikm, info=info) == out)
        return {
            "label": label.decode(),
            "ikm": ikm.hex(),
            "salt": None,
            "session_id": sid.hex(),
            "parties": list(parties),
            "info": info.hex(),
            "okm": out.hex(),
        }

    prg_key = fixed_bytes("prg key")
    prg = crypto.prg_uint32(prg_key, 16)
    return {
        "description": "Known answers for every cryptographic step of one round.  Integers in *_int fields are "
        "decimal; bytes are hex.",
        "protocol_version": list(PROTOCOL_VERSION),
        "x25519": {
            "a_private": a.private_bytes().hex(),
            "a_public": a.public_key.hex(),
            "b_private": b.private_bytes().hex(),
            "b_public": b.public_key.hex(),
            "shared_secret": shared.hex(),
        },
        "session_id": {
            "round_id": 7,
            "public_keys": {str(u): {"c": c.hex(), "s": s.hex()} for u, (c, s) in sorted(keys.items())},
            "hash_input": _session_preimage(7, keys).hex(),
            "session_id": sid.hex(),
        },
        "hkdf": {
            "raw_rfc5869": {
                "ikm": shared.hex(),
                "salt": None,
                "info": b"fedrec".hex(),
                "length": 32,
                "okm": crypto.hkdf_sha256(shared, info=b"fedrec").hex(),
            },
            "share_encryption": hkdf_entry(crypto.LABEL_SHARE_ENCRYPTION, shared, (src, dst), enc_key),
            "pair_mask": hkdf_entry(crypto.LABEL_PAIR_MASK, shared, (src, dst), pair_key),
            "self_mask": hkdf_entry(crypto.LABEL_SELF_MASK, seed, (src,), self_key),
        },
        "aead_share": {
            "key": enc_key.hex(),
            "src": src,
            "dst": dst,
            "b_share": b_share.to_bytes().hex(),
            "s_share": s_share.to_bytes().hex(),
            "plaintext": plaintext.hex(),
            "associated_data": ad.hex(),
            "nonce": nonce.hex(),
            "blob": blob.hex(),
        },
        "prg": {
            "key": prg_key.hex(),
            "aes_ctr_initial_counter_block": bytes(16).hex(),
            "length": 16,
            "keystream": crypto.prg_uint32(prg_key, 16).astype("<u4").tobytes().hex(),
            "uint32": [int(v) for v in prg],
            "pair_mask_first_8": [int(v) for v in crypto.prg_uint32(pair_key, 8)],
            "self_mask_first_8": [int(v) for v in crypto.prg_uint32(self_key, 8)],
            "keys": {
                "key": 'an arbitrary 32-byte key: SHA-256("fedrec test vector/prg key"); `keystream` and `uint32` '
                "are PRG(key, 16)",
                "pair_mask_first_8": "PRG(s_uv, 8) with s_uv = hkdf.pair_mask.okm, the pairwise mask key of devices "
                '10 and 30: derive(X25519(a_private, b_public), "fedrec/secagg/pair-mask", (10, 30)) under '
                "session_id.session_id",
                "self_mask_first_8": "PRG(k, 8) with k = hkdf.self_mask.okm, device 10's self-mask key: "
                'derive(b_10 = hkdf.self_mask.ikm, "fedrec/secagg/self-mask", (10,)) under session_id.session_id',
            },
        },
        "shamir": {
            "prime": "2**521 - 1",
            "secret": secret.hex(),
            "secret_int": str(poly[0]),
            "t": 3,
            "k": 5,
            "coefficients_int": [str(c) for c in coefficients],
            "shares": [{"index": s.index, "value_int": str(s.value), "bytes": s.to_bytes().hex()} for s in shares],
            "reconstruct_from": [[1, 2, 3], [3, 4, 5], [1, 3, 5]],
        },
        "quantization": {
            "x": x.tolist(),
            "clip_norm": qcfg.clip_norm,
            "scale_bits": qcfg.scale_bits,
            "clipped": clipped.tolist(),
            "was_clipped": stats.clipped,
            "noise_stream_seed": 20260101,
            "noise_stream": "ChaCha20 (RFC 8439 block function, 16-byte initial block counter ‖ nonce all zero) keyed "
            'with SHA-256("fedrec/INSECURE-test-only/noise-stream" ‖ u64be(noise_stream_seed)); uniforms[i] = '
            "(⌊w_i / 2**11⌋ + 1/2) / 2**53 for the i-th little-endian uint64 word w_i of the keystream",
            "noise_stream_key": hashlib.sha256(NOISE_LABEL + (20260101).to_bytes(8, "big")).hexdigest(),
            "uniforms": uniforms.tolist(),
            "q_uint32": [int(v) for v in q],
            "q_int32": [int(v) for v in q.view(np.int32)],
            "dequantized": dequantize_sum(q, qcfg).tolist(),
        },
    }


def _session_preimage(round_id: int, keys: dict[int, tuple[bytes, bytes]]) -> bytes:
    label = b"fedrec/secagg/session"
    parts = [
        len(label).to_bytes(4, "big") + label,
        PROTOCOL_VERSION[0].to_bytes(2, "big") + (0).to_bytes(2, "big"),
        round_id.to_bytes(8, "big"),
        len(keys).to_bytes(4, "big"),
    ]
    for u in sorted(keys):
        c, s = keys[u]
        parts += [u.to_bytes(8, "big"), len(c).to_bytes(4, "big") + c, len(s).to_bytes(4, "big") + s]
    preimage = b"".join(parts)
    _check(hashlib.sha256(preimage).digest() == crypto.session_id(round_id, keys))
    return preimage


# --------------------------------------------------------------------------------------------- full round

ROUND_DEVICES = (10, 20, 30, 40)
ROUND_DROPS = 40  # leaves after sending EncryptedShares: in U2, not in U3
ROUND_INPUTS = {
    10: [1, 2, 3, 4, 5, 6, 7, 8],
    20: [-1, -2, -3, -4, 100, 200, 300, 400],
    30: [1000, 0, -1000, 0, 65536, -65536, 2**20, -(2**20)],
    40: [9, 9, 9, 9, 9, 9, 9, 9],
}


def round_secrets(u: int, neighbours: tuple[int, ...], t: int) -> FixedDeviceSecrets:
    """The fixed secrets of device ``u`` in the round vector."""
    return FixedDeviceSecrets(
        c_private_key=fixed_bytes(f"round device {u} c"),
        s_private_key=fixed_bytes(f"round device {u} s"),
        self_mask_seed=fixed_bytes(f"round device {u} b seed"),
        b_coefficients=tuple(fixed_field_element(f"round device {u} b coefficient {i}") for i in range(1, t)),
        s_coefficients=tuple(fixed_field_element(f"round device {u} s coefficient {i}") for i in range(1, t)),
        share_nonces={v: fixed_bytes(f"round nonce {u}->{v}", 12) for v in neighbours if v != u},
    )


def round_vector() -> dict[str, Any]:
    """A full 4-device round (k=4, t=3, L=8, no DP) in which device 40 drops before its masked input."""
    k, t, length = 4, 3, 8
    deadlines = (100.0, 200.0, 300.0, 400.0)
    params = RoundParameters(
        round_id=7, vector_length=length, k=k, t=t, clip_norm=1.0, scale_bits=16, deadlines=deadlines
    )
    server = ServerSecAggSession(params, ROUND_DEVICES, rng=np.random.default_rng(0))
    secrets_by_device = {u: round_secrets(u, ROUND_DEVICES, t) for u in ROUND_DEVICES}
    devices: dict[int, DeviceSecAggSession] = {}
    log: list[dict[str, Any]] = []

    def record(step: str, direction: str, device: int, message: Message) -> None:
        log.append(
            {
                "step": step,
                "direction": direction,
                "device": device,
                "type": type(message).__name__,
                "hex": codec.encode(message).hex(),
            }
        )

    def deliver(step: str, u: int) -> None:
        message = server.outbox(u)
        if message is None:
            raise RuntimeError(f"no message for device {u} in {step}")
        record(step, "server_to_device", u, message)
        if u not in devices:
            if not isinstance(message, RoundInvite):
                raise RuntimeError(f"device {u} was not invited")
            noise = insecure_test_noise_stream(u)
            devices[u] = DeviceSecAggSession(message, rng=noise, fixed_secrets=secrets_by_device[u])
            devices[u].provide_input(np.array(ROUND_INPUTS[u], dtype=np.int64).astype(np.uint32))
        else:
            devices[u].receive(codec.decode(codec.encode(message)))

    def reply(step: str, u: int) -> None:
        message = devices[u].send()
        record(step, "device_to_server", u, message)
        server.receive(u, codec.decode(codec.encode(message)))

    for step, members in (
        ("advertise_keys", ROUND_DEVICES),
        ("share_keys", ROUND_DEVICES),
        ("masked_input", ROUND_DEVICES),
        ("unmask", tuple(u for u in ROUND_DEVICES if u != ROUND_DROPS)),
    ):
        for u in members:
            deliver(step, u)
        for u in members:
            if step == "masked_input" and u == ROUND_DROPS:
                continue
            reply(step, u)
        if step == "masked_input":
            _check(server.phase is Phase.MASKED_INPUT)
            server.advance(deadlines[2])  # device 40 never answers: the phase closes at its deadline
    _check(server.phase is Phase.DONE)
    result = server.result()
    expected = np.zeros(length, dtype=np.int64)
    for u in result.survivors:
        expected += np.array(ROUND_INPUTS[u], dtype=np.int64)
    _check(np.array_equal(result.total.view(np.int32).astype(np.int64), expected))
    return {
        "description": "A full SecAgg+ round through DeviceSecAggSession/ServerSecAggSession: devices 10, 20, "
        "30, 40; k=4 (everyone is everyone's neighbour), t=3, L=8, no DP.  Device 40 sends its EncryptedShares "
        "and then drops, so it is in U2 but not U3: the survivors release its s-key shares and the server "
        "removes the pairwise masks of 10, 20 and 30 with 40.  The server closes MASKED_INPUT at its deadline "
        "(advance(now=300.0)).  Messages are listed in the order the reference replay produces them.",
        "protocol_version": list(PROTOCOL_VERSION),
        "round_id": 7,
        "device_ids": list(ROUND_DEVICES),
        "graph_k": k,
        "graph_t": t,
        "vector_length": length,
        "deadlines": list(deadlines),
        "dropped_before_masked_input": ROUND_DROPS,
        "device_secrets": {
            str(u): {
                "c_private_key": s.c_private_key.hex(),
                "s_private_key": s.s_private_key.hex(),
                "self_mask_seed": s.self_mask_seed.hex(),
                "b_coefficients_int": [str(c) for c in s.b_coefficients],
                "s_coefficients_int": [str(c) for c in s.s_coefficients],
                "share_nonces": {str(v): n.hex() for v, n in sorted(s.share_nonces.items())},
            }
            for u, s in secrets_by_device.items()
        },
        "inputs_int32": {str(u): v for u, v in ROUND_INPUTS.items()},
        "session_id": server.session_id.hex(),
        "messages": log,
        "survivors": sorted(result.survivors),
        "sum_uint32": [int(v) for v in result.total],
        "sum_int32": [int(v) for v in result.total.view(np.int32)],
    }


# --------------------------------------------------------------------------------------------- identity


def _revocation_list_bytes() -> bytes:
    """identity.json's revocation list (#3 of the identity authority, naming the identity device and one
    other key); messages.json's RevocationListPayload carries the same bytes."""
    authority = SigningKey.from_private_bytes(fixed_bytes("identity/authority"))
    device = SigningKey.from_private_bytes(fixed_bytes("identity/device"))
    revoked = sorted([device.public_key, fixed_bytes("identity/revoked")])
    return issue_revocation_list(authority, 3, 1_790_086_400, revoked)


def identity_vectors() -> dict[str, Any]:
    """Protocol 1.3/1.4 identities: an enrollment certificate (formats 1 and 2), a revocation list, the
    registration proof, a signed key advertisement and a survivor-set signature (Ed25519 is deterministic:
    fixed keys give fixed bytes)."""
    from protocol.enrollment import batch_id

    authority = SigningKey.from_private_bytes(fixed_bytes("identity/authority"))
    device = SigningKey.from_private_bytes(fixed_bytes("identity/device"))
    batch = batch_id("batch-a")
    tail = fixed_bytes("identity/serial", BATCH_BYTES)
    certificate = issue_certificate(authority, device.public_key, batch=batch, serial=tail)
    _check(verify_certificate(certificate, authority.public_key) == device.public_key)
    _check(certificate_batch(certificate) == batch)
    registration = registration_payload(certificate)
    proof = device.sign(registration)
    c_key = crypto.key_pair_from_private_bytes(fixed_bytes("identity/c")).public_key
    s_key = crypto.key_pair_from_private_bytes(fixed_bytes("identity/s")).public_key
    advert = key_advertisement_payload(7, 42, c_key, s_key)
    session = fixed_bytes("identity/session")
    survivors = [3, 42, 99]
    survivor_payload = survivor_set_payload(7, session, survivors)
    register = RegisterRequest(platform="vector", certificate=certificate, proof=proof)
    keys = PublicKeys(
        round_id=7,
        device_id=42,
        c_public_key=c_key,
        s_public_key=s_key,
        certificate=certificate,
        signature=device.sign(advert),
    )
    signature = ConsistencySignature(
        round_id=7, device_id=42, session_id=session, signature=device.sign(survivor_payload)
    )
    for sig, data in ((proof, registration), (keys.signature, advert), (signature.signature, survivor_payload)):
        verify_signature(device.public_key, sig, data)
    # certificate format 2 (a validity period) and the authority's revocation list
    not_before, not_after = 1_790_000_000, 1_790_000_000 + 365 * 86400
    certificate_v2 = issue_certificate(
        authority, device.public_key, batch=batch, serial=tail, not_before=not_before, not_after=not_after
    )
    _check(verify_certificate(certificate_v2, authority.public_key, now=not_before) == device.public_key)
    revoked = sorted([device.public_key, fixed_bytes("identity/revoked")])
    crl = _revocation_list_bytes()
    _check(verify_revocation_list(crl, authority.public_key).device_keys == frozenset(revoked))
    return {
        "description": "Ed25519 identities (RFC 8032, raw 32-byte keys, 64-byte signatures); keys are "
        "SHA-256('fedrec test vector/' + label) used as Ed25519 seeds",
        "authority_seed_label": "identity/authority",
        "authority_public_key": authority.public_key.hex(),
        "device_seed_label": "identity/device",
        "device_public_key": device.public_key.hex(),
        "batch_name": "batch-a",
        "batch_id": batch.hex(),
        "serial_tail": tail.hex(),
        "certificate": certificate.hex(),
        "certificate_v2": {
            "not_before": not_before,
            "not_after": not_after,
            "hex": certificate_v2.hex(),
        },
        "certificate_v3": {  # protocol 1.8: format 2 plus the device id it was issued for
            "not_before": not_before,
            "not_after": not_after,
            "device_id": 42,
            "hex": issue_certificate(
                authority,
                device.public_key,
                batch=batch,
                serial=tail,
                not_before=not_before,
                not_after=not_after,
                device_id=42,
            ).hex(),
        },
        "revocation_list": {
            "number": 3,
            "issued_at": 1_790_086_400,
            "device_keys": [k.hex() for k in revoked],
            "hex": crl.hex(),
        },
        "registration_payload": registration.hex(),
        "registration_proof": proof.hex(),
        "key_advertisement": {
            "round_id": 7,
            "device_id": 42,
            "c_public_key": c_key.hex(),
            "s_public_key": s_key.hex(),
            "payload": advert.hex(),
            "signature": keys.signature.hex(),
        },
        "survivor_set": {
            "round_id": 7,
            "session_id": session.hex(),
            "survivors": survivors,
            "payload": survivor_payload.hex(),
            "signature": signature.signature.hex(),
        },
        "roster": _roster_vector(device, c_key, s_key, session, survivors),
        "messages": {
            "RegisterRequest": describe(register),
            "PublicKeys": describe(keys),
            "ConsistencySignature": describe(signature),
        },
    }


def _roster_vector(
    device: SigningKey, c_key: bytes, s_key: bytes, session: bytes, survivors: list[int]
) -> dict[str, Any]:
    """Protocol 1.8: a roster (ids 3, 42, 99; 42 is the vector's device), its digest, and the key
    advertisement and survivor-set payloads that bind (n, digest)."""
    ids = [3, 42, 99]
    keys = [
        device.public_key if v == 42 else SigningKey.from_private_bytes(fixed_bytes(f"identity/roster {v}")).public_key
        for v in ids
    ]
    digest = roster_digest(ids, keys)
    cohort = (len(ids), digest)
    advert = key_advertisement_payload(7, 42, c_key, s_key, cohort)
    survivor_payload = survivor_set_payload(7, session, survivors, cohort)
    for data in (advert, survivor_payload):
        verify_signature(device.public_key, device.sign(data), data)
    return {
        "description": "protocol 1.8: the signed round's roster; the payloads append u64be(n) ‖ u32be(32) ‖ digest",
        "ids": ids,
        "identity_keys": [k.hex() for k in keys],
        "digest": digest.hex(),
        "key_advertisement_payload": advert.hex(),
        "key_advertisement_signature": device.sign(advert).hex(),
        "survivor_set_payload": survivor_payload.hex(),
        "survivor_set_signature": device.sign(survivor_payload).hex(),
    }


def _write(out: Path, name: str, data: dict[str, Any]) -> None:
    text = json.dumps(data, indent=1, ensure_ascii=False) + "\n"
    (out / name).write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    """Write messages.json, crypto.json, round.json and identity.json (next to this script, or into ``--out DIR``)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT, help="output folder (default: next to this script)")
    out: Path = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    _write(out, "messages.json", message_vectors())
    _write(out, "crypto.json", crypto_vectors())
    _write(out, "round.json", round_vector())
    _write(out, "identity.json", identity_vectors())


if __name__ == "__main__":
    main()
