"""Thread limits of a simulation process."""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["one_blas_thread"]


def one_blas_thread() -> contextlib.AbstractContextManager[Any]:
    """Limit BLAS to one thread while simulating (``threadpoolctl`` when installed, the ``sim``, ``bench``
    and ``dev`` extras): the kernels call BLAS on small blocks, and a threaded BLAS on a busy machine
    spends more time waking threads than computing (measured: 48 s vs 7.8 s for one round of 10,000
    amazon-book devices on the shared 2-core machine).  Worse when several Python threads call BLAS at
    once, as a fleet's devices training in worker threads do (`fedsim.fleets.local`): the BLAS dot product of one
    237,184-value update took 3.9-8.5 ms per call with 6 threads calling it at once, 0.06-0.16 ms with one
    BLAS thread (`benchmarks/bench_blas_threads.py`, shared 2-core machine, load 10-20), and clipping the
    update (``np.linalg.norm``) was 70% of a 1,000-device fleet's CPU profile before the limit."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - optional
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")
