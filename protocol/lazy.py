"""Lazy package exports (PEP 562): a package's public names are imported on first use, so importing the
package (or one light submodule of it) does not load every heavy module behind its ``__all__``.

The one loader for `protocol`, `agg_server` and `fedsim`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, table: dict[str, str], namespace: dict[str, Any], *, prefix: str = ""
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: name ``n`` is imported from module
    ``prefix + table[n]`` on first access and cached in ``namespace`` (the package's ``globals()``)."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(prefix + module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
