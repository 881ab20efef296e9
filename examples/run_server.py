"""Running the aggregation server as an operator would, end to end on loopback.

1. Take the documented configuration `examples/server.toml` (every key with its default, DP on), change
   what a small local run needs (port 0 = any free port, a fresh ``data_dir``, a 200-item catalogue,
   short phase deadlines, distributed DP on) and write it to a temporary folder.
2. Start ``python -m agg_server --config FILE`` (the same program as the ``fedrec-server`` console
   script) and wait for its ``fedrec-server listening on URL`` line.
3. Probe ``GET /v1/health`` and ``GET /v1/status`` as a monitoring system would.
4. Run four devices (`device_sdk.DeviceClient` over HTTP, each with its own store folder) through
   one federated round: check-in, model download, local training, the four SecAgg+ phases with DP
   noise, commit.
5. Check that the server committed model version 2 and charged the privacy ledger, stop it with
   SIGTERM, and check that it exits with status 0.

Run: ``python examples/run_server.py``.  Needs only loopback; finishes in a few seconds; exits 1
with a ``FAILED:`` line if any check fails (the server log is printed then).

Invariants:
- The server is always stopped (SIGTERM, then SIGKILL after a grace period) and the temporary
  folder removed, whatever happens.
- Device generators are seeded, so the round is reproducible.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from device_sdk import ClientConfig, DeviceClient, RoundOutcome, RoundStatus, insecure_seeded_rngs
from fedsim import synthetic
from fedsim.fleets.server_process import write_server_config
from protocol.policy import PrivacyPolicy

EXAMPLE_CONFIG = Path(__file__).resolve().parent / "server.toml"
N_ITEMS = 200
BITS = 32
N_DEVICES = 4


class CheckFailed(Exception):
    """A property the example demonstrates does not hold."""


def check(condition: bool, what: str) -> None:
    """Stop the example (exit status 1) when ``condition`` is false."""
    if not condition:
        raise CheckFailed(what)


def write_config(root: Path) -> Path:
    """`examples/server.toml` with the overrides of a small loopback run, written under ``root``."""
    settings: dict[str, dict[str, Any]] = tomllib.loads(EXAMPLE_CONFIG.read_text())
    settings["server"].update(host="127.0.0.1", port=0, data_dir=str(root / "server-data"))
    settings["model"].update(n_items=N_ITEMS)
    settings["lightfr"].update(bits=BITS)
    settings["rounds"].update(
        cohort_size=N_DEVICES,
        min_cohort=3,
        advertise_timeout=20.0,
        share_keys_timeout=10.0,
        masked_input_timeout=10.0,
        unmask_timeout=10.0,
        round_interval=0.2,
        seed=11,  # reproducible cohort and damping; leave unset in production
    )
    settings["privacy"].update(enabled=True, epsilon=8.0, planned_rounds=10)
    settings["log"].update(level="info")
    path = root / "server.toml"
    write_server_config(path, settings)
    return path


def get_json(url: str) -> dict[str, Any]:
    """GET a JSON endpoint (what ``curl`` would do)."""
    with urllib.request.urlopen(url, timeout=10) as resp:  # a loopback URL built above
        data: dict[str, Any] = json.loads(resp.read())
        return data


async def one_round(url: str, root: Path) -> list[tuple[DeviceClient, NDArray[np.int64], list[RoundOutcome]]]:
    """Register ``N_DEVICES`` devices and let each take part in exactly one round.

    Returns each client (closed; its model stays usable offline), its rated items and its outcomes.
    """
    log = synthetic(n_users=N_DEVICES, n_items=N_ITEMS, ratings_per_user=20, seed=3)
    clients: list[DeviceClient] = []
    rated: list[NDArray[np.int64]] = []
    for user in range(N_DEVICES):
        mask = log.users == user
        rated.append(np.asarray(log.items[mask], dtype=np.int64))
        holder: dict[str, DeviceClient] = {}

        def rngs(round_id: int, h: dict[str, DeviceClient] = holder) -> tuple[np.random.Generator, np.random.Generator]:
            # Seeded generators (simulation only; by default a device seeds from `secrets`).  The
            # device id is read when a round starts, after registration.
            return insecure_seeded_rngs(0, round_id, int(h["c"].device_id or 0))

        client = DeviceClient.connect(
            url,
            ClientConfig(
                store_dir=root / "devices" / f"device-{user}",
                long_poll_timeout=60.0,
                privacy=PrivacyPolicy.no_floor(),  # a five-device demo cohort is below any real floor
            ),
            items=rated[-1],
            ratings=np.asarray(log.ratings[mask]),
            n_items=N_ITEMS,
            bits=BITS,
            rng_for_round=rngs,
        )
        holder["c"] = client
        clients.append(client)
    try:
        for client in clients:
            print(f"device registered: id {await client.register()}")
        # `run(rounds=1)` checks in (waiting while fewer than min_cohort devices are there), then
        # downloads the model, trains, and speaks the four SecAgg+ phases until the round ends.
        outcomes = await asyncio.wait_for(asyncio.gather(*(c.run(rounds=1) for c in clients)), timeout=120)
    finally:
        for client in clients:
            await client.close()
    return list(zip(clients, rated, outcomes, strict=True))


def stop(proc: subprocess.Popen[str], grace: float = 20.0) -> int:
    """SIGTERM (graceful: the open round is closed, the database flushed), SIGKILL after ``grace``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def run(root: Path) -> None:
    config = write_config(root)
    print(f"config: {config} (from {EXAMPLE_CONFIG.name}: port 0, m={N_ITEMS}, f={BITS}, DP on)")
    log_path = root / "server.log"
    with open(log_path, "w") as server_log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agg_server", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=server_log,
            text=True,
        )
    exit_code: int | None = None
    try:
        assert proc.stdout is not None  # for the type checker: stdout=PIPE above
        line = proc.stdout.readline()  # "fedrec-server listening on http://127.0.0.1:PORT"
        check("listening on" in line, f"the server printed {line!r} instead of 'listening on'")
        url = line.strip().rsplit(" ", 1)[-1]
        print(line.strip())

        health = get_json(f"{url}/v1/health")
        print(f"GET /v1/health -> {health}")
        check(health.get("status") == "ok", "the health probe answers ok")
        status = get_json(f"{url}/v1/status")
        print(
            f"GET /v1/status -> model version {status['model']['version']}, "
            f"{status['registered_devices']} devices, round {status['round']}"
        )
        check(status["model"]["version"] == 1, "a fresh server starts at model version 1")

        results = asyncio.run(one_round(url, root))
        for client, _, outcomes in results:
            last = outcomes[-1]
            waits = sum(o.status is RoundStatus.WAITED for o in outcomes)
            print(
                f"device {client.device_id}: {last.status} round {last.round_id} -> model version "
                f"{last.model_version} after {waits} wait(s); {last.bytes_up / 1e3:.1f} kB up, "
                f"{last.bytes_down / 1e3:.1f} kB down, {last.timings['total']:.2f} s"
            )
            check(last.status is RoundStatus.COMMITTED, f"device {client.device_id} saw the round commit")
        device, items, _ = results[0]
        top, _ = device.model.recommend(items, N=5, rng=np.random.default_rng(0))
        print(f"device {device.device_id} recommends offline: {top.tolist()}")

        status = get_json(f"{url}/v1/status")
        finished = [r for r in status["recent_rounds"] if r["status"] == "committed"]
        privacy = status["privacy"]
        print(
            f"GET /v1/status -> model version {status['model']['version']}; committed rounds "
            f"{[r['round_id'] for r in finished]}; ε spent {privacy['epsilon_spent']:.3f} of "
            f"{privacy['epsilon_budget']:g} at δ={privacy['delta']:g}"
        )
        check(status["model"]["version"] == 2, "the round committed model version 2")
        check(privacy["rounds_charged"] == 1 and privacy["epsilon_spent"] > 0, "the ledger charged one round")
    except BaseException:
        stop(proc)
        print(f"--- server log ({log_path}) ---\n{log_path.read_text()}", file=sys.stderr)
        raise
    finally:
        exit_code = stop(proc)
        if proc.stdout is not None:
            proc.stdout.close()
    print(f"SIGTERM: fedrec-server exited with status {exit_code}")
    check(exit_code == 0, "the server exits 0 after SIGTERM")


def main() -> int:
    """Run the example; returns the exit status (0 when every check held)."""
    try:
        with tempfile.TemporaryDirectory(prefix="fedrec-server-example-") as tmp:
            run(Path(tmp))
    except CheckFailed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print("run_server: all checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
