"""Argument types, help texts and small checks shared by the ``fedrec`` sub-commands.

Invariants: a type function raises `argparse.ArgumentTypeError` with the bound it checks, so argparse
names the option; the environment (``FEDREC_DATA``) is read here and in the command modules only.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from fedsim.data.datasets import find_data_dir
from protocol.errors import ConfigError
from protocol.spec import MAX_LOCAL_STEPS

__all__ = [
    "DATA_DIR_HELP",
    "JSON_HELP",
    "check_output_file",
    "fraction",
    "local_steps",
    "nonneg_float",
    "nonneg_int",
    "open_fraction",
    "option_name",
    "positive_float",
    "positive_int",
    "resolve_data_dir",
    "weight_or_auto",
    "xor_fraction",
]


def _parse_int(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _parse_int(text, 1)


def local_steps(text: str) -> int:
    # Local epochs, sweeps and steps: the bounds every training plan has (`protocol.plan`).
    value = _parse_int(text, 1)
    if value > MAX_LOCAL_STEPS:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_LOCAL_STEPS}, got {value}")
    return value


def nonneg_int(text: str) -> int:
    return _parse_int(text, 0)


def _parse_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not np.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
    return value


def fraction(text: str) -> float:
    value = _parse_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def open_fraction(text: str) -> float:
    value = _parse_float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


def positive_float(text: str) -> float:
    value = _parse_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def nonneg_float(text: str) -> float:
    value = _parse_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return value


def xor_fraction(text: str) -> float:
    value = _parse_float(text)
    if not 0 <= value <= 0.5:
        raise argparse.ArgumentTypeError(f"must be in [0, 0.5], got {text!r}")
    return value


def weight_or_auto(text: str) -> float | str:
    return "auto" if text.strip().lower() == "auto" else nonneg_float(text)


DATA_DIR_HELP = (
    "FOLDER holding the named datasets (ml-100k/, filmtrust/, filmtrust-lightfr-split/; default: $FEDREC_DATA, "
    "else a ../shared/data folder above the current directory; see docs/datasets.md)"
)


JSON_HELP = (
    "print the result as one JSON object on the last line of stdout (everything else goes to stderr); "
    "schema in docs/cli.md"
)


def resolve_data_dir(arg: Path | None) -> Path | None:
    if arg is not None:
        return arg
    env = os.environ.get("FEDREC_DATA")
    return Path(env) if env else find_data_dir()


def option_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_output_file(flag: str, path: Path) -> None:
    """Refuse, before any work, an output file that cannot be written: a missing folder or a folder
    in its place."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a folder; name a file")
    if not path.parent.is_dir():
        raise ConfigError(f"{flag} {path}: folder {path.parent} does not exist")
