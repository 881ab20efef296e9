"""The options of ``fedrec simulate``: their argument groups, which model family each applies to, and
the LightFR configuration they make.

Invariants: an option given for a model that would ignore it is an error naming the option and the
model (`check_applicable`); an option left out takes the server's or the device SDK's default, written
once where it belongs (`agg_server.strategy.lightfr.default_flip_fraction`, `LightFRConfig`, `protocol.plan`).
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from fedsim.cli.args import (
    add_dataset,
    add_seed,
    fraction,
    local_steps,
    nonneg_float,
    nonneg_int,
    open_fraction,
    option_name,
    positive_float,
    positive_int,
    weight_or_auto,
    xor_fraction,
)
from fedsim.data.datasets import DATASET_NAMES
from fedsim.evaluation.experiment import Experiment, Protocol
from protocol.errors import ConfigError
from protocol.families.lightfr import DENSITY_SCALE, density_weight
from protocol.plan import LightFRParams
from protocol.spec import Aggregation

if TYPE_CHECKING:  # the device SDK and the simulator load when a configuration is made, not to parse
    from device_sdk.models import LightFRConfig
    from fedsim.federation.lightfr import FederationConfig

__all__ = [
    "AUTO_FAMILIES",
    "NOT_PRIVATE_LIGHTFR",
    "add_data_args",
    "add_family_args",
    "add_fed_args",
    "add_model_args",
    "check_applicable",
    "fed_config",
    "flip_fraction",
    "mean_field",
    "model_config",
    "rank_ridge",
    "refuse_with_auto",
    "unobserved_weight",
]


_LIGHTFR = LightFRParams()  # the training defaults the CLI shows are the plan's

#: The families the default ``--model auto`` trains, compared on validation (the first kept on a tie).
AUTO_FAMILIES: tuple[str, ...] = ("lightfr", "ials")


#: Agg_grad damping ρ: `simulate` takes the server's default (`agg_server.strategy.lightfr.default_flip_fraction`).
_FLIP_HELP = "default: 1 under the all-items objective with the mean-field step, else 0.3, as the server's"


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LightFR model")
    g.add_argument(
        "--model",
        choices=["auto", "lightfr", "mf", "felb", "fnmf", "ials"],
        default="auto",
        help="model family (default: auto: lightfr and ials both trained with their defaults on the same split, "
        "the better on validation kept and tested); mf, felb, fnmf and ials take the options of their own group "
        "below",
    )
    g.add_argument("--bits", type=positive_int, default=64, help="code length f (default: 64)")
    g.add_argument(
        "--lam",
        type=nonneg_float,
        default=0.0,
        help="balance weight λ (default 0; the paper's 0.6 learns nothing)",
    )
    g.add_argument(
        "--negatives",
        type=nonneg_int,
        default=4,
        help="sampled unobserved items per rating, fitted as 0, when --unobserved-weight is 0 (default 4)",
    )
    g.add_argument(
        "--unobserved-weight",
        type=weight_or_auto,
        default=None,
        help="w0: > 0 trains against every unobserved item and learns item levels; 'auto' (the default; "
        "0 with --aggregation para) derives it from the catalogue's density each round, w0 = 0.6·density^(2/3), "
        "chosen on validation; 0 = the paper's sampled negatives",
    )
    g.add_argument(
        "--confidence",
        type=nonneg_float,
        default=0.0,
        help="α: observed items weigh 1 + α under the all-items objective (default 0)",
    )
    g.add_argument(
        "--query-planes",
        type=nonneg_int,
        default=0,
        help="P >= 1: asymmetric scoring, the user's vector solved exactly against the binary item codes and "
        "kept as P ±1 bit-planes (all-items objective; items stay f-bit codes); 0 = ±1 user codes (default)",
    )
    g.add_argument(
        "--user-reg",
        type=positive_float,
        default=1.0,
        help="ridge weight of the user solve with --query-planes (default 1)",
    )
    g.add_argument(
        "--rank-planes",
        type=nonneg_int,
        default=None,
        metavar="P",
        help="symmetric training (±1 codes) under the all-items objective: each user ranks with its vector "
        "ridge-solved against the final item codes, kept as P bit-planes, as the device SDK's default "
        "(LightFRConfig.rank_planes); 0 ranks with the ±1 codes; default 3, and 0 with --epsilon (under DP "
        "the planes did not help on validation, docs/dp-accounting.md §8)",
    )
    g.add_argument(
        "--rank-ridge",
        type=positive_float,
        default=None,
        help="ridge weight of that ranking-time solve in units of w0·m (LightFRConfig.rank_ridge; default 2)",
    )
    g.add_argument(
        "--targets",
        choices=["binary", "ratings"],
        default="binary",
        help="fit observed items as 1 (binary, default) or as their normalised rating",
    )
    g.add_argument(
        "--epochs", type=local_steps, default=_LIGHTFR.local_epochs, help="local epochs E per round (default: 1)"
    )
    g.add_argument(
        "--sweeps", type=local_steps, default=_LIGHTFR.max_sweeps, help="cap on DCD sweeps per epoch (default: 10)"
    )


def add_fed_args(p: argparse.ArgumentParser, rounds: int) -> None:
    g = p.add_argument_group("federation")
    g.add_argument(
        "--rounds",
        type=nonneg_int,
        default=None,
        help=f"global rounds T (default: {rounds} for lightfr, 20 for mf, 100 for felb, 10 for fnmf, 5 for ials; "
        "lightfr with --epsilon: the privacy planner's, 5 or none)",
    )
    g.add_argument(
        "--fraction",
        type=fraction,
        default=0.6,
        help="client fraction p per round (default: 0.6; ials: 1, every device)",
    )
    g.add_argument(
        "--aggregation",
        choices=[a.value for a in Aggregation],
        default="grad",
        help="server rule: grad (Agg_grad, eq. 16) or para (Agg_para, eq. 17)",
    )
    g.add_argument(
        "--flip-fraction",
        type=fraction,
        default=None,
        help=f"probability that an item bit Agg_grad wants to flip is flipped ({_FLIP_HELP}; 1 = the paper's rule)",
    )
    g.add_argument(
        "--no-mean-field",
        dest="mean_field",
        action="store_false",
        default=None,
        help="all-items objective: step every item bit from the old codes (Jacobi) instead of the default mean-field "
        "step, which follows the item's bits already changed (raters' Gram taken as counts_i/n · G_U; the server's "
        "model.mean_field)",
    )
    add_seed(
        g,
        "seed of the model and the federation: initial codes, cohorts, sampled training negatives "
        "(default: 0); the test split and candidates come from --eval-seed",
        type=int,
    )


def add_family_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("MF, FELB, FNMF and iALS (--model mf|felb|fnmf|ials)")
    g.add_argument(
        "--rank",
        type=positive_int,
        default=None,
        help="factors f (mf, default 32; ials: 64, 128 or 32 chosen on validation, with --epsilon 16, 32 or 64 "
        "from the noise) or components k (felb/fnmf: 5 on planted data, 20 on ratings)",
    )
    g.add_argument(
        "--alpha",
        type=nonneg_float,
        default=None,
        help="ials: confidence α, held items weigh 1 + α (default: chosen on validation from 5, 20, 100)",
    )
    g.add_argument(
        "--reg",
        type=positive_float,
        default=None,
        help="ials: ridge weight λ of the user and item solves (default: chosen on validation, 0.1 or "
        "5·(1 + α); with --epsilon 0.1)",
    )
    g.add_argument("--clients", type=positive_int, default=None, help="felb/fnmf clients (default 10; 50 on ratings)")
    g.add_argument(
        "--local-steps",
        type=local_steps,
        default=None,
        help="local iterations per round: felb b (default 10), fnmf T (default 100)",
    )
    g.add_argument(
        "--epsilon",
        type=nonneg_float,
        default=0.0,
        help="lightfr/mf: user-level ε at δ=1e-5 over the whole run, every device eligible, rounds through the "
        "private-round simulator (0 = no DP)",
    )
    g.add_argument(
        "--pop-share",
        type=open_fraction,
        default=None,
        help="lightfr private: share of ε calibrating the private popularity release, the rest pays for the "
        "rounds (default: the privacy planner's choice, printed before the run)",
    )
    g.add_argument(
        "--pop-theta",
        type=positive_int,
        default=1,
        help="lightfr private: each device's item indicator in the popularity release is clipped to L2 norm "
        "√θ (default 1: every device's items weigh 1/√k, the most signal per unit of noise)",
    )
    g.add_argument(
        "--threshold",
        type=nonneg_float,
        default=0.0,
        help="lightfr private: move a bit only when its summed gradient exceeds this many σ of the noise "
        "(default 0 = off: measured worse on ML-100K)",
    )
    g.add_argument(
        "--secure",
        action="store_true",
        help="mf: run every round through the real coordinator with SecAgg+ even without DP",
    )
    g.add_argument("--clip-norm", type=positive_float, default=20.0, help="mf private: L2 clip C of an upload")
    g.add_argument("--example-cap", type=nonneg_int, default=20, help="mf: θ ratings per user per round (0 = all)")
    g.add_argument("--silos", type=nonneg_int, default=0, help="mf: K silo clients holding many users (HFL)")
    g.add_argument("--server-lr", type=positive_float, default=1.0, help="mf: server step (default 1.0)")
    g.add_argument("--lr", type=positive_float, default=0.1, help="mf: device step for user vectors (default 0.1)")
    g.add_argument("--max-norm2", type=positive_float, default=None, help="mf: clipping bound R (default: top rating)")
    g.add_argument("--step-rule", choices=["lipschitz", "mu"], default="lipschitz", help="felb: FELB or FELB^MU")
    g.add_argument("--xor-noise", type=xor_fraction, default=0.1, help="felb planted: XOR noise p (default 0.1)")
    g.add_argument("--noise-sigma", type=nonneg_float, default=0.0, help="felb: Gaussian σ on each upload")
    g.add_argument("--binarize-at", type=float, default=4.0, help="felb on ratings: rating >= this is a 1")
    g.add_argument("--server-scale", type=positive_float, default=None, help="felb: server prox scale s (default 1)")
    g.add_argument(
        "--alignment", choices=["lap", "lap_rho", "sinkhorn"], default="lap", help="fnmf: client-side alignment"
    )
    g.add_argument(
        "--aggregator",
        choices=["secure", "trusted-barycenter", "fedavg", "fedprox"],
        default="secure",
        help="fnmf: secure (sums only; default), trusted-barycenter (sees every client's matrix), fedavg, fedprox",
    )


_EVAL_SEED_HELP = (
    "seed of the evaluation (default 0): which ratings a file without timestamps holds out, the validation "
    "carve of a published split, the sampled negatives and random tie-breaking; --seed never changes them"
)


def add_data_args(p: argparse.ArgumentParser, default: str | None) -> None:
    g = p.add_argument_group("data and evaluation")
    add_dataset(
        g,
        f"dataset name ({', '.join(DATASET_NAMES)}), a ratings file/folder, or planted "
        "(felb/fnmf recipe); required for lightfr and mf",
        default=default,
    )
    g.add_argument(
        "--protocol",
        choices=[p.value for p in Protocol],
        default=None,
        help="loo (default) or chrono for rating logs; full (default) or sampled for amazon-book's own split; "
        "the filmtrust-lightfr split always uses its own blocks",
    )
    g.add_argument(
        "--eval-negatives",
        type=positive_int,
        default=None,
        help="sampled negatives per test positive (default: 99, or on a catalogue too small for 99 the most that 90%% "
        "of the held-out rows can draw, the others left unranked)",
    )
    g.add_argument("--eval-seed", type=int, default=0, help=_EVAL_SEED_HELP)
    g.add_argument(
        "--eval-every",
        type=positive_int,
        default=5,
        help="evaluate on validation every N rounds (default: 5)",
    )


def model_config(args: argparse.Namespace, exp: Experiment) -> LightFRConfig:
    from device_sdk.models import LightFRConfig

    return LightFRConfig(
        bits=args.bits,
        lam=args.lam,
        negatives=args.negatives,
        local_epochs=args.epochs,
        max_sweeps=args.sweeps,
        rating_range=exp.rating_range,
        binary_positives=args.targets == "binary",
        unobserved_weight=_first_weight(args, exp.train.n_items),
        confidence=args.confidence,
    )


def unobserved_weight(args: argparse.Namespace) -> float | str:
    """The --unobserved-weight asked for: a number, or "auto" (the density rule)."""
    if args.unobserved_weight is not None:
        return args.unobserved_weight if args.unobserved_weight == "auto" else float(args.unobserved_weight)
    return "auto" if args.aggregation == Aggregation.GRAD.value else 0.0


def _first_weight(args: argparse.Namespace, n_items: int) -> float:
    """The w0 the first round trains with: the number asked for, or under "auto" the density rule at its
    floor (one positive per device; the server replaces it from the first round's counts)."""
    w = unobserved_weight(args)
    return density_weight(0.0, 1, n_items) if w == "auto" else float(w)


def flip_fraction(args: argparse.Namespace) -> float:
    """--flip-fraction, or the server's default for this objective (`strategy.lightfr.default_flip_fraction`)."""
    if args.flip_fraction is not None:
        return float(args.flip_fraction)
    from agg_server.strategy.lightfr import default_flip_fraction

    full = unobserved_weight(args) != 0 and args.aggregation == Aggregation.GRAD.value
    return default_flip_fraction(full, mean_field(args))


def mean_field(args: argparse.Namespace) -> bool:
    """The mean-field step is on unless --no-mean-field was given."""
    return getattr(args, "mean_field", None) is not False


def fed_config(args: argparse.Namespace) -> FederationConfig:
    # Symmetric training under the all-items objective ranks as a device does by default: with its vector
    # ridge-solved against the final item codes, as planes (`LightFRConfig.rank_planes` / `rank_ridge`).
    from fedsim.federation.lightfr import FederationConfig

    ranked = not getattr(args, "query_planes", 0) and unobserved_weight(args) != 0
    return FederationConfig(
        rounds=args.rounds,
        fraction=args.fraction,
        seed=args.seed,
        aggregation=Aggregation(args.aggregation),
        flip_fraction=flip_fraction(args),
        unobserved_scale=DENSITY_SCALE if unobserved_weight(args) == "auto" else 0.0,
        query_planes=getattr(args, "query_planes", 0),
        user_reg=getattr(args, "user_reg", 1.0),
        rank_planes=_rank_planes(args) if ranked else 0,
        rank_ridge=rank_ridge(args),
        mean_field=mean_field(args),
    )


def _rank_planes(args: argparse.Namespace) -> int:
    """--rank-planes, or the device SDK's default (`LightFRConfig.rank_planes`)."""
    from device_sdk.models import LightFRConfig

    planes = getattr(args, "rank_planes", None)
    return LightFRConfig().rank_planes if planes is None else int(planes)


def rank_ridge(args: argparse.Namespace) -> float:
    """--rank-ridge, or the device SDK's default (`LightFRConfig.rank_ridge`)."""
    from device_sdk.models import LightFRConfig

    ridge = getattr(args, "rank_ridge", None)
    return LightFRConfig().rank_ridge if ridge is None else float(ridge)


#: The --model values each model-specific `simulate` option applies to.  An option given (set to
#: anything but its default) for another model is an error naming the option and the model: a flag
#: that silently does nothing is worst when it is a privacy flag.
_APPLIES_TO: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        (
            "bits",
            "lam",
            "negatives",
            "unobserved_weight",
            "confidence",
            "targets",
            "epochs",
            "sweeps",
            "aggregation",
            "flip_fraction",
            "query_planes",
            "user_reg",
            "rank_planes",
            "rank_ridge",
            "mean_field",
        ),
        ("lightfr",),
    ),
    "eval_every": ("lightfr",),
    "protocol": ("auto", "lightfr", "ials"),
    "json": ("auto", "lightfr", "mf", "ials"),
    "eval_seed": ("auto", "lightfr", "mf", "ials"),
    "fraction": ("auto", "lightfr", "mf", "ials"),
    "eval_negatives": ("auto", "lightfr", "mf", "ials"),
    "rank": ("mf", "felb", "fnmf", "ials"),
    **dict.fromkeys(("alpha", "reg"), ("ials",)),
    "clients": ("felb", "fnmf"),
    "local_steps": ("felb", "fnmf"),
    **dict.fromkeys(("secure", "clip_norm", "example_cap", "silos", "server_lr", "lr", "max_norm2"), ("mf",)),
    "epsilon": ("auto", "lightfr", "mf", "ials"),
    "pop_share": ("auto", "lightfr", "ials"),
    **dict.fromkeys(("pop_theta", "threshold"), ("lightfr",)),
    **dict.fromkeys(("step_rule", "xor_noise", "noise_sigma", "binarize_at", "server_scale"), ("felb",)),
    **dict.fromkeys(("alignment", "aggregator"), ("fnmf",)),
}


