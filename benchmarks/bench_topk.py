"""Top-10 retrieval on one core: fedrec's Hamming top-k (with and without the item term) against
faiss's `IndexBinaryFlat` on the same codes and a float32 d = 32 inner-product top-10, in one process.

For each catalogue size it times one user per call and a batch of users per call (100 by default)
and prints items/s (user-item pairs scored per second) and each method's speed relative to faiss.
Codes and embeddings are random; the item term uses levels 0..15 drawn from a Zipf-like popularity
(log-quantized, as a popularity bias would be) with weight B = 4.  Results are checked against faiss:
the sorted top-k distances must agree (ties may pick different items).

    pip install 'fedrec[bench]'
    python benchmarks/bench_topk.py                      # 10^5, 10^6, 10^7 items, f = 64
    python benchmarks/bench_topk.py --sizes 1000000 --repeat 20 --batch 100
    python benchmarks/bench_topk.py --sizes 100000 1000000 --planes 1 2 3   # asymmetric (bit-plane) top-10
    python benchmarks/bench_topk.py --sizes 100000 1000000 --planes 3 2 --plane-batches 1 10 100

With ``--planes``, it times instead the top-10 of one user held as P bit-planes (asymmetric scoring,
`device_sdk.topk.plane_scores`) with the item term: the generic path (every item's integer score,
then `device_sdk.retrieval.top_n_scores`, what `LightFRModel.recommend` used before) against the
counting selection `HammingIndex.search_planes`; both must return the same scores.  With
``--plane-batches`` too, n such users per call: `HammingIndex.search_planes_batch` against a loop of
`search_planes` (they must return the same items and scores), beside the Hamming scan of n ±1 codes.

Threads: BLAS, OpenMP and faiss are pinned to one thread before numpy is imported, and times are the
CPU seconds of the calling thread (`time.thread_time`), so that other processes on a shared machine
are not counted; the methods take turns in short bursts (see `_timed`), so that a load that changes
during the run weighs on all of them; the load average is printed beside the table.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import itertools  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from numpy.typing import NDArray  # noqa: E402

from device_sdk import lightfr  # noqa: E402
from device_sdk.codes import pack_signs  # noqa: E402
from device_sdk.retrieval import top_n_scores  # noqa: E402
from device_sdk.topk import HammingIndex, plane_scores  # noqa: E402


def _timed(fns: list[Callable[[], Any]], repeat: int, budget: float, interleave: bool) -> list[float]:
    """Median CPU seconds per call of each function after one warm-up call.

    By default the functions take turns in bursts of three back-to-back calls (warm caches, the usual
    protocol), each burst after one untimed call when calls are short (< 50 ms) so that the caches the
    other functions used are warm again: a load that changes during the run then weighs on every
    function alike.  With ``interleave`` they take turns call by call, with caches the others have used.
    Each function stops at ``repeat`` timed calls, or after at least 3 once it has spent ``budget``
    CPU seconds.
    """
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    spent = [0.0] * len(fns)
    burst = 1 if interleave else 3

    def wanted(i: int) -> bool:
        return len(times[i]) < repeat and (len(times[i]) < 3 or spent[i] < budget)

    while any(wanted(i) for i in range(len(fns))):
        for i, fn in enumerate(fns):
            if not wanted(i):
                continue
            if not interleave and times[i] and times[i][-1] < 0.05:
                fn()  # caches back after the other functions' turns
            for _ in range(burst):
                t = time.thread_time()
                fn()
                dt = time.thread_time() - t
                times[i].append(dt)
                spent[i] += dt
                if not wanted(i):
                    break
    return [float(np.median(ts)) for ts in times]


def _rotating(search: Callable[..., Any], queries: Any, *args: Any, **kwargs: Any) -> Callable[[], Any]:
    """A call of search(queries[i : i + 1], *args, **kwargs) for i = 0, 1, ..., n − 1, 0, ... in turn."""
    turn = itertools.count()

    def call() -> Any:
        i = next(turn) % len(queries)
        return search(queries[i : i + 1], *args, **kwargs)

    return call


def clustered_codes(
    m: int, n: int, f: int, rank: int, noise: float, rng: np.random.Generator
) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    """(w, m) item and (n, w) user codes, the signs of z·Wᵀ + noise·√rank·e for one shared W (f, rank)
    and z, e standard normal per item and user: bits correlated along a few directions, so that codes
    crowd in clusters and a user's nearest items are nearer than in random codes."""
    W = rng.standard_normal((f, rank))
    out = []
    for count in (m, n):
        bits = np.empty((count, f), np.int8)
        for s in range(0, count, 1 << 16):  # in chunks: a few MiB of floats at a time
            e = min(count, s + (1 << 16))
            x = rng.standard_normal((e - s, rank)) @ W.T + noise * np.sqrt(rank) * rng.standard_normal((e - s, f))
            bits[s:e] = np.where(x > 0, 1, -1)
        out.append(pack_signs(bits))
    return out[0], np.ascontiguousarray(out[1].T)


