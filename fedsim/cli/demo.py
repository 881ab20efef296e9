"""``fedrec demo``: a real server on loopback and one simulated device per user, then each device's
own evaluation beside popularity and a few recommendations computed on one device.

SIGTERM or SIGINT stops the demo cleanly: the server child is stopped, the temporary folder (the
enrollment authority's private key, the server database, every device store) is removed, one line on
stderr says so, and the exit status is 128 + the signal number.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from fedsim.cli.args import (
    Command,
    add_dataset,
    add_json,
    add_quiet,
    add_seed,
    fraction,
    nonneg_float,
    nonneg_int,
    option_defaults,
    positive_float,
    positive_int,
)
from protocol.errors import ConfigError
from protocol.plan import LightFRParams

if TYPE_CHECKING:  # the simulator, the server and the SDK load when the command runs, not to parse it
    from device_sdk.models import LightFRModel
    from fedsim.evaluation.experiment import Experiment

__all__ = ["COMMAND"]

#: The demo's DP budget when ``--epsilon`` is not given and the fleet is large enough for it.
DEFAULT_EPSILON = 8.0
#: Least share of the training ratings on items whose released sum the privacy planner predicts at
#: signal-to-noise >= 2 (`fedsim.private.scaled_lightfr.plan_privacy`, its "covered") for the demo to run with
#: DP by default.  The plan for ML-100K's 943 devices in one round is 0.79, for all 600 synthetic devices 0.49
#: (both keep DP: their private model is about as good as popularity), for the README's quick demo (40 synthetic
#: devices, 3 rounds) 0.00, where the private model lost to popularity by half (docs/results/2026-11-27-first-hour.md).
MIN_PLANNED_COVERAGE = 0.4


def _add_options(p: argparse.ArgumentParser) -> None:
    add_dataset(p, "dataset name or file (default: ml-100k if found)", default="auto")
    # One round of every device: with DP each device's share of the released sum is largest when every
    # device is in it, and on ML-100K's validation blocks one round of all 943 ranked better (HR@10 0.451)
    # than three rounds of 300 (0.436); three of all 943 (0.462) would triple the demo's wall time.
    p.add_argument("--rounds", type=positive_int, default=1, help="server rounds (default: 1)")
    p.add_argument("--cohort", type=positive_int, default=None, help="devices per round (default: every device)")
    p.add_argument("--devices", type=positive_int, default=None, help="use only the first N users")
    p.add_argument("--bits", type=positive_int, default=64, help="code length f (default: 64)")
    p.add_argument("--dropout", type=nonneg_float, default=0.05, help="chance a device drops (default 0.05)")
    p.add_argument(
        "--epsilon",
        type=nonneg_float,
        default=None,
        help=f"DP budget ε over the run at δ=1e-5 (0 = no DP; default {DEFAULT_EPSILON:g}, or no DP for a fleet so "
        "small that the privacy planner predicts the noise above the signal for most ratings: a line says so)",
    )
    p.add_argument(
        "--flip-fraction",
        type=fraction,
        default=None,
        help="Agg_grad damping ρ (default 0.3: the demo runs the server's Jacobi step, model.mean_field = false, "
        "the recipe its figures were measured with)",
    )
    p.add_argument(
        "--query-planes",
        type=nonneg_int,
        default=0,
        metavar="P",
        help="asymmetric scoring through the round plan (protocol 1.6, the server's model.query_planes): each "
        "device solves a real user vector against the item codes and keeps it as P ±1 bit-planes (0..8; "
        "default 0: ±1 user codes)",
    )
    p.add_argument(
        "--user-reg",
        type=positive_float,
        default=1.0,
        help="ridge weight of the devices' user solve under --query-planes (model.user_reg; default 1)",
    )
    add_seed(
        p,
        "seed of everything the simulation decides: which devices each round invites, which drop and "
        "where, the devices' first codes and sampled negatives, the server's cohort graph and damping, the "
        "evaluation's tie-breaks and, without DP, the rounding of the devices' updates (default: 0). Without DP "
        "(--epsilon 0) two runs with one seed print the same output; with DP the noise is fresh from the OS "
        "each run, so figures differ by the noise only (see --insecure-seed-dp-noise)",
    )
    p.add_argument(
        "--insecure-seed-dp-noise",
        action="store_true",
        help="TEST HOOK: derive every device's DP noise from --seed too, so DP runs repeat exactly; anyone "
        "who knows the seed can remove the noise, so the run's ε is NOT a privacy guarantee (it says so)",
    )
    p.add_argument("--workdir", type=Path, default=None, help="keep server data and device stores here")
    add_quiet(p)
    add_json(p, "print the result as one JSON object, the last line of stdout")


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT during the demo. A KeyboardInterrupt, so that it unwinds the event loop and every
    ``with`` block as Ctrl-C does (asyncio re-raises it from any task): the server child stops on the way."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int) -> None:
    raise _Stopped(signum)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise `_Stopped` while the demo runs; the first one sets both to be ignored, so
    that stopping the server and removing the folder are not cut short by a second."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def stop(signum: int, frame: object) -> None:
        import asyncio

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise _Stopped(signum) from None
        # Inside the fleet's event loop: raised from a callback of the loop, not from whichever device task
        # was running, so it ends the loop and no task is left holding it ("exception never retrieved").
        loop.call_soon_threadsafe(_raise_stopped, signum)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run ``fedrec demo``; returns the exit status (128 + the signal's number when stopped by SIGTERM or
    SIGINT, after stopping the server and removing the temporary folder)."""
    tmp: Path | None = None
    try:
        with _stop_on_signals():
            try:
                if args.workdir is None:  # private to this run (mode 0700); removed however the run ends
                    tmp = Path(tempfile.mkdtemp(prefix="fedrec-demo-"))
                return _run(args, out, args.workdir if tmp is None else tmp)
            finally:
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
    except _Stopped as exc:
        if tmp is not None:  # a signal during the removal above cut it short
            shutil.rmtree(tmp, ignore_errors=True)
        where = f"; removed {tmp}" if tmp is not None else f"; kept {args.workdir}" if args.workdir else ""
        print(f"fedrec demo: stopped by {signal.Signals(exc.signum).name}{where}", file=sys.stderr)
        return 128 + exc.signum


