"""``fedrec simulate --model ials``: federated implicit ALS in-process (plain sums), α, λ, d and the item term's
weight chosen on validation inside the run, the kept model tested once beside the baselines."""

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

__all__ = ["ials_label", "ials_schedule", "save_ials_run", "simulate_ials", "train_ials"]


def _grids(args: argparse.Namespace) -> tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...] | None]:
    """The factor counts, confidences and ridge weights to try: the ones given, else the family's grids (None
    for λ: `fedsim.federation.ials.ridge_grid` of each α); each one checked by `protocol.plan.IALSParams` and the
    strategy's bounds (one clear line)."""
    from fedsim.federation.ials import ALPHA_GRID, FACTOR_GRID, ridge_grid
    from protocol.spec import MAX_RANK

    factors = (int(args.rank),) if args.rank is not None else FACTOR_GRID
    if factors[0] > MAX_RANK:
        raise ConfigError(f"--rank must be in [1, {MAX_RANK}] for --model ials, got {factors[0]}")
    alphas = (float(args.alpha),) if args.alpha is not None else ALPHA_GRID
    regs = (float(args.reg),) if args.reg is not None else None
    try:
        for alpha in alphas:
            for reg in regs or ridge_grid(alpha):
                IALSParams(alpha=alpha, reg=reg)
    except ValueError as exc:
        raise ConfigError(f"--{exc}") from None
    if args.rounds is not None and args.rounds < 1:
        raise ConfigError(f"--rounds must be >= 1 for --model ials, got {args.rounds}")
    return factors, alphas, regs


def ials_schedule(
    args: argparse.Namespace, defaults: argparse.Namespace
) -> tuple[IALSSchedule, tuple[int, ...], tuple[float, ...], tuple[float, ...] | None]:
    """The in-process iALS run the options ask for: its schedule, the factor counts, confidences and ridge
    weights to try, every one checked (one clear line)."""
    from fedsim.federation.ials import IALSSchedule

    factors, alphas, regs = _grids(args)
    # Every device in every round unless --fraction is given (its default is LightFR's).
    fraction = args.fraction if args.fraction != defaults.fraction else 1.0
    given = {} if args.rounds is None else {"rounds": args.rounds}  # else the schedule's default
    return IALSSchedule(**given, fraction=fraction, seed=args.seed), factors, alphas, regs


def train_ials(
    exp: Experiment,
    schedule: IALSSchedule,
    factors: tuple[int, ...],
    alphas: tuple[float, ...],
    regs: tuple[float, ...] | None,
    eval_seed: int,
    out: TextIO,
) -> IALSSelection:
    """Print the run's description, train every candidate (d, α, λ), print each validation figure, the item
    term's and the choice; the kept run and its figures (`fedsim.federation.ials.select_and_train`)."""
    from fedsim.federation.ials import LEVEL_WEIGHTS, STRONG_RIDGE, select_and_train
    from fedsim.threads import one_blas_thread

    ridges = list(regs) if regs is not None else f"[{IALSParams().reg:g}, {STRONG_RIDGE:g}·(1 + α)]"
    out.write(
        f"federated implicit ALS: T={schedule.rounds} rounds in-process (plain sums, no noise), "
        f"fraction {schedule.fraction:g}, exact user step on each device, shared-curvature item solve on the server; "
        f"α from {list(alphas)}, λ from {ridges} and d from {list(factors)} chosen on validation, then the weight "
        f"w of the item term (score u·v + w·level, level the log-scale holder counts over [0, 1]) from "
        f"{list(LEVEL_WEIGHTS)}; seed {schedule.seed}\n"
    )

    def candidate(d: int, alpha: float, reg: float, metric: str, value: float, seconds: float) -> None:
        out.write(f"  validation d={d}, α={alpha:g}, λ={reg:g}: {metric} {value:.4f} ({seconds:.1f} s)\n")
        out.flush()

    with one_blas_thread():  # small batched solves: a threaded BLAS on a busy machine only wakes threads
        sel = select_and_train(
            exp, schedule, factors=factors, alphas=alphas, regs=regs, eval_seed=eval_seed, on_candidate=candidate
        )
    weights = ", ".join(f"w={w:g} {v:.4f}" for w, v in sel.level_validation.items())
    out.write(f"  validation d={sel.factors}, α={sel.alpha:g}, λ={sel.reg:g} with the item term: {weights}\n")
    out.write(
        f"chosen on validation: d={sel.factors}, α={sel.alpha:g}, λ={sel.reg:g}, w={sel.level_weight:g} "
        f"({sel.metric} {sel.value:.4f})\n"
    )
    return sel


