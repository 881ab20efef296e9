"""What re-solving the ranking vector on adopting a model is worth (`LightFRModel.refresh_ranking`, which
`DeviceClient` runs on every download), in-process, VALIDATION blocks only.

    python benchmarks/refresh_on_adopt.py --dataset ml-100k --rounds 1 3 10 20
    python benchmarks/refresh_on_adopt.py --dataset filmtrust-lightfr --rounds 1 3 10

The library default recipe (`quality_lightfr.py` recipe 0: w0 "auto", mean-field code step, ρ = 1, ranking
with 3 planes of the ridge vector, ridge 2·w0·m) trains T + 1 rounds.  A device whose vector was solved
against the model it trained with in round T + 1 (the server's model after round T, with the w0 derived in
round T) then downloads the model after round T + 1 and ranks with
  no download : its vector with the round-T model;
  stale       : the same vector with the round-(T + 1) item codes and levels (before the refresh existed);
  refreshed   : its vector re-solved against the round-(T + 1) model and its w0 (what the device does now);
  codes       : for reference, the ±1 user codes with the round-(T + 1) model.
Every user's vector uses all its training ratings.  HR@10, random ties; figures as `quality_lightfr.py
--select`: the protocol's own validation blocks (model seed 0) and 4 carves from train (seeds 1–4).
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality_lightfr as q  # noqa: E402

from device_sdk.batched import refreshed_vectors  # noqa: E402
from fedsim.evaluation.experiment import prepare  # noqa: E402
from fedsim.federation.lightfr import FederatedLightFR, bias_from_levels, run_lightfr, user_data  # noqa: E402


def figure(exp, rounds: int, seed: int) -> tuple[float, float, float, float]:
    """(no download, stale, refreshed, codes) HR@10 of one figure after ``rounds`` + 1 rounds."""
    cfg, fed, _ = q._recipes(exp, rounds + 1)[q.DEFAULT]
    data = user_data(exp.train, cfg)
    snaps: list[tuple[np.ndarray, np.ndarray | None, float]] = []

    def grab(state: FederatedLightFR) -> None:  # the model after each round, as the server serves it
        levels = None if state.item_levels is None else state.item_levels.copy()
        snaps.append((state.item_codes.copy(), levels, state.unobserved_weight))

    st = run_lightfr(data, cfg, replace(fed, seed=seed), evaluate=grab)  # type: ignore[arg-type]
    m, f, wgt = st.item_codes.shape[0], cfg.bits, st.hamming_weight

    def vectors(snap: tuple[np.ndarray, np.ndarray | None, float]) -> np.ndarray:
        codes, levels, w0 = snap
        beta = bias_from_levels(levels, m, f, wgt)
        reg = fed.rank_ridge * w0 * m
        return refreshed_vectors(
            data.indptr, data.items, data.targets, codes, beta, w0, cfg.confidence, reg, fed.rank_planes, wgt
        )[2]

    def hr(snap: tuple[np.ndarray, np.ndarray | None, float], U: np.ndarray | None) -> float:
        s = copy.copy(st)
        s.item_codes, s.item_levels, s.user_vectors = snap[0], snap[1], U
        return q._hr(s, exp.val, exp.train)[0]

    old, new = snaps[rounds - 1], snaps[rounds]
    stale, fresh = vectors(old), vectors(new)
    if not np.allclose(fresh, st.user_vectors):  # the simulator's own end-of-run refresh
        raise AssertionError("the refreshed vectors differ from the simulator's")
    return hr(old, stale), hr(new, stale), hr(new, fresh), hr(new, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="ml-100k", choices=["ml-100k", "filmtrust-lightfr"])
    ap.add_argument("--rounds", type=int, nargs="+", default=[1, 3, 10])
    ap.add_argument("--carves", type=int, default=4)
    args = ap.parse_args()
    exp = prepare(args.dataset, seed=0)
    figures = [(exp, 0)] + [(c, j + 1) for j, c in enumerate(q._carves(exp, args.carves, 0))]
    print(f"{args.dataset}: validation HR@10, random ties; popularity {q._pop(exp)[0]:.4f} (protocol blocks)")
    print("T -> T+1 | no download | stale | refreshed | codes | refreshed - stale (mean ± std, better on)")
    for T in args.rounds:
        r = np.array([figure(e, T, seed) for e, seed in figures])
        d = r[:, 2] - r[:, 1]
        print(
            f"{T} -> {T + 1} | {r[:, 0].mean():.4f} | {r[:, 1].mean():.4f} | {r[:, 2].mean():.4f} | "
            f"{r[:, 3].mean():.4f} | {d.mean():+.4f} ± {d.std():.4f} ({int((d > 0).sum())}/{len(figures)})",
            flush=True,
        )


if __name__ == "__main__":
    main()
