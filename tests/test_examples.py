"""The scripts in ``examples/`` run as a user would run them, and do what they say.

Each example is started as ``python examples/<name>.py`` in a fresh temporary working directory (so
nothing depends on the repository being the current folder); ``PYTHONPATH`` points at the checkout so
the packages import without an install.  An example exits non-zero when one of its own checks fails,
so exit status 0 plus its key output lines is the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(name: str, cwd: Path, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


def test_embed_sdk(tmp_path: Path) -> None:
    store = tmp_path / "kept"
    out = assert_ok(run_example("embed_sdk.py", tmp_path, "--workdir", str(store)))
    assert "after a restart: same version, same codes, same top-10" in out
    assert "StorageError" in out and "moved it aside to model.fedrec.corrupt-1" in out
    assert "embed_sdk: all checks passed" in out
    # The store the example left behind: the damaged copy kept aside, a good model rebuilt.
    assert (store / "app-store" / "model.fedrec.corrupt-1").is_file()
    from device_sdk.models import LightFRModel

    assert LightFRModel.load(store / "app-store" / "model.fedrec").model_version == 26


@pytest.mark.timeout(180)
def test_run_server(tmp_path: Path) -> None:
    out = assert_ok(run_example("run_server.py", tmp_path))
    assert "fedrec-server listening on http://127.0.0.1:" in out
    assert "GET /v1/health -> {'status': 'ok', 'state': 'idle'}" in out
    assert out.count("committed round 1 -> model version 2") == 4
    assert "SIGTERM: fedrec-server exited with status 0" in out
    assert "run_server: all checks passed" in out


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "args",
    [
        # Nobody drops, so no phase waits for its deadline: a few seconds.
        pytest.param(("--dropout", "0"), id="no-dropout"),
        # The example as documented (10% of devices drop, some silently): phases wait for deadlines.
        pytest.param((), id="defaults", marks=pytest.mark.slow),
    ],
)
def test_loadtest(tmp_path: Path, args: tuple[str, ...]) -> None:
    out = assert_ok(run_example("loadtest.py", tmp_path, *args, timeout=170))
    assert "$ fedrec loadtest --url http://127.0.0.1:" in out
    assert "50 devices, 1 rounds finished" in out
    assert "per-phase latency seen by devices" in out
    assert "errors by type: none" in out
    assert "server: stopped with SIGTERM (exit 0)" in out


def test_loadtest_reports_a_server_that_cannot_start(tmp_path: Path) -> None:
    # Two devices make cohort_size = 2, which the server's configuration check refuses (>= 3).
    proc = run_example("loadtest.py", tmp_path, "--devices", "2", timeout=60)
    assert proc.returncode == 1
    assert "FAILED: the server did not start" in proc.stderr and "cohort_size" in proc.stderr


def test_custom_strategy(tmp_path: Path) -> None:
    out = assert_ok(run_example("custom_strategy.py", tmp_path))
    for r, rho in ((1, "0.500"), (2, "0.250"), (3, "0.125"), (4, "0.062")):
        assert f"round {r}: ρ = {rho}," in out
    assert "with the federated codes" in out
    assert "create_app(config, strategy=AnnealedAggGrad(...)) on http://127.0.0.1:" in out
    assert "custom_strategy: all checks passed" in out
