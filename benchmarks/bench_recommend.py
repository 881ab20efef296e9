"""What an app pays for `LightFRModel.recommend` with the SDK's default configuration, against faiss's
`IndexBinaryFlat` on the same codes in the same process: one user per call, a batch of users per call,
the re-rank's cost, stage 1's recall, bytes per item and the peak memory of a recommend.

The fedrec side calls only the public API a device uses: ``LightFRModel(m, LightFRConfig())``,
``set_item_codes``, ``set_embeddings`` (``--embeddings``), ``fold_in(items, userid=u)`` and
``recommend(items, N=10, userid=u)`` (stage 1's candidates, for the re-rank's cost and the recall, come from
``stage1_candidates``).  faiss searches the same item codes with each user's ±1 code for its top 10
(nothing excluded).  Both run on one thread: faiss.omp_set_num_threads(1), and BLAS pinned before numpy
is imported.  Times are CPU seconds of the calling thread (`time.thread_time`), the median of up to
``--repeat`` calls, the two methods taking turns in bursts (``bench_topk._timed``), each one-user call a
new user (users rotate); on a shared machine the ratio to faiss within a run is the figure to read.
Beside them (f = 64), the floor of any numpy scan: one XOR and one popcount call over the packed codes
(new arrays each), the same with the XOR in place on a copy of the codes and the counts into a buffer
(what stage 1 does), and that with the one compare and nonzero over the catalogue an exact threshold adds
(at each user's own (C + rated)-th distance).

The catalogue is synthetic: item embeddings E (m, d) of rank ``--rank`` plus noise, and item codes the
signs of E under a random projection (so codes and embeddings agree, as trained ones would); a user's
items are ``--rated`` drawn from the top 1% of a random taste's scores.  ``--levels`` adds an item term
(Zipf popularity in 16 levels, B = 4).

    pip install 'fedrec[bench]'                                   # faiss-cpu; without it fedrec runs alone
    python benchmarks/bench_recommend.py                          # 10^5 and 10^6 items, stage 2 by the planes
    python benchmarks/bench_recommend.py --embeddings             # stage 2 by E·u (d = 64), C = 100, 200, 500
    python benchmarks/bench_recommend.py --sizes 1000000 --rss    # + peak RSS of a recommend in a child process
    python benchmarks/bench_recommend.py --exact                  # candidates=0: every item by the planes (before)
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from numpy.typing import NDArray  # noqa: E402

from device_sdk import LightFRConfig, LightFRModel, pack_signs, to_bytes, words_for  # noqa: E402
from device_sdk.realvalued import dot_rows, stage1_recall, top_row  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_topk import _timed, zipf_levels  # noqa: E402

N = 10


def synthetic(
    m: int, d: int, f: int, rank: int, rng: np.random.Generator
) -> tuple[NDArray[np.float32], NDArray[np.int8], NDArray[np.float64]]:
    """Item embeddings (m, d) float32 of rank ``rank`` plus noise, item codes sign(E·R) (m, f), and the
    (rank, d) map from tastes to embedding space."""
    A = rng.standard_normal((rank, d)) / np.sqrt(rank)
    R = rng.standard_normal((d, f))
    E = np.empty((m, d), np.float32)
    codes = np.empty((m, f), np.int8)
    for s in range(0, m, 1 << 16):  # in chunks: a few MiB of floats at a time
        e = min(m, s + (1 << 16))
        z = rng.standard_normal((e - s, rank)) @ A + 0.3 * rng.standard_normal((e - s, d))
        E[s:e] = z
        codes[s:e] = np.where(z @ R > 0, 1, -1)
    return E, codes, A


def user_items(E: NDArray[np.float32], A: NDArray[np.float64], n: int, rated: int, rng: np.random.Generator) -> list:
    """Each user's ``rated`` items, drawn from the top 1% of a random taste's scores."""
    out = []
    top = max(rated, E.shape[0] // 100)
    for _ in range(n):
        s = E @ (rng.standard_normal(A.shape[0]) @ A).astype(np.float32)
        best = np.argpartition(-s, top - 1)[:top]
        out.append(np.sort(rng.choice(best, rated, replace=False)))
    return out


def faiss_index(codes: NDArray[np.int8]) -> Any:
    """faiss's IndexBinaryFlat over the codes (bits packed the same way for items and queries), or None."""
    try:
        import faiss
    except ImportError:
        return None
    faiss.omp_set_num_threads(1)
    index = faiss.IndexBinaryFlat(codes.shape[1])
    for s in range(0, codes.shape[0], 1 << 16):
        index.add(np.packbits(codes[s : s + (1 << 16)] > 0, axis=1, bitorder="little"))
    return index


