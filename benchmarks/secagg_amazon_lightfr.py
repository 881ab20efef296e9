"""amazon-book's asymmetric LightFR recipe through SecAgg+ (no DP) beside the plain in-process federation.

    python benchmarks/secagg_amazon_lightfr.py subset --users 300 --rounds 10 --seeds 0
    python benchmarks/secagg_amazon_lightfr.py scale --seeds 0 1 2

The recipe is `benchmarks/quality_amazon_lightfr.py`'s CHOSEN one: asymmetric scoring (uploads with 2 planes,
ridge 1), w0 = 0.01, ρ = 1, the mean-field code step with 10 passes per round, the vector a device ranks
with as 3 planes, f = 64, B = 2, p = 0.6, T = 20 unless --rounds says otherwise.  Quality: Recall@20 and
NDCG@20 by full ranking over the items not in the user's train set, random ties (evaluation seed 0
whatever the model seed), beside item popularity.

``subset`` (a real SecAgg+ run): a seeded sample of ``--users`` amazon-book users (sample seed 0); the
catalogue is the items those users rated in train (renumbered), and their test pairs on those items are
the test set (test pairs on other items cannot be recommended by either run and are left out).  Two runs
on that subset: `fedsim.private.coordinator_rounds.run_private_lightfr` — the real `RoundCoordinator`
(cohort draw, SecAgg+ session with real X25519 / AES-GCM / Shamir / mask PRG, dequantization,
`LightFRServerStrategy` with the recipe, commit), one real `LightFRModel` device per user
(`device_sdk.training.local_round`: the plan's planes and ridge, clip to ``rounds.clip_norm``,
fixed-point quantization with stochastic rounding, masking), every message through the msgpack codec,
nobody dropping, DP off — and the plain in-process federation (`fedsim.federation.lightfr.run_lightfr`,
exact sums) with the same recipe and model seed.  After the last round every user re-solves its vector
against the final codes and levels and keeps it as 3 planes (what a device with
``LightFRConfig(rank_planes=3)`` does on download), for both runs alike.

``scale`` (every amazon-book device, no crypto): `fedsim.private.scaled_lightfr.run_private_scaled` with ε = 0.  Each
round's cohort is ⌈0.6·70,679⌉ = 42,408 devices; each device's upload is built, clipped to ``--clip-norm``
as the device clips it (`protocol.families.lightfr.clip_parts`' rule) and rounded to ``scale_bits`` with
stochastic rounding by `fedsim.private.cohorts.LightFRCohort` (tests/test_fedsim_privsim.py
``test_batched_all_items_devices_match_real_devices``: its sum equals real devices' `local_round` uploads up
to the rounding coins, with planes 2 and 3 and a clip that bites; tests/test_fedsim_private_scale.py
``test_scaled_round_without_dp_releases_every_cohort_devices_clipped_quantized_upload``: an ε = 0 round of
this path releases the cohort's clipped fixed-point sum); the server dequantizes the sum and runs the same
`LightFRServerStrategy`.  ``scale_bits`` is the largest the bit budget allows for the cohort (9 at C = 64:
the server's default 10 would be refused for 42,408 devices).  SecAgg+'s masks cancel exactly in the modular sum
(tests/test_protocol_session.py ``test_secure_sum_is_bit_exact_for_any_cohort_and_dropouts``;
tests/test_fedsim_privsim.py ``test_simulator_is_bit_identical_to_the_coordinator``: the simulator's model
equals the real coordinator's with crypto, bit for bit),
so this is the arithmetic a real SecAgg+ run applies.  The plain figure of the same recipe is
`python benchmarks/quality_amazon_lightfr.py --seeds 0 1 2` (docs/results/2026-11-quality.md: 0.1151 ± 0.0009).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from own_settings import own_settings

from agg_server.config import config_from_dict
from device_sdk import lightfr
from device_sdk.batched import snapped_vectors
from fedsim.data.datasets import load_amazon_book
from fedsim.data.kgat import TrainTestSplit
from fedsim.data.ratings import Ratings
from fedsim.evaluation.ranking import evaluate_all_items, popularity_scorer
from fedsim.federation.lightfr import run_lightfr, user_data
from fedsim.private.coordinator_rounds import run_private_lightfr
from fedsim.private.scaled_lightfr import ScaledSettings, run_private_scaled
from protocol.families.lightfr import bias_from_levels
from protocol.quantization import DEFAULT_SCALE_BITS

F, B_WEIGHT, W0, REG, PLANES, RANK_PLANES, SWEEPS, FRACTION = 64, 2, 0.01, 1.0, 2, 3, 10, 0.6


def subset_split(data: TrainTestSplit, n_users: int, seed: int) -> TrainTestSplit:
    """A seeded sample of ``n_users`` users (among those with a train item), renumbered, over the items
    they rated in train; their test pairs on those items."""
    train, test = data.train, data.test
    has = np.flatnonzero(np.bincount(train.users, minlength=train.n_users))
    users = np.sort(np.random.default_rng(seed).choice(has, size=min(n_users, has.size), replace=False))
    umap = np.full(train.n_users, -1, np.int64)
    umap[users] = np.arange(users.size)
    keep = umap[train.users] >= 0
    items = np.unique(train.items[keep])
    imap = np.full(train.n_items, -1, np.int64)
    imap[items] = np.arange(items.size)
    tkeep = (umap[test.users] >= 0) & (imap[test.items] >= 0)

    def part(r: Ratings, k: np.ndarray, name: str) -> Ratings:
        return Ratings(
            users=umap[r.users[k]],
            items=imap[r.items[k]],
            ratings=r.ratings[k],
            timestamps=None,
            n_users=users.size,
            n_items=items.size,
            user_ids=r.user_ids[users],
            item_ids=r.item_ids[items],
            name=name,
        )

    sub = f"amazon-book {users.size}-user sample (seed {seed})"
    return TrainTestSplit(train=part(train, keep, sub + " train"), test=part(test, tkeep, sub + " test"), name=sub)


def _ranked(train: Ratings, D: np.ndarray, levels: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(X, Y) scoring X[u]·Y[i] = u'·d_i / f + β_i: every user's vector re-solved against the final codes and
    levels and kept as RANK_PLANES planes, as a device does on download (its own ratings only)."""
    m = train.n_items
    beta = bias_from_levels(levels, m, F, B_WEIGHT)
    idx = train.by_user()
    U = lightfr.ridge_users(idx.indptr, idx.items.astype(np.int64), np.ones(idx.items.size), D, beta, W0, 0.0, REG)
    X = np.c_[snapped_vectors(U, RANK_PLANES, B_WEIGHT) / F, np.ones(train.n_users)].astype(np.float32)
    Y = np.c_[D, beta].astype(np.float32)
    return X, Y


