"""SecAgg+ in-process benchmark (docs/design.md §9): server unmask time, device crypto time, upload, memory.

Example::

    python benchmarks/bench_secagg.py --n 100 1000 --length 100000 --drop 0.1 0.3 --late-drop 0.05
    python benchmarks/bench_secagg.py --n 1000 --drop 0.3 --signed   # with signatures and the extra round
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the harness lives in the test suite

from protocol import identity  # noqa: E402
from protocol.graph import find_parameters  # noqa: E402
from protocol.session import Phase  # noqa: E402
from tests.support.secagg_harness import run_secagg_round  # noqa: E402


def _run(
    n: int,
    length: int,
    drop: float,
    late: float,
    seed: int,
    adversary: float,
    omega: float,
    trace: bool,
    signed: bool = False,
    clock: str = "wall",
) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    n_drop = int(round(drop * n))
    n_late = int(round(late * n))
    schedule = {
        Phase.MASKED_INPUT: set(order[:n_drop].tolist()),
        Phase.UNMASK: set(order[n_drop : n_drop + n_late].tolist()),
    }
    base = rng.integers(0, 2**32, size=length, dtype=np.uint32)

    def make_input(i: int) -> np.ndarray:
        # Distinct cheap inputs: a shared random vector rotated by the device index.
        return np.roll(base, i)

    if trace:
        tracemalloc.start()
    result = run_secagg_round(
        make_input,
        n=n,
        dropouts=schedule,
        dropout_rate=omega,
        adversary_rate=adversary,
        seed=seed,
        # "cpu": this process's CPU time (the run is single-threaded), which a shared, loaded machine
        # does not inflate the way it inflates wall-clock time
        clock=time.process_time if clock == "cpu" else time.perf_counter,
        signed=signed,
    )
    peak = tracemalloc.get_traced_memory()[1] if trace else 0
    if trace:
        tracemalloc.stop()
    if result.error is not None or result.total is None:
        raise SystemExit(f"round failed: {result.error}")
    if not np.array_equal(result.total, result.expected):
        raise SystemExit("secure sum does not match the plaintext sum")
    active = [s for u, s in result.device_seconds.items() if u not in schedule[Phase.MASKED_INPUT]]
    masked_bytes = result.upload_bytes["MaskedInput"] / max(1, len(result.survivors))
    total_up = sum(result.upload_bytes.values()) / max(1, len(active))
    total_down = sum(result.download_bytes.values()) / max(1, len(active))
    return {
        "n": n,
        "k": result.params.k,
        "t": result.params.t,
        "L": length,
        "drop": drop,
        "late": late,
        "server_s": result.server_unmask_seconds,
        "dev_mean_s": float(np.mean(active)),
        "dev_max_s": float(np.max(active)),
        "B/elem_masked": masked_bytes / length,
        "B/elem_all": total_up / length,
        "kB_down/dev": total_down / 1000,
        "peak_MB": peak / 2**20,
    }


class _NoMemo(set[bytes]):
    """A memo that never hits: every simulated device pays for every verification, as a real one does."""

    def __contains__(self, item: object) -> bool:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--length", type=int, default=100_000, help="L, ring elements per vector")
    parser.add_argument("--drop", type=float, nargs="+", default=[0.1, 0.3], help="dropout before masked input")
    parser.add_argument("--late-drop", type=float, default=0.05, help="dropout after masked input")
    parser.add_argument("--adversary", type=float, default=0.05, help="gamma for the parameter finder")
    parser.add_argument("--omega", type=float, default=0.33, help="omega for the parameter finder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tracemalloc", action="store_true", help="peak Python heap (slows the run)")
    parser.add_argument(
        "--signed",
        action="store_true",
        help="protocol 1.3: enrolled Ed25519 identities, signed keys and the consistency check (extra round)",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time the server and devices by wall clock or by this process's CPU time (for loaded machines)",
    )
    parser.add_argument(
        "--shared-verify-memo",
        action="store_true",
        help="let the simulated devices share protocol.identity's per-process memo of verified signatures "
        "(off by default: a real device runs in its own process and verifies every signature itself)",
    )
    args = parser.parse_args(argv)
    if not args.shared_verify_memo:
        identity._VERIFIED = _NoMemo()
    for n in args.n:
        p = find_parameters(n, args.omega, args.adversary)
        print(f"finder: n={n} gamma={args.adversary} omega={args.omega} -> k={p.k} t={p.t}", flush=True)
    header = (
        "n",
        "k",
        "t",
        "L",
        "drop",
        "late",
        "server_s",
        "dev_mean_s",
        "dev_max_s",
        "B/elem_masked",
        "B/elem_all",
        "kB_down/dev",
        "peak_MB",
    )
    rows = []
    for n in args.n:
        for drop in args.drop:
            rows.append(
                _run(
                    n,
                    args.length,
                    drop,
                    args.late_drop,
                    args.seed,
                    args.adversary,
                    args.omega,
                    args.tracemalloc,
                    args.signed,
                    args.clock,
                )
            )
            print("done", {h: rows[-1][h] for h in ("n", "drop", "server_s")}, flush=True)
    print()
    print(" | ".join(f"{h:>13}" for h in header))
    for row in rows:
        cells = [f"{row[h]:>13.3f}" if isinstance(row[h], float) else f"{row[h]:>13}" for h in header]
        print(" | ".join(cells))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\nmax RSS of the whole process (all n devices simulated in one process): {rss:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