def rotating(fn: Callable[[int], Any], n: int) -> Callable[[], Any]:
    turn = itertools.count()
    return lambda: fn(next(turn) % n)


def build(args: argparse.Namespace, m: int, rng: np.random.Generator) -> tuple[LightFRModel, Any, Any, list]:
    E, codes, A = synthetic(m, args.dim, args.bits, args.rank, rng)
    config = LightFRConfig(bits=args.bits, candidates=0) if args.exact else LightFRConfig(bits=args.bits)
    model = LightFRModel(m, config, n_users=args.users, rng=np.random.default_rng(1))
    if args.levels:
        model.set_global(  # as a ModelPayload brings codes and levels
            to_bytes(pack_signs(codes)),
            b"",
            1,
            item_levels=zipf_levels(m, 16, rng).tobytes(),
            hamming_weight=4,
        )
    else:
        model.set_item_codes(codes, 1)
    if args.embeddings:
        model.set_embeddings(E, alpha=args.alpha, reg=args.reg)
    liked = user_items(E, A, args.users, args.rated, rng)
    for u, items in enumerate(liked):
        model.fold_in(items, userid=u)
    return model, E, codes, liked


def measure(args: argparse.Namespace, m: int, rng: np.random.Generator) -> dict[str, Any]:
    model, E, codes, liked = build(args, m, rng)
    index = faiss_index(codes)
    n = args.users
    fns: list[Callable[[], Any]] = [rotating(lambda u: model.recommend(liked[u], N=N, userid=u), n)]
    batch = args.batch
    users = np.arange(batch)
    fns.append(lambda: model.recommend(liked[:batch], N=N, userid=users))
    # The floor of any numpy scan: one XOR and one popcount call over the packed codes, nothing else.
    words = pack_signs(codes)[0] if args.bits == 64 else None
    if words is not None:
        user_words = pack_signs(model.user_codes)[0]
        fns.append(rotating(lambda u: np.bitwise_count(np.bitwise_xor(words, user_words[u])), n))
        # The least a numpy scan needs (what stage 1 does with one-word codes): one XOR in place on a copy of
        # the codes (held XOR the last user's word) and one popcount into a buffer; and the same with the
        # one compare and nonzero over the catalogue that an exact threshold adds, at the user's own
        # (C + rated)-th distance (found beforehand, not timed).
        kth = model.config.candidates + args.rated - 1
        cut = [int(np.partition(np.bitwise_count(words ^ user_words[u]), kth)[kth]) for u in range(n)]
        held, key, counts = words.copy(), np.zeros(1, np.uint64), np.empty(m, np.uint8)

        def scan_in_place(u: int) -> NDArray[np.uint8]:
            np.bitwise_xor(held, key[0] ^ user_words[u], out=held)
            key[0] = user_words[u]
            return np.bitwise_count(held, out=counts)

        fns.append(rotating(scan_in_place, n))
        fns.append(rotating(lambda u: np.flatnonzero(scan_in_place(u) <= cut[u]), n))
    if index is not None:
        queries = np.packbits(model.user_codes > 0, axis=1, bitorder="little")
        fns.append(rotating(lambda u: index.search(queries[u : u + 1], N), n))
        fns.append(lambda: index.search(queries[:batch], N))
    t = _timed(fns, args.repeat, args.budget, False)
    row: dict[str, Any] = {"items": m, "one_ms": t[0] * 1e3, "batch_ms": t[1] * 1e3}
    if words is not None:
        row["numpy_xor_popcount_ms"] = t.pop(2) * 1e3
        row["numpy_scan_in_place_ms"] = t.pop(2) * 1e3
        row["numpy_scan_in_place_compare_ms"] = t.pop(2) * 1e3
    if index is not None:
        row.update(faiss_one_ms=t[2] * 1e3, faiss_batch_ms=t[3] * 1e3, one_x=t[0] / t[2], batch_x=t[1] / t[3])
        if words is not None:
            row["numpy_xor_popcount_x"] = row["numpy_xor_popcount_ms"] / row["faiss_one_ms"]
            for name in ("numpy_scan_in_place", "numpy_scan_in_place_compare"):
                row[name + "_x"] = row[name + "_ms"] / row["faiss_one_ms"]
    # What the model holds after the fold-ins and recommends: the packed words (8 bytes a word), levels,
    # embeddings, and the ±1 matrix if anything unpacked it (reading `item_codes` would).
    held: list[NDArray[Any]] = [
        a
        for a in (model._item_signs and model._item_signs[1], model.item_levels, model.item_embeddings)
        if a is not None
    ]
    row["bytes_per_item_min"] = args.bits / 8 + (1 if args.levels else 0) + (2 * args.dim if args.embeddings else 0)
    row["bytes_per_item_held"] = (sum(a.nbytes for a in held) + m * 8 * words_for(args.bits)) / m
    # Stage 1's scan copy of one-word codes, per thread that ranks (see device_sdk.topk.candidates).
    row["bytes_per_item_scan_copy"] = 8 if args.bits <= 64 else 0
    if args.embeddings:
        row["rerank"] = rerank_cost(args, model, E, liked)
    return row


