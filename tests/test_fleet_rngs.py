"""The generators a seeded fleet gives its devices: training always from the seed; the noise stream from the
seed only in rounds without DP noise (it then holds nothing but the stochastic-rounding coins)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from device_sdk.transport import Response
from fedsim.fleets.local import FleetConfig, _new_device
from protocol.messages import Message, RoundInvite


class _Inviting:
    """A transport whose check-in answers with a given invitation."""

    def __init__(self, invite: RoundInvite) -> None:
        self.invite = invite

    async def request(self, method: str, path: str, message: Message | None = None, **_: Any) -> Response:
        return Response(status=200, message=self.invite)

    async def close(self) -> None:
        return None


def _invite(round_id: int, dp_mu: float) -> RoundInvite:
    return RoundInvite(
        round_id=round_id,
        device_id=0,
        vector_length=4,
        graph_k=3,
        graph_t=2,
        clip_norm=1.0,
        scale_bits=8,
        advertise_deadline=1.0,
        share_keys_deadline=2.0,
        masked_input_deadline=3.0,
        unmask_deadline=4.0,
        dp_mu=dp_mu,
        dp_t_min=2 if dp_mu else 0,
    )


def _round_words(tmp_path: Path, invite: RoundInvite, run: int) -> tuple[np.ndarray, np.ndarray]:
    """Check in once (the invitation passes the fleet's transport), then draw the round's generators."""
    config = FleetConfig(
        url="http://127.0.0.1:1", store_root=tmp_path / f"run-{run}", n_items=8, seed=5, seed_training=True
    )
    items = np.array([1, 2], dtype=np.int64)
    client, transport = _new_device(config, 0, items, None, _Inviting(invite), None, {})
    asyncio.run(transport.request("POST", "/v1/checkin"))
    training, noise = client._rng_for_round(invite.round_id)
    return training.integers(0, 2**62, size=4), noise.uint64(4)


@pytest.mark.parametrize("dp_mu", [0.0, 3.0])
def test_training_is_seeded_and_the_noise_stream_only_without_dp(tmp_path: Path, dp_mu: float) -> None:
    first = _round_words(tmp_path, _invite(2, dp_mu), 0)
    second = _round_words(tmp_path, _invite(2, dp_mu), 1)
    assert np.array_equal(first[0], second[0])  # training: from the seed in every round
    # Rounding coins of a round without DP: from the seed; a DP round's noise: keyed from the OS each time.
    assert np.array_equal(first[1], second[1]) == (dp_mu == 0.0)


def test_an_invitation_of_another_round_leaves_the_noise_stream_to_the_os(tmp_path: Path) -> None:
    first = _round_words(tmp_path, _invite(2, 0.0), 0)
    config = FleetConfig(url="http://127.0.0.1:1", store_root=tmp_path / "other", n_items=8, seed=5, seed_training=True)
    client, transport = _new_device(
        config, 0, np.array([1], dtype=np.int64), None, _Inviting(_invite(2, 0.0)), None, {}
    )
    asyncio.run(transport.request("POST", "/v1/checkin"))
    _, noise = client._rng_for_round(3)  # not the round the device was invited to
    assert not np.array_equal(noise.uint64(4), first[1])