def _run(args: argparse.Namespace, out: TextIO, workdir: Path) -> int:
    from agg_server.config import MIN_COHORT
    from fedsim.cli.growth import forecast_growth
    from fedsim.cli.results import report_sampled, resolve_dataset
    from fedsim.evaluation.ranking import TieMode
    from fedsim.evaluation.report import write_json
    from fedsim.fleets.demo import run_demo_fleet, verdict

    if not 0 <= args.dropout < 1:
        raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.devices is not None and args.devices < MIN_COHORT:
        raise ConfigError(f"--devices {args.devices}: a secure-aggregation round needs at least {MIN_COHORT} devices")
    if args.cohort is not None and args.cohort < MIN_COHORT:
        raise ConfigError(f"--cohort {args.cohort}: a secure-aggregation round needs at least {MIN_COHORT} devices")
    if not args.query_planes and args.user_reg != option_defaults(_add_options).user_reg:
        raise ConfigError("--user-reg applies with --query-planes P >= 1 only (the ridge weight of the user solve)")
    try:  # the plan's own bounds (protocol.plan.LightFRParams), before a server is started
        LightFRParams(query_planes=args.query_planes, user_reg=args.user_reg)
    except ValueError as exc:
        raise ConfigError(f"--{str(exc).replace('_', '-', 1)}") from None
    if args.workdir is not None and args.workdir.exists() and not args.workdir.is_dir():
        raise ConfigError(f"--workdir {args.workdir}: is not a folder")
    exp, data_dir = resolve_dataset(args, out)
    if exp.train.n_users < MIN_COHORT:
        raise ConfigError(
            f"--dataset {args.dataset}: {exp.train.n_users} user(s) with training ratings; a secure-aggregation "
            f"round needs at least {MIN_COHORT} devices"
        )
    n_devices = exp.train.n_users
    if args.devices is not None and args.devices < exp.train.n_users:
        exp = _first_users(exp, args.devices)  # keeps the id space: train.n_users stays the dataset's
        n_devices = args.devices
    if args.cohort is None:
        args.cohort = n_devices
    head = exp.describe()
    if n_devices < exp.train.n_users:  # the id space stays the dataset's; say who takes part
        head = head.replace(f"{exp.train.n_users} users,", f"the first {n_devices} of {exp.train.n_users} users,", 1)
    out.write(head + "\n")
    if args.epsilon is None:
        args.epsilon, note = small_fleet_privacy(exp, n_devices, args.rounds, args.bits)
        if note and args.insecure_seed_dp_noise:  # the hook seeds DP noise, and this run would have none
            raise ConfigError(f"--insecure-seed-dp-noise: {note.removeprefix('no DP: ')}")
        if note:
            out.write(note + "\n")
    eps = args.epsilon or None
    out.write(
        f"LightFR f={args.bits}; {args.rounds} rounds of up to {min(args.cohort, n_devices)} devices; "
        f"SecAgg+ (ω=0.33); "
        + (f"distributed DP ε={eps:g} at δ=1e-5 over the run, devices rank with their ±1 codes; " if eps else "no DP; ")
        + f"dropout {args.dropout:.0%} per device and round"
        + (
            f"; asymmetric scoring in the round plan: {args.query_planes} bit-planes, ridge {args.user_reg:g}\n"
            if args.query_planes
            else "\n"
        )
    )
    plan = _plan(exp, eps, args.bits, n_devices) if eps else None
    growth = None
    if plan is not None:
        out.write(plan.verdict() + _PLAN_SUFFIX + "\n")
        out.flush()
        growth = forecast_growth(exp, eps, seed=args.seed, bits=args.bits)
        out.write(growth.line() + "\n")
    res = run_demo_fleet(
        exp,
        rounds=args.rounds,
        cohort=args.cohort,
        bits=args.bits,
        dropout=args.dropout,
        privacy_epsilon=eps,
        flip_fraction=args.flip_fraction,
        seed=args.seed,
        out=out,
        query_planes=args.query_planes,
        user_reg=args.user_reg,
        workdir=workdir,
        show_progress=False if args.quiet else None,
        insecure_seed_noise=args.insecure_seed_dp_noise,
    )
    results = {"LightFR over the server": res["results"]}
    for name in ("popularity", "random"):
        results[name] = {t: res["baselines"][t][name] for t in TieMode}
    report_sampled(exp, results, out)
    privacy = res["status"].get("privacy")
    ours, pop = res["results"][TieMode.RANDOM], res["baselines"][TieMode.RANDOM]["popularity"]
    spent = privacy["epsilon_spent"] if privacy else None
    out.write(verdict("private model over the real server" if privacy else "model", ours.hr, pop.hr, spent) + "\n")
    if privacy and args.insecure_seed_dp_noise:
        out.write("ε is NOT a privacy guarantee here: --insecure-seed-dp-noise derived the DP noise from the seed\n")
    if privacy and ours.hr < pop.hr:
        _explain_private_loss(args, exp, n_devices, pop.hr, out)
    client = res["clients"][int(exp.test.users[0])]
    _show_device(exp, client.model, data_dir, out)
    print(f"done in {res['seconds']:.1f} s", file=sys.stderr)
    if args.json:
        write_json(_record(args, exp, res, ours, privacy, plan, growth), sys.stdout)
    return 0


