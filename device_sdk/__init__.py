"""fedrec device SDK: models trained on the device (LightFR binary codes with Hamming top-k; real-valued
MF; FELB Boolean MF; FNMF; implicit ALS), the on-device store and the client that takes part in private rounds.

Importing this package never imports aiohttp (the HTTP transport is a separate module).
"""

from __future__ import annotations

from device_sdk.client import (
    ClientConfig,
    DeviceClient,
    RoundOutcome,
    RoundStatus,
    insecure_seeded_rngs,
)
from device_sdk.codes import *  # noqa: F403
from device_sdk.codes import __all__ as _codes_all
from device_sdk.family import FederatedModel, LocalRatings, LocalResult
from device_sdk.felb import FELBConfig, FELBModel
from device_sdk.fnmf import FNMFConfig, FNMFModel
from device_sdk.ials import IALSConfig, IALSModel
from device_sdk.mf import MFConfig, MFModel
from device_sdk.models import LightFRConfig, LightFRModel, LocalUpdate
from device_sdk.store import load_store, save_store
from device_sdk.topk import hamming_distances, topk_hamming
from device_sdk.training import local_round
from device_sdk.transport import LeftRound, Response, Transport, TransportError, raise_for_error
from protocol.errors import *  # noqa: F403
from protocol.errors import __all__ as _errors_all
from protocol.policy import PrivacyPolicy
from protocol.spec import Aggregation

__all__ = [
    "DeviceClient",
    "ClientConfig",
    "PrivacyPolicy",
    "RoundOutcome",
    "RoundStatus",
    "insecure_seeded_rngs",
    "local_round",
    "Transport",
    "LeftRound",
    "Response",
    "TransportError",
    "raise_for_error",
    "LightFRConfig",
    "LightFRModel",
    "LocalUpdate",
    "MFConfig",
    "MFModel",
    "FELBConfig",
    "FELBModel",
    "FNMFConfig",
    "FNMFModel",
    "IALSConfig",
    "IALSModel",
    "FederatedModel",
    "LocalRatings",
    "LocalResult",
    "Aggregation",
    "topk_hamming",
    "hamming_distances",
    "save_store",
    "load_store",
    *_codes_all,
    *_errors_all,
]
