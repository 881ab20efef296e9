"""The privacy planner: the popularity floor it buys, its forecasts against measured runs, and the rule
that serves the private popularity list when the learned score does not beat it on validation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedsim.cli import main
from fedsim.data.datasets import load_dataset
from fedsim.data.ratings import Ratings
from fedsim.evaluation.experiment import prepare
from fedsim.evaluation.ranking import evaluate_candidates, expected_hits
from fedsim.private.planner import (
    POP_THETA,
    PRIVATE_ROUNDS,
    TARGET_RATIO,
    choose_with_margin,
    forecast_ratio,
    plan_private_run,
    popularity_weights,
)
from fedsim.private.scaled_lightfr import (
    ScaledSettings,
    _per_user,
    evaluate_private,
    plan_run,
    release_counts,
    widest_quantization,
    with_plan,
)
from fedsim.private.served import choose_alpha_full_ranking
from protocol.accounting import calibrate_mu
from protocol.quantization import sensitivity


def _ratings(users: list[int], items: list[int], n_users: int, n_items: int) -> Ratings:
    u, i = np.asarray(users, np.int64), np.asarray(items, np.int64)
    return Ratings(
        users=u,
        items=i,
        ratings=np.ones(u.size),
        timestamps=None,
        n_users=n_users,
        n_items=n_items,
        user_ids=np.arange(n_users),
        item_ids=np.arange(n_items),
        name="tiny",
    )


def test_theta_one_weights_a_device_of_k_items_one_over_root_k_as_the_release_does() -> None:
    train = _ratings([0, 0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 0, 0, 4], 3, 5)
    released, w = popularity_weights(train)
    assert w == pytest.approx([0.5, 0.5, 0.5, 0.5, 1.0, 2**-0.5, 2**-0.5])
    assert released == pytest.approx([0.5 + 1 + 2**-0.5, 0.5, 0.5, 0.5, 2**-0.5])
    q = widest_quantization(3, math.sqrt(POP_THETA))
    counts = release_counts(_per_user(train), 5, POP_THETA, q, 0.0, np.random.default_rng(0))
    assert counts == pytest.approx(released, abs=2 / q.scale)


def test_margin_rule_serves_the_floor_unless_the_gain_is_clear() -> None:
    rng = np.random.default_rng(0)
    floor = rng.random(2000)
    noise_only = {math.inf: floor, 1.0: floor + rng.normal(0.002, 0.05, 2000)}
    alpha, why = choose_with_margin(noise_only)
    assert alpha == math.inf and "serving the private popularity list" in why
    clear = {math.inf: floor, 1.0: floor + rng.normal(0.02, 0.05, 2000), 4.0: floor + 0.001}
    alpha, why = choose_with_margin(clear)
    assert alpha == 1.0 and "beats" in why
    with pytest.raises(ValueError, match="floor"):
        choose_with_margin({1.0: floor})


def test_plan_takes_the_smallest_share_that_reaches_the_target_or_the_whole_budget() -> None:
    train = _ratings(list(range(400)) * 2, [0] * 300 + list(range(1, 101)) + list(range(400)), 400, 401)
    sigmas = {0.05: 30.0, 0.1: 12.0, 0.15: 6.0, 0.2: 2.0, 0.3: 1.0}

    def sigma_at(share: float) -> float:
        return sigmas.get(share, 0.5)

    plan = plan_private_run(train, epsilon=8, delta=1e-5, negatives=99, sigma_at=sigma_at, sigma_all=0.4)
    assert plan.rounds == PRIVATE_ROUNDS and plan.forecast >= TARGET_RATIO
    chosen = sorted(sigmas).index(plan.pop_share) if plan.pop_share in sigmas else len(sigmas)
    for share in sorted(sigmas)[:chosen]:  # every smaller share misses the target
        assert forecast_ratio(train, sigma_at(share), negatives=99) < TARGET_RATIO
    hopeless = plan_private_run(
        train, epsilon=0.1, delta=1e-5, negatives=99, sigma_at=lambda s: 500.0, sigma_all=200.0
    )
    assert (hopeless.rounds, hopeless.pop_share) == (0, 1.0) and not hopeless.personalises
    assert "the private model is the private popularity list" in hopeless.verdict()


def _measured_ratio(exp: object, sigma_eps: float) -> tuple[float, float]:
    """(forecast, measured test ratio over five releases) of the θ = 1 release calibrated to ``sigma_eps``."""
    tr = exp.train  # type: ignore[attr-defined]
    q = widest_quantization(tr.n_users, 1.0)
    l2, l1 = sensitivity(q, tr.n_items)
    mu = calibrate_mu(sigma_eps, 1e-5, 1, l1, l2)
    sigma = math.sqrt(mu) / q.scale
    pop = np.bincount(tr.items, minlength=tr.n_items).astype(float)
    base = evaluate_candidates(pop[exp.test.items], 10).hr  # type: ignore[attr-defined]
    per_user = _per_user(tr)
    got = [
        evaluate_candidates(
            release_counts(per_user, tr.n_items, 1, q, mu, np.random.default_rng(r))[exp.test.items],  # type: ignore[attr-defined]
            10,
        ).hr
        for r in range(5)
    ]
    return forecast_ratio(tr, sigma, negatives=99), float(np.mean(got)) / base


@pytest.mark.parametrize("dataset", ["filmtrust", "ml-100k"])
def test_forecasts_match_measured_private_popularity(shared_data: Path, dataset: str) -> None:
    exp = prepare(load_dataset(dataset, shared_data))
    for eps in (1.0, 2.0, 8.0):
        forecast, measured = _measured_ratio(exp, eps)
        # The forecast errs low (it charges the 1/√k weighting, which ranks ML-100K's test items better than
        # counts): within 0.06 of what the release measures, and never more than 0.02 above it.
        assert measured - 0.06 <= forecast <= measured + 0.02, (dataset, eps, forecast, measured)


def test_private_model_never_ranks_below_its_floor_and_the_floor_is_near_popularity(shared_data: Path) -> None:
    exp = prepare(load_dataset("filmtrust", shared_data))
    settings = ScaledSettings(epsilon=8.0, unobserved_weight="auto", seed=0)
    plan = plan_run(exp.train, settings, negatives=99)
    assert plan.forecast >= TARGET_RATIO
    metrics, extra = evaluate_private(exp, with_plan(settings, plan))
    pop = metrics["popularity"]["hr@10"]
    assert metrics["private_popularity"]["hr@10"] >= 0.95 * pop
    assert metrics["model"]["hr@10"] >= metrics["private_popularity"]["hr@10"] - 0.005
    assert 7.99 < extra["epsilon"] <= 8.0


def test_expected_hits_average_to_the_reported_hit_ratio() -> None:
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 5, size=(200, 30)).astype(float)
    assert expected_hits(scores, 10).mean() == pytest.approx(evaluate_candidates(scores, 10).hr)


def test_simulate_prints_the_plan_first_and_reports_it(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--model", "lightfr", "--dataset", "synthetic", "--epsilon", "8", "--bits", "16", "--quiet"]
    argv.append("--json")
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert cap.err.startswith("plan: at ")  # the human lines go to stderr under --json
    record = json.loads(cap.out)
    plan = record["plan"]
    assert plan["pop_theta"] == 1 and set(plan) >= {"pop_share", "rounds", "forecast_ratio", "personalises"}
    assert record["rounds"] == plan["rounds"]
    assert 7.99 < record["epsilon"] <= 8.0
    m = record["metrics"]
    assert m["model"]["hr@10"] >= m["private_popularity"]["hr@10"] - 0.005


def test_simulate_with_no_rounds_serves_the_private_list_with_the_whole_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--model", "lightfr", "--dataset", "synthetic", "--epsilon", "2", "--rounds", "0", "--quiet"]
    argv.append("--json")
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert "the private model is the private popularity list" in cap.err.splitlines()[0]
    record = json.loads(cap.out)
    assert record["rounds"] == 0 and record["plan"]["pop_share"] == 1.0
    assert record["metrics"]["model"] == record["metrics"]["private_popularity"]
    assert 1.99 < record["epsilon"] <= 2.0


def test_alpha_without_the_private_list_in_the_grid_is_the_best_on_validation() -> None:
    """A grid without α = ∞ (no popularity channel) has no floor to beat: the best validation mean wins."""
    fit = _ratings([0, 1, 2], [0, 1, 2], 3, 40)
    val = _ratings([0, 1, 2], [5, 6, 7], 3, 40)

    def scorer_for(alpha: float) -> object:
        good = np.zeros(40)
        good[[5, 6, 7]] = 1.0 if alpha == 0.0 else -1.0  # α = 0 ranks the held-out items first
        return lambda users: np.tile(good, (np.asarray(users).size, 1))

    alpha, recall = choose_alpha_full_ranking(scorer_for, fit, val, (1.0, 0.0), val_users=3, eval_seed=0)
    assert alpha == 0.0 and recall == 1.0
    # With the list in the grid, a learned score that does not beat it clearly is not served.
    alpha, _ = choose_alpha_full_ranking(
        lambda a: scorer_for(0.0), fit, val, (0.0, math.inf), val_users=3, eval_seed=0
    )
    assert alpha == math.inf