_PLAN_SUFFIX = (
    " (the planner's forecast, as `fedrec simulate --model lightfr --epsilon` runs it; the real server's verdict"
    " follows the run)"
)


def _plan(exp: Experiment, epsilon: float, bits: int, n_devices: int) -> Any:
    """The privacy planner's plan for this data and ε (`fedsim.private.planner.PrivatePlan`), printed before
    the run; ``n_devices`` of the id space's users hold the training ratings."""
    from dataclasses import replace

    from fedsim.private.scaled_lightfr import ScaledSettings, plan_run

    settings = ScaledSettings(epsilon=epsilon, bits=bits, unobserved_weight="auto")
    return replace(plan_run(exp.train, settings, negatives=exp.n_negatives), devices=n_devices)


def small_fleet_privacy(exp: Experiment, n_devices: int, rounds: int, bits: int) -> tuple[float, str | None]:
    """The demo's ε when ``--epsilon`` is not given: `DEFAULT_EPSILON`, unless the fleet is too small for DP.

    The privacy planner (`fedsim.private.scaled_lightfr.plan_privacy`, what ``fedrec plan-privacy`` prints)
    predicts, from the fleet's ratings alone, the share of them on items whose released sum stands at
    signal-to-noise >= 2 after ``rounds`` rounds at ε = `DEFAULT_EPSILON` (its best clip norm; an upper bound,
    since it assumes every device in every round).  Below `MIN_PLANNED_COVERAGE` the noise swamps what a round
    can learn and the private model ranks below counting, so the demo runs without DP and says so.

    Returns
    -------
    tuple
        ε (0: no DP) and the one line to print when DP was left off (else None).
    """
    from dataclasses import replace

    from fedsim.private.scaled_lightfr import plan_privacy

    train = exp.train  # the fleet's devices are users 0..n_devices-1 (`_first_users`); plan for them alone
    if n_devices < train.n_users:
        train = replace(train, n_users=n_devices, user_ids=train.user_ids[:n_devices])
    covered = max(r.covered for r in plan_privacy(train, epsilon=DEFAULT_EPSILON, bits=bits, rounds=(rounds,)))
    if covered >= MIN_PLANNED_COVERAGE:
        return DEFAULT_EPSILON, None
    return 0.0, (
        f"no DP: at {n_devices} devices and ε={DEFAULT_EPSILON:g} the privacy planner (fedrec plan-privacy) puts "
        f"{1 - covered:.0%} of the ratings under the noise; --epsilon {DEFAULT_EPSILON:g} turns DP on, and at this "
        "size expect the private model below item popularity"
    )


