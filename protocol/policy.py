# Invariants:
# - The device decides, not the server: every check here reads only the invite (and, later in the round,
#   what the device itself verified) and the device's own `PrivacyPolicy`; nothing the server says
#   lowers a floor.
# - Fail closed: a field the floor needs that the invite does not state (cohort_size = 0) is a refusal.
# - Light: numpy and the standard library only (no dp-accounting, no scipy), so a phone can import it;
#   the per-round RDP bound is the one the server's accountant uses (`protocol.rdp.skellam_rdp`).
"""The device-side privacy floor (docs/threat-model.md §3.8): what a device refuses to take part in.

A `PrivacyPolicy` sits in the device's configuration with safe defaults.  `check_invite` refuses, with a
`PrivacyFloorViolation` naming the violated floor, an invite whose

* cohort size is not stated, or whose threshold t / neighbourhood k would let an adversary holding the
  policy's fraction of devices collect t shares of this device's secrets (`protocol.graph` rules, with
  the policy's adversary rate): this refuses t = 1, k = 1, and t = 2 where the cohort's safe t is 6;
* noise is below the floor: no noise at all (dp_mu = 0, unless the policy allows rounds without DP), a
  noise multiplier sqrt(mu) / Delta_2 below ``min_noise_multiplier`` (dp_mu = 1e-300), or a survivor
  threshold t_min outside [t, cohort_size] (dp_t_min = 2**62 would make each device add mu / 2**62), or
  noise calibrated against fewer colluding devices than the policy's fraction of the cohort
  (dp_colluders < floor(gamma * n): colluders that skip their noise would leave the honest survivors
  short of mu);
* privacy cost exceeds ``max_epsilon_per_round``, or would take the device's own ledger past
  ``max_epsilon_total`` (`DeviceLedger`, kept by the device across rounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from numpy.typing import NDArray

from protocol.errors import ConfigError, PrivacyFloorViolation, SessionReplayed
from protocol.graph import validate_parameters
from protocol.messages import RoundInvite
from protocol.noise import colluding_devices
from protocol.quantization import sensitivity
from protocol.rdp import ORDERS, rdp_to_epsilon, skellam_rdp

__all__ = ["PrivacyPolicy", "DeviceLedger", "SESSION_HISTORY", "check_invite", "round_rdp", "NO_NOISE_REFUSAL"]

#: Why a device with ``require_noise`` refuses a round without DP noise, and the two settings that would
#: let such a round run: DP on at the server, or the device's explicit opt-out.
NO_NOISE_REFUSAL = (
    "the round adds no DP noise (dp_mu = 0) and this device requires it: run the server with "
    "[privacy] enabled = true, or let the device join rounds without DP with "
    "ClientConfig(privacy=PrivacyPolicy(require_noise=False))"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrivacyPolicy:
    """What a device refuses (defaults are the safe setting for a phone).

    Attributes
    ----------
    adversary_rate : float
        gamma, the fraction of a cohort the device assumes may collude with the server (default 0.05,
        the design's production setting); t and k must keep this device's secrets out of its reach.
    require_noise : bool
        Refuse rounds without DP noise (default True).  A deployment that runs without DP must say so by
        setting it to False; the other floors still hold.
    min_noise_multiplier : float
        Least sqrt(mu) / Delta_2 (aggregate noise std over the L2 sensitivity in quantized units) a DP
        round may ask for (default 0.5).
    max_epsilon_per_round : float
        Most epsilon (at ``delta``) one round may charge this device (default 8.0).
    max_epsilon_total : float
        Most epsilon this device lets itself be charged over all the rounds it joins (default 16.0).
    delta : float
        The delta of the device's own accounting (default 1e-6).
    min_cohort_size : int
        Least cohort size n an invite may state (protocol 1.8; default 2): the operator pins the size
        below which this device's input is not mixed with enough others.  In a signed round n is the
        length of the roster the device signs, so a server cannot understate it without leaving devices
        off the roster, and those refuse.
    placement_safe : bool
        Refuse a sparse round (k < n) whose t an adversary could reach by choosing where its colluders sit
        (default True, protocol 1.9): the server places the neighbourhoods, so it can put ⌊γ n⌋ colluders
        around this device, report its other neighbours as dropped and hold ⌊γ n⌋ + 1 shares of its self
        mask (the device releases its own).  True asks t >= ⌊γ n⌋ + 2 (`protocol.graph.placement_floor`)
        or k = n, which the parameter finder's (k, t) always meet.  False trusts the server to place the
        devices at random (the semi-honest setting of Bell et al. 2020).
    enforce : bool
        False only for `PrivacyPolicy.no_floor` (simulations of tiny cohorts and tests).

    Raises
    ------
    ConfigError
        A value out of range.
    """

    adversary_rate: float = 0.05
    require_noise: bool = True
    min_noise_multiplier: float = 0.5
    max_epsilon_per_round: float = 8.0
    max_epsilon_total: float = 16.0
    delta: float = 1e-6
    min_cohort_size: int = 2
    placement_safe: bool = True
    enforce: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.adversary_rate) and 0.0 <= self.adversary_rate < 0.5):
            raise ConfigError(f"adversary_rate must be in [0, 0.5), got {self.adversary_rate!r}")
        for name in ("min_noise_multiplier", "max_epsilon_per_round", "max_epsilon_total"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0 and not math.isnan(value)):
                raise ConfigError(f"{name} must be > 0, got {value!r}")
        if not (0.0 < self.delta < 1.0):
            raise ConfigError(f"delta must be in (0, 1), got {self.delta!r}")
        if type(self.min_cohort_size) is not int or self.min_cohort_size < 2:
            raise ConfigError(f"min_cohort_size must be an integer >= 2, got {self.min_cohort_size!r}")

    @classmethod
    def no_floor(cls) -> PrivacyPolicy:
        """TEST HOOK: a policy that checks nothing (simulations of tiny cohorts, protocol tests).

        A device running it takes part in any round the server designs, including rounds that reveal its
        input to the server; never use it on a real device.
        """
        return cls(require_noise=False, enforce=False)


def round_rdp(invite: RoundInvite) -> NDArray[np.float64]:
    """The RDP curve (at `protocol.rdp.ORDERS`) one DP round charges a participating device.

    Raises
    ------
    ConfigError
        The invite carries no noise (dp_mu = 0).
    """
    l2, l1 = sensitivity(invite.quantization(), invite.vector_length)
    return skellam_rdp(invite.dp_mu, l1, l2)


@lru_cache(maxsize=256)
def _graph_floor(n: int, k: int, t: int, adversary_rate: float, placement_safe: bool) -> str | None:
    # Only the privacy side of the graph rules: no dropouts assumed, so liveness never refuses a round.
    try:
        validate_parameters(n, k, t, 0.0, adversary_rate, adversarial_placement=placement_safe)
    except ConfigError as exc:
        return str(exc)
    return None


def check_invite(invite: RoundInvite, policy: PrivacyPolicy, ledger: DeviceLedger | None = None) -> float:
    """Refuse an invite below the device's floor; return the epsilon the round would charge (0 without DP).

    Parameters
    ----------
    invite : RoundInvite
        The round's parameters as the server sent them.
    policy : PrivacyPolicy
        The device's floor.
    ledger : DeviceLedger, optional
        The device's own record of what it was charged so far.

    Returns
    -------
    float
        The round's epsilon at ``policy.delta``.

    Raises
    ------
    PrivacyFloorViolation
        Naming the floor the invite breaks.
    """
    if not policy.enforce:
        return 0.0
    n, k, t = invite.cohort_size, invite.graph_k, invite.graph_t
    if n < 2:
        raise PrivacyFloorViolation(f"the invite states no usable cohort size (cohort_size={n}); refused")
    if n < policy.min_cohort_size:
        raise PrivacyFloorViolation(
            f"cohort of {n} is below this device's pinned minimum cohort size {policy.min_cohort_size}"
        )
    if k > n:
        raise PrivacyFloorViolation(f"neighbourhood k={k} exceeds the stated cohort of {n}")
    problem = _graph_floor(n, k, t, policy.adversary_rate, policy.placement_safe)
    if problem is not None:
        raise PrivacyFloorViolation(f"k={k}, t={t} for a cohort of {n} is below this device's floor: {problem}")
    if invite.dp_mu <= 0.0:
        if policy.require_noise:
            raise PrivacyFloorViolation(NO_NOISE_REFUSAL)
        return 0.0
    if not (t <= invite.dp_t_min <= n):
        raise PrivacyFloorViolation(
            f"survivor threshold t_min={invite.dp_t_min} must be in [t={t}, cohort {n}]: each device adds "
            "mu / (t_min - colluders)"
        )
    colluders = colluding_devices(n, policy.adversary_rate)
    if invite.dp_colluders < colluders:
        raise PrivacyFloorViolation(
            f"the noise is calibrated against {invite.dp_colluders} colluding devices, fewer than the "
            f"{colluders} this device assumes in a cohort of {n} (adversary_rate {policy.adversary_rate}): "
            "colluders that skip their noise would leave less than mu"
        )
    l2, _ = sensitivity(invite.quantization(), invite.vector_length)
    z = math.sqrt(invite.dp_mu) / l2
    if not z >= policy.min_noise_multiplier:
        raise PrivacyFloorViolation(
            f"noise multiplier sqrt(mu)/Delta_2 = {z:.3g} is below this device's floor {policy.min_noise_multiplier}"
        )
    curve = round_rdp(invite)
    eps = rdp_to_epsilon(curve, policy.delta)
    if eps > policy.max_epsilon_per_round:
        raise PrivacyFloorViolation(
            f"the round costs ε={eps:.3g}, above this device's {policy.max_epsilon_per_round} per round"
        )
    if ledger is not None:
        total = rdp_to_epsilon(ledger.rdp + curve, policy.delta)
        if total > policy.max_epsilon_total:
            raise PrivacyFloorViolation(
                f"joining would take this device to ε={total:.3g}, above its budget {policy.max_epsilon_total}"
            )
    return eps


#: Most (round id, session id) pairs a device's ledger keeps; older ones are folded into its round floor.
SESSION_HISTORY = 4096


@dataclass(slots=True)
class DeviceLedger:
    """The privacy a device has been charged, kept by the device itself (an RDP curve at `ORDERS`), and the
    history of the sessions it took part in (protocol 1.8).

    A round is charged when the device releases its masked input, whatever happens afterwards.  A round id
    enters the history when the device creates its session for it, before any key is generated or
    signed, and the session id once the ShareKeys broadcast names it, before any share is made.  A round
    id with a session id is refused for good: a device makes shares in at most one session per round id
    and signs at most one survivor set per round id, ever, whatever session id a server names.  Until
    then the same round may be joined again (the server hands the invitation out again when a device's
    key advertisement was lost; the keys of the abandoned session are gone).  The history is
    bounded (`SESSION_HISTORY` pairs); a pair pushed out raises ``round_floor`` to its round id, and round
    ids at or below the floor are refused as well (the server numbers its rounds in increasing order).
    """

    rdp: NDArray[np.float64] = field(default_factory=lambda: np.zeros(len(ORDERS)))
    rounds: int = 0
    sessions: dict[int, bytes] = field(default_factory=dict)
    round_floor: int = -1

    def charge(self, invite: RoundInvite) -> None:
        """Add one DP round (no-op without noise)."""
        if invite.dp_mu > 0.0:
            self.rdp = self.rdp + round_rdp(invite)
            self.rounds += 1

    def epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta``."""
        return rdp_to_epsilon(self.rdp, delta)

    def admit_round(self, round_id: int) -> None:
        """Record that this device takes part in round ``round_id``, or refuse a round id it already used.

        Raises
        ------
        SessionReplayed
            ``round_id`` is in the history with a session id, or at or below its floor.
        """
        if self.sessions.get(round_id) or round_id <= self.round_floor:
            raise SessionReplayed(
                f"this device already took part in a session of round {round_id}: a second session for one round "
                "is refused (it would let the server replay signatures of the first)"
            )
        if round_id in self.sessions:
            return  # admitted before, but left before any session id, share or signature: the same invitation
        self.sessions[round_id] = b""
        while len(self.sessions) > SESSION_HISTORY:
            oldest = next(iter(self.sessions))
            del self.sessions[oldest]
            self.round_floor = max(self.round_floor, oldest)

    def record_session(self, round_id: int, session_id: bytes) -> None:
        """Name the session id of an admitted round (for the record; the round id alone is what is refused)."""
        if round_id in self.sessions:
            self.sessions[round_id] = bytes(session_id)

    def to_dict(self) -> dict[str, Any]:
        """The store form."""
        return {
            "orders": list(ORDERS),
            "rdp": [float(x) for x in self.rdp],
            "rounds": self.rounds,
            "sessions": [[r, s.hex()] for r, s in self.sessions.items()],
            "round_floor": self.round_floor,
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> DeviceLedger:
        """Rebuild from `to_dict` (a ledger written before protocol 1.8 has no session history).

        Raises
        ------
        ConfigError
            The record does not match this build's orders or is malformed.
        """
        orders, rdp, rounds = state.get("orders"), state.get("rdp"), state.get("rounds")
        if orders != list(ORDERS) or not isinstance(rdp, list) or len(rdp) != len(ORDERS) or type(rounds) is not int:
            raise ConfigError("malformed device privacy ledger")
        curve = np.asarray(rdp, dtype=np.float64)
        if not np.all(np.isfinite(curve)) or np.any(curve < 0) or rounds < 0:
            raise ConfigError("malformed device privacy ledger")
        return cls(rdp=curve, rounds=rounds, **_history_from_dict(state))


def _history_from_dict(state: dict[str, Any]) -> dict[str, Any]:
    pairs, floor = state.get("sessions", []), state.get("round_floor", -1)
    if not isinstance(pairs, list) or type(floor) is not int or len(pairs) > SESSION_HISTORY:
        raise ConfigError("malformed session history in the device ledger")
    sessions: dict[int, bytes] = {}
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int and isinstance(pair[1], str)):
            raise ConfigError("malformed session history in the device ledger")
        try:
            sessions[pair[0]] = bytes.fromhex(pair[1])
        except ValueError:
            raise ConfigError("malformed session history in the device ledger") from None
    return {"sessions": sessions, "round_floor": floor}
