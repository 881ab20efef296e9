"""fedrec protocol: sans-IO messages and codec, crypto helpers, Shamir sharing, the SecAgg+ state
machines, quantization and Skellam noise.

The names re-exported here load their submodule on first use (PEP 562), so `import protocol.crypto`
on a device does not also load the server's session, and `protocol.accounting` (dp-accounting) is
imported as a submodule only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.errors import *  # noqa: F403
from protocol.errors import __all__ as _errors_all
from protocol.lazy import lazy_exports

if TYPE_CHECKING:  # the names below, for type checkers; at run time they load on first use
    from protocol.codec import check_version, decode, encode, is_compatible
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
    from protocol.spec import PROTOCOL_VERSION, Aggregation, ModelKind

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


# name -> the submodule that defines it, for the lazy loader below.
_LAZY = {
    "PROTOCOL_VERSION": "spec",
    "check_version": "codec",
    "decode": "codec",
    "encode": "codec",
    "is_compatible": "codec",
    "Abort": "messages",
    "EncryptedShares": "messages",
    "ErrorMessage": "messages",
    "MaskedInput": "messages",
    "MaskedInputRequest": "messages",
    "PublicKeys": "messages",
    "RoundInvite": "messages",
    "ShareKeysBroadcast": "messages",
    "UnmaskRequest": "messages",
    "UnmaskResponse": "messages",
    "SkellamDraw": "noise",
    "minimum_survivors": "noise",
    "sample_skellam": "noise",
    "thin": "noise",
    "to_ring": "noise",
    "QuantizationConfig": "quantization",
    "QuantizationStats": "quantization",
    "dequantize_sum": "quantization",
    "quantize": "quantization",
    "TRANSITIONS": "phases",
    "DeviceSecAggSession": "device_session",
    "Phase": "phases",
    "RoundParameters": "round_params",
    "SecAggResult": "server_session",
    "ServerSecAggSession": "server_session",
    "Aggregation": "spec",
    "ModelKind": "spec",
}


__getattr__, __dir__ = lazy_exports("protocol", _LAZY, globals(), prefix="protocol.")
