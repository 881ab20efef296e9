"""``fedrec loadtest``: simulated devices against a running server, with dropouts injected at every phase;
prints latency percentiles, rounds, server CPU and memory, bytes and errors."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

import numpy as np

from fedsim.cli.args import (
    Command,
    add_json,
    add_plot,
    add_quiet,
    add_seed,
    nonneg_float,
    nonneg_int,
    option_name,
    positive_int,
)
from fedsim.evaluation.report import write_json
from protocol.errors import ConfigError

__all__ = ["COMMAND"]


def _add_options(p: argparse.ArgumentParser) -> None:
    _add_fleet_args(p)
    add_quiet(p)
    add_plot(
        p,
        "draw every per-phase latency the devices saw against time; 'model' points are model downloads "
        "(needs the 'plot' extra)",
    )
    add_json(p, "print the report as one JSON object, the last line of stdout")
    p.add_argument("--store", type=Path, default=None, help="device store folder (default: a temporary one)")
    _add_credential_args(p)


def _add_fleet_args(p: argparse.ArgumentParser) -> None:
    """The fleet: its server, size, rounds, shards, dropouts and seeds."""
    p.add_argument(
        "--url",
        required=True,
        action="append",
        help="server root, e.g. http://127.0.0.1:8080; give it once per instance of a server on a shared database "
        "(devices spread over them and go on with the next one when theirs dies)",
    )
    p.add_argument("--devices", type=positive_int, default=100, help="number of devices (default: 100)")
    p.add_argument("--dropout", type=nonneg_float, default=0.2, help="chance a device drops per round")
    p.add_argument("--rounds", type=positive_int, default=3, help="stop after this many rounds (default: 3)")
    p.add_argument(
        "--n-items",
        type=positive_int,
        default=None,
        help="catalogue size the server trains (default: read from the server's /v1/status; a different value is "
        "an error)",
    )
    p.add_argument(
        "--bits", type=positive_int, default=None, help="code length of the server's model (default: read from it)"
    )
    p.add_argument("--ratings-per-user", type=positive_int, default=166, help="synthetic ratings per device")
    p.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="shards of the fleet: worker processes, or Ray actors with --backend ray (default: 1)",
    )
    p.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="where the shards run: local worker processes (default) or Ray actors, each hosting its devices as "
        "asyncio tasks (needs the 'ray' extra; RAY_ADDRESS selects an existing cluster, else a local Ray is "
        "started for the run)",
    )
    p.add_argument(
        "--nice",
        type=nonneg_int,
        default=0,
        help="lower the priority of the fleet's worker processes by N (a fleet on the server's own machine then "
        "leaves the server its CPU; --workers 1 runs the fleet in this process, which is not reniced)",
    )
    p.add_argument(
        "--cohort",
        type=positive_int,
        default=None,
        help="reproducible rounds: the fleet picks each round's N devices from --seed and only those check in, and "
        "the devices' training (and, in rounds without DP noise, the rounding of their updates) is seeded; with a "
        "server whose rounds.cohort_size is N and rounds.seed is set, runs with the same seeds commit the same "
        "rounds on every back-end and split, and without DP or with --insecure-seed-noise the same model "
        "(default: every device checks in whenever it is free)",
    )
    p.add_argument(
        "--insecure-seed-noise",
        action="store_true",
        help="TEST HOOK: derive every device's noise stream (DP noise and stochastic-rounding coins) from --seed "
        "too, so seeded runs commit bit-identical models; anyone who knows the seed can remove the noise, so the "
        "run's ε is NOT a privacy guarantee (it says so)",
    )
    add_seed(
        p,
        "seed of the devices' synthetic ratings and of which devices drop, where (default: 0); keys, masks "
        "and DP noise always come from the OS, and which devices the server invites depends on timing",
    )
    p.add_argument("--time-limit", type=nonneg_float, default=3600.0, help="seconds before giving up")
    p.add_argument(
        "--announce-drops",
        action="store_true",
        help="dropped devices tell the server they leave, so phases close at once (default: drops are silent, "
        "and the server notices them when the device's connection stays closed past rounds.disconnect_grace or "
        "it checks in again)",
    )


def _add_credential_args(p: argparse.ArgumentParser) -> None:
    """How the devices trust the server and register with it."""
    p.add_argument(
        "--ca-file",
        type=Path,
        default=None,
        help="PEM certificate to trust for an https server with a private or self-signed certificate",
    )
    p.add_argument(
        "--authority-key",
        type=Path,
        default=None,
        metavar="FILE",
        help="the operator's enrollment authority key (fedrec enroll-ca init): each device gets a certificate for "
        "its identity key and registers with it; rounds run signed (the server's enrollment.authority_key)",
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="file holding the server's admin token: the fleet asks the server for one one-time enrollment token "
        "per device and each device registers with its token (default without either: open registration, "
        "which a server accepts on loopback only)",
    )
    p.add_argument(
        "--credential-sources",
        type=positive_int,
        default=1,
        help="spread the devices' credentials over this many sources (certificate or token batches; default 1)",
    )


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run ``fedrec loadtest``; returns the exit status."""
    import tempfile

    from fedsim.data.synthetic import synthetic
    from fedsim.fleets.demo import RoundProgress, run_loadtest
    from fedsim.fleets.loadtest_report import format_loadtest, loadtest_record
    from fedsim.fleets.local import FleetConfig

    if not 0 <= args.dropout < 1:
        raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.plot is not None:
        from fedsim.cli.plots import check_plot_target

        check_plot_target(args.plot)
    # The operator's own files first: a missing or malformed one is named before the server is contacted.
    admin_token = _read_secret(args.admin_token_file) if args.admin_token_file else None
    if args.authority_key is not None:
        from protocol.enrollment import EnrollmentAuthority

        EnrollmentAuthority.load(args.authority_key)
    urls = [u.rstrip("/") for u in args.url]
    url = urls[0]
    _match_server_model(args, url)
    data = synthetic(n_users=args.devices, n_items=args.n_items, ratings_per_user=args.ratings_per_user, seed=args.seed)
    idx = data.by_user()
    users = [
        (
            np.asarray(idx.items[idx.indptr[u] : idx.indptr[u + 1]]),
            np.asarray(idx.ratings[idx.indptr[u] : idx.indptr[u + 1]]),
        )
        for u in range(data.n_users)
    ]
    shard = "Ray actor" if args.backend == "ray" else "worker process"
    out.write(
        f"load test: {args.devices} devices ({args.workers} {shard}(s)) against {', '.join(urls)}; "
        f"m={args.n_items}, f={args.bits} (as the server trains), ~{args.ratings_per_user} ratings each; "
        f"dropout {args.dropout:.0%} ({'announced' if args.announce_drops else 'silent'}); {args.rounds} rounds\n"
    )
    out.flush()
    bar = RoundProgress(args.rounds, "load test", enabled=False if args.quiet else None)
    try:
        with tempfile.TemporaryDirectory(prefix="fedrec-loadtest-") as tmp:
            cfg = FleetConfig(
                url=url,
                failover_urls=tuple(urls[1:]),
                store_root=args.store or Path(tmp),
                n_items=args.n_items,
                bits=args.bits,
                rounds=args.rounds,
                dropout=args.dropout,
                seed=args.seed,
                time_limit=args.time_limit,
                ca_file=args.ca_file,
                announce_drops=args.announce_drops,
                authority_key_file=args.authority_key,
                admin_token=admin_token,
                credential_sources=args.credential_sources,
                cohort=args.cohort,
                seed_training=args.cohort is not None,
                insecure_reproducible=args.insecure_seed_noise,
            )
            report = run_loadtest(
                cfg,
                users,
                args.workers,
                progress=bar,
                backend=args.backend,
                keep_store=args.store is not None,
                probe_health=True,
                worker_nice=args.nice,
            )
    finally:
        bar.close()
    format_loadtest(report, out)
    if args.plot is not None:
        from fedsim.cli.plots import plot_loadtest
        from fedsim.fleets.local import PHASE_STEPS

        title = f"{args.devices} devices, dropout {args.dropout:.0%}, {report.rounds_finished} rounds ({url})"
        plot_loadtest(args.plot, report.latency_series, PHASE_STEPS, title)
        out.write(f"plot: {args.plot}\n")
    failure = report.failure(args.rounds)
    if args.json:
        write_json(
            loadtest_record(report, args.rounds, failure, url=url, backend=args.backend, workers=args.workers),
            sys.stdout,
        )
    if failure is not None:
        out.flush()
        print(f"fedrec loadtest: error: {failure}", file=sys.stderr)
        return 1
    return 0


