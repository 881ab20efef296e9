"""``fedrec simulate``'s default, ``--model auto``: LightFR and federated implicit ALS, each trained with its
shipped defaults on the same split, compared on the same validation figure; the better one is tested once.

Invariants:
- Both families are judged by one figure on one validation split: HR@10 of the experiment's validation blocks,
  or Recall@20 of the carved validation pairs of a published split (`fedsim.federation.ials.validation_metric`,
  which scores any trained model through its ``scores`` / ``all_scores``); under ``--epsilon`` the validation
  figure of the score each private run serves (`fedsim.private.served.ServedScore`), on the carve both runs share.
- Nothing is refitted: the kept run is the trained one, and the test split is read once, for it alone (and the
  baselines).  On equal figures the first of `AUTO_FAMILIES` (LightFR) is kept; without DP also when the other is
  better by no more than the validation figure's noise, `validation_margin` (a near tie is not a reason to give
  up the binary codes).
- Under ``--epsilon`` each run is its own ε-DP run, charged by its own ledger; the ε reported is the kept run's.
  Choosing between the two on validation is a selection on private data, like the α choice inside each run: the
  ledger does not charge it, and the output says so.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, TextIO

from fedsim.cli.args import check_output_file
from fedsim.cli.simulate_options import AUTO_FAMILIES, refuse_with_auto
from protocol.errors import ConfigError

if TYPE_CHECKING:  # the simulator loads when the command runs, not to parse it
    from fedsim.evaluation.experiment import Experiment

__all__ = ["SELECTION_NOTE", "keep_better", "simulate_auto", "validation_margin"]

_NAMES = {"lightfr": "LightFR", "ials": "iALS"}

#: What the private default says about its choice between two private runs.
SELECTION_NOTE = (
    "each family's run is its own ε-DP run; choosing between them on validation is a selection on private data, "
    "like the α choice inside each run, and the ledger does not charge it"
)


def keep_better(validation: Mapping[str, float], margin: float = 0.0) -> str:
    """The first of `AUTO_FAMILIES`, unless another's validation figure is higher by more than ``margin``
    (then the highest such); on equal figures the first listed.

    Raises
    ------
    ValueError
        A family missing from ``validation``.
    """
    missing = [f for f in AUTO_FAMILIES if f not in validation]
    if missing:
        raise ValueError(f"no validation figure for {', '.join(missing)}")
    first = AUTO_FAMILIES[0]
    better = [f for f in AUTO_FAMILIES[1:] if validation[f] > validation[first] + margin]
    return max(better, key=lambda f: (validation[f], -AUTO_FAMILIES.index(f))) if better else first


def validation_margin(exp: Experiment, value: float) -> float:
    """√(p(1 − p)/n) for the first family's validation figure p over the n validation rows (the blocks, or the
    users of a published split's carved pairs): a bound on the standard error of a mean of n per-row figures
    in [0, 1] with mean p, the noise a difference of the two families' figures must exceed."""
    import numpy as np

    n = exp.val.users.size if exp.val_pairs is None else int(np.unique(exp.val_pairs.users).size)
    return math.sqrt(max(value * (1.0 - value), 0.0) / n) if n > 0 else 0.0


def _choice_lines(metric: str, validation: Mapping[str, float], kept: str, margin: float = 0.0) -> str:
    """One line per family's validation figure, and one for the choice."""
    lines = [f"validation {metric}, {_NAMES[f]}: {validation[f]:.4f}\n" for f in AUTO_FAMILIES]
    other = next(f for f in AUTO_FAMILIES if f != kept)
    if validation[kept] == validation[other]:
        why = "equal on validation: the first listed is kept"
    elif validation[kept] < validation[other]:
        why = (
            f"{_NAMES[other]} is higher by {validation[other] - validation[kept]:.4f}, within the noise bound "
            f"{margin:.4f} of the figure: the first listed is kept"
        )
    else:
        beyond = margin > 0 and kept != AUTO_FAMILIES[0]
        why = f"higher by more than the noise bound {margin:.4f}" if beyond else "higher"
    return "".join(lines) + f"kept: {_NAMES[kept]} ({why}); only it is tested\n"


def _check(args: argparse.Namespace) -> None:
    if args.dataset is None:
        raise ValueError("--dataset is required (a dataset name, a ratings file, or synthetic)")
    if args.dataset == "planted":
        raise ConfigError("--dataset planted is the felb/fnmf recipe: add --model felb or --model fnmf")
    if args.plot is not None:
        refuse_with_auto("--plot", ("lightfr",))
    if args.save is not None:
        if args.epsilon > 0:
            raise ConfigError("--save is not available for private runs (--epsilon) yet; drop --save")
        check_output_file("--save", args.save)


