"""The server-side parameters of one SecAgg+ round, and the `RoundInvite` each invited device receives.

A value with no session state: the coordinator and the simulator build it, `protocol.server_session`'s
`ServerSecAggSession` takes it.  Import it from `protocol.session`, the public home of the session API.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import RoundInvite

__all__ = ["RoundParameters"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundParameters:
    """Server-side parameters of one round (what every `RoundInvite` carries).

    Attributes
    ----------
    round_id, vector_length, k, t, clip_norm, scale_bits, dp_mu, dp_t_min, dp_colluders
        As in `RoundInvite` (k = graph_k, t = graph_t).
    deadlines : tuple of 4 floats
        Absolute deadlines of ADVERTISE_KEYS, SHARE_KEYS, MASKED_INPUT and UNMASK.
    """

    round_id: int
    vector_length: int
    k: int
    t: int
    clip_norm: float
    scale_bits: int
    dp_mu: float = 0.0
    dp_t_min: int = 0
    dp_colluders: int = 0
    deadlines: tuple[float, float, float, float]
    #: Protocol 1.3: the enrollment authority's public key; when set, every key advertisement must carry a
    #: certificate of it and a valid signature, and UNMASK starts with the consistency check.
    authority_key: bytes = b""

    def invite(self, device_id: int) -> RoundInvite:
        """The invite for one device.

        Raises
        ------
        ValueError
            The parameters do not make a valid invite.
        """
        d0, d1, d2, d3 = self.deadlines
        return RoundInvite(
            round_id=self.round_id,
            device_id=device_id,
            vector_length=self.vector_length,
            graph_k=self.k,
            graph_t=self.t,
            clip_norm=float(self.clip_norm),
            scale_bits=self.scale_bits,
            dp_mu=float(self.dp_mu),
            dp_t_min=self.dp_t_min,
            dp_colluders=self.dp_colluders,
            advertise_deadline=d0,
            share_keys_deadline=d1,
            masked_input_deadline=d2,
            unmask_deadline=d3,
        )
