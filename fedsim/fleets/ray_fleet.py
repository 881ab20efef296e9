"""The Ray back-end of ``fedrec loadtest --backend ray``: the fleet's shards run as Ray actors, each hosting
its share of the devices as asyncio tasks (`fedsim.fleets.local.run_fleet`, the same code as the local back-end's
worker processes).

Invariants:
- ``ray`` is an optional extra (``pip install -e '.[ray]'``), imported only here and only when the
  back-end is chosen.
- Without ``RAY_ADDRESS`` a private local Ray is started for the run (no dashboard) and stopped after
  it; with ``RAY_ADDRESS`` set, ``ray.init()`` connects to that cluster unchanged and leaves it running
  (`connect_ray`).  A cluster started with token authentication (``RAY_AUTH_MODE=token``) needs the same
  on this side plus its token (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``); a
  refused connection says so instead of Ray's bare "Failed to connect".
  A Ray already initialised by the caller (a test) is used as it is.
- Each actor keeps its devices' stores in a temporary folder on its own node unless the caller names
  a folder (``store_root``; only meaningful when every actor runs on the caller's machine).
- The shards are split as the local back-end splits them (`split_fleet`), so with the same seeds both
  back-ends register the same devices in the same order and run the same rounds.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from fedsim.fleets.local import FleetConfig, run_fleet
from protocol.errors import ConfigError

#: The Ray releases the Ray back-end is tested with (pyproject.toml's ``ray`` extra pins the same range).
RAY_VERSIONS = ">=2.60,<2.61"


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            f"--backend ray needs Ray: pip install -e '.[ray]' (or pip install 'ray{RAY_VERSIONS}')"
        ) from None
    return ray


def connect_ray() -> bool:
    """Initialise Ray for a run unless the caller did: the cluster ``RAY_ADDRESS`` names, else a private local
    Ray.  Returns whether it was initialised here (and is to be shut down after the run).

    Raises
    ------
    ConfigError
        Ray is not installed, or the cluster ``RAY_ADDRESS`` names refused the connection (the message
        says what token authentication needs on this side).
    """
    ray = _import_ray()
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        ray.init(include_dashboard=False, log_to_driver=True)
        return True
    try:
        ray.init(log_to_driver=True)  # the cluster RAY_ADDRESS names, unchanged
    except ConnectionError as exc:
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
            hint = "check that RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) holds the cluster's token"
        else:
            hint = (
                "a cluster started with token authentication refuses drivers without it: set RAY_AUTH_MODE=token "
                "and the cluster's token in RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH (`ray get-auth-token` on the "
                "head node prints it)"
            )
        raise ConfigError(f"cannot connect to the Ray cluster RAY_ADDRESS={address} names ({exc}); {hint}") from None
    return True

__all__ = ["run_ray_fleet", "FleetShard"]


class FleetShard:
    """A Ray actor's body: one shard of the fleet (decorated with ``ray.remote`` at run time)."""

    def run(
        self,
        config: FleetConfig,
        users: list[tuple[np.ndarray, np.ndarray | None]],
        first_index: int,
        keep_store: bool,
        nice: int = 0,
    ) -> dict[str, Any]:
        import asyncio

        if nice:
            os.nice(nice)

        if keep_store:
            report, _ = asyncio.run(run_fleet(config, users, first_index=first_index))
            return report.to_dict()
        with tempfile.TemporaryDirectory(prefix=f"fedrec-ray-shard-{first_index}-") as tmp:
            report, _ = asyncio.run(run_fleet(replace(config, store_root=Path(tmp)), users, first_index=first_index))
            return report.to_dict()

    def node(self) -> str:
        """Where this actor runs (host name and process id)."""
        import socket

        return f"{socket.gethostname()}:{os.getpid()}"


def run_ray_fleet(
    config: FleetConfig,
    shards: Sequence[tuple[int, list[tuple[np.ndarray, np.ndarray | None]]]],
    *,
    keep_store: bool = False,
    on_wait: Callable[[], None] | None = None,
    nice: int = 0,
) -> list[dict[str, Any]]:
    """Run each ``(first_index, users)`` shard in its own Ray actor; returns their reports (as dicts).

    ``on_wait`` is called about twice a second while the actors run (progress); ``nice`` lowers the
    actors' priority (each actor is its own process, started for this run).

    Raises
    ------
    ConfigError
        ``ray`` is not installed.
    """
    ray = _import_ray()
    started = connect_ray()
    try:
        cpus = float(ray.cluster_resources().get("CPU", 1.0))
        # Every actor fits at once (a shard that waited for a CPU would stall the others' rounds).
        per_actor = min(1.0, cpus / max(1, len(shards)))
        actor_cls: Any = ray.remote(FleetShard)
        actors: list[Any] = [actor_cls.options(num_cpus=per_actor).remote() for _ in shards]
        refs = [
            actor.run.remote(config, users, first, keep_store, nice)
            for actor, (first, users) in zip(actors, shards, strict=True)
        ]
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            if on_wait is not None:
                on_wait()
        reports: list[dict[str, Any]] = ray.get(refs)
        for actor in actors:
            ray.kill(actor)
        return reports
    finally:
        if started:
            ray.shutdown()
