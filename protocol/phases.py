# Invariants (h11's `_state.py` rule: everything that changes a session's phase lives here):
# - `TRANSITIONS` lists every legal (role, phase, direction, message type) and the phase it leads to; the
#   device session (`protocol.device_session`) and the server session (`protocol.server_session`) both
#   consult it in `send` and `receive` before doing anything else.  `CLOSE_TRANSITIONS` is the server's second
#   table: the phase an active phase leads to when it closes on quorum or deadline (h11's state-triggered
#   transitions), so no session restates the phase order.
# - Every quorum, deadline and threshold rule of a round is a function here, called by both sides where
#   both need it: `require_quorum` (server: a phase closes with at least t, and t_min with DP),
#   `prune_unmaskable` (server: a device whose neighbourhood kept fewer than t sharers cannot be unmasked),
#   `phase_deadline` (which deadline closes which phase), `check_neighbourhood` (device: t <= |N(u)| <= k),
#   `check_survivor_quorum` (device: enough surviving neighbours, n_survivors consistent and >= t_min).
# - Pure: no clock, no I/O, no randomness.
"""SecAgg+ phases, the transition table and every quorum/deadline/threshold rule (docs/design.md §4–5)."""

from __future__ import annotations

from collections.abc import Mapping, Set
from enum import Enum
from types import MappingProxyType

from protocol.errors import NotEnoughParticipants, RemoteProtocolError
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

__all__ = [
    "ACTIVE_PHASES",
    "TERMINAL_PHASES",
    "Phase",
    "Role",
    "Direction",
    "TRANSITIONS",
    "CLOSE_TRANSITIONS",
    "DEVICE_REPLY",
    "SERVER_BROADCAST",
    "SERVER_EXPECTS",
    "phase_deadline",
    "require_quorum",
    "prune_unmaskable",
    "check_neighbourhood",
    "check_sharers",
    "check_survivor_quorum",
    "consistency_deadline",
    "required_signatures",
]


class Phase(Enum):
    """Protocol phase of a session."""

    ADVERTISE_KEYS = "advertise_keys"
    SHARE_KEYS = "share_keys"
    MASKED_INPUT = "masked_input"
    UNMASK = "unmask"
    DONE = "done"
    ABORTED = "aborted"
    ERROR = "error"


class Role(Enum):
    """Which side a transition belongs to."""

    DEVICE = "device"
    SERVER = "server"


class Direction(Enum):
    """Whether the session's owner sends or receives the message."""

    SEND = "send"
    RECEIVE = "receive"


ACTIVE_PHASES = (Phase.ADVERTISE_KEYS, Phase.SHARE_KEYS, Phase.MASKED_INPUT, Phase.UNMASK)
TERMINAL_PHASES = frozenset({Phase.DONE, Phase.ABORTED, Phase.ERROR})


def _build_transitions() -> Mapping[tuple[Role, Phase, Direction, type[Message]], Phase]:
    d, s = Role.DEVICE, Role.SERVER
    snd, rcv = Direction.SEND, Direction.RECEIVE
    a, sk, mi, um = ACTIVE_PHASES
    table: dict[tuple[Role, Phase, Direction, type[Message]], Phase] = {
        # device: receive the server's message of the phase, then send its reply, which ends the phase
        (d, a, snd, PublicKeys): sk,
        (d, sk, rcv, ShareKeysBroadcast): sk,
        (d, sk, snd, EncryptedShares): mi,
        (d, mi, rcv, MaskedInputRequest): mi,
        (d, mi, snd, MaskedInput): um,
        (d, um, rcv, ConsistencyRequest): um,  # protocol 1.3: sign U3 before any share is released
        (d, um, snd, ConsistencySignature): um,
        (d, um, rcv, UnmaskRequest): um,
        (d, um, snd, UnmaskResponse): Phase.DONE,
        # server: the phase broadcast goes out and the devices' replies come in; phases close on quorum
        # or deadline (`advance`), not on a message
        (s, a, snd, RoundInvite): a,
        (s, a, rcv, PublicKeys): a,
        (s, sk, snd, ShareKeysBroadcast): sk,
        (s, sk, rcv, EncryptedShares): sk,
        (s, mi, snd, MaskedInputRequest): mi,
        (s, mi, rcv, MaskedInput): mi,
        (s, um, snd, ConsistencyRequest): um,
        (s, um, rcv, ConsistencySignature): um,
        (s, um, snd, UnmaskRequest): um,
        (s, um, rcv, UnmaskResponse): um,
        (s, Phase.ABORTED, snd, Abort): Phase.ABORTED,
    }
    for phase in ACTIVE_PHASES:
        table[(d, phase, rcv, Abort)] = Phase.ABORTED
        table[(d, phase, rcv, ErrorMessage)] = Phase.ABORTED
        table[(d, phase, snd, Abort)] = Phase.ABORTED
        # a device leaving (Abort) or reporting an error is a dropout; the round goes on
        table[(s, phase, rcv, Abort)] = phase
        table[(s, phase, rcv, ErrorMessage)] = phase
        table[(s, phase, snd, Abort)] = phase  # to a device that was dropped from the round
    return MappingProxyType(table)