# In-process LightFR options that the private-round simulator (`fedsim.private.scaled_lightfr.ScaledSettings`)
# does not take.
NOT_PRIVATE_LIGHTFR = (
    "lam",
    "sweeps",
    "epochs",
    "confidence",
    "targets",
    "aggregation",
    "fraction",
    "eval_every",
)


def check_applicable(args: argparse.Namespace, defaults: argparse.Namespace) -> None:
    """Refuse options that the chosen model would ignore (see `_APPLIES_TO`); ``defaults`` holds every
    ``simulate`` option's value when not given."""
    model = args.model
    for dest, models in _APPLIES_TO.items():
        if model in models or getattr(args, dest) == getattr(defaults, dest):
            continue
        if model == "auto":
            refuse_with_auto(option_name(dest), models)
        if dest in ("epsilon", "secure"):
            where = " or ".join(f"--model {m}" for m in models)
            raise ConfigError(
                f"{option_name(dest)} is not implemented for --model {model}: 'fedrec simulate' trains {model} "
                f"in-process with plain sums, without secure aggregation or DP noise ({option_name(dest)} works with "
                f"{where}; 'fedrec demo --epsilon E' runs LightFR through the real server with SecAgg+ and DP)"
            )
        only = " or ".join(f"--model {m}" for m in models)
        raise ConfigError(f"{option_name(dest)} applies to {only} only; --model {model} does not use it")
    if model == "mf" and not (args.epsilon > 0 or args.secure) and args.clip_norm != defaults.clip_norm:
        raise ConfigError("--clip-norm applies to private MF only (with --epsilon or --secure)")
    if model == "lightfr":
        _check_lightfr_objective(args, defaults)