def _metrics(scorer: Any, split: TrainTestSplit) -> dict[str, float]:
    r = evaluate_all_items(scorer, split.train, split.test, seed=0)
    return {"recall@20": round(r.recall, 4), "ndcg@20": round(r.ndcg, 4)}


def plain_subset(split: TrainTestSplit, rounds: int, seed: int) -> dict[str, float]:
    from benchmarks.quality_amazon_lightfr import CHOSEN, configs

    cfg, fed = configs(split.train, CHOSEN, rounds, seed)
    st = run_lightfr(user_data(split.train, cfg), cfg, fed)
    return _metrics(_ranked(split.train, st.item_codes, st.item_levels), split)


def secure_subset(split: TrainTestSplit, rounds: int, seed: int, clip_norm: float) -> dict[str, Any]:
    train = split.train
    n = train.n_users
    cohort = math.ceil(FRACTION * n)
    idx = train.by_user()
    users = {u: (idx.items[idx.indptr[u] : idx.indptr[u + 1]].astype(np.int64), None) for u in range(n)}
    with tempfile.TemporaryDirectory() as tmp:
        config = config_from_dict(
            {
                "server": {"data_dir": tmp, "port": 0},
                "model": {
                    "n_items": train.n_items,
                    "bits": F,
                    "unobserved_weight": W0,
                    "flip_fraction": 1.0,
                    "mean_field": True,
                    "code_sweeps": SWEEPS,
                    "query_planes": PLANES,
                    "user_reg": REG,
                    "hamming_weight": B_WEIGHT,
                },
                "rounds": {
                    "cohort_size": cohort,
                    "min_cohort": cohort,
                    "seed": seed,
                    "clip_norm": clip_norm,
                    "round_interval": 0.0,
                },
                # Every simulated device registers at start-up from one (open) source: no rate limit applies.
                "enrollment": {"registration_burst": n + 1},
            },
            base_dir=Path(tmp),
        )
        seconds: list[float] = []
        last = [time.perf_counter()]

        def tick(run: Any) -> None:
            now = time.perf_counter()
            seconds.append(now - last[0])
            last[0] = now
            print(f"    SecAgg+ round {len(seconds)}: {seconds[-1]:.0f} s", flush=True)

        run = run_private_lightfr(
            config, users, rounds=rounds, seed=seed, rating_range=None, binary_positives=True, after_round=tick
        )
        coord = run.coordinator
        strategy: Any = coord.strategy
        committed = sum(1 for o in run.outcomes if "committed" in o.values())
        D = np.asarray(coord.item_codes, dtype=np.int8).copy()
        levels = strategy.levels(coord.model_state)
    out: dict[str, Any] = _metrics(_ranked(train, D, levels), split)
    out["committed"] = f"{committed} of {len(run.outcomes)}"
    out["seconds_per_round"] = round(float(np.mean(seconds)), 1) if seconds else None
    return out


