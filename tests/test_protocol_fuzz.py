"""Fuzzing the decoder: random, truncated and bit-flipped encodings raise only DecodeError.

(A flip inside the version field can legitimately yield `VersionMismatch`, and a flip inside array
payload bytes can yield a different valid message; both are allowed.  Anything else is a bug.)
"""

from __future__ import annotations

import random

import numpy as np

from protocol.codec import decode, encode
from protocol.errors import DecodeError, VersionMismatch
from protocol.messages import MaskedInput, UnmaskResponse

from .secagg_helpers import sample_messages

ROUNDS = 21_000


def _corpus() -> list[bytes]:
    extra = [
        MaskedInput(round_id=3, device_id=9, session_id=b"q" * 32, masked=np.arange(40, dtype=np.uint32)),
        UnmaskResponse(
            round_id=3,
            device_id=9,
            session_id=b"q" * 32,
            b_share_ids=(1, 2),
            b_shares=(b"a" * 68, b"b" * 68),
            s_share_ids=(5,),
            s_shares=(b"c" * 68,),
            dp_excess=np.arange(6, dtype=np.uint32),
        ),
    ]
    return [encode(m) for m in [*sample_messages(), *extra]]


def _check(raw: bytes) -> str:
    try:
        decode(raw)
    except DecodeError:
        return "decode_error"
    except VersionMismatch:
        return "version"
    return "ok"


def test_random_truncated_and_bit_flipped_inputs_raise_only_decode_error() -> None:
    rng = random.Random(20240)
    corpus = _corpus()
    outcomes: dict[str, int] = {}
    for i in range(ROUNDS):
        base = corpus[i % len(corpus)]
        mode = i % 4
        if mode == 0:  # random bytes, sometimes starting like a msgpack map
            raw = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64)))
            if rng.random() < 0.5:
                raw = b"\x83" + raw
        elif mode == 1:  # truncation
            raw = base[: rng.randrange(0, len(base))]
        elif mode == 2:  # one to three bit flips
            buf = bytearray(base)
            for _ in range(rng.randrange(1, 4)):
                pos = rng.randrange(len(buf))
                buf[pos] ^= 1 << rng.randrange(8)
            raw = bytes(buf)
        else:  # splice: a prefix of one message and a suffix of another
            other = corpus[rng.randrange(len(corpus))]
            raw = base[: rng.randrange(len(base) + 1)] + other[rng.randrange(len(other) + 1) :]
        outcome = _check(raw)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert sum(outcomes.values()) == ROUNDS
    assert outcomes["decode_error"] > ROUNDS // 2
