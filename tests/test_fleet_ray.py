"""``fedrec loadtest --backend ray``: the fleet's shards as Ray actors on a local Ray started by the test
(``ray.init(num_cpus=2, include_dashboard=False)``), against a real `fedrec-server` process.  With the same
seeds the local multi-process back-end and the Ray back-end commit the same rounds (ids, cohorts,
survivors) and the same final model (the SHA-256 of the served `ModelPayload`).

Outside CI the test skips when Ray is not installed (``pip install -e '.[ray]'``); under ``$CI`` it fails
instead (`.ci/run` installs the extra).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedsim.data.synthetic import synthetic
from fedsim.fleets.demo import run_loadtest
from fedsim.fleets.loadtest_report import loadtest_record
from fedsim.fleets.local import FleetConfig
from fedsim.fleets.server_process import ServerProcess, write_server_config

pytestmark = [pytest.mark.integration, pytest.mark.ray]

N_ITEMS, BITS, DEVICES, COHORT, ROUNDS = 80, 16, 10, 6, 2


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Any]:
    try:
        import ray
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("ray is not installed (CI is set, so the Ray back-end test must run; .ci/run installs it)")
        pytest.skip("ray is not installed (pip install -e '.[ray]')")
    os.environ.pop("RAY_ADDRESS", None)  # a local Ray of the test's own, never a cluster
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _users() -> list[tuple[np.ndarray, np.ndarray]]:
    data = synthetic(n_users=DEVICES, n_items=N_ITEMS, ratings_per_user=12, seed=2)
    return [
        (np.asarray(data.items[data.users == u]), np.asarray(data.ratings[data.users == u]))
        for u in range(data.n_users)
    ]


def _run(root: Path, backend: str) -> dict[str, Any]:
    root.mkdir()
    config = root / "server.toml"
    write_server_config(
        config,
        {
            "server": {"host": "127.0.0.1", "port": 0, "data_dir": str(root / "data")},
            "model": {"n_items": N_ITEMS, "bits": BITS},
            "rounds": {
                "cohort_size": COHORT,
                "min_cohort": COHORT,
                "seed": 5,
                "clip_norm": 64.0,
                "scale_bits": 12,
                "advertise_timeout": 60.0,
                "share_keys_timeout": 60.0,
                "masked_input_timeout": 60.0,
                "unmask_timeout": 60.0,
                "round_interval": 0.05,
            },
            "log": {"level": "warning"},
        },
    )
    with ServerProcess(config, root / "server.log") as server:
        fleet = FleetConfig(
            url=server.url,
            store_root=root / "devices",
            n_items=N_ITEMS,
            bits=BITS,
            rounds=ROUNDS,
            dropout=0.25,
            announce_drops=True,
            seed=3,
            cohort=COHORT,
            # TEST HOOK: the devices' noise streams (stochastic-rounding coins) from the seed too.
            insecure_reproducible=True,
            time_limit=150.0,
        )
        report = run_loadtest(fleet, _users(), 2, backend=backend, keep_store=False)
    failure = report.failure(ROUNDS)
    assert failure is None, f"{backend}: {failure}"
    return loadtest_record(report, ROUNDS, failure)


def test_ray_and_local_backends_commit_the_same_rounds_and_model(tmp_path: Path, local_ray: Any) -> None:
    local = _run(tmp_path / "local", "local")
    on_ray = _run(tmp_path / "ray", "ray")

    def rounds(record: dict[str, Any]) -> list[tuple[Any, ...]]:
        return [(r["round_id"], r["status"], r["cohort"], r["survivors"]) for r in record["server_rounds"]]

    assert rounds(local) == rounds(on_ray)
    assert [r[1] for r in rounds(local)] == ["committed"] * ROUNDS
    assert local["drops"] == on_ray["drops"] and sum(local["drops"].values()) > 0  # the same injected drops
    assert local["final_model"]["version"] == on_ray["final_model"]["version"] == ROUNDS + 1
    assert local["final_model"]["sha256"] == on_ray["final_model"]["sha256"]
    assert local["device_errors"] == on_ray["device_errors"] == {}


# -- a cluster with token authentication (RAY_ADDRESS) ------------------------------------------------------


@pytest.fixture()
def token_cluster() -> Iterator[tuple[str, str, str]]:
    """A Ray head started by ``ray start --head --block`` with token authentication, in its own session (stopped
    by signalling that session only).  Yields (address, token, home folder)."""
    pytest.importorskip("ray")
    import secrets
    import shutil
    import signal
    import socket
    import subprocess
    import tempfile
    import time

    home = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live under --temp-dir
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(32)
    env = {**os.environ, "HOME": home, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    env.pop("RAY_ADDRESS", None)
    cmd = ["ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=1", "--include-dashboard=false"]
    cmd += ["--disable-usage-stats", f"--temp-dir={home}/r"]
    log = open(Path(home) / "head.log", "wb")  # noqa: SIM115 - the child holds it
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert head.poll() is None, (Path(home) / "head.log").read_text(errors="replace")[-2000:]
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", token, home
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(home, ignore_errors=True)


_CONNECT = (
    "import ray\n"
    "from fedsim.fleets.ray_fleet import connect_ray\n"
    "from protocol.errors import ConfigError\n"
    "try:\n"
    "    connect_ray()\n"
    "except ConfigError as exc:\n"
    "    raise SystemExit(f'refused: {exc}')\n"
    "print('cpus', int(ray.cluster_resources()['CPU']))\n"
)


def test_ray_address_reaches_a_token_authenticated_cluster(token_cluster: tuple[str, str, str]) -> None:
    import subprocess
    import sys

    address, token, home = token_cluster
    base = {**os.environ, "HOME": home, "RAY_ADDRESS": address}
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        base.pop(key, None)
    # As documented: RAY_AUTH_MODE=token and the cluster's token.
    ok = subprocess.run(
        [sys.executable, "-c", _CONNECT],
        env={**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert ok.returncode == 0 and "cpus 1" in ok.stdout, ok.stderr[-2000:]
    # Without them: refused, and the error says what to set.
    refused = subprocess.run([sys.executable, "-c", _CONNECT], env=base, capture_output=True, text=True, timeout=180)
    assert refused.returncode != 0
    assert "refused: cannot connect to the Ray cluster RAY_ADDRESS=" in refused.stderr
    assert "set RAY_AUTH_MODE=token" in refused.stderr and token not in refused.stderr
