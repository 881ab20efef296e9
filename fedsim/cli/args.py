"""What the ``fedrec`` sub-commands share: the `Command` each one declares, argument types, the option
groups several commands add the same way, help texts and small checks.

Invariants: a type function raises `argparse.ArgumentTypeError` with the bound it checks, so argparse
names the option; the environment (``FEDREC_DATA``) is read here and in the command modules only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from fedsim.data.datasets import find_data_dir
from protocol.errors import ConfigError
from protocol.spec import MAX_LOCAL_STEPS

__all__ = [
    "DATA_DIR_HELP",
    "JSON_HELP",
    "Command",
    "add_data_dir",
    "add_dataset",
    "add_json",
    "add_plot",
    "add_quiet",
    "add_run_file",
    "add_seed",
    "check_output_file",
    "fraction",
    "local_steps",
    "nonneg_float",
    "nonneg_int",
    "open_fraction",
    "option_defaults",
    "option_name",
    "positive_float",
    "positive_int",
    "resolve_data_dir",
    "weight_or_auto",
    "xor_fraction",
]


#: Where options go: a parser or one of its argument groups.
Options = argparse._ActionsContainer


@dataclass(frozen=True)
class Command:
    """One ``fedrec`` sub-command, declared once by its module: `fedsim.cli.build_parser` adds its parser
    (``name``, with ``help`` in ``fedrec --help`` and ``description`` in its own ``--help``), then its options
    (``add_options``); `fedsim.cli.main` runs it (``run`` returns the exit status)."""

    name: str
    help: str
    description: str | None
    add_options: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, TextIO], int]


def option_defaults(add_options: Callable[[argparse.ArgumentParser], None]) -> argparse.Namespace:
    """Every option's value when not given, for the options ``add_options`` adds."""
    parser = argparse.ArgumentParser()
    add_options(parser)
    return parser.parse_args([])


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


_RUN_FILE_HELP = "a run file written by 'fedrec simulate --save'"


def add_data_dir(p: Options) -> None:
    """``--data-dir FOLDER``: where the named datasets are (`resolve_data_dir`)."""
    p.add_argument("--data-dir", type=Path, default=None, metavar="FOLDER", help=DATA_DIR_HELP)


def add_dataset(p: Options, help: str, default: str | None = None, required: bool = False) -> None:
    """``--dataset`` (a name or a ratings file) and ``--data-dir``, the folder its names are looked up in."""
    p.add_argument("--dataset", default=default, required=required, help=help)
    add_data_dir(p)


def add_seed(p: Options, help: str, type: Callable[[str], int] = nonneg_int) -> None:
    """``--seed`` (default 0); ``help`` says what this command seeds with it."""
    p.add_argument("--seed", type=type, default=0, help=help)


def add_run_file(p: Options, nargs: str | None = None) -> None:
    """The positional ``run``: a run file saved by ``fedrec simulate --save``."""
    p.add_argument("run", nargs=nargs, type=Path, help=_RUN_FILE_HELP)


def add_json(p: Options, help: str = JSON_HELP) -> None:
    """``--json``: the result as one JSON object on the last line of stdout (`fedsim.cli.main`)."""
    p.add_argument("--json", action="store_true", help=help)


def add_quiet(p: Options) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_plot(p: Options, help: str) -> None:
    """``--plot FILE.png``: a picture of the run (`fedsim.cli.plots`)."""
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help=help)


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
