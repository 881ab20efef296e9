# Invariants (h11-style; the transition table and the threshold rules live in `protocol.phases`):
# - Inside a device phase the order is fixed: receive the server's message once, then send the reply once
#   (tracked by `_reply_ready`); `send` and `receive` consult `TRANSITIONS` first.
# - Any exception moves the session to ERROR and every later call raises LocalProtocolError; on a failed
#   check nothing is released (the reply is built only after every check passed).  The device never
#   releases both the b-share and the s-share for one id: only one UnmaskRequest is ever accepted and it
#   is refused when its lists overlap.
# - A neighbour whose share ciphertext is unusable (fails AEAD authentication, or decrypts to a wrong
#   length, wrong src/dst or an invalid share) is treated as dropped before the masked input: no share of it
#   is held, it is not in U2 (so not in the pairwise masks and never named in an answered unmask request),
#   and it is reported in `MaskedInput.bad_share_senders`.  The session fails only if fewer than t usable
#   neighbours remain.
# - No clock, no sockets, no global RNG: key material comes from the OS CSPRNG (via protocol.crypto); DP
#   noise and thinning coins from the generator the caller passes, through `protocol.noise`.  The one
#   exception is `FixedDeviceSecrets` (protocol.fixed_secrets), an explicit keyword-only injection for
#   known-answer test vectors.
"""The device side of one SecAgg+ round (docs/design.md §4–5; Bonawitz et al. 2017; Bell et al. 2020)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NoReturn

import numpy as np
from numpy.typing import NDArray

from protocol import crypto
from protocol.errors import (
    CertificateRevoked,
    CryptoError,
    LocalProtocolError,
    RemoteProtocolError,
    StaleRound,
    SurvivorSetSplit,
)
from protocol.fixed_secrets import FixedDeviceSecrets
from protocol.graph import placement_floor, ring_neighbourhood, roster_ring, survivor_cut
from protocol.identity import (
    Cohort,
    RevocationList,
    SigningKey,
    key_advertisement_payload,
    roster_digest,
    survivor_set_payload,
    verify_certificate,
    verify_signature,
)
from protocol.masking import mask_input, pair_mask_keys
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
    RoundInvite,
    ShareKeysBroadcast,
    UnmaskRequest,
    UnmaskResponse,
)
from protocol.noise import SkellamDraw, StoredSkellam, correct_noise, device_noise, to_ring
from protocol.phases import (
    DEVICE_REPLY,
    TERMINAL_PHASES,
    TRANSITIONS,
    Direction,
    Phase,
    Role,
    check_neighbourhood,
    check_sharers,
    check_survivor_quorum,
    required_signatures,
)
from protocol.policy import DeviceLedger, PrivacyPolicy, check_invite
from protocol.samplers import NoiseStream
from protocol.shamir import SHARE_BYTES, Share, split

__all__ = ["DeviceSecAggSession", "SHARE_PLAINTEXT_BYTES", "ID_BYTES"]

ID_BYTES = 8
#: src id ‖ dst id ‖ b-share ‖ s-share, the plaintext of one share ciphertext.
SHARE_PLAINTEXT_BYTES = 2 * ID_BYTES + 2 * SHARE_BYTES
_ID_BYTES = ID_BYTES
_SHARE_PLAINTEXT_BYTES = SHARE_PLAINTEXT_BYTES


class DeviceSecAggSession:
    """One device's side of one SecAgg+ round.

    Drive it with `send` (returns the next message to upload) and `receive` (a message from the server);
    give it the quantized update with `provide_input` any time before the masked-input reply.

    Parameters
    ----------
    invite : RoundInvite
        The round's parameters, addressed to this device.
    rng : NoiseStream, optional
        Source of the DP noise and thinning coins.  Default: a fresh stream keyed from ``secrets``, which
        is what a device must use; simulations pass `protocol.samplers.insecure_test_noise_stream`.
    fixed_secrets : FixedDeviceSecrets, optional
        Known-answer vectors and tests only: use these keys, seed, Shamir coefficients and nonces instead
        of the OS CSPRNG.  Leave None (the default) everywhere else.
    policy : PrivacyPolicy, optional
        The device's privacy floor (`protocol.policy`), checked against the invite before anything is
        generated; None checks nothing (protocol tests and simulations).  `DeviceClient` always passes one.
    ledger : DeviceLedger, optional
        The device's own privacy ledger, for the policy's total-ε floor, and (protocol 1.8) its session
        history: the round id is admitted into it here, and a round id it already holds is refused.
    identity, certificate : SigningKey and bytes, optional
        Protocol 1.3: the device's long-term Ed25519 key and its enrollment certificate; the key
        advertisement and the survivor set are signed with it.
    authority_key : bytes, optional
        Protocol 1.3: the pinned public key of the enrollment authority.  When given, the session refuses
        unsigned or wrongly signed neighbour keys (key substitution) and releases no share before it holds
        `protocol.phases.required_signatures` valid survivor signatures on the one set it signed itself.
    revoked : RevocationList, optional
        Protocol 1.5: the newest revocation list of the pinned authority the device holds (checked by the
        caller).  A ShareKeys broadcast with a neighbour whose certified key is on it is refused
        (`CertificateRevoked`, before any share is made), and a revoked member's survivor signature does
        not count.

    Raises
    ------
    PrivacyFloorViolation
        The invite is below ``policy``: the device sits the round out.
    SessionReplayed
        ``ledger`` shows this device already took part in a session of the invite's round id.
    """

    def __init__(
        self,
        invite: RoundInvite,
        *,
        rng: NoiseStream | None = None,
        fixed_secrets: FixedDeviceSecrets | None = None,
        policy: PrivacyPolicy | None = None,
        ledger: DeviceLedger | None = None,
        identity: SigningKey | None = None,
        certificate: bytes = b"",
        authority_key: bytes | None = None,
        revoked: RevocationList | None = None,
    ) -> None:
        if not isinstance(invite, RoundInvite):
            raise TypeError("invite must be a RoundInvite")
        if fixed_secrets is not None and not isinstance(fixed_secrets, FixedDeviceSecrets):
            raise TypeError("fixed_secrets must be a FixedDeviceSecrets")
        if authority_key is not None and (identity is None or not certificate):
            raise TypeError("a session that pins an enrollment authority needs the device's identity and certificate")
        if identity is not None and authority_key is not None:
            # Its own certificate: signature, validity period (expiry checked on the device) and, format 3,
            # issued for this device id.
            if verify_certificate(certificate, authority_key, device_id=invite.device_id) != identity.public_key:
                raise CryptoError("the device's certificate does not certify its identity key")
        self._identity = identity
        self._certificate = certificate
        # Protocol 1.8: the cohort this device signs, (n, roster digest); the roster stays in the invite.
        self._cohort: Cohort = None
        if authority_key is not None and identity is not None:
            self._cohort = _check_roster(invite, identity.public_key)
        self._authority = authority_key
        self._revoked: RevocationList | frozenset[bytes] = revoked if revoked is not None else frozenset()
        self._gamma = 0.0 if policy is None else policy.adversary_rate
        self._signed_set: tuple[int, ...] | None = None
        #: ε the round charges this device at its policy's δ (0 without a policy or without DP).
        self.round_epsilon = 0.0 if policy is None else check_invite(invite, policy, ledger)
        # Protocol 1.8: shares and a survivor signature in one session per round id, ever (the ledger's
        # history; `SessionReplayed` otherwise), admitted before any key exists and named at ShareKeys.
        # The caller persists the ledger before the keys and the shares leave.
        self._ledger = ledger
        if ledger is not None:
            ledger.admit_round(invite.round_id)
        self.invite = invite
        if rng is not None and not isinstance(rng, NoiseStream):
            raise TypeError(f"rng must be a protocol.samplers.NoiseStream, got {type(rng).__name__}")
        self._rng = rng if rng is not None else NoiseStream.from_os()
        self._fixed = fixed_secrets
        self._phase = Phase.ADVERTISE_KEYS
        self._reply_ready = True  # the invite is the ADVERTISE_KEYS request
        if fixed_secrets is None:
            self._c = crypto.generate_key_pair()
            self._s = crypto.generate_key_pair()
        else:
            self._c = crypto.key_pair_from_private_bytes(fixed_secrets.c_private_key)
            self._s = crypto.key_pair_from_private_bytes(fixed_secrets.s_private_key)
        self._session: bytes | None = None
        self._seed = b""
        self._neighbours: dict[int, tuple[bytes, bytes]] = {}
        self._index: dict[int, int] = {}  # neighbour id -> Shamir index of the shares we sent it
        self._held_b: dict[int, Share] = {}
        self._held_s: dict[int, Share] = {}
        self._u2: tuple[int, ...] = ()
        self._bad: tuple[int, ...] = ()  # senders whose share ciphertext was unusable (reported, not in U2)
        self._input: NDArray[np.uint32] | None = None
        # The DP noise is kept narrow (`StoredSkellam`) from the masked input to the unmask reply.
        self._noise: StoredSkellam | None = None
        self._kept_after_reply: StoredSkellam | None = None
        self._pending: Message | None = None
        self.abort_reason: str | None = None
        self._identities: dict[int, bytes] = {}  # neighbour id -> certified Ed25519 key (protocol 1.3)
        # Certificates this session verified in the key broadcast (bytes -> certified key): a neighbour's
        # certificate comes back among the survivors' and is not verified twice in one round.
        self._certified: dict[bytes, bytes] = {}

    # -- public API -----------------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """Current phase."""
        return self._phase

    @property
    def device_id(self) -> int:
        """This device's id."""
        return self.invite.device_id

    @property
    def session_id(self) -> bytes | None:
        """The session id, once the ShareKeys broadcast arrived."""
        return self._session

    def provide_input(self, x: NDArray[np.uint32]) -> None:
        """Set q(x_u), the quantized update (uint32 ring elements, length L).

        Raises
        ------
        LocalProtocolError
            Wrong dtype/shape, or the masked input was already sent.
        """
        self._guard()
        if self._phase not in (Phase.ADVERTISE_KEYS, Phase.SHARE_KEYS, Phase.MASKED_INPUT):
            self._fail(LocalProtocolError(f"input can no longer be changed in phase {self._phase.name}"))
        if not isinstance(x, np.ndarray) or x.dtype != np.uint32 or x.shape != (self.invite.vector_length,):
            self._fail(LocalProtocolError(f"input must be a uint32 vector of length {self.invite.vector_length}"))
        self._input = x.copy()

    def send(self) -> Message:
        """Return the next message to upload and advance the phase.

        Returns
        -------
        Message
            PublicKeys, EncryptedShares, MaskedInput or UnmaskResponse, by phase.

        Raises
        ------
        LocalProtocolError
            Nothing to send yet (the server's message of the phase has not arrived, or no input), or the
            session is finished or in ERROR.
        """
        self._guard()
        reply_type = DEVICE_REPLY.get(self._phase)
        if isinstance(self._pending, ConsistencySignature):
            reply_type = ConsistencySignature
        if reply_type is None:  # pragma: no cover - _guard handles the terminal phases
            self._fail(LocalProtocolError(f"nothing to send in phase {self._phase.name}"))
        key = (Role.DEVICE, self._phase, Direction.SEND, reply_type)
        if key not in TRANSITIONS:  # pragma: no cover - every active phase has its reply in the table
            self._fail(LocalProtocolError(f"{reply_type.__name__} cannot be sent in {self._phase.name}"))
        if not self._reply_ready:
            self._fail(
                LocalProtocolError(
                    f"cannot send {reply_type.__name__}: the server's {self._phase.name} message is missing"
                )
            )
        try:
            if self._phase is Phase.ADVERTISE_KEYS:
                message: Message = self._public_keys()
            elif self._phase is Phase.MASKED_INPUT:
                message = self._masked_input()
            else:
                if self._pending is None:  # pragma: no cover - _reply_ready implies a pending reply
                    raise LocalProtocolError("no reply prepared")
                message = self._pending
        except Exception as exc:
            self._fail(exc)
        self._pending = None
        self._reply_ready = False
        if self._kept_after_reply is not None:
            self._noise, self._kept_after_reply = self._kept_after_reply, None
        self._phase = TRANSITIONS[key]
        return message

    def receive(self, message: Message) -> None:
        """Process a message from the server.

        Raises
        ------
        RemoteProtocolError
            The message is not legal in this phase, or fails one of the device's checks (docs/design.md §4).
        StaleRound
            The message belongs to another round or session (replay).
        CryptoError
            A signed key advertisement does not verify (protocol 1.3).  An unusable share ciphertext is not
            an error: its sender is treated as dropped and reported (`MaskedInput.bad_share_senders`).
        LocalProtocolError
            The session already failed.
        """
        self._guard()
        key = (Role.DEVICE, self._phase, Direction.RECEIVE, type(message))
        if key not in TRANSITIONS:
            self._fail(RemoteProtocolError(f"{type(message).__name__} is not allowed in phase {self._phase.name}"))
        try:
            if isinstance(message, Abort | ErrorMessage):
                self._check_round(message.round_id if isinstance(message, Abort) else None)
                self.abort_reason = message.reason if isinstance(message, Abort) else message.message
                self._drop_secrets()
                self._phase = TRANSITIONS[key]
                return
            if self._reply_ready:
                raise RemoteProtocolError(f"{type(message).__name__} received twice in phase {self._phase.name}")
            if isinstance(message, ShareKeysBroadcast):
                self._pending = self._on_share_keys(message)
            elif isinstance(message, MaskedInputRequest):
                self._on_masked_input_request(message)
            elif isinstance(message, ConsistencyRequest):
                self._pending = self._on_consistency_request(message)
            elif isinstance(message, UnmaskRequest):
                self._pending = self._on_unmask_request(message)
        except Exception as exc:
            self._fail(exc)
        self._reply_ready = True
        self._phase = TRANSITIONS[key]

    def abort(self, reason: str = "") -> Abort:
        """Leave the round; returns the Abort to send (best effort).

        Raises
        ------
        LocalProtocolError
            The session is already finished or failed.
        """
        self._guard()
        if (Role.DEVICE, self._phase, Direction.SEND, Abort) not in TRANSITIONS:
            self._fail(LocalProtocolError(f"cannot abort in phase {self._phase.name}"))
        self._drop_secrets()
        self.abort_reason = reason
        self._phase = Phase.ABORTED
        return Abort(round_id=self.invite.round_id, device_id=self.device_id, reason=reason)

    def kept_noise(self) -> NDArray[np.int64]:
        """The DP noise this device's masked input currently carries (local only; for simulations).

        Returns
        -------
        ndarray of int64, shape (L,)
            Zeros without DP or before the masked input was built.
        """
        if self._noise is None:
            return np.zeros(self.invite.vector_length, dtype=np.int64)
        return self._noise.draw().value()

    # -- internals ------------------------------------------------------------------------------------

    def _guard(self) -> None:
        if self._phase is Phase.ERROR:
            raise LocalProtocolError("the session failed earlier and cannot be used")
        if self._phase in TERMINAL_PHASES:
            self._fail(LocalProtocolError(f"the session is finished ({self._phase.name})"))

    def _fail(self, exc: BaseException) -> NoReturn:
        self._phase = Phase.ERROR
        self._pending = None
        self._drop_secrets()
        raise exc

    def _drop_secrets(self) -> None:
        self._held_b.clear()
        self._held_s.clear()
        self._input = None

    def _check_round(self, round_id: int | None) -> None:
        if round_id is not None and round_id != self.invite.round_id:
            raise StaleRound(f"message for round {round_id}, this session is round {self.invite.round_id}")

    def _public_keys(self) -> PublicKeys:
        rid, me, c, s = self.invite.round_id, self.device_id, self._c.public_key, self._s.public_key
        if self._identity is None:
            return PublicKeys(round_id=rid, device_id=me, c_public_key=c, s_public_key=s)
        signature = self._identity.sign(key_advertisement_payload(rid, me, c, s, self._cohort))
        return PublicKeys(
            round_id=rid,
            device_id=me,
            c_public_key=c,
            s_public_key=s,
            certificate=self._certificate,
            signature=signature,
        )

    def _check_signed_keys(self, msg: ShareKeysBroadcast) -> None:
        # Protocol 1.3: every neighbour's keys carry a certificate of the pinned authority and a signature
        # binding (round, id, keys): the server cannot substitute keys of its own.
        if self._authority is None:
            return
        if not msg.certificates:
            raise RemoteProtocolError("ShareKeys broadcast carries no certificates; this device requires signed keys")
        seen: set[bytes] = set()
        for v, c, s, cert, sig in zip(
            msg.neighbour_ids, msg.c_public_keys, msg.s_public_keys, msg.certificates, msg.signatures, strict=True
        ):
            try:
                identity = verify_certificate(cert, self._authority, revoked=self._revoked, device_id=v)
            except CertificateRevoked as exc:
                raise CertificateRevoked(
                    f"neighbour device {v} in the ShareKeys broadcast of round {self.invite.round_id}: {exc}; "
                    "this device sits the round out"
                ) from None
            if identity in seen:
                raise RemoteProtocolError(f"ShareKeys broadcast uses one certified identity twice (at {v})")
            seen.add(identity)
            if _roster_key(self.invite, v) != identity:
                raise RemoteProtocolError(
                    f"neighbour device {v} is not on the round's roster with the identity it presents: the roster "
                    "this device signed is the whole cohort"
                )
            try:
                verify_signature(identity, sig, key_advertisement_payload(self.invite.round_id, v, c, s, self._cohort))
            except CryptoError:
                raise CryptoError(
                    f"the keys advertised for device {v} are not signed by its certified key for this round's "
                    "cohort (a signature on another cohort size or roster does not count)"
                ) from None
            self._identities[v] = identity
            self._certified[cert] = identity

    def _ring(self) -> tuple[int, ...] | None:
        """Protocol 1.11: the roster ring of a signed round (None unsigned); the graph every device recomputes."""
        if self._cohort is None:
            return None
        return roster_ring(tuple(self.invite.roster_ids), self._cohort[1])

    def _check_ring(self, ids: Sequence[int]) -> None:
        # Protocol 1.11: a signed round's neighbours are the roster ring's, not the server's choice.
        ring = self._ring()
        if ring is None:
            return
        near = ring_neighbourhood(ring, self.device_id, self.invite.graph_k)
        off = sorted(set(ids) - near)
        if off:
            raise RemoteProtocolError(
                f"ShareKeys broadcast names {off[:5]}, not within (k-1)/2 = {(self.invite.graph_k - 1) // 2} "
                "positions of this device on the signed roster's ring: since protocol 1.11 the server does not "
                "place the graph"
            )

    def _check_survivor_cut(self, members: Sequence[int]) -> None:
        # Protocol 1.11 (`protocol.graph.survivor_cut`): before it signs, the device checks that the honest
        # survivors' mask graph stays in one piece whoever the ⌊γ n⌋ colluders are.  First, every ring
        # neighbour the set counts as a survivor is one this device masked with (else the server cut the edge
        # by leaving it out of this device's view); then two disjoint runs of (k-1)/2 ring positions must hold
        # more survivors than the colluders.  Both depend only on the roster and the signed set, so all
        # honest survivors decide alike.
        ring = self._ring()
        if ring is None or self.invite.graph_k >= len(ring):
            return
        alive, masked = set(members), set(self._u2)
        near = ring_neighbourhood(ring, self.device_id, self.invite.graph_k)
        unmasked = sorted(v for v in near if v in alive and v not in masked)
        if unmasked:
            raise SurvivorSetSplit(
                f"the survivor set counts ring neighbours {unmasked[:5]} this device never masked with: their "
                "masks would not cancel, and the server could separate this device's part of the sum"
            )
        colluders = placement_floor(len(ring), self._gamma) - 2
        cut = survivor_cut(ring, alive, self.invite.graph_k)
        if cut <= colluders:
            raise SurvivorSetSplit(
                f"the survivor set leaves two runs of {(self.invite.graph_k - 1) // 2} ring positions with "
                f"{cut} survivors, no more than the {colluders} colluders this device allows "
                f"(adversary_rate={self._gamma:g}): the server could unmask the sum of a part of the cohort"
            )

    def _on_consistency_request(self, msg: ConsistencyRequest) -> ConsistencySignature:
        self._check_addressing(msg)
        if self._identity is None:
            raise RemoteProtocolError("ConsistencyRequest received, but this device has no identity to sign with")
        if self._signed_set is not None:
            raise RemoteProtocolError("a second ConsistencyRequest: a device signs one survivor set per round")
        members = msg.survivor_set
        if list(members) != sorted(set(members)):
            raise RemoteProtocolError("the survivor set must be sorted and list each device once")
        if self.device_id not in members:
            raise RemoteProtocolError("the survivor set omits this device, which sent its masked input")
        outside = [v for v in members if _roster_key(self.invite, v) is None]
        if self._cohort is not None and outside:
            raise RemoteProtocolError(f"the survivor set names {outside[:5]}, not on the round's roster")
        self._check_survivor_cut(members)
        session = self._session or b""
        self._signed_set = members
        signature = self._identity.sign(survivor_set_payload(self.invite.round_id, session, members, self._cohort))
        return ConsistencySignature(
            round_id=self.invite.round_id, device_id=self.device_id, session_id=session, signature=signature
        )

    def _check_consistency(self, msg: UnmaskRequest) -> int:
        # Protocol 1.3: the request must rest on the set this device signed, carry enough valid signatures of
        # certified members on exactly that set, and derive its two lists from it.  Returns the number of
        # valid signatures, which bounds n_survivors for the DP correction.
        if self._authority is None and self._signed_set is None:
            return msg.n_survivors  # 1.2 behaviour: no consistency check in this session
        if self._signed_set is None:
            raise RemoteProtocolError("UnmaskRequest before the consistency check: nothing is released unsigned")
        if msg.survivor_set != self._signed_set:
            raise RemoteProtocolError("UnmaskRequest rests on a different survivor set than the one this device signed")
        members = set(self._signed_set)
        payload = survivor_set_payload(self.invite.round_id, self._session or b"", self._signed_set, self._cohort)
        valid: set[int] = set()
        identities: set[bytes] = set()
        need = required_signatures(self.invite, self._gamma)
        # Enough is enough: without DP the count only has to reach `need`; with DP it must also cover the
        # claimed survivor count (each signature costs ~0.1-0.3 ms, and n can be thousands).
        target = need if self.invite.dp_mu <= 0.0 else max(need, msg.n_survivors)
        for v, cert, sig in zip(msg.signer_ids, msg.signer_certificates, msg.signatures, strict=True):
            if len(valid) >= target:
                break
            if v not in members or v in valid:
                continue
            try:
                if self._authority is None:
                    identity = self._identities.get(v, b"")
                elif cert in self._certified:
                    identity = self._certified[cert]  # verified in this round's key broadcast
                else:
                    identity = verify_certificate(cert, self._authority, revoked=self._revoked, device_id=v)
                if identity in identities or (v in self._identities and self._identities[v] != identity):
                    continue
                if self._cohort is not None and _roster_key(self.invite, v) != identity:
                    continue  # protocol 1.8: only the roster's identities count
                verify_signature(identity, sig, payload)
            except CryptoError:
                continue
            valid.add(v)
            identities.add(identity)
        if len(valid) < need:
            raise RemoteProtocolError(
                f"only {len(valid)} valid survivor signatures on the signed set, {need} required; nothing released"
            )
        u2 = self._u2
        want_survivors = tuple(v for v in u2 if v in members)
        want_dropped = tuple(v for v in u2 if v not in members)
        if tuple(sorted(msg.survivors)) != want_survivors or tuple(sorted(msg.dropped)) != want_dropped:
            raise RemoteProtocolError("UnmaskRequest's survivor and dropped lists contradict the signed survivor set")
        if self.invite.dp_mu > 0.0 and msg.n_survivors > len(valid):
            raise RemoteProtocolError(
                f"n_survivors={msg.n_survivors} exceeds the {len(valid)} signed survivors: an overstated count would "
                "shrink every device's kept noise"
            )
        return msg.n_survivors

    def _check_addressing(
        self, message: ShareKeysBroadcast | MaskedInputRequest | UnmaskRequest | ConsistencyRequest
    ) -> None:
        self._check_round(message.round_id)
        if message.device_id != self.device_id:
            raise RemoteProtocolError(f"message addressed to device {message.device_id}, we are {self.device_id}")
        if self._session is not None and message.session_id != self._session:
            raise StaleRound("session id mismatch: the message belongs to another session (replay?)")

    def _on_share_keys(self, msg: ShareKeysBroadcast) -> EncryptedShares:
        self._check_addressing(msg)
        me, inv = self.device_id, self.invite
        ids = msg.neighbour_ids
        if len(set(ids)) != len(ids):
            raise RemoteProtocolError("ShareKeys broadcast lists a device twice")
        if me not in ids:
            raise RemoteProtocolError("ShareKeys broadcast omits this device")
        keys = dict(zip(ids, zip(msg.c_public_keys, msg.s_public_keys, strict=True), strict=True))
        if keys[me] != (self._c.public_key, self._s.public_key):
            raise RemoteProtocolError("ShareKeys broadcast altered this device's own public keys")
        all_keys = [*msg.c_public_keys, *msg.s_public_keys]
        if len(set(all_keys)) != len(all_keys):
            raise RemoteProtocolError("ShareKeys broadcast contains repeated public keys")
        check_neighbourhood(len(ids), inv)
        self._check_signed_keys(msg)
        self._check_ring(ids)
        self._session = msg.session_id
        if self._ledger is not None:
            self._ledger.record_session(inv.round_id, msg.session_id)
        self._neighbours = keys
        order = sorted(ids)
        self._index = {v: i + 1 for i, v in enumerate(order)}
        # Self-mask seed b_u and the s private key, shared t-of-|N(u)| (Bonawitz et al. 2017, round 1).
        fixed = self._fixed
        if fixed is None:
            seed = crypto.random_seed()
            b_shares = split(seed, inv.graph_t, len(order))
            s_shares = split(self._s.private_bytes(), inv.graph_t, len(order))
        else:
            seed = fixed.self_mask_seed
            b_shares = fixed.shares(seed, fixed.b_coefficients, inv.graph_t, len(order))
            s_shares = fixed.shares(self._s.private_bytes(), fixed.s_coefficients, inv.graph_t, len(order))
        self._seed = seed
        recipients, ciphertexts = [], []
        for v, b_share, s_share in zip(order, b_shares, s_shares, strict=True):
            if v == me:
                self._held_b[me], self._held_s[me] = b_share, s_share
                continue
            plaintext = (
                me.to_bytes(_ID_BYTES, "big") + v.to_bytes(_ID_BYTES, "big") + b_share.to_bytes() + s_share.to_bytes()
            )
            key = crypto.share_encryption_key(crypto.x25519(self._c.private_key, keys[v][0]), msg.session_id, me, v)
            recipients.append(v)
            nonce = None if fixed is None else fixed.share_nonces[v]
            ciphertexts.append(
                crypto.aead_encrypt(key, plaintext, crypto.share_associated_data(msg.session_id, me, v), nonce=nonce)
            )
        return EncryptedShares(
            round_id=inv.round_id,
            device_id=me,
            session_id=msg.session_id,
            recipient_ids=tuple(recipients),
            ciphertexts=tuple(ciphertexts),
        )

    def _on_masked_input_request(self, msg: MaskedInputRequest) -> None:
        self._check_addressing(msg)
        me, session = self.device_id, self._session
        if session is None:  # pragma: no cover - the table only allows this after ShareKeys
            raise LocalProtocolError("no session id")
        senders = msg.sender_ids
        if len(set(senders)) != len(senders):
            raise RemoteProtocolError("MaskedInputRequest lists a sender twice")
        for v in senders:
            if v == me or v not in self._neighbours:
                raise RemoteProtocolError(f"MaskedInputRequest carries shares from non-neighbour {v}")
        check_sharers(len(senders) + 1, self.invite)
        held_b: dict[int, Share] = {}
        held_s: dict[int, Share] = {}
        bad: list[int] = []
        for v, blob in zip(senders, msg.ciphertexts, strict=True):
            try:
                held_b[v], held_s[v] = self._open_share(v, blob, session)
            except CryptoError:
                # One bad neighbour (or a ciphertext altered on the way) does not fail this
                # session.  The neighbour is treated as dropped before the masked input: no share of it is
                # held, it is left out of U2 (so out of the pairwise masks), and the report makes the server
                # exclude it.  Nothing about it can be released later: the device's unmask checks refuse any
                # id outside its U2, so it never gives a b-share or an s-share for it.
                bad.append(v)
        good = [v for v in senders if v in held_b]
        check_sharers(len(good) + 1, self.invite, unusable=len(bad))
        self._held_b.update(held_b)
        self._held_s.update(held_s)
        self._bad = tuple(sorted(bad))
        self._u2 = tuple(sorted((*good, me)))

    def _open_share(self, v: int, blob: bytes, session: bytes) -> tuple[Share, Share]:
        """Decrypt and parse neighbour ``v``'s share ciphertext; CryptoError if it is unusable."""
        me = self.device_id
        key = crypto.share_encryption_key(crypto.x25519(self._c.private_key, self._neighbours[v][0]), session, v, me)
        plaintext = crypto.aead_decrypt(key, blob, crypto.share_associated_data(session, v, me))
        if len(plaintext) != _SHARE_PLAINTEXT_BYTES:
            raise CryptoError(f"share plaintext from {v} has the wrong length")
        src = int.from_bytes(plaintext[:_ID_BYTES], "big")
        dst = int.from_bytes(plaintext[_ID_BYTES : 2 * _ID_BYTES], "big")
        if (src, dst) != (v, me):
            raise CryptoError(f"share from {v} names src={src}, dst={dst}")
        b_share = Share.from_bytes(plaintext[2 * _ID_BYTES : 2 * _ID_BYTES + SHARE_BYTES])
        s_share = Share.from_bytes(plaintext[2 * _ID_BYTES + SHARE_BYTES :])
        if b_share.index != s_share.index:
            raise CryptoError(f"the two shares from {v} carry different indices")
        return b_share, s_share

    def _masked_input(self) -> MaskedInput:
        inv, me, session = self.invite, self.device_id, self._session
        if self._input is None:
            raise LocalProtocolError("provide_input() must be called before the masked input is sent")
        if session is None:  # pragma: no cover
            raise LocalProtocolError("no session id")
        value = self._input
        if inv.dp_mu > 0.0:
            draw = self._draw_noise()
            self._noise = StoredSkellam.of(draw)
            value = value + to_ring(draw.value())
            del draw
        peers = {v: self._neighbours[v][1] for v in self._u2 if v != me}
        y = mask_input(
            value,
            device_id=me,
            self_key=crypto.self_mask_key(self._seed, session, me),
            pair_keys=pair_mask_keys(self._s.private_bytes(), peers, session, me),
        )
        self._input = None  # the update is no longer needed on this path
        return MaskedInput(
            round_id=inv.round_id, device_id=me, session_id=session, masked=y, bad_share_senders=self._bad
        )

    def _draw_noise(self) -> SkellamDraw:
        """Skellam(mu / (t_min - f)): enough noise even if only t_min devices survive and f of them are
        colluders that add none (docs/design.md §5)."""
        inv = self.invite
        return device_noise(inv.dp_mu, inv.dp_t_min, inv.vector_length, self._rng, colluders=inv.dp_colluders)

    def _on_unmask_request(self, msg: UnmaskRequest) -> UnmaskResponse:
        self._check_addressing(msg)
        me, inv, session = self.device_id, self.invite, self._session
        survivors, dropped = msg.survivors, msg.dropped
        # Malicious-server checks (Bonawitz et al. 2017 round 4; FCP client R3; pitfall 3).
        if me in dropped:
            raise RemoteProtocolError("UnmaskRequest lists this device as dropped")
        if len(set(survivors)) != len(survivors) or len(set(dropped)) != len(dropped):
            raise RemoteProtocolError("UnmaskRequest lists a device twice")
        both = set(survivors) & set(dropped)
        if both:
            raise RemoteProtocolError(f"UnmaskRequest lists {sorted(both)} as both survivor and dropped")
        u2 = set(self._u2)
        outside = [v for v in (*survivors, *dropped) if v not in u2]
        if outside:
            raise RemoteProtocolError(
                f"UnmaskRequest names {sorted(outside)}, not neighbours that shared keys with this device"
            )
        if me not in survivors:
            raise RemoteProtocolError("UnmaskRequest does not list this device as a survivor")
        self._check_consistency(msg)
        check_survivor_quorum(len(survivors), msg.n_survivors, inv, signed=self._signed_set is not None)
        excess = np.zeros(0, dtype=np.uint32)
        if inv.dp_mu > 0.0:
            if self._noise is None:  # pragma: no cover - set when the masked input was built
                raise LocalProtocolError("no noise to correct")
            # Keep Skellam(mu / (s - f)) by binomial thinning; the excess is independent of what stays (§5).
            kept, revealed = correct_noise(
                self._noise.draw(), inv.dp_t_min, msg.n_survivors, self._rng, colluders=inv.dp_colluders
            )
            self._kept_after_reply = StoredSkellam.of(kept)  # takes effect only once the excess is actually sent
            excess = to_ring(revealed)
        b_ids = tuple(sorted(survivors))
        s_ids = tuple(sorted(dropped))
        response = UnmaskResponse(
            round_id=inv.round_id,
            device_id=me,
            session_id=session or b"",
            b_share_ids=b_ids,
            b_shares=tuple(self._held_b[v].to_bytes() for v in b_ids),
            s_share_ids=s_ids,
            s_shares=tuple(self._held_s[v].to_bytes() for v in s_ids),
            dp_excess=excess,
        )
        # After answering, nothing else may ever be released.
        self._held_b.clear()
        self._held_s.clear()
        return response


