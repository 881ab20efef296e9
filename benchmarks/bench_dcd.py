"""LightFR DCD cost: one sweep over all users of an ML-1M-shaped synthetic set, and one device's
local update.

    python benchmarks/bench_dcd.py

Data: `fedsim.data.synthetic.synthetic` sized like MovieLens-1M (6,040 users × 3,706 items, ≈ 1M ratings),
f = 64.  "observed" fits the ratings only; "implicit" adds 4 sampled negatives per rating (≈ 5M
entries).  The first sweep includes the set-up (inner products, the constant rating term); later
sweeps are reported separately.  The device figure is `LightFRModel.fit_local` for one user with 166
ratings (LightFR's ML-1M average) and m = 3,706: negatives, DCD to convergence, dense item gradient.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from device_sdk import lightfr
from device_sdk.models import LightFRConfig, LightFRModel
from fedsim.data.synthetic import synthetic
from fedsim.federation.lightfr import user_data, with_negatives
from protocol.codes import random_signs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    f = args.bits
    t = time.perf_counter()
    data = synthetic(n_users=6040, n_items=3706, ratings_per_user=166, seed=0)
    print(
        f"data: {data.n_users} users × {data.n_items} items, {len(data)} ratings "
        f"(built in {time.perf_counter() - t:.1f} s)"
    )
    cfg = LightFRConfig(bits=f, rating_range=(1.0, 5.0), binary_positives=True)
    ud = user_data(data, cfg)
    rng = np.random.default_rng(0)
    D = random_signs(data.n_items, f, rng)
    for label, batch in (("observed", ud), ("implicit (4 neg/rating)", with_negatives(ud, 4, rng))):
        B0 = random_signs(ud.n_users, f, rng)
        first, later = [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            B1, _ = lightfr.dcd_update(batch.indptr, batch.items, batch.targets, B0, D, 0.0, max_sweeps=1)
            first.append(time.perf_counter() - t)
            t = time.perf_counter()
            _, s3 = lightfr.dcd_update(batch.indptr, batch.items, batch.targets, B1, D, 0.0, max_sweeps=3)
            later.append((time.perf_counter() - t, s3.sweeps))
        t3, n3 = min(later, key=lambda x: x[0])
        print(
            f"DCD, all users, {label:<24} entries={batch.items.size:>9}  first sweep {min(first):.3f} s"
            f"  (incl. set-up); then {t3 / n3:.3f} s per sweep over {n3} sweeps"
        )
    # One device.
    model = LightFRModel(data.n_items, LightFRConfig(bits=f, rating_range=(1.0, 5.0)), rng=rng)
    model.set_item_codes(D, 1)
    items = rng.choice(data.n_items, 166, replace=False)
    ratings = rng.integers(1, 6, 166).astype(float)
    times = []
    for _ in range(20):
        t = time.perf_counter()
        up = model.fit_local(items, ratings)
        times.append(time.perf_counter() - t)
    print(
        f"one device: fit_local with 166 ratings + 664 negatives, m={data.n_items}: "
        f"median {np.median(times) * 1e3:.1f} ms "
        f"(upload {up.values.nbytes / 1e6:.1f} MB float64 before quantization)"
    )


if __name__ == "__main__":
    main()
