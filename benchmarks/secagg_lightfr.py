"""LightFR through real SecAgg+ (no DP) beside the plain in-process federation, same recipe, same data.

    python benchmarks/secagg_lightfr.py --seeds 0                 # ML-100K, the default recipe, T = 40
    python benchmarks/secagg_lightfr.py --seeds 0 --clip-norm 1e6  # clipping out of the way

The SecAgg+ run is `fedsim.private.coordinator_rounds.run_private_lightfr`: the real `RoundCoordinator` (cohort draw,
SecAgg+ session with real X25519 / AES-GCM / Shamir / mask PRG, dequantization, the LightFR strategy,
commit) and one real `LightFRModel` device per user (`device_sdk.training.local_round`: clip to
``rounds.clip_norm``, fixed-point quantization with stochastic rounding, masking), every message through
the msgpack codec, nobody dropping.  Privacy (DP) is off.  The plain run is `fedsim.federation.lightfr.run_lightfr`,
the in-process federation whose sums are exact.  Both use the library default (all items, w0 derived
from the density of each round's counts, learned item levels, ρ = 0.3), f = 64, p = 0.6 (the SecAgg+
cohort is ⌈0.6·n⌉ of the n devices each round), T rounds, E = 1.  Quality: ML-100K leave-one-out
(latest rating by timestamp), 99 sampled negatives, HR@10 / NDCG@10 with random ties; the evaluation
seed stays 0 whatever the model seed.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np
from own_settings import own_settings

from agg_server.config import config_from_dict
from device_sdk.models import LightFRConfig
from fedsim.evaluation.experiment import Experiment, prepare
from fedsim.evaluation.ranking import TieMode, evaluate_candidates
from fedsim.federation.lightfr import FederatedLightFR, FederationConfig, run_lightfr, user_data
from fedsim.private.coordinator_rounds import run_private_lightfr
from protocol.families.lightfr import DENSITY_SCALE, density_weight


def _score(state: FederatedLightFR, exp: Experiment) -> tuple[float, float]:
    r = evaluate_candidates(state.scores(exp.test.users, exp.test.items), 10, TieMode.RANDOM)
    return r.hr, r.ndcg


def plain(exp: Experiment, rounds: int, seed: int) -> FederatedLightFR:
    cfg = LightFRConfig(
        bits=64,
        rating_range=exp.rating_range,
        binary_positives=True,
        unobserved_weight=density_weight(0.0, 1, exp.train.n_items),
    )
    # The server's defaults: w0 = auto, the mean-field code step with ρ = 1 (agg_server.config.ModelSection).
    fed = FederationConfig(
        rounds=rounds, fraction=0.6, seed=seed, flip_fraction=1.0, unobserved_scale=DENSITY_SCALE, mean_field=True
    )
    return run_lightfr(user_data(exp.train, cfg), cfg, fed)


def secure(exp: Experiment, rounds: int, seed: int, clip_norm: float, data_dir: Path) -> FederatedLightFR:
    train = exp.train
    n = train.n_users
    cohort = math.ceil(0.6 * n)
    idx = train.by_user()
    users = {
        u: (idx.items[idx.indptr[u] : idx.indptr[u + 1]].astype(np.int64), None)
        for u in range(n)
        if idx.indptr[u + 1] > idx.indptr[u]
    }
    config = config_from_dict(
        {
            "server": {"data_dir": str(data_dir), "port": 0},
            "model": {"n_items": train.n_items, "bits": 64},
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
        base_dir=data_dir,
    )
    last = [time.perf_counter()]

    def tick(run: object) -> None:
        now = time.perf_counter()
        print(f"    SecAgg+ round done in {now - last[0]:.0f} s", flush=True)
        last[0] = now

    run = run_private_lightfr(
        config, users, rounds=rounds, seed=seed, rating_range=None, binary_positives=True, after_round=tick
    )
    coord = run.coordinator
    strategy = coord.strategy
    user_codes = np.ones((n, 64), dtype=np.int8)
    for device_id, u in zip(run.devices, users, strict=True):
        user_codes[u] = run.devices[device_id].model.user_codes[0]
    levels = strategy.levels(coord.model_state)  # type: ignore[attr-defined]
    committed = sum(1 for o in run.outcomes if "committed" in o.values())
    w0 = strategy.plan().unobserved_weight  # type: ignore[union-attr]
    print(f"  SecAgg+ rounds committed: {committed} of {len(run.outcomes)}; last w0 {w0:.4g}")
    return FederatedLightFR(
        user_codes=user_codes,
        item_codes=np.asarray(coord.item_codes, dtype=np.int8).copy(),
        item_levels=levels,
        hamming_weight=strategy.hamming_weight,  # type: ignore[attr-defined]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="ml-100k")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--clip-norm", type=float, default=64.0, help="rounds.clip_norm of the SecAgg+ run (default 64)")
    p.add_argument("--skip-plain", action="store_true")
    args = p.parse_args()
    own_settings("LightFR's recipe through SecAgg+ without DP, --clip-norm and rounds as given")
    exp = prepare(args.dataset, seed=0)
    print(f"### {exp.describe()}; T={args.rounds}, f=64, p=0.6, clip norm {args.clip_norm}")
    rows: dict[str, list[tuple[float, float]]] = {"plain in-process": [], "SecAgg+ (no DP)": []}
    for seed in args.seeds:
        if not args.skip_plain:
            t = time.perf_counter()
            rows["plain in-process"].append(_score(plain(exp, args.rounds, seed), exp))
            print(f"  seed {seed} plain {rows['plain in-process'][-1]} ({time.perf_counter() - t:.0f} s)", flush=True)
        t = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            rows["SecAgg+ (no DP)"].append(_score(secure(exp, args.rounds, seed, args.clip_norm, Path(tmp)), exp))
        print(f"  seed {seed} SecAgg+ {rows['SecAgg+ (no DP)'][-1]} ({time.perf_counter() - t:.0f} s)", flush=True)
    print("\n| run | HR@10 | NDCG@10 |\n|---|---|---|")
    for name, vals in rows.items():
        if vals:
            hr, nd = zip(*vals, strict=True)
            hr_txt, nd_txt = f"{np.mean(hr):.4f} ± {np.std(hr):.4f}", f"{np.mean(nd):.4f} ± {np.std(nd):.4f}"
            print(f"| {name} | {hr_txt} | {nd_txt} | (seeds {args.seeds})")
    pop = evaluate_candidates(
        np.bincount(exp.train.items, minlength=exp.train.n_items)[exp.test.items], 10, TieMode.RANDOM
    )
    print(f"| item popularity | {pop.hr:.4f} | {pop.ndcg:.4f} |")


if __name__ == "__main__":
    main()
