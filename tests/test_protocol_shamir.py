"""Tests for `protocol.shamir`: round trips, thresholds, duplicates, tampering, encoding, the field."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import CryptoError, NotEnoughParticipants
from protocol.shamir import PRIME, SHARE_BYTES, Share, lagrange_at_zero, reconstruct, split


def _is_probable_prime(n: int, rounds: int = 40) -> bool:
    # Miller–Rabin with fixed small bases plus seeded random ones (deterministic test).
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    if n in small:
        return True
    if any(n % p == 0 for p in small):
        return False
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    rng = random.Random(1234)
    bases = list(small) + [rng.randrange(2, n - 1) for _ in range(rounds)]
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def test_field_is_a_prime_above_2_256() -> None:
    assert PRIME > 2**256
    assert _is_probable_prime(PRIME)
    assert not _is_probable_prime(PRIME - 2)  # sanity: the test can say no


@settings(max_examples=40, deadline=None)
@given(secret=st.binary(min_size=32, max_size=32), k=st.integers(1, 30), data=st.data())
def test_any_t_shares_reconstruct(secret: bytes, k: int, data: st.DataObject) -> None:
    t = data.draw(st.integers(1, k))
    shares = split(secret, t, k)
    assert [s.index for s in shares] == list(range(1, k + 1))
    subset = data.draw(st.permutations(shares)).copy()[: data.draw(st.integers(t, k))]
    assert reconstruct(subset, t) == secret


def test_every_subset_of_size_t_works_small() -> None:
    secret = bytes(range(32))
    shares = split(secret, 3, 6)
    for subset in itertools.combinations(shares, 3):
        assert reconstruct(list(subset), 3) == secret


def test_fewer_than_t_raises_never_returns_garbage() -> None:
    shares = split(b"\x07" * 32, 4, 7)
    for m in range(4):
        with pytest.raises(NotEnoughParticipants):
            reconstruct(shares[:m], 4)


def test_duplicate_indices_raise() -> None:
    shares = split(b"\x07" * 32, 3, 5)
    with pytest.raises(CryptoError, match="duplicate"):
        reconstruct([shares[0], shares[0], shares[1]], 3)
    with pytest.raises(CryptoError, match="duplicate"):
        reconstruct([shares[0], Share(shares[0].index, 5), shares[1]], 2)


def test_wrong_shares_are_detected() -> None:
    # A share from another secret (or a random one) interpolates to a uniform field element, which is
    # not a 32-byte value except with probability 2**-265.
    shares = split(b"\xff" * 32, 3, 5)
    other = split(b"\x01" * 32, 3, 5)
    with pytest.raises(CryptoError, match="inconsistent"):
        reconstruct([shares[0], other[1], shares[2]], 3)
    with pytest.raises(CryptoError, match="inconsistent"):
        reconstruct([shares[0], Share(2, random.Random(5).randrange(PRIME)), shares[2]], 3)


def test_share_encoding_is_fixed_length_and_validated() -> None:
    for share in split(b"\x00" * 32, 2, 3):
        raw = share.to_bytes()
        assert len(raw) == SHARE_BYTES
        assert Share.from_bytes(raw) == share
    with pytest.raises(CryptoError):
        Share.from_bytes(b"\x00" * (SHARE_BYTES - 1))
    with pytest.raises(CryptoError):  # index 0 would be the secret itself
        Share.from_bytes(b"\x00\x00" + b"\x01" * (SHARE_BYTES - 2))
    with pytest.raises(CryptoError):  # value >= p
        Share.from_bytes(b"\x00\x01" + b"\xff" * (SHARE_BYTES - 2))


def test_lagrange_coefficients_are_cached_per_index_set() -> None:
    lagrange_at_zero.cache_clear()
    secret = b"\x42" * 32
    for _ in range(5):
        assert reconstruct(split(secret, 3, 5)[1:4], 3) == secret
    info = lagrange_at_zero.cache_info()
    assert info.misses == 1 and info.hits == 4
    # Coefficients at 0 sum to 1 (they interpolate the constant polynomial).
    assert sum(lagrange_at_zero((2, 5, 9))) % PRIME == 1


@pytest.mark.parametrize(("t", "k"), [(0, 3), (4, 3), (1, 70000)])
def test_bad_parameters(t: int, k: int) -> None:
    with pytest.raises(ValueError):
        split(b"\x00" * 32, t, k)


def test_bad_secret_length() -> None:
    with pytest.raises(ValueError):
        split(b"\x00" * 31, 1, 2)