#: Every legal (role, phase, direction, message type) → the phase after it.
TRANSITIONS: Mapping[tuple[Role, Phase, Direction, type[Message]], Phase] = _build_transitions()

#: Server: the phase after an active phase closes (on quorum or deadline, `advance`, not on a message).  UNMASK
#: leads to DONE once the masks are off (with protocol 1.3 its consistency sub-step closes first, in place).
CLOSE_TRANSITIONS: Mapping[Phase, Phase] = MappingProxyType(
    {
        Phase.ADVERTISE_KEYS: Phase.SHARE_KEYS,
        Phase.SHARE_KEYS: Phase.MASKED_INPUT,
        Phase.MASKED_INPUT: Phase.UNMASK,
        Phase.UNMASK: Phase.DONE,
    }
)

# The message each device phase sends, and each server phase broadcasts.
DEVICE_REPLY: Mapping[Phase, type[Message]] = MappingProxyType(
    {
        Phase.ADVERTISE_KEYS: PublicKeys,
        Phase.SHARE_KEYS: EncryptedShares,
        Phase.MASKED_INPUT: MaskedInput,
        Phase.UNMASK: UnmaskResponse,
    }
)
SERVER_BROADCAST: Mapping[Phase, type[Message]] = MappingProxyType(
    {
        Phase.ADVERTISE_KEYS: RoundInvite,
        Phase.SHARE_KEYS: ShareKeysBroadcast,
        Phase.MASKED_INPUT: MaskedInputRequest,
        Phase.UNMASK: UnmaskRequest,
    }
)
SERVER_EXPECTS: Mapping[type[Message], Phase] = MappingProxyType(
    {
        PublicKeys: Phase.ADVERTISE_KEYS,
        EncryptedShares: Phase.SHARE_KEYS,
        MaskedInput: Phase.MASKED_INPUT,
        UnmaskResponse: Phase.UNMASK,
        ConsistencySignature: Phase.UNMASK,
    }
)


def phase_deadline(phase: Phase, deadlines: tuple[float, float, float, float]) -> float:
    """The absolute deadline that closes an active phase (deadlines in `ACTIVE_PHASES` order).

    Raises
    ------
    ValueError
        ``phase`` is not active.
    """
    return deadlines[ACTIVE_PHASES.index(phase)]


def require_quorum(count: int, what: str, *, t: int, dp_mu: float, dp_t_min: int) -> None:
    """Server rule: a phase may close only with at least t devices, and at least t_min with DP noise.

    Raises
    ------
    NotEnoughParticipants
        Below t (the round aborts with nothing revealed) or, with DP, below t_min (the noise would not
        cover mu).
    """
    if count < t:
        raise NotEnoughParticipants(f"{count} {what}, below the threshold t={t}; round aborted unrevealed")
    if dp_mu > 0.0 and count < dp_t_min:
        raise NotEnoughParticipants(f"{count} {what}, below t_min={dp_t_min} needed for the DP guarantee")