def refuse_with_auto(option: str, models: tuple[str, ...]) -> None:
    """Refuse ``option`` (which applies to ``models``) under the default ``--model auto``, naming the model to
    choose when it is one of the two families auto trains."""
    one = [m for m in models if m in AUTO_FAMILIES]
    if one:
        raise ConfigError(
            f"{option} applies to --model {one[0]}; with the default --model auto both families run: "
            f"add --model {one[0]}"
        )
    only = " or ".join(f"--model {m}" for m in models)
    raise ConfigError(f"{option} applies to {only} only; the default --model auto (lightfr and ials) does not use it")


def _check_lightfr_objective(args: argparse.Namespace, defaults: argparse.Namespace) -> None:
    """Refuse LightFR options that the chosen objective would ignore: sampled negatives belong to the
    paper's objective (w0 = 0), α and asymmetric scoring to the all-items one (w0 > 0)."""
    full = unobserved_weight(args) != 0
    if full:
        objective = "the all-items objective (the default with --aggregation grad) fits every unobserved item"
    else:
        why = "--aggregation para" if args.unobserved_weight is None else "--unobserved-weight 0"
        objective = f"the sampled-negatives objective ({why}) is in use"
    if full and args.negatives != defaults.negatives:
        raise ConfigError(f"--negatives applies with --unobserved-weight 0 only; {objective}")
    if not full and args.confidence != defaults.confidence:
        raise ConfigError(
            f"--confidence applies to the all-items objective (--unobserved-weight > 0) only; {objective}"
        )
    if not full and args.query_planes:
        raise ConfigError(f"--query-planes needs the all-items objective (--unobserved-weight > 0); {objective}")
    if not args.query_planes and args.user_reg != defaults.user_reg:
        raise ConfigError("--user-reg applies with --query-planes P >= 1 only (the ridge weight of the user solve)")
    asked = [option_name(d) for d in ("rank_planes", "rank_ridge") if getattr(args, d, None) is not None]
    if asked and (not full or args.query_planes):
        why = "--query-planes ranks with the plan's vector" if full else objective
        verb = "apply" if len(asked) > 1 else "applies"
        raise ConfigError(f"{' and '.join(asked)} {verb} to symmetric training under the all-items objective; {why}")
    if args.rank_planes is not None and args.rank_planes > 8:
        raise ConfigError(f"--rank-planes must be in [0, 8], got {args.rank_planes}")
    if args.rank_ridge is not None and not (math.isfinite(args.rank_ridge) and args.rank_ridge <= 1e6):
        raise ConfigError(f"--rank-ridge must be a finite number in (0, 1e6], got {args.rank_ridge}")
    try:  # the plan's own bounds (protocol.plan.LightFRParams), as the server and the device SDK check them
        LightFRParams(query_planes=args.query_planes, user_reg=args.user_reg)
    except ValueError as exc:
        raise ConfigError(f"--{str(exc).replace('_', '-', 1)}") from None
