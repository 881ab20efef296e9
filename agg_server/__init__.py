"""fedrec aggregation server: configuration, storage, the round coordinator, strategies and the
aiohttp application (`create_app`).

The names re-exported here load their module on first use (PEP 562), so importing one light module
(`agg_server.config`, the operator's `agg_server.authority`) does not load aiohttp and dp-accounting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.errors import *  # noqa: F403
from protocol.errors import __all__ as _errors_all
from protocol.lazy import lazy_exports

if TYPE_CHECKING:  # the names below, for type checkers; at run time they load on first use (PEP 562)
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
    from agg_server.strategy.ials import IALSStrategy
    from agg_server.strategy.mf import MFStrategy

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
    "IALSStrategy",
    "Strategy",
    "build_strategy",
    "agg_grad",
    "agg_para",
    "cold_start_items",
    *_errors_all,
]

# exported name -> the module that defines it, imported on first use
_LAZY = {
    "create_app": "agg_server.app",
    "ListenConfig": "agg_server.config",
    "LogSection": "agg_server.config",
    "ModelSection": "agg_server.config",
    "PrivacySection": "agg_server.config",
    "RoundSection": "agg_server.config",
    "ServerConfig": "agg_server.config",
    "config_from_dict": "agg_server.config",
    "load_config": "agg_server.config",
    "RoundCoordinator": "agg_server.coordinator",
    "Storage": "agg_server.storage",
    "LightFRServerStrategy": "agg_server.strategy",
    "LightFRStrategy": "agg_server.strategy",
    "Strategy": "agg_server.strategy",
    "agg_grad": "agg_server.strategy",
    "agg_para": "agg_server.strategy",
    "build_strategy": "agg_server.strategy",
    "cold_start_items": "agg_server.strategy",
    "FELBStrategy": "agg_server.strategy.felb",
    "FNMFStrategy": "agg_server.strategy.fnmf",
    "TrustedBarycenterFNMF": "agg_server.strategy.fnmf",
    "MFStrategy": "agg_server.strategy.mf",
    "IALSStrategy": "agg_server.strategy.ials",
}


__getattr__, __dir__ = lazy_exports("agg_server", _LAZY, globals())
