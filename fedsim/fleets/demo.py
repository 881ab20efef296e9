"""``fedrec demo`` and ``fedrec loadtest``: a real server process on loopback and a fleet of
simulated devices talking HTTP to it.

Invariants:
- The demo starts its own `fedrec-server` subprocess on a free loopback port with a configuration it
  writes into a temporary folder, and always stops it (SIGTERM, then SIGKILL after a grace period).
- Quality is measured the way it would be on real devices: each device scores its own held-out
  item against sampled negatives with its own code and the downloaded item codes; the simulation
  only averages the per-device results.
- The load test sends traffic only to the URL it is given, stops after the requested rounds or its
  time limit, and can split the fleet over several worker processes.

The server process and the health probe are `fedsim.fleets.server_process`; the load test's record and
tables, `fedsim.fleets.loadtest_report`.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from device_sdk.client import DeviceClient
from device_sdk.lightfr import LEVEL_SHIFT
from fedsim.evaluation.experiment import Experiment, baselines
from fedsim.evaluation.ranking import EvalResult, TieMode, evaluate_candidates
from fedsim.fleets.local import (
    FleetConfig,
    FleetReport,
    fetch_status,
    get_status,
    rounds_so_far,
    run_fleet,
)
from fedsim.fleets.server_process import HealthProbe, ServerProcess, write_server_config
from protocol.codec import decode, encode
from protocol.codes import from_bytes, unpack_signs
from protocol.enrollment import EnrollmentAuthority
from protocol.errors import ConfigError, FedRecError
from protocol.families.lightfr import LEVEL_CENTER
from protocol.identity import SigningKey, registration_payload
from protocol.messages import ModelPayload, RegisterRequest, RegisterResponse

__all__ = [
    "device_data",
    "run_demo_fleet",
    "run_loadtest",
    "verdict",
    "simulated_beside",
]


#: The private popularity channel of the demo's DP runs (chosen on ML-100K's validation blocks, see
#: docs/dp-accounting.md §9): half of the clip norm's square buys the upload's per-item counts, and the
#: item levels come from them on a log scale spanning the widest bias the uint8 levels hold at B = 1.
PRIVATE_MODEL: dict[str, Any] = {"counts_share": 0.5, "popularity_span": 4.0, "hamming_weight": 1}


def device_data(exp: Experiment, n_devices: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each user's training items and ratings (one simulated device per user, users 0..n−1)."""
    idx = exp.train.by_user()
    n = exp.train.n_users if n_devices is None else min(n_devices, exp.train.n_users)
    return [
        (
            np.asarray(idx.items[idx.indptr[u] : idx.indptr[u + 1]]),
            np.asarray(idx.ratings[idx.indptr[u] : idx.indptr[u + 1]]),
        )
        for u in range(n)
    ]


def evaluate_devices(
    exp: Experiment,
    clients: list[Any],
    payload: ModelPayload,
    seed: int = 0,
    *,
    query_planes: int = 0,
    user_reg: float = 1.0,
    rank_planes: int | None = None,
) -> dict[TieMode, EvalResult]:
    """Every device installs the final model (item codes and, under the all-items objective, item
    levels), refreshes its code against it (a local DCD, nothing uploaded; with ``query_planes`` P >= 1,
    the server's asymmetric-scoring plan, its user vector as P bit-planes, solved with ``user_reg``) and
    scores its own test block with the score its ``recommend`` ranks by, (f − Hamming)·B + level or the
    planes' integer score; the results are averaged.

    The evaluation is a simulation step, so its randomness is seeded: a device never invited to a
    round starts from a code drawn from ``(seed, u)``, and each device's tie-breaking generator (used
    by its later ``recommend``) is ``(seed, 1, u)``.

    ``rank_planes`` sets each device's `LightFRConfig.rank_planes` before it refreshes (0: rank with the ±1
    code); None keeps the devices' own setting.  Under DP a device needs no setting: the model it installs
    says DP noise trained it (`ModelPayload.dp_trained`, protocol 1.7), so it ranks with its ±1 code
    (`LightFRModel.private_model`), and with the w0 the server derived (`ModelPayload.unobserved_weight`).
    """
    idx = exp.train.by_user()
    blocks = {int(u): c for u, c in zip(exp.test.users, exp.test.items, strict=True)}
    scores = []
    for u, client in enumerate(clients):
        model = client.model
        if model.config.unobserved_weight > 0:  # what the server's plan says (a device never invited saw none)
            model.config = replace(model.config, query_planes=query_planes, user_reg=user_reg)
        if rank_planes is not None:
            model.config = replace(model.config, rank_planes=rank_planes)
        model.rng = np.random.default_rng([seed, 1, u])
        if not model.user_trained[0]:
            model.reset_user(np.random.default_rng([seed, u]))
        if u not in blocks:
            continue
        model.set_global(payload.words, b"", payload.model_version, **payload.lightfr_extras())
        items = idx.items[idx.indptr[u] : idx.indptr[u + 1]]
        ratings = idx.ratings[idx.indptr[u] : idx.indptr[u + 1]]
        if items.size:
            model.fit_local(items, ratings, rng=np.random.default_rng(u))
        scores.append(device_scores(model, blocks[u]))
    matrix = np.vstack(scores)
    return {t: evaluate_candidates(matrix, 10, t) for t in TieMode}


