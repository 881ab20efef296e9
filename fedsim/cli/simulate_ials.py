"""``fedrec simulate --model ials``: federated implicit ALS in-process (plain sums), α and d chosen on validation
inside the run, the kept model tested once beside the baselines."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from protocol.errors import ConfigError
from protocol.plan import IALSParams

if TYPE_CHECKING:  # the simulator loads when the command runs, not to parse it
    from fedsim.evaluation.experiment import Experiment
    from fedsim.federation.ials import IALSSchedule, IALSSelection

__all__ = ["ials_schedule", "save_ials_run", "simulate_ials", "train_ials"]


def _grids(args: argparse.Namespace) -> tuple[tuple[int, ...], tuple[float, ...], float]:
    """The factor counts and confidences to try, and λ: the ones given, else the family's grids; each one
    checked by `protocol.plan.IALSParams` and the strategy's bounds (one clear line)."""
    from fedsim.federation.ials import ALPHA_GRID, FACTOR_GRID
    from protocol.spec import MAX_RANK

    factors = (int(args.rank),) if args.rank is not None else FACTOR_GRID
    if factors[0] > MAX_RANK:
        raise ConfigError(f"--rank must be in [1, {MAX_RANK}] for --model ials, got {factors[0]}")
    alphas = (float(args.alpha),) if args.alpha is not None else ALPHA_GRID
    reg = float(args.reg) if args.reg is not None else IALSParams().reg
    try:
        for alpha in alphas:
            IALSParams(alpha=alpha, reg=reg)
    except ValueError as exc:
        raise ConfigError(f"--{exc}") from None
    if args.rounds is not None and args.rounds < 1:
        raise ConfigError(f"--rounds must be >= 1 for --model ials, got {args.rounds}")
    return factors, alphas, reg


def ials_schedule(
    args: argparse.Namespace, defaults: argparse.Namespace
) -> tuple[IALSSchedule, tuple[int, ...], tuple[float, ...], float]:
    """The in-process iALS run the options ask for: its schedule, the factor counts and confidences to try,
    and λ, every one checked (one clear line)."""
    from fedsim.federation.ials import IALSSchedule

    factors, alphas, reg = _grids(args)
    # Every device in every round unless --fraction is given (its default is LightFR's).
    fraction = args.fraction if args.fraction != defaults.fraction else 1.0
    given = {} if args.rounds is None else {"rounds": args.rounds}  # else the schedule's default
    return IALSSchedule(**given, fraction=fraction, seed=args.seed), factors, alphas, reg


def train_ials(
    exp: Experiment,
    schedule: IALSSchedule,
    factors: tuple[int, ...],
    alphas: tuple[float, ...],
    reg: float,
    eval_seed: int,
    out: TextIO,
) -> IALSSelection:
    """Print the run's description, train every candidate (d, α), print each validation figure and the choice;
    the kept run and its figures (`fedsim.federation.ials.select_and_train`)."""
    from fedsim.federation.ials import select_and_train
    from fedsim.threads import one_blas_thread

    out.write(
        f"federated implicit ALS: λ={reg:g}, T={schedule.rounds} rounds in-process (plain sums, no noise), "
        f"fraction {schedule.fraction:g}, exact user step on each device, shared-curvature item solve on the server; "
        f"d from {list(factors)}, α from {list(alphas)} chosen on validation; seed {schedule.seed}\n"
    )

    def candidate(d: int, alpha: float, metric: str, value: float, seconds: float) -> None:
        out.write(f"  validation d={d}, α={alpha:g}: {metric} {value:.4f} ({seconds:.1f} s)\n")
        out.flush()

    with one_blas_thread():  # small batched solves: a threaded BLAS on a busy machine only wakes threads
        sel = select_and_train(
            exp, schedule, factors=factors, alphas=alphas, reg=reg, eval_seed=eval_seed, on_candidate=candidate
        )
    best = sel.validation[(sel.factors, sel.alpha)]
    out.write(f"chosen on validation: d={sel.factors}, α={sel.alpha:g} ({sel.metric} {best:.4f})\n")
    return sel


