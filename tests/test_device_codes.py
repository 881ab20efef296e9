from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_sdk.codes import (
    all_signs,
    from_bitarray,
    from_bytes,
    pack_signs,
    pack_user,
    random_signs,
    to_bitarray,
    to_bytes,
    unpack_signs,
    words_for,
)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(0, 40), f=st.integers(1, 200), seed=st.integers(0, 2**32 - 1))
def test_pack_roundtrips(m: int, f: int, seed: int) -> None:
    signs = random_signs(m, f, np.random.default_rng(seed))
    words = pack_signs(signs)
    assert words.shape == (words_for(f), m) and words.dtype == np.uint64
    assert np.array_equal(unpack_signs(words, f), signs)
    assert np.array_equal(from_bitarray(to_bitarray(signs), f), signs)
    assert np.array_equal(from_bytes(to_bytes(words), f, m), words)
    assert len(to_bytes(words)) == 8 * words_for(f) * m


def test_bit_layout_is_plus_one_as_one_little_endian() -> None:
    code = -np.ones(70, dtype=np.int8)
    code[[0, 3, 64, 69]] = 1
    words = pack_user(code)
    assert words.tolist() == [0b1001, (1 << 0) | (1 << 5)]
    ba = to_bitarray(code[None, :])
    assert ba.to01()[:5] == "10010" and ba.count() == 4


def test_packed_hamming_matches_sign_disagreements() -> None:
    rng = np.random.default_rng(3)
    a, b = random_signs(2, 130, rng)
    wa, wb = pack_user(a), pack_user(b)
    assert int(np.bitwise_count(wa ^ wb).sum()) == int(np.sum(a != b))


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="-1 and \\+1"):
        pack_signs(np.array([[1, 0]]))
    with pytest.raises(ValueError, match="2-D"):
        pack_signs(np.array([1, -1]))
    with pytest.raises(ValueError, match="expected 16 bytes"):
        from_bytes(b"\x00" * 8, 64, 2)
    with pytest.raises(ValueError, match="padding"):
        from_bytes((1 << 10).to_bytes(8, "little"), 8, 1)
    with pytest.raises(ValueError, match="positive"):
        words_for(0)


@pytest.mark.parametrize(
    "values",
    [
        np.array([[1, -1], [-1, 1]], np.int8),
        np.array([[1, -128]], np.int8),  # |-128| wraps to -128 in int8: not a sign
        np.array([[1, 0, -1]], np.int64),
        np.array([[2**40 + 1, 1]], np.int64),
        np.array([[1, 255]], np.uint8),
        np.array([[1, 1]], np.uint16),
        np.array([[True, True]]),
        np.array([[True, False]]),
        np.array([[1.0, -1.0]]),
        np.array([[1.0, -1.0000001]]),
        np.array([[1.0, np.nan]]),
        np.array([[-np.inf, 1.0]]),
        np.array([[1 + 0j, -1 + 0j]]),
        np.array([[1j, 1]]),  # |1j| == 1, but it is not a sign: complex goes through np.isin
        np.zeros((0, 64), np.int8),
        np.ones((3, 0), np.int8),
        np.array([1, -1, 1], np.int8),
        np.ones((2, 3, 4), np.int8),
        np.array([[1, -1, 1, 3]], np.int8)[:, ::2],  # strided
        np.array([[1, -1, 1, 3]], np.int8)[:, 1::2],
    ],
)
def test_all_signs_answers_as_isin_does(values: np.ndarray) -> None:
    assert all_signs(values) is bool(np.isin(values, (-1, 1)).all())


def test_all_signs_over_many_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import protocol.codes as codes

    monkeypatch.setattr(codes, "_CHECK_CHUNK", 64)  # 5 rows a chunk of 13 columns
    signs = random_signs(101, 13, np.random.default_rng(0))
    assert all_signs(signs)
    for row in (0, 4, 5, 99, 100):  # first and last row of a chunk, and the last row of all
        bad = signs.copy()
        bad[row, 12] = 0
        assert not all_signs(bad)
        assert not all_signs(np.asfortranarray(bad))