def _explain_private_loss(
    args: argparse.Namespace, exp: Experiment, n_devices: int, pop_hr: float, out: TextIO
) -> None:
    """Why the private model lost to popularity, and the private-round simulator's figure on the same data and ε."""
    from fedsim.fleets.demo import simulated_beside, verdict

    out.write(
        "The real server's LightFR model did not beat popularity here: with user-level DP over "
        f"{n_devices} devices\n"
        "the noise each code coordinate needs is larger than the per-item signal the sum carries, and its item\n"
        "levels (the private counts of the uploads) did not make up for it. The private-round simulator on the\n"
        "same data and ε, every device in every round, a separate private popularity release feeding the\n"
        "item level (fedsim.private.scaled_lightfr):\n"
    )
    metrics, extra = simulated_beside(exp, float(args.epsilon), args.seed)
    sim_hr = metrics["model"]["hr@10"]
    out.write(
        verdict("simulated private model", sim_hr, pop_hr, float(extra["epsilon"]))
        + f" (private popularity alone {metrics['private_popularity']['hr@10']:.3f})\n"
    )


def _record(
    args: argparse.Namespace,
    exp: Experiment,
    res: dict[str, Any],
    ours: Any,
    privacy: dict[str, Any] | None,
    plan: Any,
    growth: Any,
) -> dict[str, Any]:
    """The ``--json`` result of the demo (`fedsim.evaluation.report`)."""
    from fedsim.evaluation.ranking import TieMode
    from fedsim.evaluation.report import result_record

    base = res["baselines"][TieMode.RANDOM]
    figures = {"model": ours, "popularity": base["popularity"], "random": base["random"]}
    rounds_run = res["report"].server_rounds
    return result_record(
        dataset=exp.name,
        protocol=exp.protocol.value,
        rounds=sum(1 for r in rounds_run if r.get("status") == "committed"),
        seconds=res["seconds"],
        metrics={k: {"hr@10": v.hr, "ndcg@10": v.ndcg} for k, v in figures.items()},
        epsilon=None if not privacy else float(privacy["epsilon_spent"]),
        delta=None if not privacy else float(privacy["delta"]),
        seed=args.seed,
        epsilon_is_guarantee=bool(privacy) and not args.insecure_seed_dp_noise,
        server_rounds=[{k: r.get(k) for k in ("round_id", "status", "cohort_size", "survivors")} for r in rounds_run],
        **({"plan": plan.record()} if plan is not None else {}),
        **({"growth": growth.record()} if growth is not None else {}),
    )


def _first_users(exp: Experiment, n: int) -> Experiment:
    from dataclasses import replace

    from fedsim.evaluation.experiment import Candidates

    keep = np.asarray(exp.train.users) < n
    train = exp.train.subset(keep)

    def cut(c: Candidates) -> Candidates:
        sel = c.users < n
        return Candidates(c.users[sel], c.items[sel])

    return replace(exp, train=train, val=cut(exp.val), test=cut(exp.test))


def _show_device(exp: Experiment, model: LightFRModel, data_dir: Path | None, out: TextIO) -> None:
    from fedsim.evaluation.experiment import item_titles

    titles = item_titles(exp, data_dir)
    user = int(exp.test.users[0])
    train = exp.train
    liked = np.asarray(train.items[train.users == user], dtype=np.int64)
    ids, scores = model.recommend(liked, N=5)

    def name(i: int) -> str:
        return titles[i] if titles else f"item {train.item_ids[i]}"

    held = int(exp.test.items[0, 0])
    out.write(
        f"\nTop-5 computed on device {user} (offline, XOR + popcount; {liked.size} rated items, "
        f"e.g. {', '.join(name(int(i)) for i in liked[:3])}):\n"
    )
    for rank, (i, s) in enumerate(zip(ids, scores, strict=True), start=1):
        mark = "   <- its held-out test item" if int(i) == held else ""
        out.write(f"  {rank}. {name(int(i))}  (score {s:.3f}){mark}\n")


COMMAND = Command(
    name="demo",
    help="run a real server and a fleet of devices on loopback, then show recommendations",
    description="Starts fedrec-server on a free loopback port, registers one simulated device per user "
    "(MovieLens-100K when ../shared/data or --data-dir has it, else a built-in synthetic dataset), runs "
    "federated LightFR rounds with SecAgg+ and distributed DP, prints a per-round table, then each "
    "device's HR@10/NDCG@10 averaged beside popularity and a few recommendations for one device. With DP, two "
    "lines come before the run: the privacy planner's plan, and when personalisation starts paying: `fedrec "
    "simulate --model lightfr --epsilon E`'s private LightFR on the same data, then on every user replicated 2, 4, "
    "8 and 16 times (the same shape with more devices, fresh noise), until the learned model beats its private "
    "popularity list on validation; no test data is read (about half a minute on MovieLens-100K at ε = 8).",
    add_options=_add_options,
    run=run,
)
