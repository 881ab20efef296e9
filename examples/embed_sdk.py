"""An app embedding the fedrec device SDK: the on-device LightFR model, offline.

What an app does with `device_sdk.LightFRModel`, step by step, on the built-in synthetic data (no
network at all; a few seconds):

1. Get a global model.  In production the app's `DeviceClient` downloads the item codes from the
   server; here a tiny federation is trained in-process with `fedsim` (users 0..499 of a synthetic
   log) and its item codes are handed to the app as the server would send them (bit-packed words).
2. Train this user's private 64-bit code on the device (`fit_local`) and answer `recommend` offline
   with XOR + popcount.
3. Keep the model in the on-device store (`save` / `load`) and show it survives an app restart:
   same codes, same recommendations.
4. Cold start: `fold_in` brand-new users (users 500..599, never part of the federation) from five of
   their items, with no server round, and measure how many of their other items the top-10 finds
   against item popularity and random picks.
5. Corrupt the store file: `load` raises `StorageError` naming the file, moves it aside
   (``model.fedrec.corrupt-1``) and never overwrites it; the app then starts over from the global
   model.

Run: ``python examples/embed_sdk.py [--workdir DIR]``.  Exits 1 with a ``FAILED:`` line if any check
fails.

Invariants:
- Only the public exports of `device_sdk` and `fedsim` are used.
- Every random choice comes from a generator seeded here, so the output is the same on every run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from device_sdk import LightFRConfig, LightFRModel, StorageError, pack_signs
from fedsim import FederationConfig, Ratings, run_lightfr, synthetic, user_data

N_FEDERATED = 500  # users 0..499 train the global model; 500..599 arrive later (cold start)
BITS = 64
SEEDS_FOLD_IN = 5  # items a new user gives before asking for recommendations


class CheckFailed(Exception):
    """A property the example demonstrates does not hold."""


def check(condition: bool, what: str) -> None:
    """Stop the example (exit status 1) when ``condition`` is false."""
    if not condition:
        raise CheckFailed(what)


def items_of(log: Ratings, user: int) -> NDArray[np.int64]:
    """The items ``user`` rated, in a fixed (sorted) order."""
    return np.sort(np.asarray(log.items[log.users == user], dtype=np.int64))


def train_global_model(log: Ratings, config: LightFRConfig) -> NDArray[np.int8]:
    """What the server would hold: item codes (m, f) ±1 from 25 in-process federated rounds."""
    federated = log.subset(np.asarray(log.users) < N_FEDERATED)
    state = run_lightfr(
        user_data(federated, config),
        config,
        FederationConfig(rounds=25, fraction=0.6, seed=0, flip_fraction=0.1),
    )
    return state.item_codes


def run(workdir: Path) -> None:
    log = synthetic(n_users=600, n_items=400, ratings_per_user=40, seed=7)
    m = log.n_items
    config = LightFRConfig(bits=BITS, binary_positives=True)  # implicit feedback: every rated item is a 1

    # 1. The global model, as the server would ship it: packed (w, m) uint64 words, version 26.
    item_codes = train_global_model(log, config)
    words = pack_signs(item_codes)
    version = 26
    print(f"global model: {m} items × {BITS} bits = {words.nbytes} bytes on the wire, version {version}")

    # 2. The app's user: train the private code on the device and recommend offline.
    model = LightFRModel(n_items=m, config=config, rng=np.random.default_rng(1))
    model.set_item_codes(words, version=version)
    mine = items_of(log, 0)
    update = model.fit_local(mine)  # the upload (update.values) would go to secure aggregation
    check(update.values.shape == (m, BITS), "fit_local returns a dense (m, f) upload")
    ids, scores = model.recommend(mine, N=10, rng=np.random.default_rng(2))
    print(f"user 0 rated {mine.size} items; offline top-10: {ids.tolist()}")
    print("  similarities: " + ", ".join(f"{s:.3f}" for s in scores))
    check(ids.size == 10 and np.unique(ids).size == 10, "ten distinct recommendations")
    check(not np.isin(ids, mine).any(), "already rated items are filtered out")
    check(bool(np.all(np.diff(scores) <= 0)), "scores are sorted, best first")

    # 3. The on-device store: atomic save, and the model survives a restart of the app.
    store = workdir / "app-store" / "model.fedrec"
    store.parent.mkdir(parents=True, exist_ok=True)
    model.save(store)
    print(f"saved the model to {store} ({store.stat().st_size} bytes)")
    restarted = LightFRModel.load(store, rng=np.random.default_rng(99))
    check(restarted.model_version == version, "the model version survives the restart")
    check(np.array_equal(restarted.user_codes, model.user_codes), "the user code survives the restart")
    check(np.array_equal(restarted.item_codes, model.item_codes), "the item codes survive the restart")
    again, _ = restarted.recommend(mine, N=10, rng=np.random.default_rng(2))
    check(np.array_equal(again, ids), "the same recommendations after the restart")
    print("after a restart: same version, same codes, same top-10")

    # 4. Cold start without a server round: fold in new users from five items each.
    newcomer = LightFRModel(n_items=m, config=config, rng=np.random.default_rng(3))
    newcomer.set_item_codes(words, version=version)
    popular = np.argsort(-np.bincount(log.items[log.users < N_FEDERATED], minlength=m), kind="stable")
    hits_fold, hits_pop, expected_random, shown = 0, 0, 0.0, False
    for user in range(N_FEDERATED, log.n_users):
        rated = items_of(log, user)
        given, hidden = rated[:SEEDS_FOLD_IN], rated[SEEDS_FOLD_IN:]
        newcomer.fold_in(given)
        top, _ = newcomer.recommend(given, N=10, rng=np.random.default_rng(user))
        hits_fold += int(np.isin(top, hidden).sum())
        hits_pop += int(np.isin(popular[~np.isin(popular, given)][:10], hidden).sum())
        expected_random += 10 * hidden.size / (m - given.size)
        if not shown:
            print(f"new user {user}: gave items {given.tolist()}; top-10 after fold_in: {top.tolist()}")
            shown = True
    check(newcomer.model_version == version, "fold_in does not touch the global model")
    check(np.array_equal(newcomer.item_codes, item_codes), "fold_in leaves the item codes unchanged")
    n_new = log.n_users - N_FEDERATED
    print(
        f"cold start, {n_new} new users, {SEEDS_FOLD_IN} items each: hidden items found in the top-10: "
        f"fold_in {hits_fold / n_new:.2f} per user, popularity {hits_pop / n_new:.2f}, "
        f"random {expected_random / n_new:.2f}"
    )
    check(hits_fold > 2 * expected_random, "fold_in recommendations beat random picks by a wide margin")

    # 5. A corrupt store file is a clear error, and it is moved aside, never overwritten.
    blob = bytearray(store.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # one flipped byte inside the payload
    store.write_bytes(bytes(blob))
    try:
        LightFRModel.load(store)
    except StorageError as exc:
        print(f"loading the damaged store: StorageError: {exc}")
        check("corrupt" in str(exc), "the error says the file is corrupt")
    else:
        raise CheckFailed("a damaged store file loaded without an error")
    aside = store.with_name(store.name + ".corrupt-1")
    check(not store.exists() and aside.exists(), "the damaged file was moved aside")
    check(aside.read_bytes() == bytes(blob), "the moved-aside file is kept byte for byte")
    # Recovery: start over from the global model (a real app re-downloads it) and save again.
    fresh = LightFRModel(n_items=m, config=config, rng=np.random.default_rng(4))
    fresh.set_item_codes(words, version=version)
    fresh.fit_local(mine)
    fresh.save(store)
    check(LightFRModel.load(store).model_version == version, "the rebuilt store loads")
    print(f"moved aside to {aside.name}; rebuilt {store.name} from the global model")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the example; returns the exit status (0 when every check held)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the store here (default: a temp folder)")
    args = parser.parse_args(argv)
    try:
        if args.workdir is not None:
            args.workdir.mkdir(parents=True, exist_ok=True)
            run(args.workdir)
        else:
            with tempfile.TemporaryDirectory(prefix="fedrec-embed-") as tmp:
                run(Path(tmp))
    except CheckFailed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print("embed_sdk: all checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
