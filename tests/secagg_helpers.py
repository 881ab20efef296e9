"""Shared builders for the protocol tests: sample messages and a small in-memory round driver."""

from __future__ import annotations

import numpy as np

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
    RoundInvite,
    RoundResult,
    ShareKeysBroadcast,
    UnmaskRequest,
    UnmaskResponse,
    Wait,
)
from protocol.samplers import insecure_test_noise_stream
from protocol.session import DeviceSecAggSession, Phase, RoundParameters, ServerSecAggSession

SID = b"\x11" * 32


def sample_messages(round_id: int = 1, device_id: int = 0) -> list[Message]:
    """One valid instance of every message type."""
    r, d = round_id, device_id
    return [
        RoundInvite(
            round_id=r,
            device_id=d,
            vector_length=4,
            graph_k=3,
            graph_t=2,
            clip_norm=1.0,
            scale_bits=8,
            advertise_deadline=1.0,
            share_keys_deadline=2.0,
            masked_input_deadline=3.0,
            unmask_deadline=4.0,
        ),
        PublicKeys(round_id=r, device_id=d, c_public_key=b"\x01" * 32, s_public_key=b"\x02" * 32),
        ShareKeysBroadcast(
            round_id=r,
            device_id=d,
            session_id=SID,
            neighbour_ids=(d,),
            c_public_keys=(b"\x01" * 32,),
            s_public_keys=(b"\x02" * 32,),
        ),
        EncryptedShares(round_id=r, device_id=d, session_id=SID, recipient_ids=(5,), ciphertexts=(b"x" * 40,)),
        MaskedInputRequest(round_id=r, device_id=d, session_id=SID, sender_ids=(5,), ciphertexts=(b"x" * 40,)),
        MaskedInput(round_id=r, device_id=d, session_id=SID, masked=np.arange(4, dtype=np.uint32)),
        UnmaskRequest(round_id=r, device_id=d, session_id=SID, survivors=(d,), dropped=(), n_survivors=1),
        UnmaskResponse(
            round_id=r,
            device_id=d,
            session_id=SID,
            b_share_ids=(),
            b_shares=(),
            s_share_ids=(),
            s_shares=(),
            dp_excess=np.zeros(0, dtype=np.uint32),
        ),
        Abort(round_id=r, device_id=d, reason="test"),
        ErrorMessage(code="decode_error", message="bad"),
        RegisterRequest(platform="pytest"),
        RegisterResponse(device_id=d, token="t" * 32),
        CheckIn(device_id=d, model_version=3),
        Wait(retry_after=2.5, reason="no round open"),
        ModelPayload(model_version=3, bits=70, n_items=2, words=bytes(32)),
        RoundResult(round_id=r, committed=True, model_version=4),
    ]


class Round:
    """A server and n devices shuttling messages in memory (h11's ConnectionPair idea)."""

    def __init__(
        self,
        n: int = 5,
        k: int | None = None,
        t: int = 3,
        length: int = 8,
        dp_mu: float = 0.0,
        dp_t_min: int = 0,
        seed: int = 0,
    ) -> None:
        self.params = RoundParameters(
            round_id=7,
            vector_length=length,
            k=k or n,
            t=t,
            clip_norm=1.0,
            scale_bits=16,
            dp_mu=dp_mu,
            dp_t_min=dp_t_min,
            deadlines=(1.0, 2.0, 3.0, 4.0),
        )
        self.ids = list(range(10, 10 + n))
        self.server = ServerSecAggSession(self.params, self.ids, rng=np.random.default_rng(seed))
        self.devices = {
            u: DeviceSecAggSession(self.server.outbox(u), rng=insecure_test_noise_stream(seed, u)) for u in self.ids
        }  # type: ignore[arg-type]
        rng = np.random.default_rng(seed + 1)
        self.inputs = {u: rng.integers(0, 2**32, size=length, dtype=np.uint32) for u in self.ids}

    def step(self, phase: Phase, skip: set[int] | frozenset[int] = frozenset(), deliver: bool = True) -> None:
        """Run one phase: deliver the server's message (unless ADVERTISE_KEYS), send replies, close it."""
        for u in self.ids:
            dev = self.devices[u]
            if dev.phase in (Phase.ERROR, Phase.ABORTED, Phase.DONE):
                continue
            if phase is not Phase.ADVERTISE_KEYS and deliver:
                dev.receive(self.server.outbox(u))  # type: ignore[arg-type]
            if u in skip:
                continue
            if phase is Phase.MASKED_INPUT:
                dev.provide_input(self.inputs[u])
            self.server.receive(u, dev.send())
        if self.server.phase is phase:
            self.server.advance(self.params.deadlines[list(Phase).index(phase)])

    def to_unmask(self, drop_masked: set[int] | frozenset[int] = frozenset()) -> None:
        """Run up to the start of UNMASK (devices have not yet received their UnmaskRequest)."""
        self.step(Phase.ADVERTISE_KEYS)
        self.step(Phase.SHARE_KEYS)
        self.step(Phase.MASKED_INPUT, skip=drop_masked)
