"""``fedrec simulate``: in-process federated training on a dataset, evaluated beside the baselines.

LightFR runs here (plain sums, no sockets); ``--epsilon`` and MF on a published split go through the
private-round simulator (`fedsim.cli.simulate_private`), implicit ALS through `fedsim.cli.simulate_ials`, the
other families through `fedsim.federation.families`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from fedsim.cli.args import Command, add_json, add_plot, add_quiet, check_output_file, option_defaults, resolve_data_dir
from fedsim.cli.simulate_options import (
    add_data_args,
    add_family_args,
    add_fed_args,
    add_model_args,
    check_applicable,
    fed_config,
    flip_fraction,
    mean_field,
    model_config,
    unobserved_weight,
)
from protocol.errors import ConfigError

if TYPE_CHECKING:  # the simulator loads when the command runs, not to parse it
    from fedsim.evaluation.experiment import Experiment
    from fedsim.federation.lightfr import FederatedLightFR, RoundReport

__all__ = ["COMMAND", "lightfr_description", "save_lightfr_run", "train_lightfr"]


def _add_options(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_fed_args(p, rounds=50)
    add_family_args(p)
    add_data_args(p, default=None)
    p.add_argument("--save", type=Path, default=None, help="write the trained run to this file")
    add_plot(p, "draw validation HR@10/NDCG@10 per evaluated round (LightFR in-process runs; needs the 'plot' extra)")
    add_quiet(p)
    add_json(p)


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run ``fedrec simulate``; returns the exit status."""
    from fedsim.cli.results import evaluate_and_report, resolve_dataset
    from fedsim.cli.simulate_private import simulate_mf_published, simulate_private_lightfr
    from fedsim.data.datasets import TrainTestSplit, load_dataset
    from fedsim.evaluation.experiment import require_validation
    from fedsim.evaluation.report import result_record, write_json
    from fedsim.federation.families import FAMILY_DEFAULT_ROUNDS, simulate_family

    defaults = option_defaults(_add_options)
    check_applicable(args, defaults)
    if args.model == "auto":
        from fedsim.cli.simulate_auto import simulate_auto

        return simulate_auto(args, defaults, out)
    if args.plot is not None:
        from fedsim.cli.plots import check_plot_target

        if args.model != "lightfr" or args.epsilon > 0:
            raise ConfigError(
                "--plot draws in-process LightFR runs only (not --model mf|felb|fnmf|ials or --epsilon) yet"
            )
        check_plot_target(args.plot)
    if args.save is not None:
        check_output_file("--save", args.save)
    if args.model == "lightfr" and args.epsilon > 0:
        if args.save is not None:
            raise ConfigError("--save is not available for private LightFR runs (--epsilon) yet; drop --save")
        return simulate_private_lightfr(args, defaults, out)
    if args.model == "ials":
        from fedsim.cli.simulate_ials import simulate_ials

        return simulate_ials(args, defaults, out)
    if args.model == "mf" and args.dataset not in (None, "planted", "synthetic"):
        published = load_dataset(args.dataset, resolve_data_dir(args.data_dir))
        if isinstance(published, TrainTestSplit):
            return simulate_mf_published(args, defaults, published, out)
    if args.rounds is None:
        args.rounds = FAMILY_DEFAULT_ROUNDS[args.model]
    if args.model != "lightfr":
        return simulate_family(args, resolve_data_dir(args.data_dir), out)
    if args.dataset is None:
        raise ValueError("--dataset is required (a dataset name, a ratings file, or synthetic)")
    t0 = time.perf_counter()
    exp, data_dir = resolve_dataset(args, out)
    require_validation(exp)
    out.write(exp.describe() + "\n")
    out.write(lightfr_description(args))
    state = train_lightfr(args, exp, out, show_progress=not getattr(args, "quiet", False))
    if args.plot is not None:
        _plot(args, exp, state, out)
    label = f"LightFR (Agg_{args.aggregation})"
    metrics = evaluate_and_report(exp, state, label, args.eval_seed, out)
    if getattr(args, "save", None) is not None:
        save_lightfr_run(args, exp, state, out)
    seconds = time.perf_counter() - t0
    out.write(f"done in {seconds:.1f} s\n")
    if args.json:
        record = result_record(
            dataset=exp.name, protocol=exp.protocol.value, rounds=args.rounds, seconds=seconds, metrics=metrics
        )
        write_json(record, sys.stdout)
    return 0


def lightfr_description(args: argparse.Namespace) -> str:
    """The line describing an in-process LightFR run of these options."""
    return (
        f"LightFR f={args.bits}, λ={args.lam}, "
        + (
            f"all items (w0={unobserved_weight(args)}, α={args.confidence}, item levels)"
            if unobserved_weight(args) != 0
            else f"{args.negatives} negatives per rating"
        )
        + f", E={args.epochs}; "
        f"T={args.rounds} rounds, p={args.fraction}, Agg_{args.aggregation} "
        f"(flip fraction {flip_fraction(args):g}{', mean field' if mean_field(args) else ''}), "
        f"seed {args.seed}\n"
    )