def device_scores(model: Any, items: np.ndarray) -> np.ndarray:
    """The integer score a LightFR device's ``recommend`` ranks ``items`` by: (f − Hamming)·B + level, or
    for a user vector held as bit-planes a·qᵀd + 2^8·level (`device_sdk.topk.plane_scores`; no levels:
    every item at the centre level)."""
    ids = np.asarray(items)
    if model.user_weight[0] > 0:
        dots = model.item_codes[ids].astype(np.int64) @ model.user_q[0].astype(np.int64)
        levels = model.item_levels
        lv = np.full(ids.shape, LEVEL_CENTER, np.int64) if levels is None else levels[ids].astype(np.int64)
        return (int(model.user_weight[0]) * dots + (lv << LEVEL_SHIFT)).astype(np.float64)
    f = model.config.bits
    same = np.rint(model.similarity(items) * f)  # f − Hamming = f·sim, exact
    levels = model.item_levels
    extra = 0.0 if levels is None else levels[np.asarray(items)].astype(np.float64)
    return same * model.hamming_weight + extra


def verdict(label: str, model_hr: float, popularity_hr: float, epsilon: float | None) -> str:
    """The demo's one-line verdict: the private model against item popularity (HR@10, random ties)."""
    spent = f"; ε spent {epsilon:.3f} at δ=1e-5" if epsilon is not None else "; no DP"
    return (
        f"verdict: {label} HR@10 {model_hr:.3f} vs popularity {popularity_hr:.3f}: "
        f"{model_hr - popularity_hr:+.3f}{spent}"
    )


def simulated_beside(exp: Experiment, epsilon: float, seed: int) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """The same data and ε through the private-round simulator with the budget spent where it buys
    signal (`fedsim.private.scaled_lightfr`: a private popularity release feeding the item level, noise-aware
    aggregation, every device in every round), evaluated on the same test blocks."""
    from fedsim.private.scaled_lightfr import ScaledSettings, evaluate_private, plan_run, with_plan

    settings = ScaledSettings(epsilon=epsilon, threshold=0.0, seed=seed)
    plan = plan_run(exp.train, settings, negatives=exp.n_negatives)
    return evaluate_private(exp, with_plan(settings, plan), eval_seed=0)


