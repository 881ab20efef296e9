"""Private LightFR over a whole dataset through the private-round simulator, and planning its budget.

The budget is spent where it buys signal; `plan_privacy` predicts each choice's signal-to-noise first.

One run (`run_private_scaled`):

1. **Private popularity** (one release, charged to the ledger first): every device adds a 1 for
   each of at most θ of its items (clipped to L2 norm √θ, quantized and noised like any upload).
   The server learns noisy per-item counts; they are the private popularity baseline and the item
   level of the model's score.
2. **T LightFR rounds** of every device (`fedsim.private.simulator.PrivateSimulator.run_scaled_round`), each
   charged in full (no amplification: the server picks the cohort).  Optional noise-aware
   aggregation (`NoiseAwareLightFR`): a summed gradient coordinate moves its bit only when it
   exceeds ``threshold`` standard deviations of the released noise; otherwise the bit keeps its
   value instead of following the sign of noise.
3. Each device refreshes its user code against the final item codes (a local DCD; nothing is
   uploaded), and ranks items by ``(f − Hamming) + α·level`` where level is the private count on a
   log scale spread over [0, f]; α is chosen on a validation split carved from train (one train item
   per user with at least two), from a grid that contains pure private popularity (α = ∞), so the
   chosen scorer is never worse than private popularity on validation.

The ε reported is the ledger's: the popularity release and every round composed (RDP) and converted
once (`protocol.accounting`).  The split between the channels is ``pop_share``: the popularity
release is calibrated for ``pop_share·ε`` on its own, then the rounds' μ is bisected so the composed
ε meets the target.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from agg_server.config import ServerConfig, config_from_dict
from agg_server.strategy import build_strategy
from agg_server.strategy.base import Strategy
from fedsim.data.ratings import Ratings
from fedsim.private.cohorts import LightFRCohort
from fedsim.private.planner import POP_THETA, PRIVATE_ROUNDS, PrivatePlan, plan_private_run
from fedsim.private.served import PrivateRunResult, ServedScore, evaluate_served, validate
from fedsim.private.simulator import PrivateSimulator, one_blas_thread
from protocol.accounting import PrivacyLedger, calibrate_mu, composed_rdp, epsilon_from_rdp
from protocol.codes import pack_signs
from protocol.families.lightfr import bias_from_levels
from protocol.noise import colluding_devices, released_variance, sample_skellam
from protocol.policy import PrivacyPolicy
from protocol.quantization import QuantizationConfig, clip_l2, sensitivity, stochastic_round
from protocol.samplers import insecure_test_noise_stream

__all__ = [
    "ScaledSettings",
    "ScaledResult",
    "NoiseAwareLightFR",
    "split_budget",
    "split_run_budget",
    "widest_quantization",
    "colluder_inflation",
    "release_counts",
    "seeded_release",
    "popularity_only",
    "plan_split",
    "run_private_scaled",
    "scaled_config",
    "plan_run",
    "with_plan",
    "validate_private",
]

#: The α grid of the item level (∞ = private popularity alone, 0 = the codes alone).
ALPHAS: tuple[float, ...] = (0.0, 0.25, 1.0, 4.0, 16.0, math.inf)


@dataclass(frozen=True, slots=True)
class ScaledSettings:
    """One scaled private LightFR run.

    Attributes
    ----------
    epsilon : user-level ε over the whole run at ``delta`` (0 = no DP noise).
    delta : δ.
    rounds : LightFR rounds T.
    bits : code length f.
    clip_norm, scale_bits : C and s of the LightFR uploads.
    example_cap : θ items per device per round (and in the popularity release).
    negatives : sampled unobserved items per kept item (0 = none: fewer coordinates per device).
    flip_fraction : Agg_grad damping ρ.
    threshold : noise-aware aggregation, in standard deviations of the released noise (0 = off).
    pop_share : fraction of ε given to the popularity release when calibrating (0 = no channel).
    dropout_rate : ω tolerated by SecAgg+ and the DP correction (t_min = ⌈(1 − ω)·n⌉).
    seed : seeds the server generators and the simulation.
    unobserved_weight : w0 of LightFR's objective: > 0 or "auto" (derived from the catalogue's
        density each round, the server's default) the all-items objective (item codes and learned item
        biases, the upload's longer layout), 0 sampled negatives.
    mean_field : the server's mean-field code step (`model.mean_field`, all-items objective; the default,
        as on the server: chosen on validation under DP too, docs/dp-accounting.md §8); False is the
        Jacobi step the earlier figures of that section were measured with.
    query_planes, user_reg : asymmetric scoring in the round plan (protocol 1.6, all-items objective):
        each device's user vector solved against the codes, kept as P bit-planes; 0 = ±1 codes.
    fraction : share p of the devices in each round's cohort (⌈p·n⌉, drawn by the coordinator's rule;
        1 = every device every round).
    code_sweeps : passes of the server's mean-field code step over one round's sums (`model.code_sweeps`).
    rank_planes : the planes of the vector each device ranks with after the last round
        (`device_sdk.models.LightFRConfig.rank_planes`). Under ``query_planes``: the plan's vector (0 = the
        plan's ``query_planes``). Without (symmetric training, all-items objective): the device keeps its
        ±1 code for training and ranks with its vector solved against the final item codes and levels with
        ridge ``rank_ridge``·w0·m (w0 the last round's value), held as ``rank_planes`` planes, as the SDK's
        default device does; 0 ranks with the ±1 code.
    rank_ridge : that ranking-time ridge in units of w0·m (`LightFRConfig.rank_ridge`), > 0.
    """

    epsilon: float = 8.0
    delta: float = 1e-5
    rounds: int = 3
    bits: int = 64
    # θ and C: the best validation Recall@20 on amazon-book at ε = 8 (5 rounds, the planner's split) among the
    # nine (θ, C) pairs tried, θ in {20, 50, 100}, C in {0.5, 1, 2, 4, 8} (results/2026-11-27-private-planner.md).
    clip_norm: float = 1.0
    scale_bits: int = 0  # 0 = the largest that fits the bit budget
    example_cap: int = 50
    negatives: int = 0
    flip_fraction: float = 1.0
    threshold: float = 0.0
    pop_share: float = 0.1
    dropout_rate: float = 0.3
    seed: int = 0
    unobserved_weight: float | str = 0.0
    mean_field: bool = True
    query_planes: int = 0
    user_reg: float = 1.0
    fraction: float = 1.0
    code_sweeps: int = 1
    rank_planes: int = 0
    rank_ridge: float = 2.0
    pop_theta: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.fraction, (int, float)) and 0 < self.fraction <= 1):
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction!r}")
        planes = self.rank_planes
        if isinstance(planes, bool) or not (isinstance(planes, int) and 0 <= planes <= 8):
            raise ValueError(f"rank_planes must be an integer in [0, 8], got {planes!r}")
        if planes and self.unobserved_weight == 0:
            raise ValueError("rank_planes needs the all-items objective (unobserved_weight > 0 or 'auto')")
        ridge = self.rank_ridge
        if isinstance(ridge, bool) or not (isinstance(ridge, int | float) and math.isfinite(ridge) and ridge > 0):
            raise ValueError(f"rank_ridge must be a finite number > 0, got {ridge!r}")


@dataclass
class ScaledResult(PrivateRunResult):
    """Codes of one run, beside its private counts and the ledger's ε (`PrivateRunResult`, keyword fields)."""

    item_codes: NDArray[np.int8]
    user_codes: NDArray[np.int8]
    settings: ScaledSettings = field(default_factory=ScaledSettings)
    #: The model's own item term in units of (f − Hamming): β·f/2 for the learned biases β of the
    #: all-items objective (what its levels stand for); zeros under sampled negatives.
    item_bias: NDArray[np.float64] | None = None
    #: Under asymmetric scoring, each user's snapped real vector Δ'·q (n, f), which scores replace the
    #: ±1 code with; None otherwise.
    user_vectors: NDArray[np.float64] | None = None
    #: The last round's released sum in quantized units (signed), and the rows of ``train``'s users whose
    #: uploads it holds: what the server learned in that round, for diagnostics and tests.
    last_release: NDArray[np.int64] | None = None
    last_users: NDArray[np.int64] | None = None
    #: w0 of the last round (the derived value under "auto"; 0 under sampled negatives).
    unobserved_weight: float = 0.0
    #: The hamming weight B of the model's integer score (what the snapped plane scales are on).
    hamming_weight: int = 1
    #: The final model's item levels (all-items objective; what a device downloads with the codes), else None.
    item_levels: NDArray[np.uint8] | None = None


def _largest_scale_bits(n: int, clip_norm: float, head: float = 0.9) -> int:
    """The largest s with n·⌈2^s·C⌉ below ``head``·2^31 (room left for the noise head-room)."""
    s = 0
    while s < 30 and n * math.ceil(2 ** (s + 1) * clip_norm) < head * 2**31:
        s += 1
    return s


def widest_quantization(n: int, clip_norm: float) -> QuantizationConfig:
    """Clip norm ``clip_norm`` with the finest scale a sum of ``n`` devices leaves room for
    (`_largest_scale_bits`): the quantization of a simulated release outside the model rounds."""
    return QuantizationConfig(clip_norm=clip_norm, scale_bits=_largest_scale_bits(n, clip_norm))


def split_budget(
    epsilon: float,
    delta: float,
    rounds: int,
    model_sens: tuple[float, float],
    pop_sens: tuple[float, float] | None,
    pop_share: float,
) -> tuple[float, float]:
    """(μ of each model round, μ of the popularity release) meeting ``epsilon`` composed.

    The popularity release gets μ calibrated for ``pop_share·ε`` alone; the rounds' μ is then the
    smallest (bisected on log μ) for which the composed RDP of the release plus ``rounds`` rounds
    converts to at most ε.  Sensitivities are (Δ1, Δ2).
    """
    l1m, l2m = model_sens
    if pop_sens is None or pop_share <= 0:
        return calibrate_mu(epsilon, delta, rounds, l1m, l2m), 0.0
    l1p, l2p = pop_sens
    mu_pop = calibrate_mu(pop_share * epsilon, delta, 1, l1p, l2p)

    def eps_at(mu: float) -> float:
        curve = composed_rdp([(mu_pop, l1p, l2p), *[(mu, l1m, l2m)] * rounds])
        return epsilon_from_rdp(curve, delta)

    lo, hi = math.log(l2m * l2m * 1e-3), math.log(l2m * l2m * 1e6)
    if eps_at(math.exp(hi)) > epsilon:
        raise ValueError("the popularity share leaves no budget for the rounds; lower pop_share (--pop-share)")
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if eps_at(math.exp(mid)) > epsilon:
            lo = mid
        else:
            hi = mid
    return math.exp(hi), mu_pop


def split_run_budget(
    epsilon: float,
    delta: float,
    rounds: int,
    model_sens: tuple[float, float],
    pop_sens: tuple[float, float],
    pop_share: float,
) -> tuple[float, float]:
    """`split_budget` of a run with DP (``epsilon`` > 0); (0, 0) without: no noise in either channel."""
    if epsilon <= 0:
        return 0.0, 0.0
    return split_budget(epsilon, delta, rounds, model_sens, pop_sens, pop_share)


def colluder_inflation(n: int, adversary_rate: float | None = None) -> float:
    """n / (n − f): the released noise over μ when all n devices of one secure sum add their noise, with f =
    ⌊γ n⌋ (each keeps μ/(n − f) so the honest ones alone carry μ); γ the round's ``adversary_rate``, by default
    the default device policy's (which the server's default equals)."""
    n = max(1, int(n))
    gamma = PrivacyPolicy().adversary_rate if adversary_rate is None else adversary_rate
    return n / (n - colluding_devices(n, gamma))


def release_counts(
    users: list[NDArray[np.int64]],
    n_items: int,
    theta: int,
    quantization: QuantizationConfig,
    mu: float,
    rng: np.random.Generator,
) -> NDArray[np.float64]:
    """The private popularity release: Σ_u clip(1[u's items]) + Skellam(n/(n − f)·μ), dequantized.

    Each device's indicator of all its items is clipped to L2 norm C = √θ (`clip_l2`: a device with
    k > θ items adds √(θ/k) to each, one with k ≤ θ adds 1) and rounded with `stochastic_round` like
    any upload.  Clipping the whole indicator, rather than keeping θ items at random, has the same
    sensitivity and no sampling noise: on ML-100K's validation blocks, private popularity at ε = 1
    (θ = 20) ranks 0.439 by HR@10 this way and 0.378 with θ random items.  ``mu = 0``: no noise.
    ``theta`` is used only through ``quantization.clip_norm`` (= √θ, checked).  The noise is what the n
    devices leave in one secure sum when nobody drops: each keeps μ/(n − f), so the honest ones carry μ
    even if the f = ⌊γ n⌋ colluders a device's default policy assumes add none (`colluder_inflation`).
    """
    if not math.isclose(quantization.clip_norm, math.sqrt(theta)):
        raise ValueError(f"the popularity release clips to √θ = {math.sqrt(theta):g}, got {quantization.clip_norm:g}")
    scale = quantization.scale
    # a simulation: the rounding coins come from a seeded stream, so ε is not a guarantee here
    coins = insecure_test_noise_stream(int(rng.integers(2**63)))
    sizes = np.array([u.size for u in users], dtype=np.int64)
    items = np.concatenate(users) if users else np.zeros(0, np.int64)
    # Every entry of a device's clipped all-ones vector is the same: clip it once per distinct length.
    lengths, which = np.unique(sizes, return_inverse=True)
    entry = np.array([clip_l2(np.ones(k), quantization.clip_norm)[0][0] if k else 0.0 for k in lengths])
    values = np.repeat(entry[which], sizes) * scale
    total = np.bincount(items, weights=stochastic_round(values, coins), minlength=n_items).astype(np.int64)
    if mu > 0:
        noise = insecure_test_noise_stream(int(rng.integers(2**63)))  # a simulation: ε is not a guarantee here
        n = max(1, len(users))
        f = colluding_devices(n, PrivacyPolicy().adversary_rate)
        total += sample_skellam(released_variance(mu, n, n, n, colluders=f), n_items, noise).value()
    return total.astype(np.float64) / scale


def seeded_release(
    users: list[NDArray[np.int64]],
    n_items: int,
    theta: int,
    quantization: QuantizationConfig,
    mu: float,
    seed: int,
    ledger: PrivacyLedger | None = None,
) -> NDArray[np.float64]:
    """A run's popularity release (`release_counts`) from the run's own seeded stream (a simulation), charged to
    ``ledger`` when it is noised (μ > 0); the model rounds' streams are other ones."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xC0]))
    counts = release_counts(users, n_items, theta, quantization, mu, rng)
    if ledger is not None and mu > 0:
        l2, l1 = sensitivity(quantization, n_items)
        ledger.record_round(mu, l1, l2)
    return counts


def popularity_only(
    users: list[NDArray[np.int64]], n_items: int, *, epsilon: float, delta: float, theta: int, seed: int
) -> tuple[NDArray[np.float64], float, float | None]:
    """(counts, μ, the ledger's ε) of a run without model rounds: the popularity release alone, calibrated to the
    whole ``epsilon`` (no noise and ε None for ``epsilon`` 0)."""
    qp = widest_quantization(len(users), math.sqrt(theta))
    l2p, l1p = sensitivity(qp, n_items)
    mu_pop, eps = 0.0, None
    if epsilon > 0:
        mu_pop = calibrate_mu(epsilon, delta, 1, l1p, l2p)
        eps = PrivacyLedger(epsilon_budget=epsilon, delta=delta).record_round(mu_pop, l1p, l2p)
    return seeded_release(users, n_items, theta, qp, mu_pop, seed), mu_pop, eps


def plan_split(
    train: Ratings,
    *,
    epsilon: float,
    delta: float,
    rounds: int,
    model_sens: tuple[float, float],
    negatives: int | None,
    seed: int,
) -> PrivatePlan:
    """The privacy planner's choice (`fedsim.private.planner.plan_private_run`) for a run over ``train`` whose
    ``rounds`` model rounds have sensitivities ``model_sens`` (Δ1, Δ2), against the popularity release at θ =
    `POP_THETA`, with `split_budget` and the accountant; ``negatives``: the evaluation's sampled items per
    positive (None: full ranking)."""
    qp = widest_quantization(train.n_users, math.sqrt(POP_THETA))
    l2p, l1p = sensitivity(qp, train.n_items)

    inflation = colluder_inflation(train.n_users)

    def sigma_at(share: float) -> float:
        mu = split_budget(epsilon, delta, rounds, model_sens, (l1p, l2p), share)[1]
        return math.sqrt(mu * inflation) / qp.scale

    sigma_all = math.sqrt(calibrate_mu(epsilon, delta, 1, l1p, l2p) * inflation) / qp.scale
    return plan_private_run(
        train,
        epsilon=epsilon,
        delta=delta,
        negatives=negatives,
        sigma_at=sigma_at,
        sigma_all=sigma_all,
        rounds=rounds,
        seed=seed,
    )


@dataclass(frozen=True, slots=True)
class NoiseAwareLightFR:
    """A LightFR strategy that moves a bit only on evidence: summed gradient coordinates smaller
    than ``threshold``·σ (σ = √(μ·n/(n − f)) / 2^s, the released noise's standard deviation in float units)
    are set to 0 before the base strategy's Agg_grad, which keeps a bit whose d* is 0."""

    base: Any
    sigma: float
    threshold: float

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def aggregate(
        self, state: NDArray[np.int8], total: NDArray[np.float64], survivors: int, rng: np.random.Generator, **kw: Any
    ) -> NDArray[np.int8]:
        cut = self.threshold * self.sigma
        kept = np.where(np.abs(total) > cut, total, 0.0)
        return self.base.aggregate(state, kept, survivors, rng, **kw)


def _per_user(train: Ratings) -> list[NDArray[np.int64]]:
    idx = train.by_user()
    return [np.asarray(idx.items[idx.indptr[u] : idx.indptr[u + 1]], dtype=np.int64) for u in range(train.n_users)]


def scaled_config(n_users: int, n_items: int, settings: ScaledSettings, data_dir: Path) -> ServerConfig:
    """The server configuration of a scaled run over ``n_users`` devices (``settings.scale_bits`` as given)."""
    s = settings
    cohort_size = max(1, math.ceil(s.fraction * n_users))
    dp = s.epsilon > 0
    return config_from_dict(
        {
            "server": {"data_dir": str(data_dir)},
            "model": {
                "n_items": n_items,
                "bits": s.bits,
                "negatives": s.negatives,
                "flip_fraction": s.flip_fraction,
                "unobserved_weight": s.unobserved_weight,
                "mean_field": s.mean_field,
                "query_planes": s.query_planes,
                "user_reg": s.user_reg,
                "code_sweeps": s.code_sweeps,
            },
            "rounds": {
                "cohort_size": cohort_size,
                "min_cohort": cohort_size,
                "seed": s.seed,
                "clip_norm": s.clip_norm,
                "scale_bits": s.scale_bits,
                "dropout_rate": s.dropout_rate,
                "example_cap": s.example_cap,
            },
            "privacy": (
                {"enabled": True, "epsilon": s.epsilon, "delta": s.delta, "planned_rounds": max(1, s.rounds)}
                if dp
                else {"enabled": False}  # the budget keys are refused without DP (nothing reads them)
            ),
        },
        base_dir=data_dir,
    )


def _sensitivities(n: int, m: int, settings: ScaledSettings) -> tuple[ServerConfig, Any, tuple[float, float], Any]:
    """(configuration, strategy, (Δ1, Δ2) of a model round, popularity quantization) of a run over ``n``
    devices and ``m`` items; the configuration's data folder is a temporary one, removed again."""
    s = settings
    cohort_size = max(1, math.ceil(s.fraction * n))
    scale_bits = s.scale_bits or _largest_scale_bits(cohort_size, s.clip_norm)
    tmp = tempfile.mkdtemp(prefix="fedrec-privsim-")
    try:
        cfg = scaled_config(n, m, replace(s, scale_bits=scale_bits), Path(tmp))
        base = build_strategy(cfg)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the configuration needs a data folder; the simulator writes none
    l2m, l1m = sensitivity(cfg.rounds.quantization(), int(base.vector_length))
    return cfg, base, (l1m, l2m), widest_quantization(n, math.sqrt(s.pop_theta))


def plan_run(
    train: Ratings, settings: ScaledSettings, *, negatives: int | None, rounds: int = PRIVATE_ROUNDS
) -> PrivatePlan:
    """The privacy planner's choice of the popularity share and the rounds for ``settings.epsilon`` over
    ``train`` (`fedsim.private.planner`), with this run's own sensitivities and accountant; ``negatives``: the
    evaluation's sampled items per positive (None: full ranking)."""
    s = settings
    _, _, model_sens, _ = _sensitivities(train.n_users, train.n_items, s)
    return plan_split(
        train, epsilon=s.epsilon, delta=s.delta, rounds=rounds, model_sens=model_sens, negatives=negatives, seed=s.seed
    )


def with_plan(settings: ScaledSettings, plan: PrivatePlan) -> ScaledSettings:
    """``settings`` with the plan's popularity share and rounds (no round: the share is not used)."""
    return replace(settings, pop_share=plan.pop_share if plan.rounds else settings.pop_share, rounds=plan.rounds)


def run_private_scaled(
    train: Ratings,
    settings: ScaledSettings,
    *,
    on_round: Callable[[int, float], None] | None = None,
) -> ScaledResult:
    """Run the popularity release and T private LightFR rounds over every user of ``train`` (T = 0: the
    release alone, with the whole ε)."""
    from device_sdk.batched import refreshed_vectors
    from device_sdk.lightfr import dcd_full, dcd_update

    start = time.perf_counter()
    s = settings
    n, m = train.n_users, train.n_items
    per_user = _per_user(train)
    dp = s.epsilon > 0
    if s.rounds == 0:
        return _popularity_only(per_user, m, s, start)
    cfg, base, (l1m, l2m), qp = _sensitivities(n, m, s)
    qm = cfg.rounds.quantization()
    scale_bits = qm.scale_bits
    l2p, l1p = sensitivity(qp, m)
    pop_share = s.pop_share if s.pop_share > 0 else 0.0
    mu_model, mu_pop = split_run_budget(s.epsilon, s.delta, s.rounds, (l1m, l2m), (l1p, l2p), pop_share)
    strategy: Strategy = base
    if dp and s.threshold > 0:
        inflation = colluder_inflation(cfg.rounds.cohort_size, cfg.rounds.adversary_rate)
        strategy = NoiseAwareLightFR(base, math.sqrt(mu_model * inflation) / qm.scale, s.threshold)
    sim = PrivateSimulator(cfg, strategy=strategy, mu=mu_model if dp else None)
    counts = seeded_release(per_user, m, s.pop_theta, qp, mu_pop, s.seed, sim.ledger)
    cohort = LightFRCohort([(u, None) for u in per_user], m, s.bits)
    round_seconds = sim.run_scaled_rounds(cohort, s.rounds, sim_seed=s.seed, on_round=on_round)
    st: Any = base
    D = np.asarray(st.codes(sim.model_state), dtype=np.int8)
    beta = np.zeros(m)
    levels = None
    if st.full:
        levels = np.asarray(st.levels(sim.model_state), dtype=np.uint8)
        beta = bias_from_levels(levels, m, s.bits, st.hamming_weight)
    # Each device refreshes its code against the final item codes (local; nothing uploaded).
    indptr = np.concatenate(([0], np.cumsum([u.size for u in per_user]))).astype(np.int64)
    items = np.concatenate(per_user) if per_user else np.zeros(0, np.int64)
    ones, w0 = np.ones(items.size), float(st.current_weight)
    vectors: NDArray[np.float64] | None = None
    with one_blas_thread():
        if st.full and s.query_planes:
            q, _, vectors = refreshed_vectors(
                indptr, items, ones, D, beta, w0, 0.0, s.user_reg, s.rank_planes or s.query_planes, st.hamming_weight
            )
            B = np.where(q > 0, 1, -1).astype(np.int8)
        elif st.full:
            B, _ = dcd_full(
                indptr, items, np.ones(items.size), cohort.codes, D, beta, st.current_weight, 0.0, max_sweeps=10
            )
            if s.rank_planes:
                # The SDK's default device: its vector with ridge rank_ridge·w0·m (LightFRConfig.rank_ridge).
                _, _, vectors = refreshed_vectors(
                    indptr, items, ones, D, beta, w0, 0.0, s.rank_ridge * w0 * m, s.rank_planes, st.hamming_weight
                )
        else:
            B, _ = dcd_update(indptr, items, np.ones(items.size), cohort.codes, D, 0.0, max_sweeps=10)
    eps = sim.ledger.spent() if sim.ledger is not None else None
    return ScaledResult(
        item_codes=D,
        user_codes=B,
        private_counts=counts,
        epsilon=eps,
        delta=s.delta,
        mu_model=mu_model,
        mu_pop=mu_pop,
        seconds=time.perf_counter() - start,
        round_seconds=round_seconds,
        settings=replace(s, scale_bits=scale_bits),
        item_bias=beta * s.bits / 2.0,
        user_vectors=vectors,
        last_release=sim.last_release,
        last_users=np.asarray(sim.last_survivors, dtype=np.int64) - cohort.device_ids[0],  # ids are consecutive
        unobserved_weight=float(st.current_weight) if st.full else 0.0,
        hamming_weight=int(st.hamming_weight),
        item_levels=levels,
    )


def _popularity_only(per_user: list[NDArray[np.int64]], m: int, s: ScaledSettings, start: float) -> ScaledResult:
    """The popularity release alone, calibrated to the whole ε (no model round: the model is the list)."""
    n = len(per_user)
    counts, mu_pop, eps = popularity_only(per_user, m, epsilon=s.epsilon, delta=s.delta, theta=s.pop_theta, seed=s.seed)
    return ScaledResult(
        item_codes=np.ones((m, s.bits), np.int8),
        user_codes=np.ones((n, s.bits), np.int8),
        private_counts=counts,
        epsilon=eps,
        delta=s.delta,
        mu_model=0.0,
        mu_pop=mu_pop,
        seconds=time.perf_counter() - start,
        settings=s,
    )


def item_levels(counts: NDArray[np.float64], top: float) -> NDArray[np.float64]:
    """Private counts on a log scale spread over [0, ``top``] (negative noisy counts count as 0): f for LightFR's
    codes, 1 for iALS, R for MF."""
    lv = np.log1p(np.maximum(counts, 0.0))
    highest = float(lv.max()) if lv.size else 0.0
    return lv * (top / highest) if highest > 0 else lv


def scorer(result: ScaledResult, alpha: float) -> Callable[[NDArray[np.int64]], NDArray[np.float64]]:
    """``(f − Hamming(b_u, d_i)) + own_i + α·level_i`` for a batch of users, own_i the model's item
    bias β_i·f/2 (all-items objective; 0 otherwise) and level_i the private popularity (α = ∞: the
    level alone)."""
    f = result.item_codes.shape[1]
    level = item_levels(result.private_counts, f)
    Dt = result.item_codes.astype(np.float32).T
    B = (result.user_codes if result.user_vectors is None else result.user_vectors).astype(np.float32)

    own = _own_term(result)

    def score(users: NDArray[np.int64]) -> NDArray[np.float64]:
        if math.isinf(alpha):
            return np.broadcast_to(level, (np.asarray(users).size, level.size)).astype(np.float64)
        # f − Hamming = (f + b·d)/2, exact in float32 for f ≤ 2^23.
        sim = (f + B[np.asarray(users)] @ Dt) / 2.0
        return sim.astype(np.float64) + own + alpha * level

    return score


def packed(result: ScaledResult) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    """(user words, item words) for `fedsim.evaluation.ranking.hamming_scorer`."""
    return pack_signs(result.user_codes), pack_signs(result.item_codes)


def candidate_scores(result: ScaledResult, users: NDArray[np.int64], items: NDArray[np.int64], alpha: float) -> Any:
    """Scores of candidate blocks (``items[j]`` ranked for ``users[j]``), as `scorer` scores them."""
    f = result.item_codes.shape[1]
    level = item_levels(result.private_counts, f)
    if math.isinf(alpha):
        return level[items]
    if result.user_vectors is None:
        B = result.user_codes[users].astype(np.int32)
        dots = np.einsum("uf,ukf->uk", B, result.item_codes[items].astype(np.int32))
    else:  # asymmetric scoring: the vector's real score u·d in place of b·d
        dots = np.einsum("uf,ukf->uk", result.user_vectors[users], result.item_codes[items].astype(np.float64))
    return (f + dots) / 2.0 + _own_term(result)[items] + alpha * level[items]


def _own_term(result: ScaledResult) -> NDArray[np.float64]:
    """The model's own item term (its learned biases, in units of f − Hamming), zeros if none."""
    m = result.item_codes.shape[0]
    return np.zeros(m) if result.item_bias is None else result.item_bias


@dataclass(frozen=True, slots=True)
class PlanRow:
    """The planner's prediction for one (rounds, clip) choice.

    Attributes
    ----------
    rounds, clip_norm : the choice.
    scale_bits : the fixed-point scale that fits the bit budget.
    sigma : standard deviation of the released noise per coordinate and round, in float units.
    median_snr : per-coordinate signal-to-noise of the median item (by number of users).
    covered : share of the training interactions on items whose predicted SNR is at least 2.
    pop_noise : standard deviation of the private popularity counts (in users).
    pop_top_gap : the 100th largest true count divided by ``pop_noise`` (how well the head is ranked).
    """

    rounds: int
    clip_norm: float
    scale_bits: int
    sigma: float
    median_snr: float
    covered: float
    pop_noise: float
    pop_top_gap: float


def plan_privacy(
    train: Ratings,
    *,
    epsilon: float,
    delta: float = 1e-5,
    bits: int = 64,
    example_cap: int = 50,
    negatives: int = 0,
    pop_share: float = 0.1,
    rounds: tuple[int, ...] = (1, 2, 3, 5, 10),
    clips: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0),
) -> list[PlanRow]:
    """Predict, before spending anything, the per-coordinate signal-to-noise of each choice.

    The model: a device with k kept items uploads (1 + negatives)·k rows of f gradient coordinates of
    magnitude about 1/2, so its norm is about ½·√((1 + negatives)·k·f) and clipping to C scales it by
    c = min(1, C / norm).  An item rated by n_i devices whose gradients agree sums to about ½·c·n_i per
    coordinate; the released noise has standard deviation σ = √(μ·n/(n − f)) / 2^s, with μ from `split_budget`
    (the accountant's own numbers) and n/(n − f) what every device's share of the colluders' noise adds
    (`colluder_inflation`).  The popularity release adds noise of σ_pop users per item.
    Every figure uses only the public shape of the data a planner would know (users per item).
    """
    n, m = train.n_users, train.n_items
    per_user = np.bincount(train.users, minlength=n)
    kept = np.minimum(per_user, example_cap) if example_cap else per_user
    users_per_item = np.bincount(train.items, minlength=m).astype(np.float64)
    theta_pop = example_cap or int(per_user.max())
    inflation = colluder_inflation(n)
    qp = widest_quantization(n, math.sqrt(theta_pop))
    l2p, l1p = sensitivity(qp, m)
    out = []
    for clip in clips:
        qm = widest_quantization(n, clip)
        s_bits = qm.scale_bits
        l2m, l1m = sensitivity(qm, m * bits)
        norm = 0.5 * np.sqrt((1 + negatives) * np.maximum(kept, 1) * bits)
        c = float(np.mean(np.minimum(1.0, clip / norm)))
        for r in rounds:
            mu, mu_pop = split_budget(epsilon, delta, r, (l1m, l2m), (l1p, l2p), pop_share)
            sigma = math.sqrt(mu * inflation) / qm.scale
            snr = 0.5 * c * users_per_item / sigma
            covered = float(users_per_item[snr >= 2].sum() / max(users_per_item.sum(), 1))
            pop_noise = math.sqrt(mu_pop * inflation) / qp.scale if mu_pop else 0.0
            head = float(np.sort(users_per_item)[::-1][min(99, m - 1)])
            out.append(
                PlanRow(
                    rounds=r,
                    clip_norm=clip,
                    scale_bits=s_bits,
                    sigma=sigma,
                    median_snr=float(np.median(snr)),
                    covered=covered,
                    pop_noise=pop_noise,
                    pop_top_gap=head / pop_noise if pop_noise else math.inf,
                )
            )
    return out


def evaluate_private(
    data: Any,
    settings: ScaledSettings,
    *,
    eval_seed: int = 0,
    val_users: int = 8000,
    test_users: int | None = None,
    on_round: Callable[[int, float], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Train privately on ``data`` (a `fedsim.evaluation.experiment.Experiment` with candidate blocks, or a
    `fedsim.data.kgat.TrainTestSplit` evaluated by full ranking) and evaluate on its test split.

    α of the item level is chosen on validation (`validate_private`); the test split is scored once for the
    chosen α, for private popularity (α = ∞), and for the non-private popularity and random baselines (random
    ties everywhere; `fedsim.private.served.evaluate_served`).  ``test_users`` evaluates a seeded sample of that
    many users instead of all (full ranking only).

    Returns
    -------
    (metrics, extra) : ``metrics`` maps "model", "private_popularity", "popularity", "random" to
        their metric maps; ``extra`` holds "epsilon" (the ledger's), "delta", "alpha", "validation" (the
        chosen score's validation figure) and the μ's (`fedsim.private.served.ServedScore.extra`).
    """
    served = validate_private(data, settings, eval_seed=eval_seed, val_users=val_users, on_round=on_round, log=log)
    return evaluate_served(data, served, eval_seed=eval_seed, test_users=test_users), served.extra()


def validate_private(
    data: Any,
    settings: ScaledSettings,
    *,
    eval_seed: int = 0,
    val_users: int = 8000,
    on_round: Callable[[int, float], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> ServedScore:
    """Train privately on ``data`` and choose α of the item level on validation (candidate blocks, or one
    carved train item per user), without reading the test split: a `fedsim.private.served.ServedScore`."""
    return validate(
        data,
        run_private_scaled,
        settings,
        scorer,
        candidate_scores,
        ALPHAS,
        eval_seed=eval_seed,
        val_users=val_users,
        on_round=on_round,
        log=log,
    )