def simulate_auto(args: argparse.Namespace, defaults: argparse.Namespace, out: TextIO) -> int:
    """Run ``simulate`` with ``--model auto``; ``defaults`` holds every ``simulate`` option's value when not
    given."""
    _check(args)
    if args.epsilon > 0:
        return _simulate_private_auto(args, defaults, out)
    if args.pop_share is not None:
        raise ConfigError("--pop-share applies to private runs only (with --epsilon)")
    from fedsim.cli.results import evaluate_and_report, resolve_dataset
    from fedsim.cli.simulate import lightfr_description, save_lightfr_run, train_lightfr
    from fedsim.cli.simulate_ials import _record, ials_label, ials_schedule, save_ials_run, train_ials
    from fedsim.evaluation.experiment import Protocol, require_validation
    from fedsim.evaluation.report import result_record, write_json
    from fedsim.federation.families import FAMILY_DEFAULT_ROUNDS
    from fedsim.federation.ials import validation_metric
    from fedsim.threads import one_blas_thread

    schedule, factors, alphas, regs = ials_schedule(args, defaults)  # every option checked before training
    if args.rounds is None:
        args.rounds = FAMILY_DEFAULT_ROUNDS["lightfr"]
    t0, c0 = time.perf_counter(), time.process_time()
    exp, _ = resolve_dataset(args, out)
    require_validation(exp)
    out.write(exp.describe() + "\n")
    out.write(
        "model auto: LightFR and federated implicit ALS, each with its defaults, trained on the same split and "
        "compared on the same validation; the better one is tested\n"
    )
    out.write(lightfr_description(args))
    lightfr = train_lightfr(args, exp, out, show_progress=not getattr(args, "quiet", False))
    metric, lightfr_value = validation_metric(exp, lightfr, eval_seed=args.eval_seed)
    sel = train_ials(exp, schedule, factors, alphas, regs, args.eval_seed, out)
    validation = {"lightfr": lightfr_value, "ials": sel.value}
    margin = validation_margin(exp, validation[AUTO_FAMILIES[0]])
    kept = keep_better(validation, margin)
    out.write(_choice_lines(metric, validation, kept, margin))
    with one_blas_thread():
        if kept == "ials":
            metrics = evaluate_and_report(exp, sel.run, ials_label(sel), args.eval_seed, out)
        else:
            metrics = evaluate_and_report(exp, lightfr, f"LightFR (Agg_{args.aggregation})", args.eval_seed, out)
    if args.save is not None:  # the kept family's run, as `--model lightfr|ials --save` writes it
        if kept == "ials":
            save_ials_run(args, exp, schedule, sel, out)
        else:
            save_lightfr_run(args, exp, lightfr, out)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    out.write(f"done in {seconds:.1f} s ({cpu:.1f} s CPU)\n")
    if args.json:
        if kept == "ials":
            record = _record(exp, schedule, sel, metrics, seconds, cpu)
            record["candidates"] = record.pop("validation")
        else:
            record = result_record(
                dataset=exp.name, protocol=exp.protocol.value, rounds=args.rounds, seconds=seconds, metrics=metrics
            )
            record.update(family="lightfr", cpu_seconds=cpu)
        record.update(validation=validation, validation_metric=metric, validation_margin=margin)
        if exp.protocol is not Protocol.FULL:
            record["eval_negatives"] = exp.n_negatives
        write_json(record, sys.stdout)
    return 0


def _simulate_private_auto(args: argparse.Namespace, defaults: argparse.Namespace, out: TextIO) -> int:
    """``simulate --epsilon E`` with ``--model auto``: private LightFR and private iALS (each planned by its
    privacy planner), each run's served score chosen on validation, the better run tested once."""
    from fedsim.cli.simulate_private import (
        load_private_data,
        private_ials_run,
        private_lightfr_run,
        report_private,
        run_extra,
        validate_run,
    )
    from fedsim.private.served import evaluate_served

    t0 = time.perf_counter()
    data = load_private_data(args)
    # Every option of both runs is checked before either trains.
    runs = {"lightfr": private_lightfr_run(args, defaults, data), "ials": private_ials_run(args, defaults, data)}
    out.write(
        "model auto: private LightFR and private implicit ALS, each planned by its privacy planner and trained on "
        "the same split, compared on the same validation; the better one is tested\n"
    )
    served = {family: validate_run(run, data, args, out) for family, run in runs.items()}
    validation = {family: s.validation for family, s in served.items()}
    kept = keep_better(validation)
    out.write(_choice_lines(served[kept].metric, validation, kept))
    metrics = evaluate_served(data, served[kept], eval_seed=args.eval_seed)
    extra = run_extra(runs[kept], served[kept])
    note = (
        f"the ε of the kept {_NAMES[kept]} run; its item level α={extra['alpha']} chosen on validation; random ties.\n"
        f"{SELECTION_NOTE[0].upper()}{SELECTION_NOTE[1:]}"
    )
    return report_private(
        args,
        out,
        t0,
        metrics,
        extra,
        runs[kept].rounds,
        note,
        private=True,
        family=kept,
        validation=validation,
        validation_metric=served[kept].metric,
        selection=SELECTION_NOTE,
    )
