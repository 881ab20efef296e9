"""Size rules for the installed packages, so that no room outgrows itself again.

- No function or method is longer than ``MAX_FUNCTION_LINES`` lines (decorators excluded, docstring
  included): a longer one is split along its steps.
- No module is longer than ``MAX_MODULE_LINES`` lines unless its docstring says why it stays one module,
  in a line that starts with ``Why one module:``.

Complexity (branches, statements, McCabe) is ruff's job: ``C901``, ``PLR0912`` and ``PLR0915`` are on in
``pyproject.toml``.  These two rules are what ruff has no rule for.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "device_sdk", "agg_server", "fedsim")
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 800
REASON = "Why one module:"


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """``(name, lines)`` of every function in ``source`` longer than ``limit`` lines, nested ones too."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                out.append((node.name, lines))
    return out


def unexplained_size(source: str, limit: int) -> bool:
    """Whether ``source`` is over ``limit`` lines without a ``Why one module:`` line in its docstring."""
    if source.count("\n") <= limit:
        return False
    doc = ast.get_docstring(ast.parse(source)) or ""
    return not any(line.strip().startswith(REASON) for line in doc.splitlines())


def test_the_checks_find_what_they_look_for() -> None:
    body = "\n".join(f"    x = {i}" for i in range(5))
    assert long_functions(f"def f():\n{body}\n", 5) == [("f", 6)]
    method = "\n".join(f"        x = {i}" for i in range(5))
    assert long_functions(f"class C:\n    async def g(self):\n{method}\n", 6) == []
    assert long_functions(f"class C:\n    async def g(self):\n{method}\n", 5) == [("g", 6)]
    big = '"""A module."""\n' + "x = 1\n" * 10
    assert unexplained_size(big, 5)
    assert not unexplained_size('"""A module.\n\nWhy one module: one table.\n"""\n' + "x = 1\n" * 10, 5)
    assert not unexplained_size(big, 20)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_function_is_longer_than_the_limit(path: Path) -> None:
    found = long_functions(path.read_text(encoding="utf-8"), MAX_FUNCTION_LINES)
    assert not found, f"{path.relative_to(ROOT)}: split {found} (over {MAX_FUNCTION_LINES} lines)"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_long_module_says_why_it_is_one_module(path: Path) -> None:
    assert not unexplained_size(path.read_text(encoding="utf-8"), MAX_MODULE_LINES), (
        f"{path.relative_to(ROOT)} is over {MAX_MODULE_LINES} lines: split it along a seam, or say in its "
        f"docstring, in a line starting {REASON!r}, why it stays one module"
    )


def test_ruff_complexity_rules_hold_on_the_packages() -> None:
    """The complexity limits of pyproject.toml (C901, PLR0912, PLR0915), checked with the dev extra's ruff."""
    pytest.importorskip("ruff", reason="ruff comes with the dev extra")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--select",
            "C901,PLR0912,PLR0915",
            "--output-format",
            "concise",
            *PACKAGES,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