def simulate_ials(args: argparse.Namespace, defaults: argparse.Namespace, out: TextIO) -> int:
    """Run ``simulate --model ials``; ``defaults`` holds every ``simulate`` option's value when not given."""
    from fedsim.cli.results import evaluate_and_report, resolve_dataset
    from fedsim.evaluation.experiment import require_validation
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
    schedule, factors, alphas, regs = ials_schedule(args, defaults)
    t0, c0 = time.perf_counter(), time.process_time()
    exp, _ = resolve_dataset(args, out)
    require_validation(exp)
    out.write(exp.describe() + "\n")
    sel = train_ials(exp, schedule, factors, alphas, regs, args.eval_seed, out)
    label = ials_label(sel)
    with one_blas_thread():
        metrics = evaluate_and_report(exp, sel.run, label, args.eval_seed, out)
    if args.save is not None:
        save_ials_run(args, exp, schedule, sel, out)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    out.write(f"done in {seconds:.1f} s ({cpu:.1f} s CPU)\n")
    if args.json:
        write_json(_record(exp, schedule, sel, metrics, seconds, cpu), sys.stdout)
    return 0


def ials_label(sel: IALSSelection) -> str:
    """The kept model's name in the results table."""
    return f"federated iALS (d={sel.factors}, α={sel.alpha:g}, λ={sel.reg:g}, w={sel.level_weight:g})"


def save_ials_run(
    args: argparse.Namespace, exp: Experiment, schedule: IALSSchedule, sel: IALSSelection, out: TextIO
) -> None:
    """``--save``: the kept iALS run as a ``family-run`` (`fedsim.federation.runs`): one `IALSModel` holding every
    user's vector, V and the item term the run ranks with, with what `fedrec eval` needs to rebuild the split
    (dataset, protocol, seeds)."""
    import numpy as np

    from device_sdk.ials import IALSConfig, IALSModel
    from fedsim.federation.runs import TrainItems, save_family_run

    train = exp.train
    config = IALSConfig(factors=sel.factors, alpha=sel.alpha, reg=sel.reg)
    model = IALSModel(train.n_items, config, n_users=train.n_users)
    model.item_factors = np.array(sel.run.item_factors, dtype=np.float64)
    model.user_factors = np.array(sel.run.user_factors, dtype=np.float64)
    model.user_trained[:] = True  # every user took its exact step against the final V (no items: u = 0)
    model.model_version = schedule.rounds + 1
    if sel.run.item_levels is not None and sel.level_weight > 0:  # the item term the last payload carried
        model.item_levels, model.level_weight = sel.run.item_levels.copy(), sel.level_weight
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
) -> dict[str, Any]:
    """The ``--json`` record: the fixed keys, the chosen (d, α, λ, w), every candidate's validation figure, the
    kept model's at each w, and the command's CPU seconds."""
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
        reg=sel.reg,
        level_weight=sel.level_weight,
        validation=[{"factors": d, "alpha": a, "reg": r, sel.metric: v} for (d, a, r), v in sel.validation.items()],
        level_weights=[{"level_weight": w, sel.metric: v} for w, v in sel.level_validation.items()],
        cpu_seconds=cpu,
    )
