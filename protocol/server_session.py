# Invariants (the transition tables and the quorum/deadline/threshold rules live in `protocol.phases`):
# - A misbehaving device is isolated (it is excluded from the round and the error is raised to the
#   caller); the server session itself moves to ERROR only when its own processing fails.  It never asks
#   for s-shares of devices that dropped before sharing keys: "dropped" is exactly U2 ∖ U3 (pitfall 2).
#   Fewer than t survivors (or fewer than t_min with DP) aborts before any share is requested.
# - A device reported for unusable share ciphertexts (`MaskedInput.bad_share_senders`) is excluded while its
#   own masked input is still outside the sum: each masked input waits (`_pending`) until t of the
#   neighbours that received its shares answered the masked-input request without reporting it (so t
#   holders of its shares exist), or all of them answered or are gone, and only then is added.  A report
#   about a device already added excludes the reporter instead (its masked input, which left the reported
#   device out of its masks, never counts).  The reporter holds none of the reported device's shares, so it
#   is never asked for them, and its masks are not corrected for it (`_mask_peers`).
# - No clock, no sockets, no global RNG: deadlines are compared with the `now` the caller passes; the
#   graph placement uses the caller's generator.
"""The server side of one SecAgg+ round (docs/design.md §4–5; Bonawitz et al. 2017; Bell et al. 2020)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
from numpy.typing import NDArray

from protocol import crypto
from protocol.codec import encode
from protocol.errors import (
    CryptoError,
    FedRecError,
    LocalProtocolError,
    NotEnoughParticipants,
    RemoteProtocolError,
    RoundClosed,
    StaleRound,
)
from protocol.graph import harary_graph, ring_graph, roster_ring
from protocol.identity import (
    Cohort,
    key_advertisement_payload,
    roster_digest,
    survivor_set_payload,
    verify_certificate,
    verify_signature,
)
from protocol.masking import MaskedSumAccumulator, pair_mask_keys
from protocol.messages import (
    Abort,
    ConsistencyRequest,
    ConsistencySignature,
    EncryptedShares,
    ErrorMessage,
    MaskedInput,
    MaskedInputRequest,
    Message,
    PublicKeys,
    ShareKeysBroadcast,
    UnmaskRequest,
    UnmaskResponse,
)
from protocol.phases import (
    ACTIVE_PHASES,
    CLOSE_TRANSITIONS,
    SERVER_EXPECTS,
    TRANSITIONS,
    Direction,
    Phase,
    Role,
    consistency_deadline,
    phase_deadline,
    prune_unmaskable,
    require_quorum,
    required_signatures,
)
from protocol.round_params import RoundParameters
from protocol.shamir import Share, reconstruct

__all__ = ["SecAggResult", "ServerSecAggSession"]


@dataclass(frozen=True, slots=True)
class SecAggResult:
    """Outcome of a completed round.

    Attributes
    ----------
    total : ndarray of uint32, shape (L,)
        Σ_{u ∈ U3} (q(x_u) + kept noise_u) mod 2**32.
    survivors : frozenset of int
        U3, the devices whose input is in ``total``.
    dropouts : mapping of Phase to frozenset of int
        Devices lost in each phase (missed the deadline, left, or were excluded after an error).
    corrected : frozenset of int
        Survivors whose DP excess was revealed and removed.
    reports : mapping of int to frozenset of int
        Device → the neighbours whose share ciphertexts it reported unusable (those were excluded).
    """

    total: NDArray[np.uint32]
    survivors: frozenset[int]
    dropouts: Mapping[Phase, frozenset[int]]
    corrected: frozenset[int]
    reports: Mapping[int, frozenset[int]] = dataclasses.field(default_factory=lambda: MappingProxyType({}))


class ServerSecAggSession:
    """The server's side of one SecAgg+ round (semi-honest server).

    Call `receive` from request handlers, `advance` from a ticker, and read each device's next message
    with `outbox`.

    Parameters
    ----------
    params : RoundParameters
        Round parameters.
    device_ids : sequence of int
        The invited cohort.
    rng : np.random.Generator
        Randomness for the Harary graph placement of an unsigned round (a signed round's ring comes from its
        roster, protocol 1.11).
    identities : mapping of int to bytes, optional
        Protocol 1.8, signed rounds: each invited device's certified identity key.  The invites then carry
        the roster (ids and keys) that every device signs, and a device whose advertisement presents
        another identity is excluded.  Without it the invites carry no roster (an unsigned round), which
        a device that pins an enrollment authority refuses.

    Raises
    ------
    ConfigError, ValueError
        Invalid parameters (k even and below n, t > k, bad invite fields, duplicate ids).
    """

    def __init__(
        self,
        params: RoundParameters,
        device_ids: Sequence[int],
        *,
        rng: np.random.Generator,
        defer_finish: bool = False,
        identities: Mapping[int, bytes] | None = None,
    ) -> None:
        ids = [int(i) for i in device_ids]
        if len(set(ids)) != len(ids):
            raise ValueError("device ids must be distinct")
        self.params = params
        roster = tuple(sorted(ids))
        keys = () if identities is None else tuple(bytes(identities[u]) for u in roster)
        self._roster_keys = dict(zip(roster, keys, strict=True)) if keys else {}
        self._cohort: Cohort = (len(roster), roster_digest(roster, keys)) if keys else None
        # Protocol 1.11: a signed round's graph is the ring over the signed roster, which every device recomputes.
        self._ring: tuple[int, ...] | None = roster_ring(roster, self._cohort[1]) if self._cohort else None
        # validates every field once; the cohort size and roster let each device check its floor and sign them
        self._invites = {
            u: dataclasses.replace(
                params.invite(u), cohort_size=len(ids), roster_ids=roster if keys else (), roster_keys=keys
            )
            for u in ids
        }
        if params.k < len(ids) and params.k % 2 == 0:
            harary_graph(ids, params.k, rng)  # raises the graph module's ConfigError
        self._rng = rng
        self._phase = Phase.ADVERTISE_KEYS
        self.invited: frozenset[int] = frozenset(ids)
        self._keys: dict[int, tuple[bytes, bytes]] = {}
        self._used_keys: set[bytes] = set()
        self._defer_finish = defer_finish
        self._finishing = False
        self._failed: set[int] = set()
        self._left: set[int] = set()
        self._dropouts: dict[Phase, set[int]] = {p: set() for p in ACTIVE_PHASES}
        self._graph: dict[int, tuple[int, ...]] = {}
        self._session: bytes = b""
        self._u1: frozenset[int] = frozenset()
        self._u2: frozenset[int] = frozenset()
        self._u3: frozenset[int] = frozenset()
        self._shares_out: dict[int, dict[int, bytes]] = {}  # dst -> src -> ciphertext
        self._sent_shares: set[int] = set()
        self._masked_from: set[int] = set()
        # Masked inputs not yet in the sum, reports of unusable shares, and per device the
        # number of its neighbours that got its shares and have not yet answered (or gone)
        self._pending: dict[int, NDArray[np.uint32]] = {}
        self._bad: dict[int, frozenset[int]] = {}
        self._unsettled: dict[int, int] = {}
        self._vouches: dict[int, int] = {}
        self._settled: set[int] = set()
        self._digests: dict[int, bytes] = {}  # device -> fingerprint of its message in the current phase
        self._acc: MaskedSumAccumulator | None = None
        self._b_shares: dict[int, list[Share]] = {}
        self._s_shares: dict[int, list[Share]] = {}
        self._responded: set[int] = set()
        # protocol 1.3
        self._probe = crypto.generate_key_pair()  # a throwaway key to test advertised points
        self._certs: dict[int, tuple[bytes, bytes, bytes]] = {}  # id -> (certificate, signature, identity)
        self._identities: dict[bytes, int] = {}  # identity -> the device id that presented it
        self._set_payload = b""  # what survivors sign once U3 is fixed (built once, not per signature)
        self._signing = False  # UNMASK sub-step: collecting survivor-set signatures
        self._set_signatures: dict[int, bytes] = {}
        self._signers: frozenset[int] = frozenset()
        self._corrected: set[int] = set()
        self._result: SecAggResult | None = None
        self._abort_error: FedRecError | None = None

    # -- public API -----------------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """Current phase."""
        return self._phase

    @property
    def session_id(self) -> bytes:
        """Session id (empty until ADVERTISE_KEYS closed)."""
        return self._session

    @property
    def dropouts(self) -> Mapping[Phase, frozenset[int]]:
        """Devices lost per phase so far."""
        return MappingProxyType({p: frozenset(s) for p, s in self._dropouts.items()})

    @property
    def reports(self) -> Mapping[int, frozenset[int]]:
        """Device → neighbours whose share ciphertexts it reported unusable (each of those was excluded)."""
        return MappingProxyType(dict(self._bad))

    @property
    def abort_error(self) -> FedRecError | None:
        """Why the round aborted (None unless ABORTED)."""
        return self._abort_error

    @property
    def consistency_open(self) -> bool:
        """Protocol 1.3: UNMASK is in its first sub-step, collecting survivor-set signatures."""
        return self._signing

    @property
    def finishing(self) -> bool:
        """UNMASK has closed and the mask removal waits for `finish` (only with ``defer_finish``)."""
        return self._finishing

    def expected(self) -> frozenset[int]:
        """Devices whose message for the current phase is still awaited."""
        return frozenset(self._expected_set() - self._done_set())

    def receive(self, device_id: int, message: Message, *, digest: bytes | None = None) -> None:
        """Accept one device's message.

        A device whose message is illegal is excluded from the round (a dropout) and the error is raised
        for the caller to report; the round itself goes on.  An identical retransmission is ignored.

        ``digest`` identifies the message's bytes (the SHA-256 of the request body, say); without it
        the message is encoded again to be hashed.

        Raises
        ------
        RoundClosed
            The message is for a phase that already closed, or the round is over.
        RemoteProtocolError
            Unknown or excluded device, sender mismatch, message illegal in this phase, wrong session,
            or contents that break the protocol.
        LocalProtocolError
            The server session is in ERROR.
        """
        self._guard()
        if device_id not in self.invited:
            raise RemoteProtocolError(f"device {device_id} is not part of round {self.params.round_id}")
        if device_id in self._failed:
            raise RemoteProtocolError(f"device {device_id} was excluded from this round after a protocol error")
        if self._phase in (Phase.DONE, Phase.ABORTED):
            raise RoundClosed(f"round {self.params.round_id} is {self._phase.name}")
        if self._finishing:
            raise RoundClosed(f"round {self.params.round_id} closed UNMASK and is finishing")
        if device_id in self._left:
            raise RoundClosed(f"device {device_id} left the round")
        key = (Role.SERVER, self._phase, Direction.RECEIVE, type(message))
        if key not in TRANSITIONS:
            target = SERVER_EXPECTS.get(type(message))
            if target is not None and ACTIVE_PHASES.index(target) < ACTIVE_PHASES.index(self._phase):
                raise RoundClosed(f"{type(message).__name__} arrived after {target.name} closed")
            self._exclude(device_id)
            raise RemoteProtocolError(f"{type(message).__name__} is not allowed in phase {self._phase.name}")
        if isinstance(message, Abort | ErrorMessage):
            self._left.add(device_id)
            self._settle(device_id)
            self._maybe_close()
            return
        if getattr(message, "device_id", device_id) != device_id:
            self._exclude(device_id)
            raise RemoteProtocolError(
                f"message claims device {getattr(message, 'device_id', None)}, sent by {device_id}"
            )
        if device_id not in self._expected_set():
            raise RoundClosed(f"device {device_id} is not part of phase {self._phase.name}")
        if digest is None:
            digest = hashlib.sha256(encode(message)).digest()
        if device_id in self._done_set():
            if self._digests.get(device_id) == digest:
                return  # idempotent retry (e.g. an HTTP retransmission)
            # The first message stands (a masked input is already in the sum and cannot be taken out).
            raise RemoteProtocolError(f"device {device_id} sent a second, different {type(message).__name__}")
        try:
            self._accept(device_id, message)
        except FedRecError:
            self._exclude(device_id)
            raise
        self._digests[device_id] = digest
        self._maybe_close()

    def advance(self, now: float) -> Phase:
        """Close every phase whose deadline has passed at ``now``.

        Parameters
        ----------
        now : float
            The caller's clock, same timebase as the deadlines.

        Returns
        -------
        Phase
            The phase after advancing.
        """
        self._guard()
        while self._phase in ACTIVE_PHASES and not self._finishing:
            if self._signing and now >= consistency_deadline(self.params.deadlines):
                self._close_phase()
                continue
            if now < phase_deadline(self._phase, self.params.deadlines):
                break
            self._close_phase()
        return self._phase

    def outbox(self, device_id: int) -> Message | None:
        """The message a device should receive now.

        Returns
        -------
        Message or None
            The current phase's broadcast for a device that is part of it, `Abort` for a device that is
            not (dropped, excluded) or when the round aborted, None when the round is DONE.

        Raises
        ------
        RemoteProtocolError
            Unknown device.
        LocalProtocolError
            The server session is in ERROR.
        """
        self._guard()
        if device_id not in self.invited:
            raise RemoteProtocolError(f"device {device_id} is not part of round {self.params.round_id}")
        rid = self.params.round_id
        if self._phase is Phase.DONE or self._finishing:
            return None
        if self._phase is Phase.ABORTED:
            return Abort(round_id=rid, device_id=device_id, reason=str(self._abort_error or "aborted"))
        if device_id in self._failed or device_id in self._left or device_id not in self._expected_set():
            return Abort(round_id=rid, device_id=device_id, reason=f"dropped before {self._phase.name}")
        message = self._broadcast(device_id)
        if (Role.SERVER, self._phase, Direction.SEND, type(message)) not in TRANSITIONS:  # pragma: no cover
            raise LocalProtocolError(f"{type(message).__name__} cannot be sent in {self._phase.name}")
        return message

    def abort(self, reason: str) -> None:
        """Abort the round from the coordinator's side (nothing further is revealed)."""
        self._guard()
        if self._finishing:
            raise LocalProtocolError("the round is finishing; it cannot be aborted now")
        if self._phase in ACTIVE_PHASES:
            self._abort(RoundClosed(reason))

    def finish(self) -> Phase:
        """Remove the masks after UNMASK closed (``defer_finish``): the CPU-heavy part of a round.

        While `finishing`, nothing else changes this session (receive refuses, advance and abort
        wait), so a caller may run this in another thread.

        Returns
        -------
        Phase
            DONE, or ABORTED when too few shares came back.

        Raises
        ------
        LocalProtocolError
            Not finishing.
        CryptoError
            A reconstructed key does not match its advertised key (the session moves to ERROR).
        """
        self._guard()
        if not self._finishing:
            raise LocalProtocolError(f"nothing to finish in phase {self._phase.name}")
        try:
            self._remove_masks()
        except NotEnoughParticipants as exc:
            self._abort(exc)
        except Exception:
            self._phase = Phase.ERROR
            raise
        finally:
            self._finishing = False
        return self._phase

    def result(self) -> SecAggResult:
        """The aggregate of a completed round.

        Raises
        ------
        NotEnoughParticipants
            The round aborted for lack of survivors.
        RoundClosed
            The round aborted for another reason.
        LocalProtocolError
            The round is not finished, or the session is in ERROR.
        """
        self._guard()
        if self._phase is Phase.ABORTED:
            raise self._abort_error or RoundClosed("round aborted")
        if self._result is None:
            raise LocalProtocolError(f"no result yet: phase {self._phase.name}")
        return self._result

    # -- internals ------------------------------------------------------------------------------------

    def _guard(self) -> None:
        if self._phase is Phase.ERROR:
            raise LocalProtocolError("the server session failed earlier and cannot be used")

    def _exclude(self, device_id: int) -> None:
        self._failed.add(device_id)
        self._settle(device_id)
        self._maybe_close()

    def _settle(self, w: int) -> None:
        # MASKED_INPUT only: w can no longer report a neighbour; a pending masked input whose every
        # share recipient has settled can no longer be excluded, so it goes into the sum.
        if self._phase is not Phase.MASKED_INPUT or w in self._settled or w not in self._u2:
            return
        self._settled.add(w)
        for v in self._graph[w]:
            if v == w or v not in self._unsettled:
                continue
            self._unsettled[v] -= 1
            if self._unsettled[v] == 0 and v in self._pending:
                self._fold(v)

    def _fold(self, v: int) -> None:
        if self._acc is None:  # pragma: no cover - created when SHARE_KEYS closed
            raise LocalProtocolError("no accumulator")
        self._acc.add(self._pending.pop(v))

    def _mask_peers(self, owner: int) -> dict[int, bytes]:
        """Survivors whose masked input carries a pairwise mask with ``owner`` (a neighbour that reported
        ``owner``'s shares unusable left it out), with their s public keys."""
        return {
            u: self._keys[u][1]
            for u in self._graph[owner]
            if u in self._u3 and u != owner and owner not in self._bad.get(u, ())
        }

    def _abort(self, error: FedRecError) -> None:
        self._abort_error = error
        self._phase = Phase.ABORTED
        # Forget everything that could help reconstruct anything.
        self._b_shares.clear()
        self._s_shares.clear()
        self._shares_out.clear()
        self._pending.clear()
        self._acc = None

    def _expected_set(self) -> frozenset[int]:
        phase = self._phase
        if phase is Phase.ADVERTISE_KEYS:
            return self.invited
        if phase is Phase.SHARE_KEYS:
            return self._u1
        if phase is Phase.MASKED_INPUT:
            return self._u2
        if phase is Phase.UNMASK:
            return self._u3 if self._signing or not self.params.authority_key else self._signers
        return frozenset()

    def _done_set(self) -> set[int] | frozenset[int]:
        phase = self._phase
        if phase is Phase.ADVERTISE_KEYS:
            return frozenset(self._keys)
        if phase is Phase.SHARE_KEYS:
            return self._sent_shares
        if phase is Phase.MASKED_INPUT:
            return self._masked_from
        if phase is Phase.UNMASK:
            return frozenset(self._set_signatures) if self._signing else self._responded
        return frozenset()

    def _maybe_close(self) -> None:
        if self._phase not in ACTIVE_PHASES or self._finishing:
            return
        waiting = self._expected_set() - self._done_set() - self._failed - self._left
        if not waiting:
            self._close_phase()

    def _close_phase(self) -> None:
        try:
            {
                Phase.ADVERTISE_KEYS: self._close_advertise,
                Phase.SHARE_KEYS: self._close_share_keys,
                Phase.MASKED_INPUT: self._close_masked_input,
                Phase.UNMASK: self._close_consistency if self._signing else self._close_unmask,
            }[self._phase]()
        except NotEnoughParticipants as exc:
            self._abort(exc)
        except Exception:
            self._phase = Phase.ERROR
            raise

    def _need(self, count: int, what: str) -> None:
        p = self.params
        require_quorum(count, what, t=p.t, dp_mu=p.dp_mu, dp_t_min=p.dp_t_min)

    def _accept(self, u: int, message: Message) -> None:
        p = self.params
        round_id = getattr(message, "round_id", None)
        if round_id != p.round_id:
            raise StaleRound(f"message for round {round_id}, this is round {p.round_id}")
        if isinstance(message, ConsistencySignature):
            if not self._signing:
                raise RoundClosed("the consistency check is closed")
            if message.session_id != self._session:
                raise StaleRound("session id mismatch: the message belongs to another session")
            verify_signature(self._certs[u][2], message.signature, self._set_payload)
            self._set_signatures[u] = message.signature
            return
        if isinstance(message, PublicKeys):
            self._check_public_keys(u, message)
            pair = (message.c_public_key, message.s_public_key)
            if pair[0] in self._used_keys or pair[1] in self._used_keys:
                raise RemoteProtocolError(f"device {u} advertised a key another device already uses")
            self._keys[u] = pair
            self._used_keys.update(pair)
            return
        if getattr(message, "session_id", self._session) != self._session:
            raise StaleRound("session id mismatch: the message belongs to another session")
        if isinstance(message, EncryptedShares):
            expected = tuple(v for v in self._graph[u] if v != u)
            if message.recipient_ids != expected:
                raise RemoteProtocolError(f"device {u} must send one ciphertext to each of {expected}")
            for v, blob in zip(message.recipient_ids, message.ciphertexts, strict=True):
                self._shares_out.setdefault(v, {})[u] = blob
            self._sent_shares.add(u)
        elif isinstance(message, MaskedInput):
            if message.masked.shape != (p.vector_length,):
                raise RemoteProtocolError(
                    f"masked input has length {message.masked.shape[0]}, expected {p.vector_length}"
                )
            self._accept_masked(u, message)
        elif isinstance(message, UnmaskResponse):
            self._accept_unmask(u, message)

    def _accept_masked(self, u: int, message: MaskedInput) -> None:
        forwarded = {v for v in self._graph[u] if v in self._u2 and v != u}
        bad = frozenset(message.bad_share_senders)
        if not bad <= forwarded:
            raise RemoteProtocolError(
                f"device {u} reports unusable shares from {sorted(bad - forwarded)}, which sent it none"
            )
        usable = len(forwarded) - len(bad) + 1
        if usable < self.params.t:
            raise RemoteProtocolError(
                f"device {u} kept {usable} usable neighbours, below t={self.params.t}: it must not mask"
            )
        added = sorted(v for v in bad if v in self._masked_from and v not in self._pending)
        if added:
            # t share recipients of these already answered without a complaint, so their masked inputs are
            # in the sum and their b_v can be reconstructed: the reporter (whose masked input left them out)
            # is the one that leaves, as if it dropped before its masked input; its report is ignored.
            raise RemoteProtocolError(
                f"device {u} reports unusable shares from {added}, whose masked inputs are already in the sum "
                f"({self.params.t} of their share recipients used them); device {u} is excluded instead"
            )
        for v in sorted(bad):
            # v's ciphertext to u failed (or was altered on the way): v leaves the round before its masked
            # input counts.
            if v in self._failed or (v in self._left and v not in self._pending):
                continue
            self._pending.pop(v, None)
            self._masked_from.discard(v)
            self._failed.add(v)
            self._settle(v)
        if bad:
            self._bad[u] = bad
        self._pending[u] = message.masked  # read-only, owned by the message; added once t recipients vouched
        self._masked_from.add(u)
        for v in forwarded - bad:
            # u used v's shares: one more holder that can give b_v (or s_v) back
            self._vouches[v] = self._vouches.get(v, 0) + 1
            if self._vouches[v] >= self.params.t and v in self._pending:
                self._fold(v)
        self._settle(u)
        if u in self._pending and (self._unsettled.get(u, 0) == 0 or self._vouches.get(u, 0) >= self.params.t):
            self._fold(u)

    def _accept_unmask(self, u: int, message: UnmaskResponse) -> None:
        p = self.params
        unusable = self._bad.get(u, frozenset())
        want_b = tuple(v for v in self._graph[u] if v in self._u3)
        want_s = tuple(v for v in self._graph[u] if v in self._u2 and v not in self._u3 and v not in unusable)
        if message.b_share_ids != want_b or message.s_share_ids != want_s:
            raise RemoteProtocolError(f"device {u} released shares for other devices than requested")
        expected_excess = p.vector_length if p.dp_mu > 0.0 else 0
        if message.dp_excess.shape != (expected_excess,):
            raise RemoteProtocolError(f"DP excess of length {message.dp_excess.shape[0]}, expected {expected_excess}")
        parsed_b = [Share.from_bytes(b) for b in message.b_shares]
        parsed_s = [Share.from_bytes(b) for b in message.s_shares]
        for owner, share in (*zip(want_b, parsed_b, strict=True), *zip(want_s, parsed_s, strict=True)):
            # The holder's index in the owner's sorted neighbourhood is the x-coordinate it was given.
            if share.index != self._graph[owner].index(u) + 1:
                raise RemoteProtocolError(f"device {u} returned a share with a wrong index for {owner}")
        for owner, share in zip(want_b, parsed_b, strict=True):
            self._b_shares.setdefault(owner, []).append(share)
        for owner, share in zip(want_s, parsed_s, strict=True):
            self._s_shares.setdefault(owner, []).append(share)
        if expected_excess and self._acc is not None:
            self._acc.subtract(message.dp_excess)
            self._corrected.add(u)
        self._responded.add(u)

    def _record_dropouts(self, phase: Phase, arrived: Iterable[int]) -> None:
        self._dropouts[phase] |= set(self._expected_set()) - set(arrived)

    def _close_advertise(self) -> None:
        u1 = frozenset(self._keys) - self._failed - self._left
        self._record_dropouts(Phase.ADVERTISE_KEYS, u1)
        self._u1 = u1
        self._digests.clear()
        self._need(len(u1), "devices advertised keys")
        keys = {u: self._keys[u] for u in u1}
        self._session = crypto.session_id(self.params.round_id, keys)
        if self._ring is not None:
            self._graph = ring_graph(self._ring, self.params.k, u1)
        else:
            self._graph = harary_graph(sorted(u1), self.params.k, self._rng)
        self._phase = CLOSE_TRANSITIONS[self._phase]

    def _close_share_keys(self) -> None:
        u2 = prune_unmaskable(set(self._sent_shares) - self._failed - self._left, self._graph, self.params.t)
        self._record_dropouts(Phase.SHARE_KEYS, u2)
        self._u2 = u2
        self._need(len(u2), "devices shared keys")
        self._acc = MaskedSumAccumulator(self.params.vector_length)
        self._unsettled = {v: sum(1 for w in self._graph[v] if w != v and w in u2) for v in u2}
        self._digests.clear()
        self._phase = CLOSE_TRANSITIONS[self._phase]

    def _check_public_keys(self, u: int, message: PublicKeys) -> None:
        # A low-order or malformed X25519 point is refused before it is broadcast, so
        # one bad device cannot fail its neighbours' sessions (crypto.x25519 refuses an all-zero secret).
        for key in (message.c_public_key, message.s_public_key):
            crypto.x25519(self._probe.private_key, key)
        authority = self.params.authority_key
        if not authority:
            return
        if not message.certificate or not message.signature:
            raise RemoteProtocolError(f"device {u} advertised unsigned keys; this round requires enrolled devices")
        identity = verify_certificate(message.certificate, authority, device_id=u)
        if self._identities.get(identity, u) != u:
            raise RemoteProtocolError(f"device {u} presents a certified identity another device already used")
        if self._cohort is not None and self._roster_keys[u] != identity:
            raise RemoteProtocolError(f"device {u} presents another identity than the roster's")
        payload = key_advertisement_payload(
            message.round_id, u, message.c_public_key, message.s_public_key, self._cohort
        )
        verify_signature(identity, message.signature, payload)
        self._certs[u] = (message.certificate, message.signature, identity)
        self._identities[identity] = u

    def _close_masked_input(self) -> None:
        # Every accumulated input is in U3, even if its sender left afterwards: its masks must come off.
        for v in sorted(self._pending):
            self._fold(v)
        u3 = frozenset(self._masked_from)
        self._record_dropouts(Phase.MASKED_INPUT, u3)
        self._u3 = u3
        self._need(len(u3), "masked inputs arrived")
        self._shares_out.clear()  # routed already; no longer needed
        self._digests.clear()
        self._signing = bool(self.params.authority_key)
        if self._signing:
            self._set_payload = survivor_set_payload(self.params.round_id, self._session, sorted(u3), self._cohort)
        self._phase = CLOSE_TRANSITIONS[self._phase]

    def _close_consistency(self) -> None:
        p = self.params
        signers = frozenset(self._set_signatures)
        self._record_dropouts(Phase.UNMASK, signers)
        invite = next(iter(self._invites.values()))
        need = required_signatures(invite)
        if len(signers) < need:
            raise NotEnoughParticipants(
                f"{len(signers)} survivors signed the survivor set, {need} needed; round aborted unrevealed"
            )
        require_quorum(len(signers), "survivors signed", t=p.t, dp_mu=p.dp_mu, dp_t_min=p.dp_t_min)
        self._signers = signers
        self._signing = False
        self._digests.clear()

    def _close_unmask(self) -> None:
        # The checks close the phase; the mask removal (`_remove_masks`) is the heavy part, run at once
        # or, with ``defer_finish``, by `finish` (the server runs it off its event loop).
        p = self.params
        self._record_dropouts(Phase.UNMASK, self._responded)
        dropped = sorted(self._u2 - self._u3)
        for owner in sorted(self._u3):
            if len(self._b_shares.get(owner, ())) < p.t:
                raise NotEnoughParticipants(f"too few neighbours of {owner} answered the unmask request")
        for owner in dropped:
            if self._mask_peers(owner) and len(self._s_shares.get(owner, ())) < p.t:
                raise NotEnoughParticipants(f"too few neighbours of dropped {owner} answered the unmask request")
        self._finishing = True
        if not self._defer_finish:
            self._finishing = False
            self._remove_masks()

    def _remove_masks(self) -> None:
        p, acc = self.params, self._acc
        if acc is None:  # pragma: no cover
            raise LocalProtocolError("no accumulator")
        dropped = sorted(self._u2 - self._u3)
        session = self._session
        for owner in sorted(self._u3):
            acc.remove_self_mask(reconstruct(self._b_shares[owner], p.t), session, owner)
        for owner in dropped:
            peers = self._mask_peers(owner)
            if not peers:
                continue  # every survivor among its neighbours left it out of its masks
            # Parsed once per dropped device (its public key is derived once for the check, too).
            pair = crypto.key_pair_from_private_bytes(reconstruct(self._s_shares[owner], p.t))
            if pair.public_key != self._keys[owner][1]:
                raise CryptoError(f"reconstructed mask key of {owner} does not match its advertised key")
            for u, key in pair_mask_keys(pair.private_key, peers, session, owner).items():
                acc.remove_pair_mask(u, owner, key)
        self._result = SecAggResult(
            total=acc.total(),
            survivors=self._u3,
            dropouts=self.dropouts,
            corrected=frozenset(self._corrected),
            reports=self.reports,
        )
        self._b_shares.clear()
        self._s_shares.clear()
        self._phase = CLOSE_TRANSITIONS[self._phase]

    def _broadcast(self, u: int) -> Message:
        rid, session = self.params.round_id, self._session
        phase = self._phase
        if phase is Phase.ADVERTISE_KEYS:
            return self._invites[u]
        if phase is Phase.SHARE_KEYS:
            ids = self._graph[u]
            return ShareKeysBroadcast(
                round_id=rid,
                device_id=u,
                session_id=session,
                neighbour_ids=ids,
                c_public_keys=tuple(self._keys[v][0] for v in ids),
                s_public_keys=tuple(self._keys[v][1] for v in ids),
                certificates=tuple(self._certs[v][0] for v in ids) if self.params.authority_key else (),
                signatures=tuple(self._certs[v][1] for v in ids) if self.params.authority_key else (),
            )
        if phase is Phase.MASKED_INPUT:
            inbound = self._shares_out.get(u, {})
            senders = tuple(v for v in self._graph[u] if v in self._u2 and v != u and v in inbound)
            return MaskedInputRequest(
                round_id=rid,
                device_id=u,
                session_id=session,
                sender_ids=senders,
                ciphertexts=tuple(inbound[v] for v in senders),
            )
        if self._signing:
            return ConsistencyRequest(
                round_id=rid, device_id=u, session_id=session, survivor_set=tuple(sorted(self._u3))
            )
        ids = self._graph[u]
        signed = bool(self.params.authority_key)
        signers = tuple(sorted(self._signers)) if signed else ()
        return UnmaskRequest(
            round_id=rid,
            device_id=u,
            session_id=session,
            survivors=tuple(v for v in ids if v in self._u3),
            dropped=tuple(v for v in ids if v in self._u2 and v not in self._u3 and v not in self._bad.get(u, ())),
            # with the consistency check the DP correction counts signed survivors only (safe side)
            n_survivors=len(signers) if signed else len(self._u3),
            survivor_set=tuple(sorted(self._u3)) if signed else (),
            signer_ids=signers,
            signer_certificates=tuple(self._certs[v][0] for v in signers),
            signatures=tuple(self._set_signatures[v] for v in signers),
        )
