"""``fedrec eval``: re-score a saved LightFR or iALS run on the split it was trained on, or score a baseline."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from fedsim.cli.args import Command, add_dataset, add_json, add_run_file, positive_int, resolve_data_dir
from fedsim.evaluation.experiment import Protocol
from protocol.errors import ConfigError, FedRecError

if TYPE_CHECKING:  # the simulator loads when the command runs, not to parse it
    from fedsim.evaluation.experiment import Experiment

__all__ = ["COMMAND"]


def _add_options(p: argparse.ArgumentParser) -> None:
    add_run_file(p, nargs="?")
    p.add_argument("--baseline", choices=["popularity", "random"], default=None, help="evaluate a baseline instead")
    add_dataset(p, "dataset (for --baseline; a run file names its own)")
    p.add_argument(
        "--protocol",
        choices=[p.value for p in Protocol],
        default=None,
        help="with --baseline, as for simulate; a run file evaluates on its own (another one is refused)",
    )
    p.add_argument(
        "--eval-negatives",
        type=positive_int,
        default=None,
        help="sampled negatives per test positive, with --baseline (default: as simulate's); a run file uses its own "
        "(another number is refused)",
    )
    p.add_argument(
        "--eval-seed",
        type=int,
        default=None,
        help="seed of the evaluation (default: the run file's, else 0); see simulate --eval-seed",
    )
    add_json(p)


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run ``fedrec eval``; returns the exit status."""
    from fedsim.cli.results import evaluate_and_report
    from fedsim.evaluation.experiment import prepare
    from fedsim.evaluation.report import result_record, write_json

    if (args.run is None) == (args.baseline is None):
        raise ValueError("give either a run file or --baseline")
    t0 = time.perf_counter()
    if args.baseline is not None:
        if args.dataset is None:
            raise ValueError("--baseline needs --dataset")
        eval_seed = 0 if args.eval_seed is None else args.eval_seed
        exp = prepare(
            args.dataset,
            Protocol(args.protocol) if args.protocol else None,
            n_negatives=args.eval_negatives,
            seed=eval_seed,
            data_dir=resolve_data_dir(args.data_dir),
        )
        out.write(exp.describe() + "\n")
        metrics = evaluate_and_report(exp, None, "", eval_seed, out, only=args.baseline)
        rounds: int | None = 0
    else:
        exp, state, label, eval_seed, rounds = _load_run(args)
        out.write(exp.describe() + "\n")
        metrics = evaluate_and_report(exp, state, label, eval_seed, out)
    if args.json:
        seconds = time.perf_counter() - t0
        record = result_record(
            dataset=exp.name, protocol=exp.protocol.value, rounds=rounds, seconds=seconds, metrics=metrics
        )
        write_json(record, sys.stdout)
    return 0


def _run_state(family: str, model: Any) -> tuple[Any, str]:
    """(what `evaluate_and_report` scores, its label) of a saved run's whole model."""
    import numpy as np

    from device_sdk.batched import plane_vectors
    from fedsim.federation.ials import IALSRun
    from fedsim.federation.lightfr import FederatedLightFR

    if family == "ials":
        term = {"item_levels": model.item_levels, "level_weight": model.level_weight}  # the item term, if any
        return IALSRun(model.user_factors, model.item_factors, **term), "iALS (saved run)"
    state = FederatedLightFR(
        user_codes=model.user_codes.copy(),
        item_codes=model.item_codes.copy(),
        item_levels=model.item_levels,
        hamming_weight=model.hamming_weight,
    )
    if np.all(model.user_weight > 0):  # the run saved the vectors its users rank with
        state.user_vectors = plane_vectors(model.user_q, model.user_weight, model.hamming_weight)
    return state, "LightFR (saved run)"


def _load_run(args: argparse.Namespace) -> tuple[Experiment, Any, str, int, int | None]:
    """A saved LightFR or iALS run (what it scores with and its label) and the experiment it was trained on
    (same split, same evaluation seed)."""
    from fedsim.evaluation.experiment import DEFAULT_NEGATIVES, prepare
    from fedsim.federation.runs import load_run

    run = load_run(args.run)
    if run.family not in ("lightfr", "ials"):
        raise ConfigError(
            f"{args.run} is a {run.family} run: 'fedrec eval' re-scores LightFR and iALS runs ('fedrec simulate' "
            f"printed the {run.family} figures); 'fedrec recommend {args.run} --user ID' uses it"
        )
    model = run.device_model(None)[0]
    state_dict = run.state
    try:
        n_users, n_items = run.n_users, run.n_items
        state, label = _run_state(run.family, model)
        dataset, protocol = str(state_dict["dataset"]), Protocol(state_dict["protocol"])
        n_neg = int(state_dict["eval_negatives"])
        # runs saved before --eval-seed existed drew their split and candidates from --seed
        run_eval_seed = int(state_dict.get("eval_seed", state_dict["seed"]))
        rounds = int(state_dict["rounds"]) if "rounds" in state_dict else None
    except (KeyError, TypeError, ValueError) as exc:
        raise FedRecError(f"{args.run}: not a valid run file ({exc})") from exc
    if args.eval_seed is not None and args.eval_seed != run_eval_seed:
        raise ConfigError(
            f"{args.run} was trained on the split of evaluation seed {run_eval_seed}; --eval-seed {args.eval_seed} "
            "would draw another split, whose test ratings the model may have trained on"
        )
    data_dir = resolve_data_dir(args.data_dir)
    if dataset == "auto":
        dataset = "ml-100k" if data_dir is not None and (data_dir / "ml-100k").is_dir() else "synthetic"
    # A run is evaluated as it was trained: another dataset, protocol or candidate count would be ignored.
    for flag, asked, own in (
        ("--dataset", args.dataset, dataset),
        ("--protocol", args.protocol, protocol.value),
        ("--eval-negatives", args.eval_negatives, n_neg),
    ):
        if asked is not None and asked != own:
            raise ConfigError(
                f"{flag} {asked}: {args.run} is evaluated on the split and candidates it was trained with "
                f"({flag} {own}); leave {flag} out, or evaluate a baseline with --baseline"
            )
    # A run saved with fewer than the default negatives had them chosen for its small catalogue: the same
    # choice again (it depends on the data only), with the same users left unranked.
    fitted = None if n_neg < DEFAULT_NEGATIVES else n_neg
    exp = prepare(dataset, protocol, n_negatives=fitted, seed=run_eval_seed, data_dir=data_dir)
    if exp.n_negatives != n_neg:
        exp = prepare(dataset, protocol, n_negatives=n_neg, seed=run_eval_seed, data_dir=data_dir)
    if (exp.train.n_users, exp.train.n_items) != (n_users, n_items):
        raise FedRecError(
            f"{args.run} was trained on {n_users}×{n_items}, the dataset is {exp.train.n_users}×{exp.train.n_items}"
        )
    return exp, state, label, run_eval_seed, rounds


COMMAND = Command(
    name="eval",
    help="evaluate a saved run or a baseline",
    description="Evaluate a run saved by 'fedrec simulate --save' on its test blocks, or a baseline "
    "(popularity, random) on a dataset.",
    add_options=_add_options,
    run=run,
)
