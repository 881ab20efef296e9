"""``fedrec loadtest --backend ray``: the fleet's shards as Ray actors on a local Ray started by the test
(``ray.init(num_cpus=2, include_dashboard=False)``), against a real `fedrec-server` process.  With the same
seeds the local multi-process back-end and the Ray back-end commit the same rounds (ids, cohorts,
survivors) and the same final model (the SHA-256 of the served `ModelPayload`).

Outside CI the test skips when Ray is not installed (``pip install -e '.[ray]'``); under ``$CI`` it fails
instead (`.ci/run` installs the extra).
"""

from __future__ import annotations

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