def simulate_ials(args: argparse.Namespace, defaults: argparse.Namespace, out: TextIO) -> int:
    """Run ``simulate --model ials``; ``defaults`` holds every ``simulate`` option's value when not given."""
    from fedsim.cli.results import evaluate_and_report, resolve_dataset
    from fedsim.evaluation.report import write_json
    from fedsim.threads import one_blas_thread

    if args.dataset in (None, "planted"):
        raise ConfigError("--model ials needs --dataset (a rating log such as ml-100k, filmtrust-lightfr, amazon-book)")
    if args.epsilon > 0:
        if args.save is not None:
            raise ConfigError("--save is not available for private iALS runs (--epsilon) yet; drop --save")
        from fedsim.cli.simulate_private import simulate_private_ials

        return simulate_private_ials(args, defaults, out)
    if args.pop_share is not None:
        raise ConfigError("--pop-share applies to private runs only (with --epsilon)")
    schedule, factors, alphas, reg = ials_schedule(args, defaults)
    t0, c0 = time.perf_counter(), time.process_time()
    exp, _ = resolve_dataset(args, out)
    out.write(exp.describe() + "\n")
    sel = train_ials(exp, schedule, factors, alphas, reg, args.eval_seed, out)
    label = f"federated iALS (d={sel.factors}, α={sel.alpha:g})"
    with one_blas_thread():
        metrics = evaluate_and_report(exp, sel.run, label, args.eval_seed, out)
    if args.save is not None:
        save_ials_run(args, exp, schedule, sel, reg, out)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    out.write(f"done in {seconds:.1f} s ({cpu:.1f} s CPU)\n")
    if args.json:
        write_json(_record(exp, schedule, sel, metrics, seconds, cpu, reg), sys.stdout)
    return 0


def save_ials_run(
    args: argparse.Namespace, exp: Experiment, schedule: IALSSchedule, sel: IALSSelection, reg: float, out: TextIO
) -> None:
    """``--save``: the kept iALS run as a ``family-run`` (`fedsim.federation.runs`): one `IALSModel` holding every
    user's vector and V, with what `fedrec eval` needs to rebuild the split (dataset, protocol, seeds)."""
    import numpy as np

    from device_sdk.ials import IALSConfig, IALSModel
    from fedsim.federation.runs import TrainItems, save_family_run

    train = exp.train
    model = IALSModel(train.n_items, IALSConfig(factors=sel.factors, alpha=sel.alpha, reg=reg), n_users=train.n_users)
    model.item_factors = np.array(sel.run.item_factors, dtype=np.float64)
    model.user_factors = np.array(sel.run.user_factors, dtype=np.float64)
    model.user_trained[:] = True  # every user took its exact step against the final V (no items: u = 0)
    model.model_version = schedule.rounds + 1
    save_family_run(
        args.save,
        "ials",
        [(model, train.n_users)],
        TrainItems.from_pairs(train.users, train.items, train.n_users),
        {
            "dataset": str(args.dataset),
            "protocol": exp.protocol.value,
            "eval_negatives": exp.n_negatives,
            "seed": args.seed,
            "eval_seed": args.eval_seed,
            "rounds": schedule.rounds,
            "n_items": train.n_items,
        },
        user_ids=train.user_ids,
        item_ids=train.item_ids,
    )
    out.write(f"saved the run to {args.save}\n")


def _record(
    exp: Experiment,
    schedule: IALSSchedule,
    sel: IALSSelection,
    metrics: dict[str, dict[str, float]],
    seconds: float,
    cpu: float,
    reg: float,
) -> dict[str, Any]:
    """The ``--json`` record: the fixed keys, the chosen (d, α), λ, every candidate's validation figure and
    the command's CPU seconds."""
    from fedsim.evaluation.report import result_record

    return result_record(
        dataset=exp.name,
        protocol=exp.protocol.value,
        rounds=schedule.rounds,
        seconds=seconds,
        metrics=metrics,
        family="ials",
        factors=sel.factors,
        alpha=sel.alpha,
        reg=reg,
        validation=[{"factors": d, "alpha": a, sel.metric: v} for (d, a), v in sel.validation.items()],
        cpu_seconds=cpu,
    )
