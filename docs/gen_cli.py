"""Generate ``docs/cli.md``, the command-line reference, from the argument parsers themselves.

``python docs/gen_cli.py`` rewrites ``docs/cli.md``; ``python docs/gen_cli.py --check`` exits 1 when
the file is stale (``tests/test_docs.py`` does the same check in memory).

Invariants:
- Nothing is copied by hand: every command, subcommand, argument, type, default, choice and help text
  comes from walking the actions of `fedsim.cli.build_parser` and `agg_server.cli.build_parser`.
- The output depends only on the parsers, not on the terminal width or the Python version: usage
  lines are composed here from the actions instead of by argparse's help formatter.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePath
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = Path(__file__).resolve().parent / "cli.md"
WIDTH = 100

if str(ROOT) not in sys.path:  # run as a script from a checkout without an install
    sys.path.insert(0, str(ROOT))

__all__ = ["parsers", "render", "main"]


def parsers() -> list[argparse.ArgumentParser]:
    """The top-level parsers documented, in order: ``fedrec`` then ``fedrec-server``."""
    from agg_server.cli import build_parser as server_parser
    from fedsim.cli import build_parser as fedrec_parser

    return [fedrec_parser(), server_parser()]


# -- reading actions ---------------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _documented(action: argparse.Action) -> bool:
    return (
        not isinstance(action, argparse._HelpAction | argparse._SubParsersAction) and action.help != argparse.SUPPRESS
    )


def _metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        return action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return action.dest if not action.option_strings else action.dest.upper()


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def _spelled(action: argparse.Action) -> str:
    """How the argument is written: ``--bits BITS``, ``run``, ``--quiet``."""
    metavar = _metavar(action)
    nargs = action.nargs
    if nargs is None or nargs == 1:
        value = metavar
    elif nargs == "?":
        value = f"[{metavar}]"
    elif nargs == "*":
        value = f"[{metavar} ...]"
    elif nargs == "+":
        value = f"{metavar} [{metavar} ...]"
    elif nargs == argparse.PARSER:
        value = f"{metavar} ..."
    elif isinstance(nargs, int):
        value = " ".join([metavar] * nargs)
    else:
        value = metavar
    if not action.option_strings:
        return value
    flags = ", ".join(action.option_strings)
    return f"{flags} {value}" if _takes_value(action) else flags


def _usage(prog: str, parser: argparse.ArgumentParser) -> str:
    parts = ["[-h]"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            parts.append(f"{_metavar(action)} ...")
            continue
        if action.option_strings:
            flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
            text = f"{flag} {_metavar(action)}" if _takes_value(action) else flag
            parts.append(text if action.required else f"[{text}]")
        else:
            parts.append(_spelled(action))
    # Wrap between arguments, never inside one ("[--cohort COHORT]" stays on one line).
    indent = " " * (len("usage: ") + len(prog) + 1)
    lines = [f"usage: {prog}"]
    for part in parts:
        if len(lines[-1]) + 1 + len(part) > WIDTH and lines[-1] != f"usage: {prog}":
            lines.append(indent + part)
        else:
            lines[-1] += " " + part
    return "\n".join(lines)


def _domain(convert: Callable[[str], Any]) -> str:
    """What a converter accepts, found by calling it: "integer", "number", plus the limit its own error
    message states ("must be >= 1" -> "≥ 1"); "" when it is neither an int nor a float converter."""
    base = ""
    for sample in ("1", "0", "0.5", "2", "3", "10", "100"):
        try:
            value = convert(sample)
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            continue
        base = "integer" if isinstance(value, int) else "number" if isinstance(value, float) else ""
        break
    limits: list[str] = []
    for probe in ("-1", "1e9"):  # one value below and one above any sensible range
        try:
            convert(probe)
        except argparse.ArgumentTypeError as exc:
            message = str(exc).split(", got", 1)[0]
            if message.startswith("must be "):
                limit = message.removeprefix("must be ").removeprefix("a finite number ")
                limit = limit.replace(">=", "≥").replace("<=", "≤")
                if limit not in limits:
                    limits.append(limit)
        except (ValueError, TypeError):
            pass
    return " ".join([base, *limits]) if base else ""


def _type_name(action: argparse.Action) -> str:
    if not _takes_value(action):
        return "flag"
    if action.choices is not None:
        return "one of " + ", ".join(f"`{c}`" for c in action.choices)
    kind: Callable[[str], Any] | None = action.type  # type: ignore[assignment]
    if kind is None or kind is str:
        return "text"
    if isinstance(kind, type) and issubclass(kind, PurePath):
        return "path"
    return _domain(kind) or getattr(kind, "__name__", type(kind).__name__).lstrip("_").replace("_", " ")


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    value = action.default
    if value is None or value is argparse.SUPPRESS:
        return "—"
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "on" if value else "off"
    return f"`{value}`"


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:
        params = {**vars(action), "prog": prog}
        text = text % params
    return " ".join(text.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# -- rendering ---------------------------------------------------------------------------------------


def _groups(parser: argparse.ArgumentParser) -> Iterator[tuple[str, list[argparse.Action]]]:
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if _documented(a)]
        if actions:
            yield group.title or "arguments", actions


def _section(prog: str, parser: argparse.ArgumentParser, level: int, summary: str) -> list[str]:
    out = [f"{'#' * level} `{prog}`", ""]
    text = " ".join((parser.description or summary).split())
    if text:
        out += [text, ""]
    out += ["```text", _usage(prog, parser), "```", ""]
    subs = list(_subcommands(parser))
    if subs:
        out += ["| command | what it does |", "|---|---|"]
        out += [f"| [`{prog} {name}`](#{_anchor(f'{prog} {name}')}) | {_cell(h)} |" for name, h, _ in subs]
        out.append("")
    for title, actions in _groups(parser):
        out += [f"{title[:1].upper()}{title[1:]}:", ""]
        out += ["| argument | value | default | description |", "|---|---|---|---|"]
        for a in actions:
            out.append(
                f"| `{_cell(_spelled(a))}` | {_cell(_type_name(a))} | {_cell(_default(a))} | {_cell(_help(a, prog))} |"
            )
        out.append("")
    for name, summary_line, sub in subs:
        out += _section(f"{prog} {name}", sub, level + 1, summary_line)
    return out


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading made of ``heading`` in backticks."""
    return "".join(c for c in heading.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def _json_section() -> list[str]:
    """The ``--json`` result schema, from the docstring of `fedsim.evaluation.report` (its one home)."""
    import inspect

    import fedsim.evaluation.report

    doc = inspect.cleandoc(fedsim.evaluation.report.__doc__ or "")
    return ["## `--json` output", "", *doc.splitlines(), ""]


def render() -> str:
    """The whole ``docs/cli.md`` text."""
    out = [
        "# Command-line reference",
        "",
        "Generated from the argument parsers (`fedsim.cli.build_parser`, `agg_server.cli.build_parser`) by",
        "`python docs/gen_cli.py`; do not edit by hand. `tests/test_docs.py` fails when this page is stale.",
        "",
        "- [`fedrec`](#fedrec): the umbrella command (demo, simulations, evaluation, datasets, load tests).",
        "- [`fedrec-server`](#fedrec-server): the aggregation server (also `python -m agg_server`).",
        "",
        "Every command also takes `-h` / `--help`. Errors in arguments exit with status 2 and one line on stderr.",
        "",
    ]
    for parser in parsers():
        out += _section(parser.prog, parser, 2, "")
    out += _json_section()
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Write ``docs/cli.md`` (or, with ``--check``, exit 1 if it differs from what would be written)."""
    ap = argparse.ArgumentParser(description="generate docs/cli.md from the argument parsers")
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when docs/cli.md is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is stale: run python docs/gen_cli.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
