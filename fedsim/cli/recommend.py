"""``fedrec recommend``: top-N items for one user of a saved run, from the user's rebuilt device model."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from fedsim.cli.args import Command, add_data_dir, add_json, add_run_file, add_seed, positive_int, resolve_data_dir

__all__ = ["COMMAND"]


def _add_options(p: argparse.ArgumentParser) -> None:
    add_run_file(p)
    p.add_argument("--user", required=True, help="user id as in the dataset (its raw id; planted data: the row number)")
    p.add_argument("-n", type=positive_int, default=10, help="how many items (default: 10)")
    add_seed(p, "seed of the tie-breaking (default: 0)")
    add_json(p, "print one JSON object instead of a table")
    add_data_dir(p)


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run ``fedrec recommend``; returns the exit status."""
    from fedsim.evaluation.experiment import dataset_titles
    from fedsim.evaluation.report import write_json
    from fedsim.federation.runs import load_run
    from fedsim.ui import table

    run = load_run(args.run)
    user = run.user_index(str(args.user))
    ids, scores = run.recommend(user, args.n, seed=args.seed)
    rows = [(run.item_label(int(i)), int(i), float(sc)) for i, sc in zip(ids, scores, strict=True)]
    # MovieLens-100K runs: titles from u.item when the data folder has it (the run keeps the raw ids only)
    data_dir = resolve_data_dir(args.data_dir)
    names = dataset_titles(str(run.state.get("dataset", "")), data_dir, run.state.get("item_ids"))
    if args.json:
        record = {
            "run": str(args.run),
            "family": run.family,
            "user": run.user_label(user),
            "items": [
                {"item": label, "index": index, "score": score, "title": None if names is None else names[index]}
                for label, index, score in rows
            ],
        }
        write_json(record, sys.stdout)
        return 0
    out.write(
        f"{run.family} run {args.run}: top {len(rows)} for user {run.user_label(user)} "
        f"({run.train.of(user).size} items rated in training, not recommended again)\n"
    )
    if names is None:
        table(["rank", "item", "score"], [[str(k), str(r[0]), f"{r[2]:.4f}"] for k, r in enumerate(rows, 1)], out)
    else:
        width = max([len("title"), *(len(names[r[1]]) for r in rows)])  # titles read left-aligned, last
        cells = [[str(k), str(r[0]), f"{r[2]:.4f}", names[r[1]].ljust(width)] for k, r in enumerate(rows, 1)]
        table(["rank", "item", "score", "title".ljust(width)], cells, out)
    return 0


COMMAND = Command(
    name="recommend",
    help="top-N items for one user of a saved run",
    description="Recommend from a run saved by 'fedrec simulate --save' (any model family): the user's "
    "device model is rebuilt from the run and ranks every item the user did not rate in training, with the "
    "SDK's recommend (random ties from --seed). Items are shown by their dataset ids (the run keeps them; "
    "planted data: the index), with titles for MovieLens-100K when --data-dir (or $FEDREC_DATA) has u.item.",
    add_options=_add_options,
    run=run,
)