def _match_server_model(args: argparse.Namespace, url: str) -> None:
    """Take ``--n-items`` and ``--bits`` from the server's ``/v1/status`` when not given; refuse a value the
    server does not train, and a server that does not train LightFR."""
    from fedsim.fleets.local import get_status

    model = get_status(url, args.ca_file).get("model") or {}
    if model.get("kind", "lightfr") != "lightfr":
        raise ConfigError(f"the server at {url} trains model.kind={model.get('kind')!r}; the load test drives LightFR")
    for flag, key in (("n_items", "n_items"), ("bits", "bits")):
        served = model.get(key)
        given = getattr(args, flag)
        if given is None:
            if served is None:
                raise ConfigError(f"the server at {url} does not report model.{key}; pass {option_name(flag)}")
            setattr(args, flag, int(served))
        elif served is not None and int(served) != given:
            raise ConfigError(
                f"{option_name(flag)} {given} but the server at {url} trains model.{key}={served}; "
                f"drop {option_name(flag)} to use the server's"
            )


def _read_secret(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not text:
        raise ConfigError(f"{path} is empty")
    return text


COMMAND = Command(
    name="loadtest",
    help="run simulated devices against a server",
    description="Simulated devices as asyncio tasks (in several worker processes when asked) against "
    "a running fedrec-server, with dropouts injected at every phase (including disconnects in the middle "
    "of a request); prints per-phase latency percentiles, rounds completed, server CPU and memory per "
    "round, bytes per device and errors by type.",
    add_options=_add_options,
    run=run,
)
