"""Stage 1's recall and the two-stage ranking's quality on amazon-book's validation split, through the
device's public API, for choosing C (`LightFRConfig.candidates`).

Centralised implicit ALS (f = 64, reg 0.1, α 100, 15 iterations: the reference setting of
benchmarks/quality_amazon.py) is fitted on amazon-book's train split less a 10% validation carve
(`carve_validation`, seed 0).  Its item factors Y are the embeddings and sign(Y) the 64-bit codes, a
stand-in for item factors and codes trained through the federation.  A seeded sample of validation users
is folded in on a `LightFRModel` with the SDK's defaults (`set_item_codes`, `set_embeddings(Y, alpha=100,
reg=0.1)`, `fold_in(train items)`), and for each C the device's `recommend(N=20)` is scored by Recall@20
on the validation items, beside stage 1's recall of the real-valued top 20 (`stage1_recall`).  C = 0 is
the full real-valued ranking of the device's own vector, ``rerank=False`` stage 1 alone, and
"planes" the model without embeddings (stage 2 by the bit-planes).  These are validation figures: nothing
here looks at the test split.

    python benchmarks/two_stage_amazon.py                    # 2,000 users, C = 0, 100, 200, 500, 1000, 2000
    python benchmarks/two_stage_amazon.py --users 5000 --candidates 200 1000
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402

import numpy as np  # noqa: E402
from own_settings import own_settings  # noqa: E402

from device_sdk import LightFRConfig, LightFRModel  # noqa: E402
from device_sdk.realvalued import stage1_recall  # noqa: E402
from fedsim.data.datasets import load_amazon_book  # noqa: E402
from fedsim.data.splits import carve_validation  # noqa: E402
from fedsim.evaluation.als import implicit_als  # noqa: E402

N = 20


def recall_at(ids: np.ndarray, truth: list[np.ndarray]) -> float:
    """Mean over users of |top N ∩ validation items| / |validation items|."""
    return float(np.mean([np.isin(truth[u], ids[u]).sum() / truth[u].size for u in range(len(truth))]))


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--users", type=int, default=2000, help="seeded sample of validation users")
    p.add_argument("--candidates", type=int, nargs="+", default=[0, 100, 200, 500, 1000, 2000])
    p.add_argument("--alpha", type=float, default=100.0)
    p.add_argument("--reg", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    own_settings(
        "centralised implicit ALS (f = 64, α = 100, λ = 0.1, 15 iterations) as a stand-in for federated item "
        "factors, its signs as the codes"
    )
    t0 = time.perf_counter()
    fit, val = carve_validation(load_amazon_book().train, seed=0)
    _, Y = implicit_als(fit, factors=64, reg=args.reg, alpha=args.alpha, iterations=15, seed=0)
    print(json.dumps({"ials_seconds": round(time.perf_counter() - t0), "items": fit.n_items}), flush=True)
    rng = np.random.default_rng(args.seed)
    has = np.flatnonzero(np.bincount(val.users, minlength=fit.n_users))
    users = np.sort(rng.choice(has, min(args.users, has.size), replace=False))
    order = np.argsort(fit.users, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(np.bincount(fit.users, minlength=fit.n_users))))
    liked = [np.unique(fit.items[order][bounds[u] : bounds[u + 1]]) for u in users]
    vorder = np.argsort(val.users, kind="stable")
    vb = np.concatenate(([0], np.cumsum(np.bincount(val.users, minlength=fit.n_users))))
    truth = [np.unique(val.items[vorder][vb[u] : vb[u + 1]]) for u in users]
    n = users.size
    model = LightFRModel(fit.n_items, LightFRConfig(), n_users=n, rng=np.random.default_rng(args.seed))
    model.set_item_codes(np.where(Y >= 0, 1, -1).astype(np.int8), 1)
    model.set_embeddings(Y, alpha=args.alpha, reg=args.reg)
    for row in range(n):
        model.fold_in(liked[row], userid=row)
    base = model.config
    rows = np.arange(n)
    for C in args.candidates:
        model.config = replace(base, candidates=C)
        t = time.thread_time()
        ids, _ = model.recommend(liked, N=N, userid=rows)
        spent = (time.thread_time() - t) / n
        out = {"C": C, "recall@20": round(recall_at(ids, truth), 4), "ms_per_user": round(spent * 1e3, 3)}
        if C:
            cand = [model.stage1_candidates(liked[r], userid=r) for r in range(n)]
            padded = np.full((n, max(c.size for c in cand)), -1, np.int64)
            for r, c in enumerate(cand):
                padded[r, : c.size] = c
            E = model.item_embeddings
            assert E is not None
            out["stage1_recall_of_top20"] = round(
                float(stage1_recall(padded, E, model.user_vectors, N, exclude=liked).mean()), 4
            )
            out["candidates_mean"] = round(float(np.mean([c.size for c in cand])), 1)
        print(json.dumps(out), flush=True)
    model.config = replace(base, rerank=False)
    ids, _ = model.recommend(liked, N=N, userid=rows)
    print(json.dumps({"ranking": "stage 1 alone (rerank=False)", "recall@20": round(recall_at(ids, truth), 4)}))
    model.config = base
    model.set_embeddings(None)
    ids, _ = model.recommend(liked, N=N, userid=rows)
    print(
        json.dumps(
            {"ranking": f"planes (no embeddings), C = {base.candidates}", "recall@20": round(recall_at(ids, truth), 4)}
        )
    )
    print(json.dumps({"seconds": round(time.perf_counter() - t0), "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
