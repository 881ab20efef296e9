"""Benchmarks whose figures come from their own settings say so first (`benchmarks/own_settings.py`), so a
figure copied from their output is not taken for what ``fedrec simulate --dataset D --json`` ships."""

from __future__ import annotations

import ast
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

#: Scripts that train or rank with a configuration of their own (not the CLI's defaults).
OWN_SETTINGS = (
    "bench_topk_trained",
    "private_mf",
    "quality_amazon",
    "quality_amazon_lightfr",
    "quality_felb",
    "quality_fnmf",
    "quality_lightfr",
    "quality_mf",
    "secagg_amazon_lightfr",
    "secagg_lightfr",
    "two_stage_amazon",
)


def _module():
    spec = importlib.util.spec_from_file_location("own_settings", BENCH / "own_settings.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_notice_names_the_settings_and_the_shipped_command() -> None:
    out = io.StringIO()
    line = _module().own_settings("f = 64, 15 iterations", out)
    assert out.getvalue() == line + "\n"
    assert line.startswith("settings: f = 64, 15 iterations; ") and "fedrec simulate --dataset D --json" in line
    with pytest.raises(ValueError, match="say which settings"):
        _module().own_settings("  ")


@pytest.mark.parametrize("name", OWN_SETTINGS)
def test_each_script_with_its_own_settings_prints_the_notice_in_main(name: str) -> None:
    tree = ast.parse((BENCH / f"{name}.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    calls = [
        n for n in ast.walk(main) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "own_settings"
    ]
    assert len(calls) == 1 and isinstance(calls[0].args[0], ast.Constant) and calls[0].args[0].value.strip()
    # printed before any figure: the call is a top-level statement of main, right after the options are parsed
    top = [s for s in main.body if isinstance(s, ast.Expr) and s.value is calls[0]]
    assert top, f"{name}: own_settings must be called directly in main()"


def test_a_script_prints_the_notice_before_its_figures() -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH / "quality_fnmf.py"), "--steps", "2", "--seeds", "1", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))},
    )
    assert run.stdout.splitlines()[0].startswith("settings: FNMF on planted data")