def rerank_cost(args: argparse.Namespace, model: LightFRModel, E: NDArray[np.float32], liked: list) -> list:
    """For each C: what stage 2 costs on a user's stage-1 candidates (the E·u products and the top 10 with
    random ties, `realvalued.dot_rows` and `top_row`, what recommend runs on them), recommend's time beside
    stage 1's alone, and stage 1's recall of the real-valued top 10."""
    out = []
    base = model.config
    n = args.users
    E16 = model.item_embeddings
    assert E16 is not None
    rng = np.random.default_rng(0)
    for C in args.candidates:
        model.config = replace(base, candidates=C)
        cands = [model.stage1_candidates(liked[u], userid=u) for u in range(n)]
        U = model.user_vectors

        def stage2(u: int, cands: list = cands, U: NDArray[np.float32] = U) -> Any:
            return top_row(cands[u], dot_rows(E16, cands[u][None, :], U[u : u + 1])[0], N, rng)

        full = rotating(lambda u: model.recommend(liked[u], N=N, userid=u), n)
        first = rotating(lambda u: model.stage1_candidates(liked[u], userid=u), n)
        t = _timed([rotating(stage2, n), full, first], args.repeat, args.budget, False)
        width = max(c.size for c in cands)
        padded = np.full((n, width), -1, np.int64)
        for u, c in enumerate(cands):
            padded[u, : c.size] = c
        recall = stage1_recall(padded, E, U, N, exclude=liked)
        out.append(
            {
                "C": C,
                "rerank_ms": t[0] * 1e3,
                "recommend_ms": t[1] * 1e3,
                "stage1_ms": t[2] * 1e3,
                "recall_at_10": float(recall.mean()),
                "candidates_mean": float(np.mean([c.size for c in cands])),
            }
        )
    model.config = base
    return out


