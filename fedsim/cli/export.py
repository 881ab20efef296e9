"""``fedrec export``: a saved run as the model file a device loads."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TextIO

from fedsim.cli.args import Command, add_run_file, check_output_file

__all__ = ["COMMAND"]


def _add_options(p: argparse.ArgumentParser) -> None:
    add_run_file(p)
    p.add_argument("-o", dest="output", type=Path, required=True, help="model file to write (e.g. model.fedrec)")
    p.add_argument("--user", default=None, help="export only this user's device model (raw id as in the dataset)")


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run ``fedrec export``; returns the exit status."""
    from device_sdk import LightFRModel
    from fedsim.federation.runs import load_run

    check_output_file("-o", args.output)
    run = load_run(args.run)
    user = None if args.user is None else run.user_index(str(args.user))
    model, row = run.device_model(user)
    if isinstance(model, LightFRModel) and model.config.unobserved_weight > 0:
        model.item_gram()  # kept in the file: the device's first fold-in skips the pass over the catalogue
    model.save(args.output)
    cls = type(model).__name__
    who = "every user of the run" if user is None else f"user {run.user_label(user)} as userid={row}"
    article = "an" if cls[0] in "AEIOU" else "a"  # an IALSModel, a LightFRModel
    out.write(f"wrote {args.output}: {article} {cls} ({who}); load it with {cls}.load({str(args.output)!r})\n")
    return 0


COMMAND = Command(
    name="export",
    help="turn a saved run into the on-device model file the SDK loads",
    description="Write the model file a device loads (LightFRModel.load, MFModel.load, FELBModel.load, "
    "FNMFModel.load, IALSModel.load) from a run saved by 'fedrec simulate --save'. With --user: that user's device "
    "model (LightFR, MF, iALS: a one-user model; FELB, FNMF: the client model holding the user, and its row). "
    "Without: the whole run as one model (LightFR, MF, iALS).",
    add_options=_add_options,
    run=run,
)
