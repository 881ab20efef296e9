"""Known-answer and property tests for `protocol.crypto` (and `protocol.identity`'s memo of verified
signatures), all through the modules' wrappers."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.crypto import (
    MaskPrg,
    aead_decrypt,
    aead_encrypt,
    derive_key,
    generate_key_pair,
    hkdf_sha256,
    key_pair_from_private_bytes,
    pair_mask_key,
    prg_uint32,
    self_mask_key,
    session_id,
    share_associated_data,
    share_encryption_key,
    x25519,
)
from protocol.errors import CryptoError

H = bytes.fromhex


# RFC 7748 §5.2: (scalar, u-coordinate, output)
@pytest.mark.parametrize(
    ("scalar", "u", "out"),
    [
        (
            "a546e36bf0527c9d3b16154b82465edd62144c0ac1fc5a18506a2244ba449ac4",
            "e6db6867583030db3594c1a424b15f7c726624ec26b3353b10a903a6d0ab1c4c",
            "c3da55379de9c6908e94ea4df28d084f32eccf03491c71f754b4075577a28552",
        ),
        (
            "4b66e9d4d1b4673c5ad22691957d6af5c11b6421e0ea01d42ca4169e7918ba0d",
            "e5210f12786811d3f4b7959d0538ae2c31dbe7106fc03c3efc4cd549c715a493",
            "95cbde9476e8907d7aade45cb4b873f88b595a68799fa152e6f8f7647aac7957",
        ),
    ],
)
def test_x25519_rfc7748_section_5_2(scalar: str, u: str, out: str) -> None:
    assert x25519(H(scalar), H(u)) == H(out)


def test_x25519_rfc7748_section_6_1() -> None:
    alice = key_pair_from_private_bytes(H("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a"))
    bob = key_pair_from_private_bytes(H("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb"))
    assert alice.public_key == H("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
    assert bob.public_key == H("de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f")
    shared = H("4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742")
    assert x25519(alice.private_key, bob.public_key) == shared
    assert x25519(bob.private_bytes(), alice.public_key) == shared


def _seq(lo: int, hi: int) -> bytes:
    return bytes(range(lo, hi + 1))


# RFC 5869 appendix A.1–A.3 (SHA-256): (ikm, salt, info, length, okm)
@pytest.mark.parametrize(
    ("ikm", "salt", "info", "length", "okm"),
    [
        (
            b"\x0b" * 22,
            _seq(0x00, 0x0C),
            _seq(0xF0, 0xF9),
            42,
            "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865",
        ),
        (
            _seq(0x00, 0x4F),
            _seq(0x60, 0xAF),
            _seq(0xB0, 0xFF),
            82,
            "b11e398dc80327a1c8e7f78c596a49344f012eda2d4efad8a050cc4c19afa97c"
            "59045a99cac7827271cb41c65e590e09da3275600c2f09b8367793a9aca3db71"
            "cc30c58179ec3e87c14c01d5c1f3434f1d87",
        ),
        (
            b"\x0b" * 22,
            b"",
            b"",
            42,
            "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8",
        ),
    ],
    ids=["A.1", "A.2", "A.3"],
)
def test_hkdf_rfc5869(ikm: bytes, salt: bytes, info: bytes, length: int, okm: str) -> None:
    assert hkdf_sha256(ikm, salt=salt, info=info, length=length) == H(okm)


_GCM_KEY = H("feffe9928665731c6d6a8f9467308308feffe9928665731c6d6a8f9467308308")
_GCM_IV = H("cafebabefacedbaddecaf888")
_GCM_P = H(
    "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a72"
    "1c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b391aafd255"
)
_GCM_C = H(
    "522dc1f099567d07f47f37a32a84427d643a8cdcbfe5c0c97598a2bd2555d1aa"
    "8cb08e48590dbb3da7b08b1056828838c5f61e6393ba7a0abcc9f662898015ad"
)


# McGrew–Viega GCM specification, AES-256 test cases 14, 15 and 16: (key, iv, p, aad, c, tag)
@pytest.mark.parametrize(
    ("key", "iv", "plaintext", "aad", "ciphertext", "tag"),
    [
        (
            bytes(32),
            bytes(12),
            bytes(16),
            b"",
            H("cea7403d4d606b6e074ec5d3baf39d18"),
            H("d0d1c8a799996bf0265b98b5d48ab919"),
        ),
        (_GCM_KEY, _GCM_IV, _GCM_P, b"", _GCM_C, H("b094dac5d93471bdec1a502270e3cc6c")),
        (
            _GCM_KEY,
            _GCM_IV,
            _GCM_P[:60],
            H("feedfacedeadbeeffeedfacedeadbeefabaddad2"),
            _GCM_C[:60],
            H("76fc6ece0f4e1768cddf8853bb2d551b"),
        ),
    ],
    ids=["tc14", "tc15", "tc16"],
)
def test_aes_gcm_known_answers(
    key: bytes, iv: bytes, plaintext: bytes, aad: bytes, ciphertext: bytes, tag: bytes
) -> None:
    blob = aead_encrypt(key, plaintext, aad, nonce=iv)
    assert blob == iv + ciphertext + tag
    assert aead_decrypt(key, blob, aad) == plaintext


def test_aead_rejects_tampering_and_wrong_context() -> None:
    key = bytes(range(32))
    ad = share_associated_data(b"s" * 32, 1, 2)
    blob = aead_encrypt(key, b"secret shares", ad)
    assert blob[:12] != aead_encrypt(key, b"secret shares", ad)[:12]  # fresh random nonce each time
    for bad in (
        blob[:-1] + bytes([blob[-1] ^ 1]),
        blob[:12] + bytes([blob[12] ^ 0x80]) + blob[13:],
        blob[:20],
    ):
        with pytest.raises(CryptoError):
            aead_decrypt(key, bad, ad)
    with pytest.raises(CryptoError):
        aead_decrypt(key, blob, share_associated_data(b"s" * 32, 2, 1))
    with pytest.raises(CryptoError):
        aead_decrypt(bytes(32), blob, ad)
    with pytest.raises(CryptoError):
        aead_encrypt(b"short", b"x", ad)


def test_bad_key_bytes_raise_crypto_error() -> None:
    with pytest.raises(CryptoError):
        key_pair_from_private_bytes(b"\x01" * 31)
    with pytest.raises(CryptoError):
        x25519(generate_key_pair().private_key, b"\x01" * 31)
    with pytest.raises(CryptoError):  # u = 0 is a low-order point: all-zero shared secret
        x25519(generate_key_pair().private_key, bytes(32))


def test_key_agreement_is_symmetric_and_keys_are_fresh() -> None:
    a, b = generate_key_pair(), generate_key_pair()
    assert a.public_key != b.public_key
    assert x25519(a.private_key, b.public_key) == x25519(b.private_key, a.public_key)
    assert key_pair_from_private_bytes(a.private_bytes()).public_key == a.public_key


def test_derived_keys_are_bound_to_purpose_session_and_parties() -> None:
    secret, s1, s2 = b"k" * 32, b"1" * 32, b"2" * 32
    keys = {
        pair_mask_key(secret, s1, 3, 7),
        pair_mask_key(secret, s2, 3, 7),
        pair_mask_key(secret, s1, 3, 8),
        share_encryption_key(secret, s1, 3, 7),
        share_encryption_key(secret, s1, 7, 3),
        self_mask_key(secret, s1, 3),
        derive_key(secret, label=b"other", session=s1, parties=(3, 7)),
    }
    assert len(keys) == 7
    assert pair_mask_key(secret, s1, 3, 7) == pair_mask_key(secret, s1, 7, 3)


def test_session_id_depends_on_round_and_every_key_but_not_order() -> None:
    keys = {5: (b"a" * 32, b"b" * 32), 2: (b"c" * 32, b"d" * 32)}
    sid = session_id(1, keys)
    assert len(sid) == 32
    assert sid == session_id(1, dict(reversed(list(keys.items()))))
    assert sid != session_id(2, keys)
    assert sid != session_id(1, {5: keys[5], 2: (b"c" * 32, b"e" * 32)})
    assert sid != session_id(1, {5: keys[5], 3: keys[2]})


def test_prg_is_deterministic_uniform_and_matches_scratch_expander() -> None:
    key = bytes(range(32))
    m = prg_uint32(key, 100_000)
    assert m.dtype == np.uint32 and m.shape == (100_000,)
    assert np.array_equal(m, prg_uint32(key, 100_000))
    assert np.array_equal(m[:10], prg_uint32(key, 10))
    assert not np.array_equal(m, prg_uint32(bytes(32), 100_000))
    # Uniform on [0, 2**32): mean of u/2**32 near 1/2, top bit set about half the time.
    assert abs(float(m.astype(np.float64).mean()) / 2**32 - 0.5) < 0.01
    assert abs(float((m >> 31).mean()) - 0.5) < 0.01
    expander = MaskPrg(100_000)
    assert np.array_equal(expander.expand(key), m)
    assert np.array_equal(expander.expand(bytes(32)), prg_uint32(bytes(32), 100_000))
    with pytest.raises(CryptoError):
        prg_uint32(b"short", 4)


def test_a_remembered_verification_answers_only_for_the_exact_same_bytes() -> None:
    from protocol.identity import SigningKey, verify_signature

    key = SigningKey.generate()
    data = b"survivor set" * 100
    sig = key.sign(data)
    verify_signature(key.public_key, sig, data)
    verify_signature(key.public_key, sig, data)  # remembered: the same answer
    other = SigningKey.generate()
    flipped = bytes([sig[0] ^ 1]) + sig[1:]
    for pk, s, d in (
        (key.public_key, sig, data + b"!"),
        (key.public_key, flipped, data),
        (other.public_key, sig, data),
    ):
        with pytest.raises(CryptoError):
            verify_signature(pk, s, d)
        with pytest.raises(CryptoError):  # a failure is never remembered as a success either way
            verify_signature(pk, s, d)
