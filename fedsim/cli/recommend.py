"""``fedrec recommend``: top-N items for one user of a saved run, from the user's rebuilt device model."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from fedsim.cli.args import Command, add_json, add_run_file, add_seed, positive_int

__all__ = ["COMMAND"]


def _add_options(p: argparse.ArgumentParser) -> None:
    add_run_file(p)
    p.add_argument("--user", required=True, help="user id as in the dataset (its raw id; planted data: the row number)")
    p.add_argument("-n", type=positive_int, default=10, help="how many items (default: 10)")
    add_seed(p, "seed of the tie-breaking (default: 0)")
    add_json(p, "print one JSON object instead of a table")


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run ``fedrec recommend``; returns the exit status."""
    from fedsim.evaluation.report import write_json
    from fedsim.federation.runs import load_run
    from fedsim.ui import table

    run = load_run(args.run)
    user = run.user_index(str(args.user))
    ids, scores = run.recommend(user, args.n, seed=args.seed)
    rows = [(run.item_label(int(i)), int(i), float(sc)) for i, sc in zip(ids, scores, strict=True)]
    if args.json:
        record = {
            "run": str(args.run),
            "family": run.family,
            "user": run.user_label(user),
            "items": [{"item": label, "index": index, "score": score} for label, index, score in rows],
        }
        write_json(record, sys.stdout)
        return 0
    out.write(
        f"{run.family} run {args.run}: top {len(rows)} for user {run.user_label(user)} "
        f"({run.train.of(user).size} items rated in training, not recommended again)\n"
    )
    table(["rank", "item", "score"], [[str(k), str(r[0]), f"{r[2]:.4f}"] for k, r in enumerate(rows, 1)], out)
    return 0


COMMAND = Command(
    name="recommend",
    help="top-N items for one user of a saved run",
    description="Recommend from a run saved by 'fedrec simulate --save' (any model family): the user's "
    "device model is rebuilt from the run and ranks every item the user did not rate in training, with the "
    "SDK's recommend (random ties from --seed).",
    add_options=_add_options,
    run=run,
)
