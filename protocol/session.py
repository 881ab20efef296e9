"""SecAgg+ device and server state machines (docs/design.md §4–5; Bonawitz et al. 2017; Bell et al. 2020).

The public home of the session API; the code lives in five modules:

* `protocol.phases`: the phases, the transition table and every quorum/deadline/threshold rule;
* `protocol.device_session`: `DeviceSecAggSession`;
* `protocol.round_params`: `RoundParameters`;
* `protocol.server_session`: `SecAggResult`, `ServerSecAggSession`;
* `protocol.fixed_secrets`: `FixedDeviceSecrets`, for known-answer test vectors only.
"""

from __future__ import annotations

from protocol.device_session import DeviceSecAggSession
from protocol.fixed_secrets import FixedDeviceSecrets
from protocol.phases import ACTIVE_PHASES, TRANSITIONS, Direction, Phase, Role
from protocol.round_params import RoundParameters
from protocol.server_session import SecAggResult, ServerSecAggSession

__all__ = [
    "ACTIVE_PHASES",
    "Phase",
    "Role",
    "Direction",
    "TRANSITIONS",
    "RoundParameters",
    "SecAggResult",
    "FixedDeviceSecrets",
    "DeviceSecAggSession",
    "ServerSecAggSession",
]
