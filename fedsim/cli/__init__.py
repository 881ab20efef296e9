"""The ``fedrec`` command line: one module per sub-command, each declaring its `Command` (name, help,
description, options, run), which this module adds to one parser and runs.

This is the edge of the program: it reads the environment, parses and validates arguments, and turns
every `FedRecError`/`ValueError` into one clear line on stderr and exit status 2. An argument error is one
line too, ``fedrec COMMAND: error: ...`` (with "did you mean --xyz?" for a misspelt option), then
``(see fedrec COMMAND --help)``, exit status 2: not the whole usage.

Building the parser imports only what the options need; each command imports its work in its ``run``.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

from agg_server import authority
from fedsim.cli import data, demo, evaluate, export, loadtest, plan_privacy, recommend, simulate
from fedsim.cli.args import Command
from protocol.errors import FedRecError

__all__ = ["main", "build_parser"]

# ``enroll-ca`` is the operator's tool of `agg_server.authority`, which cannot import fedsim: its module
# constants make its `Command` here.
_ENROLL_CA = Command(authority.NAME, authority.HELP, authority.DESCRIPTION, authority.add_options, authority.run)

# In the order `fedrec --help` lists them.
_COMMANDS = (
    demo.COMMAND,
    loadtest.COMMAND,
    simulate.COMMAND,
    evaluate.COMMAND,
    plan_privacy.COMMAND,
    recommend.COMMAND,
    export.COMMAND,
    _ENROLL_CA,
    data.COMMAND,
)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and a pointer to ``--help``, not the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(see {self.prog} --help)\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        # An unknown option is reported by the top parser; name the sub-command it was given to instead,
        # with the nearest of that command's options.
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self._command_parser(parsed)
            (command or self).error(f"unrecognized arguments: {' '.join(extras)}{_did_you_mean(extras, command)}")
        return parsed

    def _command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen: argparse.ArgumentParser | None = action.choices.get(str(getattr(parsed, action.dest, "")))
                return chosen
        return None


def _did_you_mean(extras: list[str], parser: argparse.ArgumentParser | None) -> str:
    """``; did you mean --xyz?`` for the first unknown option that is close to one of ``parser``'s."""
    if parser is None:
        return ""
    known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    for extra in extras:
        if extra.startswith("--"):
            close = difflib.get_close_matches(extra.split("=", 1)[0], known, n=1)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


def build_parser() -> argparse.ArgumentParser:
    """The ``fedrec`` argument parser (also used to generate the CLI reference)."""
    parser = _Parser(
        prog="fedrec",
        description="fedrec: on-device federated recommendation (LightFR binary codes).",
    )
    parser.add_argument("--version", action="version", version=f"fedrec {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in _COMMANDS:
        command.add_options(sub.add_parser(command.name, help=command.help, description=command.description))
    return parser


def _run(args: argparse.Namespace, out: TextIO) -> int:
    handlers = {command.name: command.run for command in _COMMANDS}
    return handlers[args.command](args, out)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedrec")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fedrec``; returns the exit status.

    Expected failures (bad input, a missing or malformed file, a server that refuses) print one line
    ``fedrec COMMAND: error: ...`` on stderr and exit 2; an interrupt exits 130; a closed stdout (``| head``)
    ends the command quietly with status 141, as a killed-by-SIGPIPE tool would.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    # --json: the last line of stdout is the result object (fedsim.evaluation.report); everything else to stderr
    out = sys.stderr if getattr(args, "json", False) else sys.stdout
    try:
        code = _run(args, out)
        out.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return code
    except (FedRecError, ValueError, OSError) as exc:
        if isinstance(exc, BrokenPipeError):
            return _broken_pipe()
        msg = " ".join(str(exc).split()) if not isinstance(exc, FedRecError) else str(exc)
        if isinstance(exc, OSError) and not isinstance(exc, FedRecError):
            where = f"{exc.filename}: " if exc.filename else ""
            msg = f"{where}{exc.strerror or exc}"
        print(f"fedrec {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fedrec {args.command}: interrupted", file=sys.stderr)
        return 130


def _broken_pipe() -> int:
    # The reader went away (``fedrec ... | head -1``): stop writing, and keep Python from reporting the
    # failed flush of stdout at exit.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141
