"""``fedrec data``: list the datasets fedrec can find, with their sizes."""

from __future__ import annotations

import argparse
from typing import TextIO

from fedsim.cli.args import Command, add_data_dir, resolve_data_dir
from protocol.errors import FedRecError

__all__ = ["COMMAND"]


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run ``fedrec data``; returns the exit status."""
    from fedsim.data.datasets import DATASET_NAMES, LightFRSplit, TrainTestSplit, load_dataset

    base = resolve_data_dir(args.data_dir)
    out.write(f"data folder: {base if base is not None else 'not found (set FEDREC_DATA or --data-dir)'}\n")
    names = [n for n in DATASET_NAMES if n != "synthetic"] if base is not None else []
    for name in ["synthetic", *names]:
        try:
            data = load_dataset(name, base)
        except FedRecError as exc:
            out.write(f"  {name:<18} unavailable: {exc}\n")
            continue
        if isinstance(data, TrainTestSplit):
            out.write(
                f"  {name:<18} {data.train.n_users:>6} users {data.train.n_items:>6} items "
                f"{len(data.train):>8} train + {len(data.test)} test pairs (implicit, its own split)\n"
            )
            continue
        train = data.train if isinstance(data, LightFRSplit) else data
        out.write(f"  {name:<18} {train.n_users:>6} users {train.n_items:>6} items {len(train):>8} ratings\n")
    return 0


COMMAND = Command(
    name="data", help="list the datasets fedrec can find", description=None, add_options=add_data_dir, run=run
)
