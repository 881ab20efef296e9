"""fedrec protocol: sans-IO messages and codec, crypto helpers, Shamir sharing, the SecAgg+ state
machines, quantization and Skellam noise.

`protocol.accounting` (dp-accounting) is imported as a submodule only, so that `import protocol` on a
device does not load the accountant.
"""

from __future__ import annotations

from protocol.codec import PROTOCOL_VERSION, check_version, decode, encode, is_compatible
from protocol.errors import *  # noqa: F403
from protocol.errors import __all__ as _errors_all
from protocol.messages import (
    Abort,
    EncryptedShares,
    ErrorMessage,
    MaskedInput,
    MaskedInputRequest,
    PublicKeys,
    RoundInvite,
    ShareKeysBroadcast,
    UnmaskRequest,
    UnmaskResponse,
)
from protocol.noise import SkellamDraw, minimum_survivors, sample_skellam, thin, to_ring
from protocol.quantization import QuantizationConfig, QuantizationStats, dequantize_sum, quantize
from protocol.session import (
    TRANSITIONS,
    DeviceSecAggSession,
    Phase,
    RoundParameters,
    SecAggResult,
    ServerSecAggSession,
)
from protocol.spec import Aggregation, ModelKind

__all__ = [
    *_errors_all,
    "PROTOCOL_VERSION",
    "encode",
    "decode",
    "is_compatible",
    "check_version",
    "RoundInvite",
    "PublicKeys",
    "ShareKeysBroadcast",
    "EncryptedShares",
    "MaskedInputRequest",
    "MaskedInput",
    "UnmaskRequest",
    "UnmaskResponse",
    "Abort",
    "ErrorMessage",
    "Phase",
    "TRANSITIONS",
    "RoundParameters",
    "SecAggResult",
    "DeviceSecAggSession",
    "ServerSecAggSession",
    "QuantizationConfig",
    "QuantizationStats",
    "quantize",
    "dequantize_sum",
    "SkellamDraw",
    "sample_skellam",
    "thin",
    "to_ring",
    "minimum_survivors",
    "Aggregation",
    "ModelKind",
]
