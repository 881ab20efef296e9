"""The documentation stays true: the CLI reference matches the parsers, and no relative link is broken."""

from __future__ import annotations

import argparse
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _gen_cli() -> ModuleType:
    # docs/ is not a package: load the generator from its file.
    spec = importlib.util.spec_from_file_location("fedrec_docs_gen_cli", DOCS / "gen_cli.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the generated CLI reference ---------------------------------------------------------------------


def test_cli_reference_is_up_to_date() -> None:
    fresh = _gen_cli().render()
    current = (DOCS / "cli.md").read_text(encoding="utf-8")
    assert current == fresh, "docs/cli.md is stale: run python docs/gen_cli.py"


def _walk(parser: argparse.ArgumentParser, prog: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{prog} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield prog, action


def test_cli_reference_covers_every_command_and_argument() -> None:
    gen = _gen_cli()
    text = gen.render()
    sections = re.split(r"^#{2,} `", text, flags=re.MULTILINE)
    by_prog = {s.split("`", 1)[0]: s for s in sections[1:]}
    seen = 0
    for parser in gen.parsers():
        for prog, action in _walk(parser, parser.prog):
            assert prog in by_prog, f"no section for {prog}"
            section = by_prog[prog]
            names = action.option_strings or [action.dest]
            for name in names:
                assert f"`{name}" in section or f"`[{name}" in section, f"{prog}: {name} is not documented"
            if action.help:
                assert " ".join(action.help.split())[:40] in section, f"{prog}: help of {names[0]} missing"
            if action.default not in (None, False, argparse.SUPPRESS) and not action.required:
                assert f"`{action.default}`" in section, f"{prog}: default of {names[0]} missing"
            seen += 1
    assert seen > 40  # both parsers were walked, subcommands included


def test_cli_reference_renders_a_parser_it_was_not_written_for(monkeypatch: pytest.MonkeyPatch) -> None:
    # The generator walks actions generically: a new option with a default shows up with no edit.
    p = argparse.ArgumentParser(prog="tool", description="A tool.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    run = sub.add_parser("run", help="run it")
    run.add_argument("--model", choices=["mf", "felb", "fnmf"], default="mf", help="family (%(default)s)")
    run.add_argument("inputs", nargs="+", type=Path, help="files | folders")

    def small(text: str) -> int:
        value = int(text)
        if not 2 <= value <= 5:
            raise argparse.ArgumentTypeError(f"must be in [2, 5], got {value}")
        return value

    run.add_argument("--size", type=small, default=3, help="how big")
    gen = _gen_cli()
    monkeypatch.setattr(gen, "parsers", lambda: [p])
    text = gen.render()
    assert "### `tool run`" in text and "[`tool run`](#tool-run) | run it" in text
    assert "| `--model {mf,felb,fnmf}` | one of `mf`, `felb`, `fnmf` | `mf` | family (mf) |" in text
    assert "| `inputs [inputs ...]` | path | required | files \\| folders |" in text
    assert "| `--size SIZE` | integer in [2, 5] | `3` | how big |" in text  # the limit comes from the converter
    assert "usage: tool run [-h] [--model {mf,felb,fnmf}] inputs [inputs ...] [--size SIZE]" in text


# -- relative links ----------------------------------------------------------------------------------

_MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_REF = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def relative_links(text: str) -> list[str]:
    """Link targets in Markdown text that point into the repository (no scheme, not a bare anchor),
    with any ``#anchor`` or ``?query`` removed; fenced code blocks are ignored."""
    body = _FENCE.sub("", text)
    out = []
    for target in _MD_LINK.findall(body) + _HTML_REF.findall(body):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "//")):
            continue
        path = re.split(r"[#?]", target, maxsplit=1)[0]
        if path:
            out.append(path)
    return out


def _markdown_files() -> list[Path]:
    return [*sorted(ROOT.glob("*.md")), *sorted(DOCS.rglob("*.md"))]


@pytest.mark.parametrize("page", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(page: Path) -> None:
    broken = [t for t in relative_links(page.read_text(encoding="utf-8")) if not (page.parent / t).exists()]
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


@pytest.mark.parametrize("page", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_cite_nothing_outside_a_clone_and_no_internal_names(page: Path) -> None:
    # A fresh clone has nothing beside it but the datasets' folder (a documented default location), and no
    # tracker to resolve an issue number: docs cite docs/design.md and CONTRIBUTING.md, never files outside.
    text = page.read_text(encoding="utf-8")
    root = ROOT.resolve()
    outside = [t for t in relative_links(text) if not (page.parent / t).resolve().is_relative_to(root)]
    assert not outside, f"{page.relative_to(ROOT)} links outside the checkout: {outside}"
    cited = re.findall(r"\.\./shared/(?!data\b)[\w./-]*", text)
    assert not cited, f"{page.relative_to(ROOT)} cites files outside the checkout: {cited}"
    internal = re.findall(r"\b[Ii]ssue #?\d+[^.;\n]*", text)
    assert not internal, f"{page.relative_to(ROOT)} names internal issues: {internal}"


_SHIPPED_DIRS = ("protocol", "device_sdk", "agg_server", "fedsim", "benchmarks", "examples", "docs")
_ISSUE_NUMBER = re.compile(r"\b[Ii]ssue \d+")
_URL = re.compile(r"\bhttps?://\S+")


def issue_numbers(text: str) -> list[str]:
    """The lines of ``text`` that name a tracker item ("issue 15", "Issue 12 item 2"), URLs left out."""
    return [line.strip() for line in text.splitlines() if _ISSUE_NUMBER.search(_URL.sub("", line))]


def _shipped_text_files() -> Iterator[Path]:
    for folder in _SHIPPED_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in {".pyc", ".npz", ".png"}:
                yield path


def test_shipped_files_name_no_tracker_items() -> None:
    # The code, benchmarks, examples and docs are read by people without access to the project's tracker:
    # a reference such as "(issue 15 item 8)" says what it stood for or points at docs/ instead.
    named = {}
    for path in _shipped_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if hits := issue_numbers(text):
            named[str(path.relative_to(ROOT))] = hits
    assert not named, f"files name internal tracker items: {named}"


def test_issue_number_detection() -> None:
    text = (
        "A (issue 15 item 5) reference.\nItem 5 of Issue 15.\nissue 12's bars\n"
        "The server issues 32 random bytes.\nSee https://github.com/o/r/issues/15 or https://x.org/issue 7.\n"
    )
    assert issue_numbers(text) == ["A (issue 15 item 5) reference.", "Item 5 of Issue 15.", "issue 12's bars"]


def test_link_extraction() -> None:
    text = (
        'See [the API](docs/http-api.md#errors), ![picture](img/a.svg "title"), [web](https://x.org/a.md),\n'
        "[top](#fedrec), [mail](mailto:a@b.c), <img src='img/b.svg'> and [q](cli.md?plain=1).\n"
        "```text\n[not a link](inside/a/fence.md)\n```\n"
    )
    assert relative_links(text) == ["docs/http-api.md", "img/a.svg", "cli.md", "img/b.svg"]


def test_a_broken_link_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) and [gone](missing/file.md#x)\n")
    broken = [t for t in relative_links(page.read_text()) if not (page.parent / t).exists()]
    assert broken == ["missing/file.md"]
