"""fedrec aggregation server: configuration, storage, the round coordinator, strategies and the
aiohttp application (`create_app`)."""

from __future__ import annotations

from agg_server.app import create_app
from agg_server.config import (
    ListenConfig,
    LogSection,
    ModelSection,
    PrivacySection,
    RoundSection,
    ServerConfig,
    config_from_dict,
    load_config,
)
from agg_server.coordinator import RoundCoordinator
from agg_server.storage import Storage
from agg_server.strategy import (
    LightFRServerStrategy,
    LightFRStrategy,
    Strategy,
    agg_grad,
    agg_para,
    build_strategy,
    cold_start_items,
)
from agg_server.strategy.felb import FELBStrategy
from agg_server.strategy.fnmf import FNMFStrategy, TrustedBarycenterFNMF
from agg_server.strategy.mf import MFStrategy
from protocol.errors import *  # noqa: F403
from protocol.errors import __all__ as _errors_all

__all__ = [
    "create_app",
    "ServerConfig",
    "ListenConfig",
    "ModelSection",
    "RoundSection",
    "PrivacySection",
    "LogSection",
    "load_config",
    "config_from_dict",
    "RoundCoordinator",
    "Storage",
    "LightFRStrategy",
    "LightFRServerStrategy",
    "MFStrategy",
    "FELBStrategy",
    "FNMFStrategy",
    "TrustedBarycenterFNMF",
    "Strategy",
    "build_strategy",
    "agg_grad",
    "agg_para",
    "cold_start_items",
    *_errors_all,
]
