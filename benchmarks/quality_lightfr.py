"""LightFR quality on real data with hyper-parameters chosen on validation only, beside baselines.

    python benchmarks/quality_lightfr.py --select                 # every recipe on the validation blocks + carves
    python benchmarks/quality_lightfr.py --spread 8 --only 0 1    # how much one validation figure moves
    python benchmarks/quality_lightfr.py --test --seeds 0 1 2     # the validation winner on test, 3 model seeds
    python benchmarks/quality_lightfr.py --holdout --seeds 0 1 2  # the default model on splits never tuned on
    python benchmarks/quality_lightfr.py --select --only 0 59 --rounds 3  # planes vs ±1 code after 3 rounds

Protocols: FilmTrust — the LightFR authors' split (1 positive + 49 negatives per user, their
validation blocks for selection); MovieLens-100K — per-user chronological leave-one-out, 99 sampled
negatives (validation: the second-latest rating).  ``--holdout`` runs the library default on data
carved in ways no recipe was tuned on: raw FilmTrust ``ratings.txt`` with a seeded random
leave-one-out, and ML-100K's chronological 80/10/10 split (every held-out rating a positive).
HR@10 / NDCG@10 with random ties (the exact expectation over tie orders); the evaluation seed
(``--eval-seed``: held-out ratings of files without timestamps, negatives) is separate from the
model seeds.  f = 64 bits, federated in-process, p = 0.6, E = 1.

One validation block per user is noisy (FilmTrust: model-seed std 0.005, carve std 0.008 at HR@10
≈ 0.95), so ``--select`` averages the protocol's own blocks (model seed 0) with ``--carves`` further
held-out sets carved from train (`fedsim.evaluation.experiment.validation_carves`, model seed j + 1 on carve j),
every recipe on the same carves and seeds.  The LightFR authors drew their negatives from every item,
so about half of their blocks hold one of the user's own training items as a "negative"; the carves
of that split are drawn the same way, and every table also prints HR/NDCG with the user's training
items filtered out of the candidates (what `recommend(filter_already_liked_items=True)`, the SDK's
default, does); selection uses the as-published figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import replace

import numpy as np
from own_settings import own_settings

from device_sdk.models import LightFRConfig
from fedsim.data.ratings import Ratings
from fedsim.evaluation.als import implicit_als
from fedsim.evaluation.experiment import Experiment, Protocol, baselines, prepare, validation_carves
from fedsim.evaluation.ranking import TieMode, evaluate_candidates
from fedsim.federation.lightfr import FederatedLightFR, FederationConfig, run_lightfr, user_data
from protocol.families.lightfr import DENSITY_SCALE, density_weight

ROUNDS = 40
CARVES = 4  # validation carves from train beside the protocol's own blocks (see --spread for why)
# Asymmetric scoring recipes (real-valued user vector as P ±1 bit-planes against the binary item codes;
# `fedsim.federation.lightfr.FederationConfig.query_planes`): (P, user ridge weight, damping ρ).
ASYMMETRIC = [
    (2, 1.0, 1.0),
    (2, 1.0, 0.3),
    (3, 1.0, 1.0),
    (1, 1.0, 1.0),
    (2, 10.0, 0.3),
    (2, 30.0, 0.3),
    (3, 10.0, 0.5),
    (2, 10.0, 0.5),
]
DEFAULT = (
    "all items, w0=auto (0.6·density^(2/3)), learned levels, mean-field step, ρ=1, "
    "ranks with 3 planes of its ridge vector (2·w0·m)"
)
PREVIOUS = "all items, w0=auto (0.6·density^(2/3)), learned levels, ρ=0.3 (the default before the mean-field step)"
CODES = "the filmtrust4 default: mean-field step, ρ=1, ranks with the ±1 code"


def _recipes(exp: Experiment, rounds: int = ROUNDS) -> dict[str, tuple[LightFRConfig, FederationConfig, bool]]:
    """name -> (device config, federation, popularity levels instead of learned ones); ``rounds`` is T
    for every recipe that does not name its own."""
    full = LightFRConfig(bits=64, rating_range=exp.rating_range, binary_positives=True, unobserved_weight=0.1)
    sampled = replace(full, unobserved_weight=0.0, negatives=4)
    fed = FederationConfig(rounds=rounds, fraction=0.6, flip_fraction=0.3)
    auto = (
        replace(full, unobserved_weight=density_weight(0.0, 1, exp.train.n_items)),
        replace(fed, unobserved_scale=DENSITY_SCALE),
        False,
    )
    # The server's model defaults: the mean-field code step with ρ = 1; "default, …" recipes below vary it
    # and rank with the ±1 code (the library default until filmtrust5).
    default = (auto[0], replace(auto[1], mean_field=True, flip_fraction=1.0), False)
    # The library default: each device ranks with its vector ridge-solved against the final item codes
    # (ridge 2·w0·m), as 3 planes (`LightFRConfig.rank_planes` / `rank_ridge`, chosen on validation).
    ranked = (default[0], replace(default[1], rank_planes=3, rank_ridge=2.0), False)
    asym = {
        f"asymmetric: user vector as {p} bit-plane{'s' if p > 1 else ''}, ridge {reg:g}, w0=auto, ρ={rho:g}": (
            auto[0],
            replace(auto[1], query_planes=p, user_reg=reg, flip_fraction=rho),
            False,
        )
        for p, reg, rho in ASYMMETRIC
    }
    return {
        DEFAULT: ranked,
        PREVIOUS: auto,
        "paper objective, 4 sampled negatives, ρ=0.1 (old default)": (sampled, replace(fed, flip_fraction=0.1), False),
        "paper objective, 4 sampled negatives, ρ=0.3": (sampled, fed, False),
        "paper objective, 8 sampled negatives, ρ=0.1": (
            replace(sampled, negatives=8),
            replace(fed, flip_fraction=0.1),
            False,
        ),
        "all items, w0=0.1, no item term, ρ=0.3": (full, replace(fed, learn_bias=False), False),
        "all items, w0=0.1, popularity levels, ρ=0.3": (full, replace(fed, learn_bias=False), True),
        "all items, w0=0.1, learned levels, ρ=0.3 (the previous default)": (full, fed, False),
        "all items, w0=0.1, learned levels, ρ=0.1": (full, replace(fed, flip_fraction=0.1), False),
        "all items, w0=0.03, learned levels, ρ=0.3": (replace(full, unobserved_weight=0.03), fed, False),
        "all items, w0=0.3, learned levels, ρ=0.3": (replace(full, unobserved_weight=0.3), fed, False),
        "all items, w0=0.1, α=3, learned levels, ρ=0.3": (replace(full, confidence=3.0), fed, False),
        "all items, w0=0.1, α=10, learned levels, ρ=0.3": (replace(full, confidence=10.0), fed, False),
        "all items, w0=0.03, α=3, learned levels, ρ=0.3": (
            replace(full, confidence=3.0, unobserved_weight=0.03),
            fed,
            False,
        ),
        "all items, w0=auto, α=3, learned levels, ρ=0.3": (replace(auto[0], confidence=3.0), auto[1], False),
        "all items, w0=auto, E=2 local epochs, learned levels, ρ=0.3": (
            replace(auto[0], local_epochs=2),
            auto[1],
            False,
        ),
        "all items, w0=auto, learned levels, ρ=0.3, 80 rounds": (auto[0], replace(auto[1], rounds=80), False),
        "all items, w0=0.1, α=3, learned levels, ρ=0.3, 80 rounds": (
            replace(full, confidence=3.0),
            replace(fed, rounds=80),
            False,
        ),
        **asym,
        "default (mean-field step, ρ=1), E=2 local epochs": (replace(default[0], local_epochs=2), default[1], False),
        "default (mean-field step, ρ=1), α=3": (replace(default[0], confidence=3.0), default[1], False),
        "default (mean-field step, ρ=1), 80 rounds": (default[0], replace(default[1], rounds=80), False),
        "default (mean-field step, ρ=1), ρ=0.7": (default[0], replace(default[1], flip_fraction=0.7), False),
        "all items, w0=auto, learned levels, ρ=0.3, mean-field server step": (
            auto[0],
            replace(auto[1], mean_field=True),
            False,
        ),
        "all items, w0=auto, learned levels, ρ=1, mean-field server step": (
            auto[0],
            replace(auto[1], mean_field=True, flip_fraction=1.0),
            False,
        ),
        "asymmetric: user vector as 2 bit-planes, ridge 30, w0=auto, ρ=0.3, mean-field": (
            auto[0],
            replace(auto[1], query_planes=2, user_reg=30.0, mean_field=True),
            False,
        ),
        "asymmetric: user vector as 2 bit-planes, ridge 1, w0=auto, ρ=1, mean-field": (
            auto[0],
            replace(auto[1], query_planes=2, user_reg=1.0, mean_field=True, flip_fraction=1.0),
            False,
        ),
        "asymmetric: user vector as 3 bit-planes, ridge 30, w0=auto, ρ=0.5, mean-field": (
            auto[0],
            replace(auto[1], query_planes=3, user_reg=30.0, mean_field=True, flip_fraction=0.5),
            False,
        ),
        **{
            f"asymmetric: user vector as {p} bit-planes, ridge {reg:g}, w0=auto κ={kappa:g}, ρ={rho:g}, mean-field": (
                replace(auto[0], unobserved_weight=density_weight(0.0, 1, exp.train.n_items, scale=kappa)),
                replace(
                    auto[1],
                    unobserved_scale=kappa,
                    query_planes=p,
                    user_reg=reg,
                    mean_field=True,
                    flip_fraction=rho,
                ),
                False,
            )
            for p, reg, kappa, rho in [(2, 1.0, 2.0, 1.0), (3, 1.0, 2.0, 1.0), (2, 30.0, 2.0, 0.3), (2, 1.0, 6.0, 1.0)]
        },
        # Ideas on the mean-field default (docs/results/2026-11-quality.md, "Choosing on several validation carves").
        **{
            f"default, item term weight B={b} (level step 1/(f·B/2))": (
                default[0],
                replace(default[1], hamming_weight=b),
                False,
            )
            for b in (1, 4, 8)
        },
        **{
            f"default, w0 = {kappa:g}·density^(2/3)": (
                replace(default[0], unobserved_weight=density_weight(0.0, 1, exp.train.n_items, scale=kappa)),
                replace(default[1], unobserved_scale=kappa),
                False,
            )
            for kappa in (0.3, 1.0)
        },
        "default, α=1": (replace(default[0], confidence=1.0), default[1], False),
        "default, graded targets (normalised rating, not 1)": (
            replace(default[0], binary_positives=False),
            default[1],
            False,
        ),
        "default, positives = ratings at or above the middle of the scale (the rest dropped)": (
            *default,
            _threshold(exp, drop=True),
        ),
        "default, ratings below the middle of the scale as observed 0 (explicit dislikes)": (
            replace(default[0], binary_positives=False, rating_range=None),
            default[1],
            False,
            _threshold(exp, drop=False),
        ),
        "default, 30 rounds": (default[0], replace(default[1], rounds=30), False),
        "default, 60 rounds": (default[0], replace(default[1], rounds=60), False),
        "default, DCD sweep cap 3": (replace(default[0], max_sweeps=3), default[1], False),
        "default, DCD sweep cap 30": (replace(default[0], max_sweeps=30), default[1], False),
        "default, no learned term, log-popularity levels (16, B = 1) from the counts": (
            default[0],
            replace(default[1], learn_bias=False),
            True,
        ),
        **{
            f"default, {k} passes of the server's code step per round": (
                default[0],
                replace(default[1], code_sweeps=k),
                False,
            )
            for k in (3, 10)
        },
        # filmtrust5: symmetric training, asymmetric ranking (each device ranks with its vector ridge-solved
        # against the final item codes, ridge κ_r·w0·m, kept as P planes; FederationConfig.rank_planes).
        **{
            f"default, ranks with {p} planes of a vector solved against the final codes, ridge {kr:g}·w0·m": (
                default[0],
                replace(default[1], rank_planes=p, rank_ridge=kr),
                False,
            )
            for p, kr in ((3, 1.5), (2, 1.5), (3, 1.0), (3, 2.0))
        },
        CODES: default,
        # Ideas on the new default (filmtrust5): participation p, and the item levels' resolution.
        **{f"new default, p={frac:g}": (ranked[0], replace(ranked[1], fraction=frac), False) for frac in (0.3, 1.0)},
        **{
            f"new default, item term weight B={b} (level step 1/(f·B/2))": (
                ranked[0],
                replace(ranked[1], hamming_weight=b),
                False,
            )
            for b in (4, 8)
        },
        # planes5: the ranking vector kept as 2 planes instead of 3 (the plane scan is cheaper), all else the default.
        "new default, ranks with 2 planes (ridge 2·w0·m)": (ranked[0], replace(ranked[1], rank_planes=2), False),
    }


def _threshold(exp: Experiment, *, drop: bool):
    """A train transform: ratings at or above the middle of the scale (normalised ≥ 0.5) are positives;
    the others are dropped (``drop``) or kept as observed ratings with target 0."""
    lo, hi = exp.rating_range or (0.0, 1.0)

    def transform(r: Ratings) -> Ratings:
        good = (r.ratings - lo) / (hi - lo) >= 0.5
        if drop:
            return r.subset(good)
        return dataclasses.replace(r, ratings=good.astype(np.float64))

    return transform


def _popularity_levels(exp: Experiment, levels: int = 16) -> np.ndarray:
    """Item levels 0..levels-1 from log-popularity of the training counts (what the counts slice of
    the secure sum carries)."""
    count = np.bincount(exp.train.items, minlength=exp.train.n_items).astype(float)
    return np.floor(levels * np.log1p(count) / np.log1p(max(count.max(), 1.0))).clip(0, levels - 1).astype(np.uint8)


def train(exp: Experiment, recipe: tuple, seed: int) -> FederatedLightFR:
    """Train a recipe (device config, federation, popularity levels[, train transform]) federated."""
    cfg, fed, pop_levels = recipe[:3]
    data = recipe[3](exp.train) if len(recipe) > 3 else exp.train
    state = run_lightfr(user_data(data, cfg), cfg, replace(fed, seed=seed))
    if pop_levels:
        state.item_levels, state.hamming_weight = _popularity_levels(exp), 1
    return state


def _unseen(scores: np.ndarray, blocks, seen: Ratings) -> np.ndarray:
    """``scores`` with every candidate the user has in ``seen`` (its training items) put last, as
    `recommend(filter_already_liked_items=True)` (the SDK's default) leaves them out.  The LightFR
    authors' blocks draw negatives from every item, so about half of them hold a training item."""
    keys = np.unique(seen.users * seen.n_items + seen.items)
    cand = blocks.users[:, None] * seen.n_items + blocks.items
    out = np.asarray(scores, dtype=np.float64).copy()
    out[np.isin(cand, keys)] = -np.inf
    return out


def _metrics(scores: np.ndarray, blocks, seen: Ratings) -> tuple[float, float, float, float]:
    """HR@10, NDCG@10 as the blocks are, then the same with the user's training items filtered."""
    r = evaluate_candidates(scores, 10, TieMode.RANDOM)
    u = evaluate_candidates(_unseen(scores, blocks, seen), 10, TieMode.RANDOM)
    return r.hr, r.ndcg, u.hr, u.ndcg


def _hr(state: FederatedLightFR, blocks, seen: Ratings) -> tuple[float, float, float, float]:
    return _metrics(state.scores(blocks.users, blocks.items), blocks, seen)


def _pop(exp: Experiment) -> tuple[float, float, float, float]:
    return _metrics(np.bincount(exp.train.items, minlength=exp.train.n_items)[exp.val.items], exp.val, exp.train)


def _baseline_rows(exp: Experiment, eval_seed: int) -> list[str]:
    b = baselines(exp, TieMode.RANDOM, seed=eval_seed)
    X, Y = implicit_als(exp.train, factors=64, seed=0)
    als = _metrics(np.einsum("nf,ncf->nc", X[exp.test.users], Y[exp.test.items]), exp.test, exp.train)
    pop = _metrics(np.bincount(exp.train.items, minlength=exp.train.n_items)[exp.test.items], exp.test, exp.train)
    return [
        f"| item popularity | {pop[0]:.4f} | {pop[1]:.4f} | {pop[2]:.4f} | {pop[3]:.4f} |",
        f"| implicit ALS f=64, centralised (real-valued) | {als[0]:.4f} | {als[1]:.4f} | {als[2]:.4f} | {als[3]:.4f} |",
        f"| random | {b['random'].hr:.4f} | {b['random'].ndcg:.4f} | | |",
    ]


TEST_HEAD = (
    "| model | HR@10 | NDCG@10 | HR@10, training items filtered | NDCG@10, training items filtered |\n"
    "|---|---|---|---|---|"
)


def _seeds_row(label: str, exp: Experiment, recipe, seeds: list[int]) -> str:
    m = np.array([_hr(train(exp, recipe, s), exp.test, exp.train) for s in seeds])
    mean, std = m.mean(axis=0), m.std(axis=0)
    return (
        f"| {label} | "
        + " | ".join(f"{a:.4f} ± {b:.4f}" for a, b in zip(mean, std, strict=True))
        + f" | (seeds {' '.join(map(str, seeds))}; HR@10 per seed {' / '.join(f'{x:.4f}' for x in m[:, 0])})"
    )


def _carves(exp: Experiment, k: int, eval_seed: int) -> list[Experiment]:
    """Validation carves drawn like the protocol's own blocks (the LightFR split: negatives from every item)."""
    return validation_carves(exp, k, seed=eval_seed, exclude_interacted=exp.protocol is not Protocol.LIGHTFR_SPLIT)


def _spread(exp: Experiment, recipes, labels: list[str], n: int, eval_seed: int) -> None:
    """How much the validation HR@10 moves with the model seed (fixed blocks) and with the carve."""
    extra = _carves(exp, n, eval_seed)
    pop = [_pop(c)[0] for c in extra]
    print(
        f"\nspread of validation HR@10: {n} model seeds on the protocol's own blocks; {n} carves (carve j, "
        "model seed j + 1)\n\n| recipe | own blocks, per seed | mean ± std | carves | mean ± std |"
        " paired diff vs first (own blocks / carves) |\n|---|---|---|---|---|---|"
    )
    print(f"| item popularity | | | {' '.join(f'{x:.3f}' for x in pop)} | {np.mean(pop):.4f} ± {np.std(pop):.4f} | |")
    first: tuple[np.ndarray, np.ndarray] | None = None
    for label in labels:
        own = np.array([_hr(train(exp, recipes[label], s), exp.val, exp.train)[0] for s in range(n)])
        car = np.array([_hr(train(c, recipes[label], j + 1), c.val, c.train)[0] for j, c in enumerate(extra)])
        diff = ""
        if first is None:
            first = (own, car)
        else:
            d0, d1 = own - first[0], car - first[1]
            diff = f"{d0.mean():+.4f} ± {d0.std():.4f} / {d1.mean():+.4f} ± {d1.std():.4f}"
        print(
            f"| {label} | {' '.join(f'{x:.3f}' for x in own)} | {own.mean():.4f} ± {own.std():.4f} |"
            f" {' '.join(f'{x:.3f}' for x in car)} | {car.mean():.4f} ± {car.std():.4f} | {diff} |",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=["filmtrust-lightfr", "ml-100k"])
    p.add_argument("--select", action="store_true")
    p.add_argument("--test", action="store_true")
    p.add_argument("--holdout", action="store_true")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--eval-seed", type=int, default=0)
    p.add_argument("--recipe", default=None, help="recipe for --test (default: the validation winner of --select)")
    p.add_argument("--only", type=int, nargs="*", default=None, help="indices of the recipes --select tries")
    p.add_argument(
        "--carves",
        type=int,
        default=CARVES,
        help="validation carves from train that --select averages over, beside the protocol's own blocks",
    )
    p.add_argument(
        "--spread",
        type=int,
        default=0,
        help="N: the spread of the validation figure of the --only recipes: N model seeds on the protocol's "
        "own blocks, and N carves; paired differences against the first recipe",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help="T, the federated rounds of every recipe that does not name its own (default %(default)s)",
    )
    args = p.parse_args()
    own_settings("LightFR recipes from this script's grid, chosen on validation, on FilmTrust and ML-100K")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.holdout:
        for name, protocol in (("filmtrust", Protocol.LOO), ("ml-100k", Protocol.CHRONO)):
            exp = prepare(name, protocol, seed=args.eval_seed)
            print(f"\n### {exp.describe()}\n\n{TEST_HEAD}")
            print(_seeds_row(f"LightFR default ({DEFAULT})", exp, _recipes(exp)[DEFAULT], args.seeds), flush=True)
            print("\n".join(_baseline_rows(exp, args.eval_seed)), flush=True)
        return
    for name in args.datasets:
        exp = prepare(name, seed=args.eval_seed)
        recipes = _recipes(exp, args.rounds)
        print(f"\n### {exp.describe()}; T={args.rounds}, f=64, p=0.6, E=1")
        chosen = args.recipe
        if args.select or args.spread:
            carves = _carves(exp, args.carves, args.eval_seed)
            pop = np.array([_pop(exp)] + [_pop(c) for c in carves])
            names = list(recipes)
            labels = [names[i] for i in (args.only if args.only is not None else range(len(names)))]
        if args.spread:
            _spread(exp, recipes, labels, args.spread, args.eval_seed)
        if args.select:
            print(
                f"\nvalidation: the protocol's own blocks (model seed 0) and {args.carves} carves from train "
                f"(carve j: model seed j + 1); mean ± std over the {1 + args.carves}\n\n"
                "| recipe | HR@10 | NDCG@10 | HR@10 own blocks | HR@10 per carve | HR@10 / NDCG@10, training items "
                "filtered | HR@10 paired diff vs first | s |\n"
                "|---|---|---|---|---|---|---|---|"
            )
            print(
                f"| item popularity | {pop[:, 0].mean():.4f} ± {pop[:, 0].std():.4f} | {pop[:, 1].mean():.4f} |"
                f" {pop[0, 0]:.4f} | {' '.join(f'{x:.3f}' for x in pop[1:, 0])} |"
                f" {pop[:, 2].mean():.4f} / {pop[:, 3].mean():.4f} | | |"
            )
            best, first = -1.0, None
            for label in labels:
                recipe = recipes[label]
                t = time.perf_counter()
                runs = np.array(
                    [_hr(train(exp, recipe, 0), exp.val, exp.train)]
                    + [_hr(train(c, recipe, j + 1), c.val, c.train) for j, c in enumerate(carves)]
                )
                hr = runs[:, 0]
                if first is None:
                    first, diff = hr, ""
                else:
                    diff = f"{(hr - first).mean():+.4f} ± {(hr - first).std():.4f}"
                print(
                    f"| {label} | {hr.mean():.4f} ± {hr.std():.4f} | {runs[:, 1].mean():.4f} | {hr[0]:.4f} |"
                    f" {' '.join(f'{x:.3f}' for x in hr[1:])} | {runs[:, 2].mean():.4f} / {runs[:, 3].mean():.4f} |"
                    f" {diff} | {time.perf_counter() - t:.0f} |",
                    flush=True,
                )
                if hr.mean() > best:
                    best, chosen = float(hr.mean()), label
            print(f"\nchosen on validation: {chosen}")
        if args.test:
            chosen = chosen or DEFAULT
            print(f"\ntest (reported once)\n\n{TEST_HEAD}")
            print(_seeds_row(f"LightFR: {chosen}", exp, recipes[chosen], args.seeds), flush=True)
            if chosen != DEFAULT:
                print(_seeds_row(f"LightFR default: {DEFAULT}", exp, recipes[DEFAULT], args.seeds), flush=True)
            print("\n".join(_baseline_rows(exp, args.eval_seed)), flush=True)


if __name__ == "__main__":
    main()
