"""Shared pytest fixtures.

``shared_data`` locates the real datasets (``$FEDREC_DATA`` or ``../shared/data``).  When they are
missing, tests using it skip with the reason, except under CI (``$CI`` set), where missing data is a
failure: CI must exercise the real-data checks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import pytest

from fedsim.data.datasets import find_data_dir

_EXPECTED = (
    "ml-100k/u.data",
    "filmtrust/ratings.txt",
    "filmtrust-lightfr-split/filmtrust_train.csv",
    "amazon-book-kgat/train.txt",
    "amazon-book-kgat/test.txt",
)


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so real-data tests must run)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path of the shared dataset folder; skips (or fails under ``$CI``) when it is missing."""
    base = find_data_dir()
    if base is None:
        _unavailable(
            "real datasets not found: FEDREC_DATA is not set and no ../shared/data folder is above the checkout "
            "or the current directory (docs/datasets.md)"
        )
    if not base.is_dir():
        _unavailable(f"real datasets not found: FEDREC_DATA={base} is not a folder (docs/datasets.md)")
    missing = [name for name in _EXPECTED if not (base / name).is_file()]
    if missing:
        _unavailable(f"real datasets incomplete under {base}: missing {', '.join(missing)}")
    return base


# -- test layers ----------------------------------------------------------------------------------
# The unit layer runs no server, socket, fleet or real dataset; the integration layer starts real
# servers (aiohttp on loopback, `fedrec-server` processes), fleets of device clients, the example
# scripts, the CLI end to end or a browser, or trains and evaluates on the real datasets.  A test is
# integration when it uses a loopback-server fixture or the real datasets (`shared_data`), lives in one
# of these modules, or says so with ``@pytest.mark.integration``.  `.ci/run` runs the two layers
# as two steps; together they are exactly ``python -m pytest``.
_INTEGRATION_FIXTURES = frozenset({"aiohttp_server", "aiohttp_client", "aiohttp_raw_server", "shared_data"})
_INTEGRATION_MODULES = frozenset(
    {
        "test_dashboard_browser",
        "test_examples",
        "test_fedsim_cli",
        "test_readme_commands",
        "test_server_cli",
        "test_server_crash",
        "test_server_tls",
    }
)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
        if _INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())) or module in _INTEGRATION_MODULES:
            item.add_marker(pytest.mark.integration)