def prune_unmaskable(sharers: Set[int], graph: Mapping[int, tuple[int, ...]], t: int) -> frozenset[int]:
    """Server rule: drop every device whose neighbourhood kept fewer than t sharers, until none is left.

    Dropping a device shrinks its neighbours' counts, so the rule repeats to a fixed point.

    Parameters
    ----------
    sharers : set of int
        Devices whose EncryptedShares arrived (U2 before pruning).
    graph : mapping of int to tuple of int
        Each device's neighbourhood (itself included).
    t : int
        Shamir threshold.

    Returns
    -------
    frozenset of int
        U2.
    """
    u2 = set(sharers)
    changed = True
    while changed:
        changed = False
        for u in sorted(u2):
            if sum(1 for v in graph[u] if v in u2) < t:
                u2.discard(u)
                changed = True
    return frozenset(u2)


def check_neighbourhood(size: int, invite: RoundInvite) -> None:
    """Device rule: a ShareKeys neighbourhood (itself included) holds between t and k devices.

    Raises
    ------
    RemoteProtocolError
        Fewer than t (shares could never be reconstructed) or more than k.
    """
    if size < invite.graph_t:
        raise RemoteProtocolError(f"neighbourhood of {size} is below the threshold t={invite.graph_t}")
    if size > invite.graph_k:
        raise RemoteProtocolError(f"neighbourhood of {size} exceeds k={invite.graph_k}")


def check_sharers(count: int, invite: RoundInvite, *, unusable: int = 0) -> None:
    """Device (and server) rule: at least t neighbours (the device included) shared usable keys before the
    masked input.  ``unusable`` counts the senders already set aside because their ciphertext was unusable
    (only for the message).

    Raises
    ------
    RemoteProtocolError
        Fewer than t.
    """
    if count < invite.graph_t:
        extra = f" ({unusable} more sent unusable share ciphertexts)" if unusable else ""
        raise RemoteProtocolError(
            f"only {count} neighbours shared usable keys{extra}, below the threshold t={invite.graph_t}"
        )


def check_survivor_quorum(survivors: int, n_survivors: int, invite: RoundInvite, *, signed: bool = False) -> None:
    """Device rule before unmasking: at least t surviving neighbours, a consistent survivor count, and with
    DP at least t_min survivors (fewer would leave less noise than mu after the correction).

    Parameters
    ----------
    survivors : int
        Surviving neighbours listed in the UnmaskRequest (this device included).
    n_survivors : int
        The round's survivor count the request claims.
    invite : RoundInvite
        The round's parameters.
    signed : bool
        Protocol 1.3: n_survivors counts the survivors that signed the survivor set (checked by the
        device), which may be fewer than the surviving neighbours listed.

    Raises
    ------
    RemoteProtocolError
        One of the conditions fails.
    """
    if survivors < invite.graph_t:
        raise RemoteProtocolError(f"only {survivors} surviving neighbours, below the threshold t={invite.graph_t}")
    if n_survivors < survivors and not signed:
        raise RemoteProtocolError("n_survivors is smaller than the survivor list")
    if invite.cohort_size and n_survivors > invite.cohort_size:
        raise RemoteProtocolError(
            f"n_survivors={n_survivors} exceeds the invited cohort of {invite.cohort_size}: an overstated survivor "
            "count would shrink every device's kept noise"
        )
    if invite.dp_mu > 0.0 and n_survivors < invite.dp_t_min:
        raise RemoteProtocolError(
            f"{n_survivors} survivors is below t_min={invite.dp_t_min}: the noise would not cover mu"
        )


def consistency_deadline(deadlines: tuple[float, float, float, float]) -> float:
    """Protocol 1.3: the consistency check (signing U3) closes halfway between the masked-input and the
    unmask deadlines; the unmask step keeps the other half."""
    return deadlines[2] + (deadlines[3] - deadlines[2]) / 2.0


def required_signatures(invite: RoundInvite, adversary_rate: float = 0.0) -> int:
    """Protocol 1.3: how many valid survivor signatures on ONE set U3 a device needs before it unmasks.

    At least t; with DP at least t_min (the DP correction counts signed survivors); and a strict majority
    of the cohort plus the adversary's share, ⌊(n + ⌊γ n⌋) / 2⌋ + 1, so that honest devices, which sign
    one set each, can never have signed two different sets that both pass (the attack in which some
    neighbours of X are told X survived and others that X dropped).
    """
    n = invite.cohort_size
    need = invite.graph_t
    if invite.dp_mu > 0.0:
        need = max(need, invite.dp_t_min)
    if n > 0:
        need = max(need, (n + int(adversary_rate * n)) // 2 + 1)
    return need