@contextlib.contextmanager
def _workdir(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
    else:
        with tempfile.TemporaryDirectory(prefix="fedrec-demo-") as tmp:
            yield Path(tmp)


def run_demo_fleet(
    exp: Experiment,
    *,
    rounds: int,
    cohort: int,
    bits: int,
    dropout: float,
    privacy_epsilon: float | None,
    flip_fraction: float | None,
    seed: int,
    out: TextIO,
    query_planes: int = 0,
    user_reg: float = 1.0,
    workdir: Path | None = None,
    show_progress: bool | None = None,
    insecure_seed_noise: bool = False,
) -> dict[str, Any]:
    """Start a server, run a device per user for ``rounds`` rounds, evaluate, stop the server."""
    n_users = int(np.max(exp.train.users)) + 1 if len(exp.train) else 0
    cohort = min(cohort, n_users)
    with _workdir(workdir) as root:
        authority_file, authority = _demo_authority(root)
        settings = _server_settings(
            root,
            authority,
            n_items=exp.train.n_items,
            bits=bits,
            rounds=rounds,
            cohort=cohort,
            privacy_epsilon=privacy_epsilon,
            flip_fraction=flip_fraction,
            seed=seed,
            query_planes=query_planes,
            user_reg=user_reg,
        )
        config_path = root / "server.toml"
        write_server_config(config_path, settings)
        # Where and when (paths, port, seconds) goes to stderr; stdout is the run's result, the same in
        # every run with the same seed.
        log = sys.stderr
        log.write(f"server: starting fedrec-server ({config_path})\n")
        t0 = time.perf_counter()
        with ServerProcess(config_path, root / "server.log") as server:
            log.write(f"server: listening on {server.url}; {n_users} devices registering\n")
            log.flush()
            out.write(_ROUND_HEADER)
            fleet_cfg = _fleet_config(
                server.url,
                root,
                exp,
                bits=bits,
                rounds=rounds,
                dropout=dropout,
                seed=seed,
                cohort=cohort,
                insecure_seed_noise=insecure_seed_noise,
                authority_file=authority_file,
            )
            report, clients = _drive_fleet(fleet_cfg, device_data(exp, n_users), out, show_progress)
            payload, status = asyncio.run(_final_model(server.url, authority))
        log.write(f"server: stopped (exit {server.proc.returncode if server.proc else '?'})\n")
        if report.errors:  # e.g. timeouts on an overloaded machine: the run is then not the seed's alone
            first = "; ".join(f"{k}: {v}" for k, v in list(report.error_examples.items())[:2])
            log.write(f"devices hit errors: {dict(report.errors)} ({first})\n")
        codes = unpack_signs(from_bytes(payload.words, payload.bits, payload.n_items), payload.bits)
        # Under DP the devices rank with their ±1 codes, as the simulated figure beside does: the download says
        # DP noise trained the model (ModelPayload.dp_trained), and the SDK's rule does the rest.
        results = evaluate_devices(exp, clients, payload, seed, query_planes=query_planes, user_reg=user_reg)
        return {
            "report": report,
            "results": results,
            "baselines": {t: baselines(exp, t) for t in TieMode},
            "status": status,
            "clients": clients,
            "item_codes": codes,
            "seconds": time.perf_counter() - t0,
        }


def _demo_authority(root: Path) -> tuple[Path, EnrollmentAuthority]:
    """The demo plays the operator: it creates an enrollment authority (its key stays outside the
    server's folder), gives the server only the public key, and certifies each device's identity key
    before the device registers; every round then runs signed, with the consistency check."""
    authority_file = root / "enrollment-authority.key"
    if not authority_file.exists():
        EnrollmentAuthority.generate().save(authority_file)
    return authority_file, EnrollmentAuthority.load(authority_file)


def _server_settings(
    root: Path,
    authority: EnrollmentAuthority,
    *,
    n_items: int,
    bits: int,
    rounds: int,
    cohort: int,
    privacy_epsilon: float | None,
    flip_fraction: float | None,
    seed: int,
    query_planes: int,
    user_reg: float,
) -> dict[str, dict[str, Any]]:
    """The demo server's configuration (written to ``server.toml``)."""
    return {
        "server": {"host": "127.0.0.1", "port": 0, "data_dir": str(root / "server-data")},
        "model": {
            "n_items": n_items,
            "bits": bits,
            # The recipe the demo's figures were measured with: the Jacobi step, ρ = 0.3 unless asked.
            "mean_field": False,
            "flip_fraction": 0.3 if flip_fraction is None else flip_fraction,
            **(PRIVATE_MODEL if privacy_epsilon is not None else {}),
            # Asymmetric scoring in the round plan (protocol 1.6): the devices follow it.
            "query_planes": query_planes,
            "user_reg": user_reg,
        },
        "rounds": {
            "cohort_size": cohort,
            # The fleet sends exactly the seeded cohort (FleetConfig.cohort): wait for all of it.
            "min_cohort": cohort,
            "max_rounds": rounds,
            "dropout_rate": 0.33,
            "clip_norm": 8.0,
            "scale_bits": 12,
            "example_cap": 0,
            # Devices that drop announce it and the fleet sends only the cohort, so a phase closes as
            # soon as every device answered: the deadlines are only a safety net, generous enough for
            # 300 devices training in one process on a busy 2-core machine.
            "advertise_timeout": 300.0,
            "share_keys_timeout": 300.0,
            "masked_input_timeout": 300.0,
            "unmask_timeout": 300.0,
            "round_interval": 0.5,
            "seed": seed,
        },
        "privacy": (
            {"enabled": True, "epsilon": privacy_epsilon, "delta": 1e-5, "planned_rounds": rounds}
            if privacy_epsilon is not None
            else {"enabled": False}  # the budget keys are refused without DP (nothing reads them)
        ),
        "log": {"format": "text", "level": "warning"},
        "enrollment": {"authority_key": authority.public_key.hex()},
    }


def _drive_fleet(
    fleet_cfg: FleetConfig, users: list[tuple[np.ndarray, np.ndarray]], out: TextIO, show_progress: bool | None
) -> tuple[FleetReport, list[DeviceClient]]:
    """Run the fleet to its last round, printing a table row per round (with a progress bar on a terminal)."""
    bar = RoundProgress(fleet_cfg.rounds, "demo", enabled=show_progress)
    try:
        return asyncio.run(
            run_fleet(fleet_cfg, users, on_round=lambda rec: bar.write(out, _round_line(rec)), on_status=bar.on_status)
        )
    finally:
        bar.close()


def _fleet_config(
    url: str,
    root: Path,
    exp: Experiment,
    *,
    bits: int,
    rounds: int,
    dropout: float,
    seed: int,
    cohort: int,
    insecure_seed_noise: bool,
    authority_file: Path,
) -> FleetConfig:
    return FleetConfig(
        url=url,
        store_root=root / "devices",
        n_items=exp.train.n_items,
        bits=bits,
        rounds=rounds,
        dropout=dropout,
        seed=seed,
        rating_range=exp.rating_range,
        time_limit=1800.0,
        # Devices that drop say so (like an app closed cleanly), so phases close at quorum.
        announce_drops=True,
        # The fleet picks each round's cohort from the seed and the devices train from it, so
        # runs with one seed match; the DP noise is keyed from the OS unless the test hook says.
        cohort=cohort,
        seed_training=True,
        insecure_reproducible=insecure_seed_noise,
        authority_key_file=authority_file,
    )


_ROUND_HEADER = (
    f"{'round':>5} {'cohort':>6} {'survivors':>9}  dropped per phase (keys/shares/masked/unmask)  {'ε spent':>8}\n"
)


def _round_line(rec: dict[str, Any]) -> str:
    """One row of the demo's per-round table, from the server's round record."""
    drops = "/".join(str(p["dropped"]) for p in rec.get("phases", []))
    eps = (rec.get("privacy") or {}).get("epsilon_spent")
    eps_text = f"{eps:8.3f}" if isinstance(eps, float) else "       -"
    state = "" if rec.get("status") == "committed" else f"  ({rec.get('status')}: {rec.get('reason')})"
    return (
        f"{rec['round_id']:>5} {rec.get('cohort_size', 0):>6} {rec.get('survivors') or 0:>9}  "
        f"{drops:<46} {eps_text}{state}\n"
    )


async def _final_model(url: str, authority: EnrollmentAuthority) -> tuple[ModelPayload, dict[str, Any]]:
    """The committed model and the server status, fetched as an evaluation device would (enrolled with a
    certificate of the demo's enrollment authority, like every other device)."""
    import aiohttp

    identity = SigningKey.generate()
    certificate = authority.issue(identity.public_key, "evaluator")
    request = RegisterRequest(
        platform="fedrec-demo-evaluator",
        certificate=certificate,
        proof=identity.sign(registration_payload(certificate)),
    )
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/devices", data=encode(request)) as resp:
            reg = decode(await resp.read())
        if not isinstance(reg, RegisterResponse):
            raise RuntimeError(f"registration failed: {reg}")
        async with session.get(f"{url}/v1/model", headers={"Authorization": f"Bearer {reg.token}"}) as resp:
            payload = decode(await resp.read())
        if not isinstance(payload, ModelPayload):
            raise RuntimeError(f"model download failed: {payload}")
        status = await fetch_status(session, url)
    return payload, status


def run_loadtest(
    config: FleetConfig,
    users: Sequence[tuple[np.ndarray, np.ndarray | None]],
    workers: int,
    progress: RoundProgress | None = None,
    *,
    backend: str = "local",
    keep_store: bool = True,
    probe_health: bool = False,
    worker_nice: int = 0,
) -> FleetReport:
    """Run the fleet, split over ``workers`` shards: worker processes (``backend="local"``, the default;
    one in-process fleet when ``workers`` is 1) or Ray actors (``backend="ray"``, `fedsim.fleets.ray_fleet`).
    Every shard watches the server and stops after the requested rounds; ``progress`` follows the rounds.

    The shards count the same rounds as the fleet's (``FleetConfig.rounds_before``) and, when the fleet
    picks its cohorts or seeds its devices, register in fleet order: with the same seeds every split and
    both back-ends run the same rounds.  ``probe_health``: a separate process times ``GET /v1/health``
    every 50 ms throughout (`FleetReport.health`).  ``keep_store`` (Ray): the actors use
    ``config.store_root`` instead of temporary folders on their nodes.  ``worker_nice``: the local
    back-end's worker processes lower their priority by this much (a fleet sharing the server's machine
    then does not take the server's CPU; so do Ray actors; the in-process fleet of ``workers=1`` is not
    reniced).
    """
    if backend not in ("local", "ray"):
        raise ConfigError(f"backend must be 'local' or 'ray', got {backend!r}")
    status = _status_of(config)
    seeded = config.cohort is not None or config.seed_training or config.insecure_reproducible
    config = replace(
        config,
        fleet_size=len(users),
        rounds_before=rounds_so_far(status) if config.rounds_before is None else config.rounds_before,
        registered_before=int(status.get("registered_devices") or 0) if seeded else None,
    )
    shards = [
        (int(idx[0]), [users[i] for i in idx]) for idx in np.array_split(np.arange(len(users)), workers) if idx.size
    ]

    def watch() -> None:
        if progress is not None:
            with contextlib.suppress(FedRecError):
                progress.on_status(_status_of(config))

    with HealthProbe(config.url, enabled=probe_health) as probe:
        if backend == "ray":
            from fedsim.fleets.ray_fleet import run_ray_fleet

            dicts = run_ray_fleet(config, shards, keep_store=keep_store, on_wait=watch, nice=worker_nice)
        elif len(shards) <= 1:
            report, _ = asyncio.run(run_fleet(config, users, on_status=progress.on_status if progress else None))
            dicts = [report.to_dict()]
        else:
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(len(shards)) as pool:
                jobs = [pool.apply_async(_worker, (config, part, first, worker_nice)) for first, part in shards]
                while not all(job.ready() for job in jobs):
                    watch()
                    time.sleep(0.5)
                dicts = [job.get() for job in jobs]
    merged = FleetReport.from_dict(dicts[0])
    for d in dicts[1:]:
        merged.merge(FleetReport.from_dict(d))
    merged.health = probe.samples
    with contextlib.suppress(FedRecError):
        merged.final_status = _status_of(config)
    return merged


def _status_of(config: FleetConfig) -> dict[str, Any]:
    """The server's status from the first of the fleet's roots that answers (`get_status`)."""
    for i, url in enumerate(config.urls):
        try:
            return get_status(url, config.ca_file)
        except FedRecError:
            if i == len(config.urls) - 1:
                raise
    raise FedRecError("no server URL given")


def _worker(
    config: FleetConfig, users: list[tuple[np.ndarray, np.ndarray | None]], first: int, nice: int = 0
) -> dict[str, Any]:
    # Every shard watches the server's status and stops once the requested rounds have finished.
    if nice:
        os.nice(nice)
    report, _ = asyncio.run(run_fleet(config, users, first_index=first))
    return report.to_dict()


class RoundProgress:
    """An in-round progress bar (stderr) driven by the fleet's ``/v1/status`` snapshots: one step per
    SecAgg+ phase of each requested round, with the current phase and the devices still in it, and an
    ETA.  With ``enabled=None`` and stderr not a terminal (CI, a log file) there is no bar: one
    timestamped line per phase change instead (``2026-11-27T09:31:02Z round 1 share_keys: 905/943
    devices``); ``enabled=False`` prints neither."""

    PHASES = ("advertise_keys", "share_keys", "masked_input", "unmask")

    def __init__(self, rounds: int, desc: str, enabled: bool | None = None) -> None:
        from fedsim.ui import progress

        self.bar = progress(rounds * len(self.PHASES), desc, "phases", enabled=enabled)
        self.rounds = rounds
        self._last_foreign: int | None = None
        self._finished: set[int] = set()
        self._lines = enabled is None and not sys.stderr.isatty()
        self._last_phase: tuple[int, str] | None = None
        self._reported: set[int] = set()

    def _log(self, text: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        sys.stderr.write(f"{stamp} {text}\n")
        sys.stderr.flush()

    def _log_changes(self, recent: list[dict[str, Any]], cur: dict[str, Any] | None) -> None:
        """Plain-line mode: one line per round the fleet saw end and per phase it saw begin."""
        assert self._last_foreign is not None
        for r in sorted(recent, key=lambda r: int(r["round_id"])):
            rid = int(r["round_id"])
            if r.get("status") in ("committed", "aborted") and rid > self._last_foreign and rid not in self._reported:
                self._reported.add(rid)
                why = f" ({r['reason']})" if r.get("reason") else ""
                self._log(f"round {rid} {r['status']}: {r.get('survivors', 0)}/{r.get('cohort_size', 0)} devices{why}")
        if cur and cur.get("phase") in self.PHASES and int(cur["round_id"]) > self._last_foreign:
            key = (int(cur["round_id"]), str(cur["phase"]))
            if key != self._last_phase:
                self._last_phase = key
                self._log(f"round {key[0]} {key[1]}: {cur.get('alive', 0)}/{cur.get('cohort', 0)} devices")

    @property
    def finished(self) -> int:
        return min(len(self._finished), self.rounds)

    def on_status(self, status: dict[str, Any]) -> None:
        recent = status.get("recent_rounds") or []
        cur = status.get("round")
        if self._last_foreign is None:  # as the fleet's monitor: rounds open before the fleet are not ours
            ids = [int(r["round_id"]) for r in recent] + ([int(cur["round_id"])] if cur else [])
            self._last_foreign = max(ids, default=0)
        if self._lines:
            self._log_changes(recent, cur)
        for r in recent:
            if r.get("status") in ("committed", "aborted") and int(r["round_id"]) > self._last_foreign:
                self._finished.add(int(r["round_id"]))
        pos = self.finished * len(self.PHASES)
        if cur and cur.get("phase") in self.PHASES:
            pos += self.PHASES.index(cur["phase"])
            self.bar.set_postfix_str(
                f"round {cur['round_id']} {cur['phase']}: {cur.get('alive', 0)}/{cur.get('cohort', 0)} alive",
                refresh=False,
            )
        pos = min(pos, self.bar.total)
        if pos > self.bar.n:
            self.bar.update(pos - self.bar.n)
        else:
            self.bar.refresh()

    def write(self, out: TextIO, text: str) -> None:
        """Write a report line without tearing the bar."""
        self.bar.clear()
        out.write(text)
        out.flush()
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
