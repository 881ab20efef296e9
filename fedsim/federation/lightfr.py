"""In-process federated LightFR (no sockets): LightFR Algorithm 1 with a whole cohort's devices
computed together.

Invariants:
- Each device's work is exactly `device_sdk`'s kernels on that device's own ratings (the kernels are
  per-user; a cohort is a batch of independent users), and the server sees only the cohort **sum**
  of uploads, passed to the `agg_server` strategy — the same split of work as over HTTP, without
  secure aggregation (which `tests.support.secagg_harness` and the server add).
- All randomness (initial codes, cohorts, negative sampling) comes from one seeded generator, so a
  run is reproducible from its seed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from agg_server.strategy import LightFRStrategy
from agg_server.strategy.lightfr import agg_full
from device_sdk import batched, lightfr
from device_sdk.models import LightFRConfig
from fedsim.data.ratings import Ratings
from fedsim.evaluation.ranking import EvalResult
from protocol.codes import random_signs
from protocol.families.lightfr import bias_from_levels, density_weight, levels_from_bias
from protocol.spec import Aggregation

__all__ = [
    "FederationConfig",
    "UserData",
    "RoundReport",
    "FederatedLightFR",
    "user_data",
    "run_lightfr",
    "run_full",
    "with_negatives",
]


@dataclass(frozen=True, slots=True)
class FederationConfig:
    """Federation schedule.

    Attributes
    ----------
    rounds : global rounds T.
    fraction : share p of the users selected per round (the paper uses 0.6).
    seed : seed of the run's generator.
    aggregation : LightFR aggregation rule on the server.
    flip_fraction : damping ρ of the server's code update (see `agg_server.strategy.lightfr.agg_grad`).
    hamming_weight : B of the integer score (f − Hamming)·B + item level (all-items objective).
    learn_bias : learn item biases (shipped as uint8 levels) under the all-items objective.
    query_planes : P >= 1 selects asymmetric scoring (all-items objective only): each device solves its
        user vector exactly against the binary item codes (`device_sdk.lightfr.ridge_users`, ridge
        weight ``user_reg``), keeps it as P ±1 bit-planes (`quantize_planes`, `snap_scale`) and uploads
        with it; items stay 64-bit codes and the score stays an integer from XOR + popcount
        (`device_sdk.topk.plane_scores`).  0 (default): ±1 user codes by DCD.
    user_reg : ridge weight of the user solve under ``query_planes`` (in units of the f²-scaled loss).
    refresh_users : under ``query_planes`` (or ``rank_planes``), re-solve every user's vector against the
        final model, as a device does locally when it downloads a model (nothing is uploaded).
    rank_planes : under ``query_planes``, the planes of that refreshed vector, the one the device ranks
        with (0 = ``query_planes``); the uploads keep ``query_planes`` planes.  Without ``query_planes``
        (symmetric training, all-items objective): the devices train and upload with ±1 codes as
        before, and each ranks with its real-valued vector solved against the final item codes
        (`device_sdk.lightfr.ridge_users`, ridge ``rank_ridge``·w0·m) kept as ``rank_planes`` planes
        (`device_sdk.models.LightFRConfig.rank_planes`); 0 ranks with the ±1 code.
    rank_ridge : the ridge weight of that ranking-time solve in units of w0·m (= tr(w0·DᵀD)/f, the
        unobserved term's weight), so it follows the catalogue and the derived w0.
    unobserved_scale : κ > 0 derives the all-items objective's w0 from the catalogue density, as the
        server does (`agg_server.strategy.lightfr.LightFRServerStrategy`): each round w0 = κ·density^γ
        from the counts slice of the cohort's sum; the devices of round 1 train with the model
        config's ``unobserved_weight``.  0 keeps that w0 fixed.
    mean_field : the server's mean-field code step (`agg_server.strategy.lightfr.agg_full`).
    code_sweeps : passes of the server's code step over one round's sums (``agg_full(sweeps=…)``); 1 = one.
    """

    rounds: int = 50
    fraction: float = 0.6
    seed: int = 0
    aggregation: Aggregation = Aggregation.GRAD
    flip_fraction: float = 1.0
    hamming_weight: int = 2
    learn_bias: bool = True
    unobserved_scale: float = 0.0
    query_planes: int = 0
    user_reg: float = 1.0
    refresh_users: bool = True
    rank_planes: int = 0
    rank_ridge: float = 2.0
    mean_field: bool = False
    code_sweeps: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.code_sweeps, bool) or not (isinstance(self.code_sweeps, int) and self.code_sweeps >= 1):
            raise ValueError(f"code_sweeps must be an integer >= 1, got {self.code_sweeps!r}")
        if not (np.isfinite(self.unobserved_scale) and self.unobserved_scale >= 0):
            raise ValueError(f"unobserved_scale must be a finite value >= 0, got {self.unobserved_scale}")
        if self.rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {self.rounds}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if self.hamming_weight < 1:
            raise ValueError(f"hamming_weight must be >= 1, got {self.hamming_weight}")
        planes = self.query_planes
        if isinstance(planes, bool) or not (isinstance(planes, int) and 0 <= planes <= 8):
            raise ValueError(f"query_planes must be an integer in [0, 8], got {self.query_planes!r}")
        ranked = self.rank_planes
        if isinstance(ranked, bool) or not (isinstance(ranked, int) and 0 <= ranked <= 8):
            raise ValueError(f"rank_planes must be an integer in [0, 8], got {self.rank_planes!r}")
        if not (np.isfinite(self.user_reg) and self.user_reg > 0):
            raise ValueError(f"user_reg must be a finite value > 0, got {self.user_reg}")
        if not (np.isfinite(self.rank_ridge) and self.rank_ridge > 0):
            raise ValueError(f"rank_ridge must be a finite value > 0, got {self.rank_ridge}")


@dataclass(frozen=True, slots=True)
class UserData:
    """Every user's local training examples in CSR form, targets already normalised to [0, 1]."""

    indptr: NDArray[np.int64]
    items: NDArray[np.int64]
    targets: NDArray[np.float64]
    n_items: int

    @property
    def n_users(self) -> int:
        return int(self.indptr.size - 1)

    def rows(self, users: NDArray[np.int64]) -> UserData:
        """The CSR restricted to ``users`` (in that order)."""
        counts = np.diff(self.indptr)[users]
        indptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        starts = self.indptr[users]
        take = np.arange(int(indptr[-1]), dtype=np.int64) + np.repeat(starts - indptr[:-1], counts)
        return UserData(indptr, self.items[take], self.targets[take], self.n_items)


def user_data(train: Ratings, config: LightFRConfig) -> UserData:
    """Group training ratings by user and normalise them as ``config`` says."""
    idx = train.by_user()
    targets = config.normalize(idx.ratings, idx.items.size)
    return UserData(idx.indptr.astype(np.int64), idx.items.astype(np.int64), targets, train.n_items)


def with_negatives(data: UserData, per_positive: int, rng: np.random.Generator) -> UserData:
    """Each user's entries plus ``per_positive`` sampled unobserved items per entry, at target 0."""
    if per_positive == 0:
        return data
    neg_ptr, neg = lightfr.sample_negatives(data.indptr, data.items, data.n_items, per_positive, rng)
    indptr, items, targets = batched.merge_negatives(data.indptr, data.items, data.targets, neg_ptr, neg)
    return UserData(indptr, items, targets, data.n_items)


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What one round did."""

    round: int
    cohort: int
    user_flips: int
    item_flips: int
    seconds: float
    metric: EvalResult | None = None


@dataclass
class FederatedLightFR:
    """Result of a run: every user's private code (held on the devices in reality) and the global
    item codes, with per-round reports."""

    user_codes: NDArray[np.int8]
    item_codes: NDArray[np.int8]
    history: list[RoundReport] = field(default_factory=list)
    item_levels: NDArray[np.uint8] | None = None
    hamming_weight: int = 1
    #: The w0 of the last round under the all-items objective (density-derived or fixed).
    unobserved_weight: float = 0.0
    #: With query planes P >= 1: every user's quantized real-valued vector Δ·q (n, f), what it scores with.
    user_vectors: NDArray[np.float64] | None = None
    #: The refreshed vectors (what devices rank with after the last round) as a device holds them: odd
    #: integers q (n, f) and integer weights a (n,) (`device_sdk.models.LightFRModel.user_q` / `user_weight`).
    user_q: NDArray[np.int16] | None = None
    user_weight: NDArray[np.int64] | None = None

    def scores(self, users: NDArray[np.int64], candidates: NDArray[np.int64]) -> NDArray[np.int32]:
        """The integer score (f − Hamming)·B + level (level 0 without item levels) of each user's
        candidates; ranks exactly like Hamming similarity when there are no levels."""
        f = self.user_codes.shape[1]
        if self.user_vectors is not None:
            x = np.einsum("nf,ncf->nc", self.user_vectors[users], self.item_codes[candidates].astype(np.float64)) / f
            if self.item_levels is not None:
                x += bias_from_levels(self.item_levels, self.item_codes.shape[0], f, self.hamming_weight)[candidates]
            return x
        B = self.user_codes[users].astype(np.int32)
        Dc = self.item_codes[candidates].astype(np.int32)
        close = (np.einsum("nf,ncf->nc", B, Dc) + f) // 2  # f − Hamming
        if self.item_levels is None:
            return close.astype(np.int32)
        return (close * self.hamming_weight + self.item_levels[candidates]).astype(np.int32)

    def all_scores(self, users: NDArray[np.int64]) -> NDArray[np.float32]:
        """The same score as `scores` against every item, (len(users), m) float32 (exact: the values are
        small integers); a full-ranking scorer for `fedsim.evaluation.ranking.evaluate_all_items`."""
        f = self.user_codes.shape[1]
        if self.user_vectors is not None:
            x = self.user_vectors[users] @ self.item_codes.T.astype(np.float64) / f
            if self.item_levels is not None:
                x += bias_from_levels(self.item_levels, self.item_codes.shape[0], f, self.hamming_weight)
            return x.astype(np.float32)
        close = (self.user_codes[users].astype(np.float32) @ self.item_codes.T.astype(np.float32) + f) / 2
        if self.item_levels is None:
            return close
        return close * np.float32(self.hamming_weight) + self.item_levels.astype(np.float32)


def run_lightfr(
    data: UserData,
    model: LightFRConfig,
    federation: FederationConfig,
    *,
    evaluate: Callable[[FederatedLightFR], EvalResult] | None = None,
    eval_every: int = 1,
    on_round: Callable[[RoundReport], None] | None = None,
) -> FederatedLightFR:
    """Federated LightFR (Algorithm 1): T rounds; each round a random cohort of ⌈p·n⌉ users runs E
    local epochs (DCD on its code, then its item-gradient or item-code upload) and the server
    aggregates the cohort's sum.  With ``model.unobserved_weight > 0`` the devices train against
    every item (`device_sdk.lightfr.dcd_full`) and the server also learns item levels
    (`agg_server.strategy.lightfr.agg_full`); see `run_full`.

    Parameters
    ----------
    data : every user's training examples (see `user_data`).
    model : device-side hyper-parameters (bits, λ, negatives, epochs, sweeps).
    federation : rounds, client fraction, seed, aggregation rule.
    evaluate : optional callback scoring the current model; run every ``eval_every`` rounds and
        after the last round.
    on_round : called with each round's report (progress display).
    """
    if federation.query_planes and model.unobserved_weight == 0:
        raise ValueError("query_planes needs the all-items objective (unobserved_weight > 0)")
    if federation.rank_planes and model.unobserved_weight == 0:
        raise ValueError("rank_planes needs the all-items objective (unobserved_weight > 0)")
    if model.unobserved_weight > 0:
        return run_full(data, model, federation, evaluate=evaluate, eval_every=eval_every, on_round=on_round)
    rng = np.random.default_rng(federation.seed)
    strategy = LightFRStrategy(
        bits=model.bits,
        lam=model.lam,
        aggregation=federation.aggregation,
        flip_fraction=federation.flip_fraction,
    )
    n, m = data.n_users, data.n_items
    state = FederatedLightFR(user_codes=random_signs(n, model.bits, rng), item_codes=strategy.initialize(m, rng))
    cohort_size = max(1, int(np.ceil(federation.fraction * n)))
    for t in range(1, federation.rounds + 1):
        start = time.perf_counter()
        cohort = np.sort(rng.choice(n, size=cohort_size, replace=False)).astype(np.int64)
        local = data.rows(cohort)
        B = state.user_codes[cohort]
        D = state.item_codes
        upload = np.zeros((m, model.bits), dtype=np.float64)
        flips = 0
        for _ in range(model.local_epochs):
            batch = with_negatives(local, model.negatives, rng)
            B, stats = lightfr.dcd_update(
                batch.indptr, batch.items, batch.targets, B, D, model.lam, max_sweeps=model.max_sweeps
            )
            flips += stats.flips
            if federation.aggregation is Aggregation.GRAD:
                upload += lightfr.item_gradient_sum(batch.indptr, batch.items, batch.targets, B, D)
            else:
                upload = lightfr.item_codes_sum(batch.indptr, batch.items, batch.targets, B, D, model.lam).astype(
                    np.float64
                )
        if federation.aggregation is Aggregation.GRAD:
            upload /= model.local_epochs
        state.user_codes[cohort] = B
        new_D = strategy.aggregate(D, upload, rng)
        item_flips = int(np.count_nonzero(new_D != D))
        state.item_codes = new_D
        metric = None
        if evaluate is not None and (t % eval_every == 0 or t == federation.rounds):
            metric = evaluate(state)
        report = RoundReport(t, cohort.size, flips, item_flips, time.perf_counter() - start, metric)
        state.history.append(report)
        if on_round is not None:
            on_round(report)
    return state


def run_full(
    data: UserData,
    model: LightFRConfig,
    federation: FederationConfig,
    *,
    evaluate: Callable[[FederatedLightFR], EvalResult] | None = None,
    eval_every: int = 1,
    on_round: Callable[[RoundReport], None] | None = None,
) -> FederatedLightFR:
    """`run_lightfr` under the all-items objective: each round the cohort's devices run E epochs of
    `dcd_full` against the broadcast codes and item levels, and upload the parts of
    `protocol.families.lightfr.UploadLayout`; the server applies `agg_full` to the cohort's sums and
    broadcasts new codes and levels (the server's real-valued biases never leave it)."""
    if federation.aggregation is not Aggregation.GRAD:
        raise ValueError("the all-items objective uploads gradients (aggregation 'grad')")
    rng = np.random.default_rng(federation.seed)
    n, m, f = data.n_users, data.n_items, model.bits
    w0, alpha, wgt = model.unobserved_weight, model.confidence, federation.hamming_weight
    state = FederatedLightFR(user_codes=random_signs(n, f, rng), item_codes=random_signs(m, f, rng), hamming_weight=wgt)
    state.unobserved_weight = w0
    beta = np.zeros(m)
    if federation.learn_bias:
        state.item_levels = levels_from_bias(beta, f, wgt)
    cohort_size = max(1, int(np.ceil(federation.fraction * n)))
    for t in range(1, federation.rounds + 1):
        start = time.perf_counter()
        cohort = np.sort(rng.choice(n, size=cohort_size, replace=False)).astype(np.int64)
        local = data.rows(cohort)
        D = state.item_codes
        dev_beta = bias_from_levels(state.item_levels, m, f, wgt)  # what the devices received
        B = state.user_codes[cohort]
        flips = 0
        if federation.query_planes:
            U = lightfr.ridge_users(
                local.indptr, local.items, local.targets, D, dev_beta, w0, alpha, federation.user_reg
            )
            Uq = batched.snapped_vectors(U, federation.query_planes, wgt)
            parts = lightfr.full_upload(local.indptr, local.items, local.targets, Uq, D, dev_beta, w0, alpha)
            if state.user_vectors is None:
                state.user_vectors = np.zeros((n, f))
            state.user_vectors[cohort] = Uq
        else:
            for _ in range(model.local_epochs):
                B, stats = lightfr.dcd_full(
                    local.indptr, local.items, local.targets, B, D, dev_beta, w0, alpha, max_sweeps=model.max_sweeps
                )
                flips += stats.flips
            parts = lightfr.full_upload(local.indptr, local.items, local.targets, B, D, dev_beta, w0, alpha)
            state.user_codes[cohort] = B
        if federation.unobserved_scale > 0:  # the server's w0, from this round's counts (next round's plan)
            w0 = density_weight(
                float(parts["counts"].sum()), cohort.size, m, scale=federation.unobserved_scale, cap=1.0 + alpha
            )
            state.unobserved_weight = w0
        new_D, beta = agg_full(
            D,
            dev_beta,
            parts,
            cohort.size,
            w0,
            alpha,
            flip_fraction=federation.flip_fraction,
            rng=rng,
            learn_bias=federation.learn_bias,
            mean_field=federation.mean_field,
            sweeps=federation.code_sweeps,
        )
        item_flips = int(np.count_nonzero(new_D != D))
        state.item_codes = new_D
        if federation.learn_bias:
            state.item_levels = levels_from_bias(beta, f, wgt)
        metric = None
        if evaluate is not None and (t % eval_every == 0 or t == federation.rounds):
            metric = evaluate(state)
        report = RoundReport(t, cohort.size, flips, item_flips, time.perf_counter() - start, metric)
        state.history.append(report)
        if on_round is not None:
            on_round(report)
    if (federation.query_planes or federation.rank_planes) and federation.refresh_users:
        # What a device does when it downloads a model: re-solve its vector against it (local, nothing uploaded).
        # Symmetric training ranks with a vector of its own ridge weight (rank_ridge·w0·m).
        dev_beta = bias_from_levels(state.item_levels, m, f, wgt)
        reg = federation.user_reg if federation.query_planes else federation.rank_ridge * w0 * m
        state.user_q, state.user_weight, state.user_vectors = batched.refreshed_vectors(
            data.indptr,
            data.items,
            data.targets,
            state.item_codes,
            dev_beta,
            w0,
            alpha,
            reg,
            federation.rank_planes or federation.query_planes,
            wgt,
        )
    return state