def _check_roster(invite: RoundInvite, own_key: bytes) -> Cohort:
    """Protocol 1.8: the roster a signed round's invite shows, checked before anything is generated: one
    certified identity key per id, ``cohort_size`` of them, this device among them under its own key.

    Why it is enough (the consistency threshold, `protocol.phases.required_signatures`): every signature a
    device counts names (n, roster digest), so all devices that accept one neighbour's keys count signers
    of the same n-device roster, of which at most ⌊γ n⌋ are dishonest; an honest device signs one survivor
    set per round id, ever (the ledger's history); so two different sets each signed by more than
    (n + ⌊γ n⌋) / 2 roster identities would need an honest identity that signed both.  A server that
    shows a smaller n must list every participant in the smaller roster (each checks it is on it), so the
    threshold still counts a majority of everyone who takes part.
    """
    ids, keys = invite.roster_ids, invite.roster_keys
    if not ids or not keys:
        raise RemoteProtocolError(
            "the invite shows no roster of identity keys: this device signs only a cohort it was shown in full"
        )
    if len(set(keys)) != len(keys):
        raise RemoteProtocolError("the roster lists one identity key twice")
    if _roster_key(invite, invite.device_id) != own_key:
        raise RemoteProtocolError(f"the roster does not list this device ({invite.device_id}) under its own key")
    return len(ids), roster_digest(ids, keys)


def _roster_key(invite: RoundInvite, device_id: int) -> bytes | None:
    """The identity key the invite's roster lists for ``device_id`` (None off the roster; the ids are sorted,
    so the device keeps no second copy of an n-entry roster)."""
    ids = invite.roster_ids
    i = bisect.bisect_left(ids, device_id)
    if i < len(ids) and ids[i] == device_id and invite.roster_keys:
        return invite.roster_keys[i]
    return None