def float_topk(V: NDArray[np.float32], U: NDArray[np.float32], k: int) -> NDArray[np.int64]:
    """Top-k of U @ Vᵀ per user (argpartition + sort of the k), users in chunks of 8."""
    out = np.empty((U.shape[0], k), np.int64)
    for s in range(0, U.shape[0], 8):
        S = U[s : s + 8] @ V.T
        top = np.argpartition(S, -k, axis=1)[:, -k:]
        order = np.argsort(-np.take_along_axis(S, top, axis=1), axis=1)
        out[s : s + 8] = np.take_along_axis(top, order, axis=1)
    return out


def zipf_levels(m: int, n_levels: int, rng: np.random.Generator) -> NDArray[np.uint8]:
    """Levels 0..n_levels−1 from log-quantized Zipf(1) popularity, in random item order."""
    pop = 1.0 / np.arange(1, m + 1)
    logp = np.log(pop)
    lv = np.floor((logp - logp.min()) / (logp.max() - logp.min() + 1e-12) * n_levels).clip(0, n_levels - 1)
    return rng.permutation(lv.astype(np.uint8))


def main() -> None:
    import faiss  # benchmark-only dependency: pip install 'fedrec[bench]'

    faiss.omp_set_num_threads(1)
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10**5, 10**6, 10**7])
    p.add_argument("--bits", type=int, default=64)
    p.add_argument("--batch", type=int, default=100, help="users per call in the batched runs")
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--budget", type=float, default=10.0, help="CPU seconds per method before fewer repeats")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--levels", type=int, default=16)
    p.add_argument("--weight", type=int, default=4)
    p.add_argument("--block-pairs", type=int, default=None, help="HammingIndex.search block size (default: its own)")
    p.add_argument("--interleave", action="store_true", help="methods take turns (cold caches) instead of back to back")
    p.add_argument(
        "--codes",
        choices=["random", "clustered"],
        default="random",
        help="item and user codes: uniform random bits, or signs of a low-rank Gaussian model (correlated bits "
        "in clusters, like trained codes; see --rank and --noise)",
    )
    p.add_argument("--rank", type=int, default=8, help="--codes clustered: rank of the Gaussian model")
    p.add_argument("--noise", type=float, default=0.5, help="--codes clustered: noise beside the low-rank part")
    p.add_argument(
        "--rotate-users",
        action="store_true",
        help="one-user calls take the next of the --batch users each time (all methods alike), so that no call "
        "finds the previous call's data in cache; by default every call ranks the same user",
    )
    p.add_argument("--batch-only", action="store_true")
    p.add_argument("--single-only", action="store_true")
    p.add_argument("--planes", type=int, nargs="+", default=None, help="time bit-plane (asymmetric) top-k for these P")
    p.add_argument(
        "--plane-batches",
        type=int,
        nargs="+",
        default=None,
        help="with --planes: time search_planes_batch against a loop of search_planes for these users per call",
    )
    args = p.parse_args()
    if args.planes and args.plane_batches:
        plane_batches_main(args)
        return
    if args.planes:
        planes_main(args)
        return
    rng = np.random.default_rng(0)
    f, k = args.bits, args.k
    w = (f + 63) // 64
    mode = " (interleaved)" if args.interleave else ""
    print(f"top-{k}, f = {f}, one core, median of up to {args.repeat} runs{mode}; load average {os.getloadavg()}")
    print(f"{'items':>9} {'users/call':>10} {'method':<26} {'CPU ms':>9} {'G items/s':>9} {'vs faiss':>8}")
    print(f"codes: {args.codes}" + (f" (rank {args.rank}, noise {args.noise})" if args.codes == "clustered" else ""))
    for m in args.sizes:
        if args.codes == "clustered":
            words, users = clustered_codes(m, args.batch, f, args.rank, args.noise, rng)
        else:
            words = rng.integers(0, 2**64, size=(w, m), dtype=np.uint64, endpoint=False)
            users = rng.integers(0, 2**64, size=(args.batch, w), dtype=np.uint64, endpoint=False)
        if f % 64:
            words[-1] &= np.uint64((1 << (f % 64)) - 1)
            users[:, -1] &= np.uint64((1 << (f % 64)) - 1)
        levels = zipf_levels(m, args.levels, rng)
        plain = HammingIndex(words, f)
        termed = HammingIndex(words, f, levels, args.weight)
        index = faiss.IndexBinaryFlat(f)
        index.add(np.ascontiguousarray(words.T).view(np.uint8).reshape(m, -1)[:, : (f + 7) // 8])
        q = np.ascontiguousarray(users).view(np.uint8).reshape(args.batch, -1)[:, : (f + 7) // 8]
        V = rng.standard_normal((m, 32), dtype=np.float32)
        U = rng.standard_normal((args.batch, 32), dtype=np.float32)
        # Same codes, same answer: the sorted top-k distances agree with faiss for every user.
        fd, _ = index.search(q, k)
        _, sc = plain.search(users, k, rng)
        if not np.array_equal(np.sort(fd, axis=1), np.sort(f - sc, axis=1)):
            raise SystemExit("fedrec and faiss disagree on the top-k distances")
        blk = {} if args.block_pairs is None else {"block_pairs": args.block_pairs}
        batches = [1] if args.single_only else [args.batch] if args.batch_only else [1, args.batch]
        for n_users in batches:
            uu, qq, UU = users[:n_users], q[:n_users], U[:n_users]
            runs: list[tuple[str, Callable[[], Any]]] = [
                ("faiss IndexBinaryFlat", partial(index.search, qq, k)),
                ("fedrec hamming", partial(plain.search, uu, k, rng, **blk)),
                (f"fedrec + item term (B={args.weight})", partial(termed.search, uu, k, rng, **blk)),
                ("float32 d=32 inner prod", partial(float_topk, V, UU, k)),
            ]
            if n_users == 1 and args.rotate_users:
                runs = [
                    ("faiss IndexBinaryFlat", _rotating(index.search, q, k)),
                    ("fedrec hamming", _rotating(plain.search, users, k, rng, **blk)),
                    (f"fedrec + item term (B={args.weight})", _rotating(termed.search, users, k, rng, **blk)),
                    ("float32 d=32 inner prod", _rotating(partial(float_topk, V), U, k)),
                ]
            seconds = _timed([fn for _, fn in runs], args.repeat, args.budget, args.interleave)
            for (name, _), t in zip(runs, seconds, strict=True):
                print(
                    f"{m:>9} {n_users:>10} {name:<26} {t * 1e3:>9.3f} {m * n_users / t / 1e9:>9.3f} "
                    f"{seconds[0] / t:>7.2f}x",
                    flush=True,
                )


def generic_planes(
    planes: NDArray[np.uint64], words: NDArray[np.uint64], f: int, a: int, levels: NDArray[np.uint8], k: int, rng: Any
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """The generic path: every item's plane score, then the vectorised real-valued top-N."""
    S = plane_scores(planes, words, f, a, levels, lightfr.LEVEL_SHIFT)
    return top_n_scores(S[None, :].astype(np.float64), k, exclude=[None], items=None, rng=rng)


def planes_main(args: argparse.Namespace) -> None:
    """One user as P bit-planes against the codes and a Zipf item term: generic vs counting top-k."""
    rng = np.random.default_rng(0)
    f, k = args.bits, args.k
    w = (f + 63) // 64
    print(f"bit-plane top-{k}, f = {f}, item term (B = {args.weight}), one user per call, one core, median of up to ")
    print(f"{args.repeat} runs; load average {os.getloadavg()}")
    print(f"{'items':>9} {'P':>2} {'a':>5} {'method':<30} {'CPU ms':>9} {'G items/s':>9} {'speed-up':>8}")
    for m in args.sizes:
        words = rng.integers(0, 2**64, size=(w, m), dtype=np.uint64, endpoint=False)
        if f % 64:
            words[-1] &= np.uint64((1 << (f % 64)) - 1)
        levels = zipf_levels(m, args.levels, rng)
        index = HammingIndex(words, f, levels, args.weight)
        for P in args.planes:
            # A user vector as a device would hold it: P planes of odd integers and an integer weight a.
            q, scale = lightfr.quantize_planes(rng.normal(0.0, 0.1, (1, f)), P)
            a = int(lightfr.snap_scale(scale, args.weight)[0][0])
            codes = lightfr.sign_planes(q, P)[:, 0, :]
            planes = np.zeros((P, w), np.uint64)
            for j in range(w):
                bits = (codes[:, j * 64 : (j + 1) * 64] > 0).astype(np.uint64)
                planes[:, j] = (bits << np.arange(bits.shape[1], dtype=np.uint64)).sum(axis=1, dtype=np.uint64)
            _, want = generic_planes(planes, words, f, a, levels, k, rng)
            _, got = index.search_planes(planes, a, k, rng, level_shift=lightfr.LEVEL_SHIFT)
            if not np.array_equal(want[0].astype(np.int64), got):
                raise SystemExit("generic and counting plane top-k disagree on the scores")
            runs: list[tuple[str, Callable[[], Any]]] = [
                ("plane_scores + top_n_scores", partial(generic_planes, planes, words, f, a, levels, k, rng)),
                ("search_planes (counting)", partial(index.search_planes, planes, a, k, rng)),
            ]
            seconds = _timed([fn for _, fn in runs], args.repeat, args.budget, args.interleave)
            for (name, _), t in zip(runs, seconds, strict=True):
                print(
                    f"{m:>9} {P:>2} {a:>5} {name:<30} {t * 1e3:>9.3f} {m / t / 1e9:>9.3f} {seconds[0] / t:>7.2f}x",
                    flush=True,
                )


def _user_planes(rng: np.random.Generator, n: int, f: int, P: int, weight: int) -> tuple[NDArray[np.uint64], Any]:
    """n user vectors as a device holds them: (n, P, w) packed planes and their integer weights a."""
    q, scale = lightfr.quantize_planes(rng.normal(0.0, 0.1, (n, f)), P)
    a = lightfr.snap_scale(scale, weight)[0].astype(np.int64)
    signs = np.swapaxes(lightfr.sign_planes(q, P), 0, 1).reshape(-1, f)
    return np.ascontiguousarray(pack_signs(signs).T).reshape(n, P, -1), a


def _plane_loop(index: HammingIndex, planes: NDArray[np.uint64], a: Any, k: int, rng: Any) -> list[Any]:
    return [index.search_planes(planes[u], int(a[u]), k, rng) for u in range(planes.shape[0])]


def plane_batches_main(args: argparse.Namespace) -> None:
    """n users as P bit-planes per call: a loop of single-user searches (the substring tables where they
    apply, f = 64 and >= 786,432 items), the same loop on an index without tables (the scan), one
    batched call, and the Hamming search and faiss IndexBinaryFlat for n ±1 codes (the users' top
    planes) for scale.  With --rotate-users, one-user calls take the next of --batch users each time."""
    import faiss

    rng = np.random.default_rng(0)
    f, k = args.bits, args.k
    print(f"bit-plane top-{k}, f = {f}, item term (B = {args.weight}), one core, median of up to {args.repeat} runs;")
    print(f"load average {os.getloadavg()}" + ("; one-user calls rotate users" if args.rotate_users else ""))
    print(f"{'items':>9} {'P':>2} {'users':>5} {'method':<30} {'CPU ms':>9} {'G pairs/s':>9} {'vs faiss':>8}")
    for m in args.sizes:
        words = rng.integers(0, 2**64, size=((f + 63) // 64, m), dtype=np.uint64, endpoint=False)
        if f % 64:
            words[-1] &= np.uint64((1 << (f % 64)) - 1)
        levels = zipf_levels(m, args.levels, rng)
        index = HammingIndex(words, f, levels, args.weight)
        scan = HammingIndex(words, f, levels, args.weight, substring_index=False)
        flat = faiss.IndexBinaryFlat(f)
        flat.add(np.ascontiguousarray(words.T).view(np.uint8).reshape(m, -1)[:, : (f + 7) // 8])
        for P in args.planes:
            for n in args.plane_batches:
                pool = max(n, args.batch) if n == 1 and args.rotate_users else n
                planes, a = _user_planes(rng, pool, f, P, args.weight)
                ids, scores = index.search_planes_batch(planes, a, k, None)
                for u, (one_ids, one_scores) in enumerate(_plane_loop(index, planes, a, k, None)):
                    if not (np.array_equal(ids[u], one_ids) and np.array_equal(scores[u], one_scores)):
                        raise SystemExit("batched and per-user plane top-k disagree")
                for u, (one_ids, one_scores) in enumerate(_plane_loop(scan, planes, a, k, None)):
                    if not (np.array_equal(ids[u], one_ids) and np.array_equal(scores[u], one_scores)):
                        raise SystemExit("the plane search with and without substring tables disagree")
                codes = planes[:, -1, :].copy()  # ±1 codes of the same users: the Hamming search beside them
                q = np.ascontiguousarray(codes).view(np.uint8).reshape(pool, -1)[:, : (f + 7) // 8]
                runs: list[tuple[str, Callable[[], Any]]] = [
                    ("faiss IndexBinaryFlat (±1)", partial(flat.search, q, k)),
                    ("search_planes per user", partial(_plane_loop, index, planes, a, k, rng)),
                    ("search_planes, no tables", partial(_plane_loop, scan, planes, a, k, rng)),
                    ("search_planes_batch", partial(index.search_planes_batch, planes, a, k, rng)),
                    ("hamming search (±1 codes)", partial(index.search, codes, k, rng)),
                ]
                if pool > n:
                    runs = [
                        ("faiss IndexBinaryFlat (±1)", _rotating(flat.search, q, k)),
                        ("search_planes per user", _rotating_planes(partial(_plane_loop, index), planes, a, k, rng)),
                        ("search_planes, no tables", _rotating_planes(partial(_plane_loop, scan), planes, a, k, rng)),
                        ("search_planes_batch", _rotating_planes(index.search_planes_batch, planes, a, k, rng)),
                        ("hamming search (±1 codes)", _rotating(index.search, codes, k, rng)),
                    ]
                seconds = _timed([fn for _, fn in runs], args.repeat, args.budget, args.interleave)
                for (name, _), t in zip(runs, seconds, strict=True):
                    print(
                        f"{m:>9} {P:>2} {n:>5} {name:<30} {t * 1e3:>9.3f} {m * n / t / 1e9:>9.3f} "
                        f"{seconds[0] / t:>7.2f}x",
                        flush=True,
                    )


def _rotating_planes(
    search: Callable[..., Any], planes: NDArray[np.uint64], a: Any, k: int, rng: Any
) -> Callable[[], Any]:
    """`_rotating` for plane users: user i's planes and weight a_i, i = 0, 1, ..., n − 1, 0, ... in turn."""
    turn = itertools.count()

    def call() -> Any:
        i = next(turn) % len(planes)
        return search(planes[i : i + 1], a[i : i + 1], k, rng)

    return call


if __name__ == "__main__":
    main()