def subset_main(args: argparse.Namespace) -> None:
    split = subset_split(load_amazon_book(), args.users, seed=0)
    tr, te = split.train, split.test
    head = {"split": split.name, "users": tr.n_users, "items": tr.n_items, "train_pairs": len(tr)}
    head |= {"test_users": int(np.unique(te.users).size), "test_pairs": len(te), "rounds": args.rounds}
    head |= {"cohort": math.ceil(FRACTION * tr.n_users), "clip_norm": args.clip_norm}
    print(json.dumps(head), flush=True)
    print(json.dumps({"model": "item popularity", **_metrics(popularity_scorer(tr), split)}), flush=True)
    for seed in args.seeds:
        if not args.skip_plain:
            t = time.perf_counter()
            row = {"model": "plain in-process", "seed": seed, **plain_subset(split, args.rounds, seed)}
            print(json.dumps({**row, "seconds": round(time.perf_counter() - t)}), flush=True)
        if args.simulated:
            t = time.perf_counter()
            row = {"model": "SecAgg+ arithmetic without crypto (the scale path)", "seed": seed}
            row |= scaled(split, args.rounds, seed, args.clip_norm, DEFAULT_SCALE_BITS)  # the real run's s
            print(json.dumps({**row, "seconds": round(time.perf_counter() - t)}), flush=True)
        if args.skip_secure:
            continue
        t = time.perf_counter()
        row = {"model": "SecAgg+ (no DP), real coordinator and crypto", "seed": seed}
        row |= secure_subset(split, args.rounds, seed, args.clip_norm)
        print(json.dumps({**row, "seconds": round(time.perf_counter() - t)}), flush=True)


def scaled(split: TrainTestSplit, rounds: int, seed: int, clip_norm: float, scale_bits: int = 0) -> dict[str, Any]:
    """The recipe through `run_private_scaled` with ε = 0 (SecAgg+'s clip and quantization, no crypto)."""
    settings = ScaledSettings(
        epsilon=0.0,
        rounds=rounds,
        bits=F,
        clip_norm=clip_norm,
        scale_bits=scale_bits,
        example_cap=0,
        pop_share=0.0,
        seed=seed,
        unobserved_weight=W0,
        mean_field=True,
        query_planes=PLANES,
        user_reg=REG,
        fraction=FRACTION,
        code_sweeps=SWEEPS,
        rank_planes=RANK_PLANES,
    )
    res = run_private_scaled(
        split.train, settings, on_round=lambda r, sec: print(f"    round {r}: {sec:.0f} s", flush=True)
    )
    assert res.user_vectors is not None and res.item_bias is not None
    X = np.c_[res.user_vectors / F, np.ones(split.train.n_users)].astype(np.float32)
    Y = np.c_[res.item_codes, res.item_bias * 2.0 / F].astype(np.float32)
    out: dict[str, Any] = {"clip_norm": clip_norm, "scale_bits": res.settings.scale_bits}
    out |= _metrics((X, Y), split)
    out["seconds_per_round"] = round(float(np.mean(res.round_seconds)), 1)
    return out


def scale_main(args: argparse.Namespace) -> None:
    data = load_amazon_book()
    print(json.dumps({"model": "item popularity", **_metrics(popularity_scorer(data.train), data)}), flush=True)
    for seed in args.seeds:
        t = time.perf_counter()
        row = {"model": "SecAgg+ arithmetic (clip + quantization, no DP), every device", "seed": seed}
        row |= {"rounds": args.rounds} | scaled(data, args.rounds, seed, args.clip_norm)
        row["seconds"] = round(time.perf_counter() - t)
        print(json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("subset", help="real coordinator + SecAgg+ crypto on a seeded user sample, beside plain")
    a.add_argument("--users", type=int, default=300)
    a.add_argument("--skip-plain", action="store_true")
    a.add_argument("--skip-secure", action="store_true", help="no real SecAgg+ run")
    a.add_argument("--simulated", action="store_true", help="also the scale path (no crypto) on the same subset")
    b = sub.add_parser("scale", help="every device, SecAgg+'s clip + quantization without the crypto")
    for q in (a, b):
        q.add_argument("--seeds", type=int, nargs="+", default=[0])
        q.add_argument("--rounds", type=int, default=20)
        q.add_argument("--clip-norm", type=float, default=64.0, help="rounds.clip_norm (default 64, the server's)")
    args = p.parse_args()
    own_settings("the asymmetric LightFR recipe of quality_amazon_lightfr.py (CHOSEN) through SecAgg+ without DP")
    (subset_main if args.mode == "subset" else scale_main)(args)


if __name__ == "__main__":
    main()