def _status_mb(field: str) -> float:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_child(path: str, rated: int) -> None:
    """In a fresh process: load the model (its CPU time and peak RSS), fold in a user, then recommend twice, the
    peak RSS reset before each (Linux: "5" into /proc/self/clear_refs), so a recommend's own peak is read apart
    from the load's."""
    # ru_maxrss would carry the parent's high-water mark over fork: reset the peak to this process's own.
    Path("/proc/self/clear_refs").write_text("5")
    started = time.process_time()
    model = LightFRModel.load(path)
    load_cpu = time.process_time() - started
    peak_load = _status_mb("VmHWM")
    items = np.random.default_rng(0).choice(model.n_items, rated, replace=False)
    model.fold_in(items, userid=0)
    before = _status_mb("VmRSS")
    peaks = []
    for _ in range(2):  # the first call also builds the index and its scan buffers
        Path("/proc/self/clear_refs").write_text("5")
        model.recommend(items, N=N, userid=0)
        peaks.append(_status_mb("VmHWM"))
    print(
        json.dumps(
            {
                "store_mb": os.path.getsize(path) / 2**20,
                "load_cpu_ms": load_cpu * 1e3,
                "peak_mb_load": peak_load,
                "rss_mb_before_recommend": before,
                "peak_mb_first_recommend": peaks[0],
                "peak_mb_recommend": peaks[1],
            }
        )
    )


def rss(args: argparse.Namespace, m: int, rng: np.random.Generator) -> dict[str, Any]:
    model, _, _, _ = build(replace_users(args, 1), m, rng)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model.fedrec")
        model.save(path)
        del model
        out = subprocess.run(
            [sys.executable, __file__, "--rss-child", path, "--rated", str(args.rated)],
            check=True,
            capture_output=True,
            text=True,
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def replace_users(args: argparse.Namespace, users: int) -> argparse.Namespace:
    copy = argparse.Namespace(**vars(args))
    copy.users = users
    return copy


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10**5, 10**6])
    p.add_argument("--bits", type=int, default=LightFRConfig().bits)
    p.add_argument("--dim", type=int, default=64, help="embedding dimension d (with --embeddings)")
    p.add_argument("--rank", type=int, default=8, help="rank of the synthetic tastes")
    p.add_argument("--users", type=int, default=100, help="fold-in users the one-user calls rotate over")
    p.add_argument("--batch", type=int, default=100, help="users per batched call")
    p.add_argument("--rated", type=int, default=50)
    p.add_argument("--levels", action="store_true", help="an item term: Zipf popularity in 16 levels, B = 4")
    p.add_argument("--embeddings", action="store_true", help="the model holds item embeddings (stage 2: E·u)")
    p.add_argument("--alpha", type=float, default=10.0, help="implicit-ALS confidence of the user step")
    p.add_argument("--reg", type=float, default=1.0, help="implicit-ALS ridge of the user step")
    p.add_argument("--candidates", type=int, nargs="+", default=[100, 200, 500], help="C for the re-rank cost")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--budget", type=float, default=3.0, help="CPU seconds per method before it stops early")
    p.add_argument("--rss", action="store_true", help="peak RSS of load + fold_in + recommend in a child process")
    p.add_argument(
        "--exact", action="store_true", help="not the default: candidates=0, every item scored (the one-stage ranking)"
    )
    p.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rss_child:
        rss_child(args.rss_child, args.rated)
        return
    cfg = LightFRConfig(candidates=0) if args.exact else LightFRConfig()
    try:
        import faiss  # noqa: F401
    except ImportError:
        print("faiss not installed: fedrec measured alone (pip install 'fedrec[bench]' for the comparison)")
    print(
        f"recommend, {'NOT the default: ' if args.exact else 'default '}LightFRConfig(rank_planes={cfg.rank_planes}, "
        f"candidates={cfg.candidates}, "
        f"rerank={cfg.rerank}), N = {N}, f = {args.bits}, {args.rated} rated items a user"
        f"{', item term' if args.levels else ''}{f', embeddings d = {args.dim}' if args.embeddings else ''}; "
        f"load average {os.getloadavg()}",
        flush=True,
    )
    rng = np.random.default_rng(0)
    for m in args.sizes:
        row = measure(args, m, rng)
        print(json.dumps(row), flush=True)
        if args.rss:
            print(json.dumps({"items": m, **rss(args, m, rng)}), flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
