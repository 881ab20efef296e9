"""``fedrec plan-privacy``: predict the signal-to-noise of private LightFR choices before spending any ε."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from fedsim.cli.args import (
    Command,
    add_dataset,
    nonneg_int,
    open_fraction,
    positive_float,
    positive_int,
    resolve_data_dir,
)
from protocol.errors import ConfigError

__all__ = ["COMMAND", "MAX_PLAN_ROUNDS"]

#: The most rounds `fedrec plan-privacy` plans (its accountant composes every round: 10^3 take about
#: 3 s, 10^4 about 25 s).
MAX_PLAN_ROUNDS = 1_000


def _plan_rounds(text: str) -> int:
    value = positive_int(text)
    if value > MAX_PLAN_ROUNDS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_PLAN_ROUNDS}, got {value}")
    return value


def _add_options(p: argparse.ArgumentParser) -> None:
    add_dataset(p, "dataset name or ratings file", required=True)
    p.add_argument("--epsilon", type=positive_float, default=8.0, help="target ε over the run (default 8)")
    p.add_argument("--bits", type=positive_int, default=64, help="code length f (default 64)")
    p.add_argument("--example-cap", type=nonneg_int, default=50, help="θ items per device (default 50)")
    p.add_argument("--negatives", type=nonneg_int, default=0, help="sampled negatives per item (default 0)")
    p.add_argument(
        "--pop-share",
        type=open_fraction,
        default=0.5,
        help="share of ε for popularity, the rest pays for the rounds (default 0.5)",
    )
    p.add_argument("--rounds", type=_plan_rounds, nargs="+", default=[1, 2, 3, 5, 10], help="rounds to plan")
    p.add_argument("--clips", type=positive_float, nargs="+", default=[1.0, 4.0], help="clip norms C to plan")
    p.add_argument(
        "--growth",
        action="store_true",
        help="also say when personalisation starts paying: the private LightFR run `fedrec simulate --model lightfr "
        "--epsilon E` makes, on the data and on every user replicated 2, 4, 8 and 16 times, until its learned model "
        "beats its private popularity list on validation (a rating log; takes a few private runs)",
    )


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run ``fedrec plan-privacy``; returns the exit status."""
    from fedsim.cli.results import print_rows
    from fedsim.data.datasets import LightFRSplit, TrainTestSplit, load_dataset
    from fedsim.evaluation.experiment import prepare
    from fedsim.private.scaled_lightfr import ScaledSettings, colluder_inflation, plan_privacy, plan_run
    from protocol.noise import colluding_devices
    from protocol.policy import PrivacyPolicy

    data: Any = load_dataset(args.dataset, resolve_data_dir(args.data_dir))
    if args.growth and isinstance(data, TrainTestSplit):
        raise ConfigError(f"--growth needs a rating log: {args.dataset} comes with its own train/test split")
    train = data.train if isinstance(data, TrainTestSplit | LightFRSplit) else data
    out.write(
        f"{args.dataset}: {train.n_users} devices, {train.n_items} items; target ε={args.epsilon:g} at δ=1e-5, "
        f"f={args.bits}, θ={args.example_cap}, {args.negatives} negatives, popularity share {args.pop_share:g}\n"
    )
    gamma = PrivacyPolicy().adversary_rate  # the default device's, which the server's default equals
    out.write(
        f"noise sized so the honest devices alone carry it when {colluding_devices(train.n_users, gamma)} of them "
        f"(⌊γ n⌋, γ = {gamma:g}) collude and add none: {colluder_inflation(train.n_users, gamma):.3f}× the variance "
        "the accountant charges, in every σ below\n"
    )
    rows = plan_privacy(
        train,
        epsilon=args.epsilon,
        bits=args.bits,
        example_cap=args.example_cap,
        negatives=args.negatives,
        pop_share=args.pop_share,
        rounds=tuple(args.rounds),
        clips=tuple(args.clips),
    )
    header = ["rounds", "C", "s", "σ/coord", "median item SNR", "interactions at SNR>=2", "popularity σ", "top-100 gap"]
    body = [
        [
            str(r.rounds),
            f"{r.clip_norm:g}",
            str(r.scale_bits),
            f"{r.sigma:.3g}",
            f"{r.median_snr:.3f}",
            f"{r.covered:.1%}",
            f"{r.pop_noise:.3g}",
            f"{r.pop_top_gap:.3g}",
        ]
        for r in rows
    ]
    print_rows([header, *body], out)
    best = max(rows, key=lambda r: (r.covered, -r.rounds))
    out.write(
        f"most interactions above SNR 2: T={best.rounds}, C={best.clip_norm:g} ({best.covered:.1%}); the SNR "
        "assumes the gradients of an item's devices agree, so it is an upper bound on what a round can learn\n"
    )
    settings = ScaledSettings(epsilon=args.epsilon, bits=args.bits, unobserved_weight="auto")
    # The evaluation `fedrec simulate` would run: full ranking on a published split, else sampled candidates.
    if isinstance(data, TrainTestSplit):
        plan = plan_run(data.train, settings, negatives=None)
    else:
        exp = prepare(data)
        plan = plan_run(exp.train, settings, negatives=exp.n_negatives)
    out.write(plan.verdict() + " (what `fedrec simulate --epsilon` runs by default)\n")
    if args.growth:
        from fedsim.cli.growth import forecast_growth

        out.flush()
        out.write(forecast_growth(exp, args.epsilon, bits=args.bits).line() + "\n")
    return 0


COMMAND = Command(
    name="plan-privacy",
    help="predict per-coordinate signal-to-noise of private LightFR choices before spending any ε",
    description="For a dataset and a target ε (user-level, δ=1e-5, every round charged), predicts for each "
    "number of rounds and clip norm the released noise σ per coordinate, the signal-to-noise of the median "
    "item, the share of interactions on items with SNR >= 2, and the noise of the private popularity "
    "release, using the accountant's own μ (docs/dp-accounting.md §6); then prints the plan `fedrec simulate "
    "--epsilon` runs by default: the share of ε the private popularity list needs to stay near popularity, "
    "and whether the rest buys rounds of personalisation.",
    add_options=_add_options,
    run=run,
)
