"""SecAgg+ communication graph (Bell et al. 2020) and its (k, t) parameter finder.

Invariants of this module:

* ``k`` always counts the device itself (the self-edge convention of Bell et al. and FCP): a device
  Shamir-shares its secrets into exactly ``min(k, n)`` shares, one of which it holds itself.
* A sparse graph (``k < n``) always has odd ``k``: self plus ``(k - 1) / 2`` ring neighbours on each
  side.  ``k == n`` means the complete graph (plain SecAgg).
* Parameters returned by `find_parameters` always pass `validate_parameters`.
* Probabilities are exact hypergeometric tails summed in log space; nothing is a Chernoff bound.
* No global randomness: the graph's permutation comes from the generator passed in.

The parameter search (Bell et al. 2020, §3 and Appendix; the same formulation as Google FCP's
``graph_parameter_finder``).  Let ``d = k - 1`` be the number of neighbours other than the device,
``A = floor(gamma * n)`` the adversary's devices, ``D = floor(omega * n)`` the dropouts and
``S = n - D`` the guaranteed survivors.  A neighbourhood is modelled as ``d`` devices drawn without
replacement from the ``n`` (the random permutation makes this exact up to the self-exclusion, which
FCP also ignores), so the number of adversarial neighbours is Hypergeom(n, A, d) and the number of
surviving neighbours Hypergeom(n, S, d).  The 40-bit security budget is split evenly over two bad events
(2^-41 each) and both per-device events are union-bounded over the n devices:

1. *disconnection*: removing the A + D bad devices disconnects the ring-Harary graph only if two
   disjoint runs of d/2 consecutive ring positions are all bad; at most n (n - d - 1) / 2 pairs of
   runs, each all-bad with probability (A+D)! (n-d)! / (n! (A+D-d)!), must total < 2^-41;
2. *privacy*: t is the smallest threshold with P[Hypergeom(n, A, d) >= t] < 2^-41 / n, so with
   probability > 1 - 2^-41 no honest device has t adversarial share holders;
3. *correctness*: P[Hypergeom(n, S, d) <= t - 1] < 2^-20 / n, so with probability > 1 - 2^-20 every
   neighbourhood keeps at least t live share holders.

4. *placement* (protocol 1.9): t >= ⌊γ n⌋ + 2, `placement_floor`.  The server places the
   neighbourhoods, so conditions 1 and 2 (random placement) do not bind it: it can put all A colluders
   around one device X and, by reporting X's honest neighbours as dropped (their pairwise masks are then
   reconstructed), leave X's self-mask seed with A colluder shares plus X's own (an honest survivor
   releases its own b-share).  t >= A + 2 forces every reconstructable self mask to rest on a share of at
   least one other honest survivor, which is then in X's component: the server learns sums over at least
   t - A honest survivors (2 at the floor), never one device's input, wherever it places anyone.

5. *survivor cut* (protocol 1.11, signed rounds): the graph is the ring over the signed roster
   (`roster_ring`), so every device can recompute it, and before it releases anything a device checks that
   the signed survivor set puts more than A survivors in every two disjoint runs of d/2 ring positions
   (`survivor_cut`).  Honest survivors then form one connected mask graph even after the A colluders leave
   it: two runs with no honest survivor are what separating the ring takes, since an edge spans at most
   d/2 positions.  So the server learns only the sum over all honest survivors, whichever honest devices it
   reports as dropped, and wherever it put anyone.  Under random dropouts the check fails when two runs
   together lose d - A of their d positions: at most n (n - d - 1) / 2 pairs, each with probability
   P[Hypergeom(n, D, d) >= d - A], must total < 2^-20 (a second correctness event beside 3).

The smallest even ``d`` (from 2 up to n - 2) meeting all five gives ``k = d + 1`` and ``t`` (at least 2,
since one share must not reveal the secret).  If none exists the graph is complete: ``k = n`` and
``t = S`` (the guaranteed survivors), which is deterministic-safe iff ``S > A``.  This reproduces the
FCP test table: its "degree" column is ``d`` (FCP adds the self-edge afterwards), so FCP's
n=100, gamma=5%, omega=33% row "28, 6" is ``GraphParams(k=29, t=6)`` here, with the placement rule off
(``adversarial_placement=False``, the semi-honest setting of Bell et al. and FCP, which also drops
condition 5); with it (the default, and the only setting the server uses) n = 100 moves to k = 29, t = 7
and n = 1,000 from k = 73, t = 24 to k = 131, t = 52 (k = 123 before condition 5).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from protocol.errors import ConfigError
from protocol.noise import exact_rate

__all__ = [
    "SECURITY_BITS",
    "CORRECTNESS_BITS",
    "GraphParams",
    "find_parameters",
    "placement_floor",
    "validate_parameters",
    "harary_graph",
    "roster_ring",
    "ring_graph",
    "ring_neighbourhood",
    "survivor_cut",
]

SECURITY_BITS = 40
"""Statistical security: an adversary learns an honest input with probability < 2^-40."""

CORRECTNESS_BITS = 20
"""A round fails to reconstruct (under the assumed dropout rate) with probability < 2^-20."""

_LN2 = math.log(2.0)
# Each of the two bad events (disconnection, t adversarial share holders) gets half the budget.
_LOG_SECURITY_PER_EVENT = -(SECURITY_BITS + 1) * _LN2
_LOG_CORRECTNESS = -CORRECTNESS_BITS * _LN2


@dataclass(frozen=True, slots=True)
class GraphParams:
    """Neighbourhood size and Shamir threshold of a SecAgg+ round.

    Attributes
    ----------
    k : int
        Neighbourhood size INCLUDING the device itself; ``k == n`` means the complete graph.
    t : int
        Shamir threshold: shares needed to reconstruct a device's secrets (2 <= t <= k).
    """

    k: int
    t: int

    @property
    def degree(self) -> int:
        """Number of neighbours other than the device itself (``k - 1``; FCP's "degree")."""
        return self.k - 1


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 2:
        raise ConfigError(f"cohort size n must be an integer >= 2 for secure aggregation, got {n!r}")


def _counts(n: int, dropout_rate: float, adversary_rate: float) -> tuple[int, int, int]:
    """Return (A, D, S): adversarial devices, dropouts, guaranteed survivors, in exact arithmetic."""
    omega = exact_rate(dropout_rate, "dropout_rate")
    gamma = exact_rate(adversary_rate, "adversary_rate")
    adversaries = math.floor(gamma * n)
    dropouts = math.floor(omega * n)
    return adversaries, dropouts, n - dropouts


def _log_prob_disconnected(n: int, d: int, bad: int) -> float:
    """Log union bound on the ring-Harary graph (d ring neighbours) being cut by ``bad`` removals."""
    if d > bad:
        return -math.inf
    log_pairs = math.log(n) + math.log(n - d - 1) - _LN2
    log_all_bad = math.lgamma(bad + 1) + math.lgamma(n - d + 1) - math.lgamma(n + 1) - math.lgamma(bad - d + 1)
    return float(log_pairs + log_all_bad)


@functools.lru_cache(maxsize=8)
def _log_factorials(n: int) -> np.ndarray:
    """``out[i] = log(i!)`` for i = 0..n, each from `math.lgamma` (no summed rounding error)."""
    out = np.array([math.lgamma(i + 1.0) for i in range(n + 1)], dtype=np.float64)
    out.setflags(write=False)
    return out


def _log_pmf(n: int, marked: int, d: int) -> np.ndarray:
    """``out[x] = log P[Hypergeom(n, marked, d) == x]`` for x = 0..d; -inf outside the support.

    C(marked, x) C(n - marked, d - x) / C(n, d) from exact log-factorials (scipy stays off the device:
    this module is on its import path through the session).
    """
    lf = _log_factorials(n)
    x = np.arange(d + 1)
    ok = (x <= marked) & (d - x <= n - marked)
    xs, ys = x[ok], d - x[ok]
    out = np.full(d + 1, -np.inf)
    out[ok] = (lf[marked] - lf[xs] - lf[marked - xs] + lf[n - marked] - lf[ys] - lf[n - marked - ys]) - (
        lf[n] - lf[d] - lf[n - d]
    )
    return out


def _log_sf(n: int, marked: int, d: int) -> np.ndarray:
    """``out[a] = log P[Hypergeom(n, marked, d) >= a]`` for a = 0..d (exact, log space)."""
    return np.logaddexp.accumulate(_log_pmf(n, marked, d)[::-1])[::-1]


def _log_cdf(n: int, marked: int, d: int) -> np.ndarray:
    """``out[x] = log P[Hypergeom(n, marked, d) <= x]`` for x = 0..d (exact, log space)."""
    return np.logaddexp.accumulate(_log_pmf(n, marked, d))


def placement_floor(n: int, adversary_rate: float) -> int:
    """The least t of a sparse round (k < n) that holds wherever the server places the neighbourhoods.

    ⌊γ n⌋ + 2 (module docstring, condition 4): ⌊γ n⌋ colluders around a device plus the device's own share
    stay below t, so its self mask is never reconstructed without a share of another honest survivor.

    Raises
    ------
    ConfigError
        n or the rate is invalid.
    """
    _check_n(n)
    return math.floor(exact_rate(adversary_rate, "adversary_rate") * int(n)) + 2


def _log_prob_cut_refused(n: int, d: int, adversaries: int, dropouts: int) -> float:
    """Log union bound on condition 5 failing an honest round: two disjoint runs of d/2 ring positions keep at
    most ``adversaries`` survivors when ``dropouts`` devices drop at random."""
    need = d - adversaries  # dropouts among the 2 · d/2 positions that leave at most A survivors there
    if need <= 0:
        return 0.0
    if need > min(d, dropouts):
        return -math.inf
    log_pairs = math.log(n) + math.log(max(n - d - 1, 1)) - _LN2
    return float(log_pairs + _log_sf(n, dropouts, d)[need])


def _sparse_threshold(
    n: int, d: int, adversaries: int, survivors: int, dropouts: int, floor: int = 2, *, cut: bool = False
) -> int | None:
    """Return t for ``d`` ring neighbours if the conditions (module docstring) hold, else None; ``floor`` is
    the least t (condition 4, or 2 without it); ``cut``: condition 5 too."""
    if _log_prob_disconnected(n, d, adversaries + dropouts) >= _LOG_SECURITY_PER_EVENT:
        return None
    if cut and _log_prob_cut_refused(n, d, adversaries, dropouts) >= _LOG_CORRECTNESS:
        return None
    log_sec = _LOG_SECURITY_PER_EVENT - math.log(n)
    ok = np.nonzero(_log_sf(n, adversaries, d) < log_sec)[0]
    if ok.size == 0:
        return None
    t = max(int(ok[0]), floor)
    if t > d:
        return None
    if _log_cdf(n, survivors, d)[t - 1] >= _LOG_CORRECTNESS - math.log(n):
        return None
    return t


def find_parameters(
    n: int, dropout_rate: float, adversary_rate: float, *, adversarial_placement: bool = True
) -> GraphParams:
    """Find the smallest SecAgg+ neighbourhood ``k`` and its threshold ``t``.

    Parameters
    ----------
    n : int
        Cohort size (devices that advertised keys), n >= 2.
    dropout_rate : float
        omega in [0, 1): the largest fraction of the cohort that may drop out.
    adversary_rate : float
        gamma in [0, 1): the fraction of devices the adversary may control (colluding with the server).
    adversarial_placement : bool
        True (the default; the server never passes False): a sparse t is at least `placement_floor`, so
        (k, t) hold against a server that places the neighbourhoods, and k passes condition 5 (an honest
        round's survivor cut check).  False gives the semi-honest figures of Bell et al. 2020 and FCP
        (random placement), for comparison only.

    Returns
    -------
    GraphParams
        ``k`` includes the device itself and is odd, or ``k == n`` (complete graph, ``t`` = the
        guaranteed survivors).  Failure probability < 2^-20, security 40 bits (module docstring).

    Raises
    ------
    ConfigError
        If n or a rate is invalid, or no (k, t) is safe (too many adversaries plus dropouts for n).
    """
    _check_n(n)
    n = int(n)
    adversaries, dropouts, survivors = _counts(n, dropout_rate, adversary_rate)
    floor = adversaries + 2 if adversarial_placement else 2
    for d in range(max(2, floor + floor % 2), n - 1, 2):  # d >= t >= floor
        t = _sparse_threshold(n, d, adversaries, survivors, dropouts, floor, cut=adversarial_placement)
        if t is not None:
            return GraphParams(k=d + 1, t=t)
    params = GraphParams(k=n, t=max(survivors, 2))
    validate_parameters(n, params.k, params.t, dropout_rate, adversary_rate)
    return params


def validate_parameters(
    n: int, k: int, t: int, dropout_rate: float, adversary_rate: float, *, adversarial_placement: bool = True
) -> None:
    """Refuse an unsafe or impossible SecAgg+ configuration.

    Parameters
    ----------
    n : int
        Cohort size, n >= 2.
    k : int
        Neighbourhood size including the device itself; odd if ``k < n``; ``k == n`` is complete.
    t : int
        Shamir threshold, 2 <= t <= k.
    dropout_rate : float
        omega in [0, 1).
    adversary_rate : float
        gamma in [0, 1).
    adversarial_placement : bool
        True (the default): a sparse t below `placement_floor` is refused.  False checks the random-placement
        (semi-honest) conditions only.

    Raises
    ------
    ConfigError
        Naming the offending value: rates outside [0, 1); k outside [2, n] or even for a sparse
        graph; t outside [2, k]; t reachable by the adversary (complete graph: t <= floor(gamma*n);
        sparse: t < floor(gamma*n) + 2 with ``adversarial_placement``, or probability >= 2^-41/n per
        device); t not reachable by the survivors (complete graph:
        t > n - floor(omega*n); sparse: probability >= 2^-20/n per device); or a graph that the bad
        devices disconnect with probability >= 2^-41.
    """
    _check_n(n)
    adversaries, dropouts, survivors = _counts(int(n), dropout_rate, adversary_rate)
    for name, value in (("k", k), ("t", t)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
    n, k, t = int(n), int(k), int(t)
    if not 2 <= k <= n:
        raise ConfigError(f"neighbourhood size k={k} must be in [2, n={n}] (k counts the device itself)")
    if not 2 <= t <= k:
        raise ConfigError(f"threshold t={t} must be in [2, k={k}]")
    if k == n:
        if t <= adversaries:
            raise ConfigError(
                f"threshold t={t} is unsafe: an adversary controlling adversary_rate={adversary_rate} "
                f"of n={n} devices ({adversaries} devices) could collect t shares; need t > {adversaries}"
            )
        if t > survivors:
            raise ConfigError(
                f"threshold t={t} is too high: with dropout_rate={dropout_rate} only {survivors} of "
                f"n={n} devices are guaranteed to survive; need t <= {survivors}"
            )
        return
    if k % 2 == 0:
        raise ConfigError(
            f"neighbourhood size k={k} must be odd for a sparse graph (self + (k-1)/2 ring neighbours "
            f"on each side), or k == n={n} for the complete graph"
        )
    d = k - 1
    log_disc = _log_prob_disconnected(n, d, adversaries + dropouts)
    if log_disc >= _LOG_SECURITY_PER_EVENT:
        raise ConfigError(
            f"neighbourhood size k={k} is unsafe for n={n}: adversaries plus dropouts "
            f"({adversaries}+{dropouts}) disconnect the graph with probability up to "
            f"2^{log_disc / _LN2:.1f} (need < 2^-{SECURITY_BITS + 1})"
        )
    if adversarial_placement and t < adversaries + 2:
        raise ConfigError(
            f"threshold t={t} is unsafe for a sparse graph (k={k} < n={n}): a server that places its {adversaries} "
            f"colluder{'' if adversaries == 1 else 's'} (adversary_rate={adversary_rate}) around one device and "
            f"reports the device's other neighbours as dropped reconstructs its input; need t >= {adversaries + 2} "
            "(or k = n)"
        )
    log_adv = float(_log_sf(n, adversaries, d)[t]) if t <= d else -math.inf
    if log_adv >= _LOG_SECURITY_PER_EVENT - math.log(n):
        raise ConfigError(
            f"threshold t={t} is unsafe for k={k}, n={n}: an adversary controlling "
            f"adversary_rate={adversary_rate} ({adversaries} devices) holds >= t shares of a device with "
            f"probability 2^{log_adv / _LN2:.1f} (need < 2^-{SECURITY_BITS + 1}/n); raise t or k"
        )
    log_fail = float(_log_cdf(n, survivors, d)[t - 1])
    if log_fail >= _LOG_CORRECTNESS - math.log(n):
        raise ConfigError(
            f"threshold t={t} is too high for k={k}, n={n}, dropout_rate={dropout_rate}: a neighbourhood "
            f"keeps fewer than t live share holders with probability 2^{log_fail / _LN2:.1f} "
            f"(need < 2^-{CORRECTNESS_BITS}/n); lower t or raise k"
        )


def harary_graph(ids: Sequence[int], k: int, rng: np.random.Generator) -> dict[int, tuple[int, ...]]:
    """Build a random k-regular (self included) Harary graph over device ids.

    The ids (sorted first, so the graph depends only on the id set and the generator) are placed on a
    ring in a uniformly random order; each is linked to itself and to the ``(k - 1) / 2`` nearest ring
    positions on each side.  The random placement is what the security analysis of Bell et al. needs.
    Even ``k < n`` is refused rather than rounded: an odd number of ring neighbours cannot be placed
    symmetrically, and silently changing k would change the analysed guarantee.

    Parameters
    ----------
    ids : Sequence[int]
        Distinct device ids.
    k : int
        Neighbourhood size including the device itself; odd, or >= len(ids) for all-to-all.
    rng : np.random.Generator
        Source of the random permutation.

    Returns
    -------
    dict[int, tuple[int, ...]]
        Each id mapped to its sorted neighbourhood, itself included, of size ``min(k, n)``.
        The relation is symmetric.

    Raises
    ------
    ConfigError
        If ``k < 1``, or ``k`` is even and smaller than the number of ids.
    ValueError
        If the ids are not distinct.
    """
    id_list = sorted(int(i) for i in ids)
    n = len(id_list)
    if len(set(id_list)) != n:
        raise ValueError("device ids passed to harary_graph must be distinct")
    if k < 1:
        raise ConfigError(f"neighbourhood size k={k} must be >= 1")
    if n == 0:
        return {}
    if k >= n:
        everyone = tuple(id_list)
        return {i: everyone for i in id_list}
    if k % 2 == 0:
        raise ConfigError(
            f"neighbourhood size k={k} must be odd when k < n={n} (self + (k-1)/2 on each side of the ring)"
        )
    half = (k - 1) // 2
    ring = np.asarray(id_list, dtype=np.int64)[rng.permutation(n)]
    offsets = np.arange(-half, half + 1)
    rows = np.sort(ring[(np.arange(n)[:, None] + offsets[None, :]) % n], axis=1)
    return {int(node): tuple(row) for node, row in zip(ring.tolist(), rows.tolist(), strict=True)}


_LABEL_RING = b"fedrec/secagg-ring/v1"


@functools.lru_cache(maxsize=4)
def roster_ring(roster_ids: tuple[int, ...], digest: bytes) -> tuple[int, ...]:
    """Protocol 1.11: the ring order of a signed round, which every device recomputes from what it signs.

    The roster's ids sorted by SHA-256(label ‖ roster digest ‖ id), ties (never seen) by id.  The server picks
    the roster, so it can steer the order by trying rosters; nothing rests on the order being random except an
    honest round's odds of passing the survivor cut check (condition 5), which the server only harms itself by
    spoiling.

    Raises
    ------
    ValueError
        Repeated ids or an empty digest.
    """
    if len(set(roster_ids)) != len(roster_ids):
        raise ValueError("a roster lists each device once")
    if not digest:
        raise ValueError("the ring needs the roster's digest")
    prefix = _LABEL_RING + len(digest).to_bytes(4, "big") + digest
    keyed = sorted((hashlib.sha256(prefix + int(v).to_bytes(8, "big")).digest(), int(v)) for v in roster_ids)
    return tuple(v for _, v in keyed)


def ring_neighbourhood(ring: Sequence[int], device_id: int, k: int) -> frozenset[int]:
    """The ids within (k - 1) / 2 ring positions of ``device_id`` (itself included); the whole ring if k >= n.

    Raises
    ------
    ValueError
        ``device_id`` is not on the ring.
    """
    n = len(ring)
    if k >= n:
        return frozenset(int(v) for v in ring)
    half = (k - 1) // 2
    i = list(ring).index(device_id)
    return frozenset(int(ring[(i + o) % n]) for o in range(-half, half + 1))


def ring_graph(ring: Sequence[int], k: int, members: Iterable[int]) -> dict[int, tuple[int, ...]]:
    """Protocol 1.11: the graph of a signed round.  Each member is linked to itself and to the members within
    (k - 1) / 2 positions on each side of the whole roster ring; a roster device that is not a member (it did
    not advertise keys) leaves a hole, as a dropout would.  ``k >= len(ring)``: every member with every other.

    Returns
    -------
    dict[int, tuple[int, ...]]
        Each member mapped to its sorted neighbourhood, itself included (at most ``k`` ids).  Symmetric.

    Raises
    ------
    ConfigError
        ``k`` even and below the ring's size.
    ValueError
        A member not on the ring.
    """
    n = len(ring)
    inside = {int(v) for v in members}
    position = {int(v): i for i, v in enumerate(ring)}
    if not inside <= position.keys():
        raise ValueError(f"graph members off the roster ring: {sorted(inside - position.keys())[:5]}")
    if k >= n:
        everyone = tuple(sorted(inside))
        return {v: everyone for v in everyone}
    if k % 2 == 0:
        raise ConfigError(
            f"neighbourhood size k={k} must be odd when k < n={n} (self + (k-1)/2 on each side of the ring)"
        )
    half = (k - 1) // 2
    ring_ids = np.fromiter((int(v) for v in ring), dtype=np.int64, count=n)
    member = np.zeros(n, dtype=bool)
    member[[position[v] for v in inside]] = True
    at = np.flatnonzero(member)
    near = (at[:, None] + np.arange(-half, half + 1)[None, :]) % n
    present = member[near]
    # Absent positions sort last under the largest id; each row keeps its first `count` entries.
    rows = np.where(present, ring_ids[near], np.iinfo(np.int64).max)
    rows.sort(axis=1)
    counts = present.sum(axis=1).tolist()
    return {
        v: tuple(row[:c]) for v, row, c in zip(ring_ids[at].tolist(), rows.tolist(), counts, strict=True)
    }


def survivor_cut(ring: Sequence[int], survivors: Iterable[int], k: int) -> int:
    """The fewest survivors that two disjoint runs of (k - 1) / 2 consecutive ring positions hold (condition
    5 of the module docstring); ``len(survivors)`` for the complete graph (k >= n), which has no such runs.

    An edge of the ring graph spans at most (k - 1) / 2 positions, so the survivors' mask graph falls apart
    only where two such runs hold no survivor that still keeps its masks secret.  A device that sees a cut
    above the colluders' number A = ⌊γ n⌋ knows that every honest survivor is in one component after the A
    colluders are removed, so the server can unmask only the sum over all of them.

    Raises
    ------
    ValueError
        A survivor off the ring.
    """
    n = len(ring)
    alive = {int(v) for v in survivors}
    if k >= n:
        return len(alive)
    half = (k - 1) // 2
    flags = np.fromiter((int(v) in alive for v in ring), dtype=np.int64, count=n)
    if int(flags.sum()) != len(alive):
        raise ValueError("survivors off the roster ring")
    doubled = np.concatenate([flags, flags])
    prefix = np.concatenate([[0], np.cumsum(doubled)])
    runs = prefix[half : half + n] - prefix[:n]  # runs[i]: survivors at ring positions i .. i + half - 1
    # Disjoint partners of the run at i start at i + half .. i + n - half (cyclic): a window of n - 2 half + 1
    # starts, whose minimum a sparse table answers for every i at once.
    width = n - 2 * half + 1
    table = np.concatenate([runs, runs, runs])
    level = 1
    while level * 2 <= width:
        table = np.minimum(table[:-level], table[level:])
        level *= 2
    starts = np.arange(n) + half
    partner = np.minimum(table[starts], table[starts + width - level])
    return int((runs + partner).min())