def train_lightfr(args: argparse.Namespace, exp: Experiment, out: TextIO, show_progress: bool) -> FederatedLightFR:
    """Train LightFR in-process as the options say, printing the per-round validation progress."""
    from fedsim.cli.results import print_rows, score_blocks
    from fedsim.evaluation.ranking import TieMode
    from fedsim.federation.lightfr import run_lightfr, user_data
    from fedsim.ui import progress

    cfg, fed = model_config(args, exp), fed_config(args)
    if fed.query_planes and getattr(args, "save", None) is not None:
        raise ValueError("--save stores ±1 user codes; a run with --query-planes keeps bit-plane user vectors")
    data = user_data(exp.train, cfg)
    bar: Any = None
    if show_progress and fed.rounds:
        bar = progress(fed.rounds, "training", "rounds")
    rows = [["round", "cohort", "user flips", "item flips", "seconds", "val HR@10", "val NDCG@10"]]

    def on_round(r: RoundReport) -> None:
        if bar is not None:
            bar.update(1)
            if r.metric is not None:
                bar.set_postfix(hr=f"{r.metric.hr:.3f}")
        if r.metric is not None:
            rows.append(
                [
                    str(r.round),
                    str(r.cohort),
                    str(r.user_flips),
                    str(r.item_flips),
                    f"{r.seconds:.2f}",
                    f"{r.metric.hr:.4f}",
                    f"{r.metric.ndcg:.4f}",
                ]
            )

    state = run_lightfr(
        data,
        cfg,
        fed,
        evaluate=lambda s: score_blocks(s, exp.val, TieMode.RANDOM),
        eval_every=args.eval_every,
        on_round=on_round,
    )
    if bar is not None:
        bar.close()
    if len(rows) > 1:
        out.write("\nPer-round progress (validation blocks, random ties):\n")
        print_rows(rows, out)
    return state


def _plot(args: argparse.Namespace, exp: Experiment, state: FederatedLightFR, out: TextIO) -> None:
    """``--plot``: validation HR@10 / NDCG@10 per evaluated round of an in-process LightFR run."""
    from fedsim.cli.plots import plot_training

    evaluated = [r for r in state.history if r.metric is not None]
    plot_training(
        args.plot,
        f"LightFR f={args.bits} on {exp.name}, Agg_{args.aggregation} ρ={flip_fraction(args):g}",
        [r.round for r in evaluated],
        {
            "HR@10": [r.metric.hr for r in evaluated if r.metric],
            "NDCG@10": [r.metric.ndcg for r in evaluated if r.metric],
        },
        None,
    )
    out.write(f"plot: {args.plot}\n")


def save_lightfr_run(args: argparse.Namespace, exp: Experiment, state: FederatedLightFR, out: TextIO) -> None:
    """``--save``: the trained LightFR run as a ``lightfr-run`` store file (`fedsim.federation.runs`)."""
    from device_sdk.store import save_store
    from fedsim.federation.runs import LIGHTFR_RUN, TrainItems, lightfr_run_fields

    train = exp.train
    save_store(
        args.save,
        LIGHTFR_RUN,
        {
            "dataset": str(args.dataset),
            "protocol": exp.protocol.value,
            "eval_negatives": exp.n_negatives,
            "seed": args.seed,
            "eval_seed": args.eval_seed,
            "rounds": args.rounds,
            **lightfr_run_fields(
                state.user_codes,
                state.item_codes,
                TrainItems.from_pairs(train.users, train.items, train.n_users),
                item_levels=state.item_levels,
                hamming_weight=state.hamming_weight,
                user_ids=train.user_ids,
                item_ids=train.item_ids,
                user_q=state.user_q,
                user_weight=state.user_weight,
            ),
        },
    )
    out.write(f"saved the run to {args.save}\n")


COMMAND = Command(
    name="simulate",
    help="run an in-process federated training and evaluate it",
    description="In-process federated training (no sockets) on a dataset, evaluated beside simple "
    "baselines. Default (--model auto): LightFR and federated implicit ALS both trained with their defaults on the "
    "same split, compared on the same validation figure, the better one tested once (with --epsilon: both "
    "private runs, the kept run's ε reported). --model lightfr: HR@10/NDCG@10 in both tie modes beside "
    "popularity and random. --model mf: test RMSE and HR@10/NDCG@10, optionally private through the real "
    "coordinator (--epsilon). --model felb / fnmf: the planted recipes (or binarized ratings for felb) with F1 / "
    "Σ-RMSD figures. --model ials: federated implicit ALS, confidence α, ridge λ, factors d and the weight of "
    "its item-popularity term chosen on validation, the same test protocol as LightFR.",
    add_options=_add_options,
    run=run,
)
