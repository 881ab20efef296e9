# Invariants of this module:
# - Randomness only through an explicit `np.random.default_rng(seed)`; no global state.  The order of
#   the generator's draws is part of the output: equal seeds give equal logs across versions.
"""A synthetic rating log with planted taste clusters, for tests, demos and benchmarks."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt

from fedsim.data.ratings import FloatArray, IntArray, Ratings

__all__ = ["synthetic"]


def synthetic(
    n_users: int = 600,
    n_items: int = 400,
    n_clusters: int = 8,
    ratings_per_user: int = 40,
    seed: int = 0,
    *,
    in_cluster_share: float = 0.8,
    popularity_exponent: float = 0.8,
) -> Ratings:
    """Generate a rating log with planted taste clusters.

    Each user belongs to one of ``n_clusters`` clusters, each item to one cluster.  A user rates
    about ``ratings_per_user`` distinct items (Poisson, at least 3), drawn without replacement with
    weights favouring its cluster's items (``in_cluster_share`` of the weight mass) and popular items
    (Zipf-like weights with ``popularity_exponent``).  Ratings 1-5 are high on in-cluster items and
    low elsewhere, plus item, user and noise terms; timestamps are random in 1998.

    Parameters
    ----------
    n_users, n_items, n_clusters, ratings_per_user : int
        Shape of the log.  ``ratings_per_user`` must be at most ``n_items // 2``.
    seed : int
        Seed of `np.random.default_rng`; equal seeds give equal logs (simulation data, not security).
    in_cluster_share : float
        Fraction in [0, 1] of a user's sampling weight on its own cluster's items.
    popularity_exponent : float
        Skew of item popularity (0 = uniform).

    Returns
    -------
    Ratings
        Named ``"synthetic"``; raw ids are 1-based; ``meta`` has no cluster labels (use the seed).

    Raises
    ------
    ValueError
        If a size is not positive or ``ratings_per_user`` is too large.
    """
    if min(n_users, n_items, n_clusters, ratings_per_user) < 1:
        raise ValueError("n_users, n_items, n_clusters and ratings_per_user must be >= 1")
    if ratings_per_user > n_items // 2:
        raise ValueError(f"ratings_per_user={ratings_per_user} exceeds n_items // 2 = {n_items // 2}")
    if not 0.0 <= in_cluster_share <= 1.0:
        raise ValueError("in_cluster_share must be in [0, 1]")
    rng = np.random.default_rng(seed)
    user_cluster = rng.integers(n_clusters, size=n_users)
    item_cluster = rng.permutation(np.arange(n_items) % n_clusters)
    popularity = 1.0 / (rng.permutation(n_items) + 1.0) ** popularity_exponent
    item_quality = rng.normal(0.0, 0.5, size=n_items)
    user_bias = rng.normal(0.0, 0.3, size=n_users)
    n_per_user = np.clip(rng.poisson(ratings_per_user, size=n_users), 3, n_items // 2)
    log_w = _cluster_log_weights(item_cluster, popularity, n_clusters, in_cluster_share)
    users, items = _sample_pairs(rng, log_w, user_cluster, n_per_user)
    in_cluster = user_cluster[users] == item_cluster[items]
    raw = (
        np.where(in_cluster, 4.0, 2.3)
        + item_quality[items]
        + user_bias[users]
        + rng.normal(0.0, 0.6, size=users.shape[0])
    )
    ratings = np.clip(np.rint(raw), 1.0, 5.0)
    t0 = 883_612_800  # 1998-01-01 UTC
    timestamps = np.asarray(rng.integers(0, 365 * 86_400, size=users.shape[0], dtype=np.int64) + t0)
    # shuffle rows so file order is not user-sorted, like real logs
    perm = rng.permutation(users.shape[0])
    return Ratings(
        users=users[perm],
        items=items[perm],
        ratings=ratings[perm],
        timestamps=timestamps[perm],
        n_users=n_users,
        n_items=n_items,
        user_ids=np.arange(1, n_users + 1, dtype=np.int64),
        item_ids=np.arange(1, n_items + 1, dtype=np.int64),
        name="synthetic",
        meta=MappingProxyType({"seed": int(seed), "n_clusters": int(n_clusters)}),
    )


def _cluster_log_weights(
    item_cluster: IntArray, popularity: npt.NDArray[np.floating[Any]], n_clusters: int, in_cluster_share: float
) -> FloatArray:
    """Per-cluster log sampling weights over items, shape (clusters, items), normalised so that a
    cluster's own items carry `in_cluster_share` of the mass."""
    member = item_cluster[None, :] == np.arange(n_clusters)[:, None]  # (clusters, items)
    w_in = np.where(member, popularity, 0.0)
    w_out = np.where(member, 0.0, popularity)
    share = min(max(in_cluster_share, 1e-9), 1 - 1e-9)
    weights = share * w_in / w_in.sum(1, keepdims=True) + (1 - share) * w_out / np.maximum(
        w_out.sum(1, keepdims=True), 1e-300
    )
    return np.log(np.maximum(weights, 1e-300))


def _sample_pairs(
    rng: np.random.Generator, log_w: FloatArray, user_cluster: IntArray, n_per_user: IntArray
) -> tuple[IntArray, IntArray]:
    """Draw ``n_per_user[u]`` distinct items for every user ``u`` without replacement, with the log
    weights of its cluster ``log_w[user_cluster[u]]``; returns the (user, item) pairs, user-major."""
    n_users, n_items = user_cluster.shape[0], log_w.shape[1]
    users_out: list[IntArray] = []
    items_out: list[IntArray] = []
    batch = max(1, 2_000_000 // n_items)  # bounded memory for ML-1M-sized logs
    for start in range(0, n_users, batch):  # loop over user batches, not ratings
        us = np.arange(start, min(start + batch, n_users))
        # Gumbel top-k = weighted sampling without replacement, for every user of the batch at once
        keys = log_w[user_cluster[us]] + rng.gumbel(size=(us.shape[0], n_items))
        order = np.argsort(-keys, axis=1)
        take = np.arange(n_items)[None, :] < n_per_user[us][:, None]
        users_out.append(np.broadcast_to(us[:, None], order.shape)[take])
        items_out.append(order[take])
    return np.concatenate(users_out).astype(np.int64), np.concatenate(items_out).astype(np.int64)
