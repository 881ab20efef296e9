"""Field checks shared by the server configuration's sections (`agg_server.config`,
`agg_server.config_families`).

Each returns the normalised value or raises ``ConfigError("<key>: must be <what>, got <value>")``, the
message starting with the exact TOML key.  Numbers use the training plan's checks (`protocol.plan`), so a
key and the parameter it sets are refused with the same words.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from protocol.errors import ConfigError
from protocol.plan import check_float, check_int


def _fail(key: str, what: str, value: object) -> ConfigError:
    return ConfigError(f"{key}: must be {what}, got {value!r}")


def _int(key: str, value: object, **bounds: int | None) -> int:
    # The same checks, and messages, as the training plan's parameters (`protocol.plan`).
    try:
        return check_int(key, value, **bounds)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _float(key: str, value: object, **bounds: Any) -> float:
    try:
        return check_float(key, value, **bounds)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _fail(key, "true or false", value)
    return value


def _choice(key: str, value: object, choices: tuple[str, ...], *, fold_case: bool = False) -> str:
    what = "one of " + ", ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        raise _fail(key, what, value)
    text = value.lower() if fold_case else value
    if text not in choices:
        raise _fail(key, what, value)
    return text


def _optional_path(key: str, value: object) -> Path | None:
    if value is None:
        return None
    return _path(key, value)


def _path(key: str, value: object) -> Path:
    if isinstance(value, Path):
        return value
    if isinstance(value, str | os.PathLike) and os.fspath(value):
        return Path(value)
    raise _fail(key, "a non-empty path", value)


def _set(obj: object, name: str, value: object) -> None:
    # Normalising a frozen dataclass's own field during __post_init__ is the one sanctioned bypass.
    object.__setattr__(obj, name, value)


def _is_default(value: object, default: object) -> bool:
    """Whether a configured value is the key's default (an int for a float default counts; a bool never
    stands for a number, nor a number for a bool)."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return bool(type(value) is type(default) or (_is_number(value) and _is_number(default))) and value == default


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
