"""The all-items LightFR objective: device DCD against the item Gram, the upload layout, and the
server's code and bias step, each checked against a dense, literal evaluation of the objective."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from agg_server.strategy.lightfr import LightFRServerParams, LightFRServerStrategy, agg_full
from device_sdk import lightfr
from protocol.codes import random_signs
from protocol.families.lightfr import LEVEL_CENTER, UploadLayout, bias_from_levels, levels_from_bias
from protocol.plan import LightFRParams


def _batch(rng: np.random.Generator, n: int, m: int, per_user: int):
    counts = rng.integers(1, per_user + 1, n)
    indptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    items = np.concatenate([rng.choice(m, c, replace=False) for c in counts]).astype(np.int64)
    return indptr, items, rng.random(items.size)


def _item_loss(
    U: np.ndarray,
    beta: np.ndarray,
    indptr: np.ndarray,
    items: np.ndarray,
    r: np.ndarray,
    w0: float,
    alpha: float,
    i: int,
    d: np.ndarray,
) -> float:
    """Item i's part of the all-items loss with code d: (1 + α)(r − x)² for the users who rated it,
    w0·x² for the rest, x = u·d/f + β_i."""
    x = U @ d / U.shape[1] + beta[i]
    loss = 0.0
    for u in range(len(indptr) - 1):
        hit = np.flatnonzero(items[indptr[u] : indptr[u + 1]] == i)
        loss += (1 + alpha) * (r[indptr[u] + hit[0]] - x[u]) ** 2 if hit.size else w0 * x[u] ** 2
    return float(loss)


def _dense_loss(b, D, beta, items, r, w0, alpha) -> float:
    """Σ_{i∈Ω} c (t_i − x_i)² + w0 Σ_{i∉Ω} x_i², x = bᵀd/f + β, by brute force over all items."""
    f = b.size
    x = D.astype(float) @ b / f + beta
    obs = np.zeros(D.shape[0], bool)
    obs[items] = True
    t = np.zeros(D.shape[0])
    t[items] = r
    return float(np.sum((1 + alpha) * (t - x)[obs] ** 2) + w0 * np.sum(x[~obs] ** 2))


@pytest.mark.parametrize("seed", range(4))
def test_dcd_full_never_increases_the_all_items_loss_and_each_bit_is_optimal(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, m, f = 6, 40, 12
    indptr, items, r = _batch(rng, n, m, 8)
    D, B0 = random_signs(m, f, rng), random_signs(n, f, rng)
    beta = rng.normal(0, 0.2, m)
    w0, alpha = 0.3, 1.5
    B, stats = lightfr.dcd_full(indptr, items, r, B0, D, beta, w0, alpha, max_sweeps=50)
    assert stats.converged
    for u in range(n):
        sl = slice(indptr[u], indptr[u + 1])
        before = _dense_loss(B0[u].astype(float), D, beta, items[sl], r[sl], w0, alpha)
        after = _dense_loss(B[u].astype(float), D, beta, items[sl], r[sl], w0, alpha)
        assert after <= before + 1e-9
        # Converged: no single bit flip lowers the loss (coordinate-wise optimum).
        for k in range(f):
            b = B[u].astype(float)
            b[k] = -b[k]
            assert _dense_loss(b, D, beta, items[sl], r[sl], w0, alpha) >= after - 1e-9


def test_full_upload_is_the_sum_of_device_uploads_and_matches_the_item_side_loss() -> None:
    rng = np.random.default_rng(7)
    n, m, f = 5, 30, 8
    indptr, items, r = _batch(rng, n, m, 6)
    D, B = random_signs(m, f, rng), random_signs(n, f, rng)
    beta = rng.normal(0, 0.1, m)
    w0, alpha = 0.2, 2.0
    total = lightfr.full_upload(indptr, items, r, B, D, beta, w0, alpha)
    for key in total:
        acc = sum(
            lightfr.full_upload(
                np.array([0, indptr[u + 1] - indptr[u]]),
                items[indptr[u] : indptr[u + 1]],
                r[indptr[u] : indptr[u + 1]],
                B[u : u + 1],
                D,
                beta,
                w0,
                alpha,
            )[key]
            for u in range(n)
        )
        np.testing.assert_allclose(total[key], acc, atol=1e-9)
    # The server's sign test for item i, bit k equals the sign of the loss change of flipping it.
    new_D, _ = agg_full(D, beta, total, n, w0, alpha, flip_fraction=1.0, learn_bias=False)

    item_loss = partial(_item_loss, B.astype(float), beta, indptr, items, r, w0, alpha)

    for i in np.unique(items)[:5]:
        # Bit 0 is decided first, from the old codes: flipping must not increase the item's loss.
        d_old = D[i].astype(float)
        d_new = d_old.copy()
        d_new[0] = new_D[i, 0]
        assert item_loss(i, d_new) <= item_loss(i, d_old) + 1e-9


def test_server_bias_is_the_exact_minimiser_given_the_codes() -> None:
    rng = np.random.default_rng(3)
    n, m, f = 7, 25, 8
    indptr, items, r = _batch(rng, n, m, 6)
    D, B = random_signs(m, f, rng), random_signs(n, f, rng)
    w0, alpha = 0.25, 1.0
    parts = lightfr.full_upload(indptr, items, r, B, D, np.zeros(m), w0, alpha)
    _, beta = agg_full(D, np.zeros(m), parts, n, w0, alpha, flip_fraction=1.0)
    s = B.astype(float) @ D.T.astype(float) / f  # (n, m)
    for i in range(m):
        wts = np.full(n, w0)
        t = np.zeros(n)
        for u in range(n):
            its = items[indptr[u] : indptr[u + 1]]
            hit = np.flatnonzero(its == i)
            if hit.size:
                wts[u], t[u] = 1 + alpha, r[indptr[u] + hit[0]]
        assert beta[i] == pytest.approx(np.sum(wts * (t - s[:, i])) / np.sum(wts), abs=1e-12)


def test_layout_round_trip_and_levels() -> None:
    m, f = 6, 4
    lay = UploadLayout(m, f, full=True)
    rng = np.random.default_rng(0)
    g, bias, cnt = rng.random((m, f)), rng.random(m), rng.integers(0, 3, m).astype(float)
    gram, bsum = rng.random((f, f)), rng.random(f)
    v = lay.join(g, bias, cnt, gram, bsum)
    assert v.size == lay.length == m * f + 2 * m + f * f + f
    back = lay.split(v)
    for key, want in {"gradient": g, "bias": bias, "counts": cnt, "gram": gram, "code_sum": bsum}.items():
        np.testing.assert_allclose(back[key], want)
    assert UploadLayout(m, f, full=False).length == m * f
    with pytest.raises(ValueError, match="only the item gradients"):
        _ = UploadLayout(m, f, full=False).counts
    with pytest.raises(ValueError, match="elements"):
        lay.split(v[:-1])
    beta = np.array([-5.0, -0.25, 0.0, 0.03, 0.5, 9.0])
    lv = levels_from_bias(beta, 64, 2)
    assert lv.dtype == np.uint8 and lv[2] == LEVEL_CENTER and lv[0] == 0 and lv[-1] == 255
    np.testing.assert_allclose(bias_from_levels(lv, 6, 64, 2)[1:5], beta[1:5], atol=1 / 64)
    with pytest.raises(ValueError, match="uint8"):
        bias_from_levels(lv.astype(np.int16), 6, 64, 2)


def test_full_kernels_reject_bad_input() -> None:
    rng = np.random.default_rng(0)
    indptr, items, r = _batch(rng, 2, 10, 3)
    D, B = random_signs(10, 4, rng), random_signs(2, 4, rng)
    with pytest.raises(ValueError, match="unobserved weight"):
        lightfr.dcd_full(indptr, items, r, B, D, np.zeros(10), 0.0, 0.0)
    with pytest.raises(ValueError, match="confidence"):
        lightfr.full_upload(indptr, items, r, B, D, np.zeros(10), 0.1, -1.0)
    with pytest.raises(ValueError, match="biases"):
        lightfr.dcd_full(indptr, items, r, B, D, np.zeros(9), 0.1, 0.0)


def test_devices_through_the_wire_match_the_in_process_cohort() -> None:
    """LightFRModel devices fed the server's ModelPayload and RoundInvite upload vectors whose sum,
    aggregated by the server strategy, is exactly the in-process batched step (codes and levels)."""
    from agg_server.strategy.base import round_plan
    from device_sdk.family import LocalRatings
    from device_sdk.models import LightFRConfig, LightFRModel
    from protocol.codec import decode, encode
    from protocol.messages import ModelPayload

    rng = np.random.default_rng(11)
    n, m, f = 9, 30, 16
    indptr, items, _ = _batch(rng, n, m, 6)
    r = np.ones(items.size)
    strategy = LightFRServerStrategy(
        n_items=m,
        params=LightFRParams(unobserved_weight=0.2, confidence=1.0),
        server=LightFRServerParams(bits=f, flip_fraction=1.0, mean_field=False, hamming_weight=2),
    )
    state = strategy.initialize(rng)
    state[:, -1] = rng.integers(-20, 20, m).astype(np.int8)  # some item levels
    wire = decode(
        encode(ModelPayload(model_version=1, model_kind="lightfr", bits=f, n_items=m, **strategy.to_wire(state)))
    )
    assert isinstance(wire, ModelPayload) and len(wire.item_levels) == m and wire.hamming_weight == 2
    np.testing.assert_array_equal(strategy.from_wire(wire.words, wire.values, wire.item_levels), state)
    plan = round_plan(strategy, 1)
    B0 = random_signs(n, f, rng)
    total = np.zeros(strategy.vector_length)
    for u in range(n):
        dev = LightFRModel(m, LightFRConfig(bits=f, rating_range=None), rng=np.random.default_rng(u))
        dev.set_global(wire.words, wire.values, 1, **wire.lightfr_extras())
        dev.user_codes[0] = B0[u]
        dev.user_trained[0] = True
        res = dev.local_update(plan, LocalRatings.single_user(items[indptr[u] : indptr[u + 1]], None), rng)
        assert res.vector.size == strategy.vector_length == m * f + 2 * m + f * f + f
        total += res.vector
    new_state = strategy.aggregate(state, total, n, np.random.default_rng(0), round_index=0)
    # The batched in-process step on the same inputs.
    beta = bias_from_levels((state[:, -1].astype(np.int16) + LEVEL_CENTER).astype(np.uint8), m, f, 2)
    B1, _ = lightfr.dcd_full(indptr, items, r, B0, state[:, :f], beta, 0.2, 1.0, max_sweeps=10)
    parts = lightfr.full_upload(indptr, items, r, B1, state[:, :f], beta, 0.2, 1.0)
    D, new_beta = agg_full(state[:, :f], beta, parts, n, 0.2, 1.0, flip_fraction=1.0)
    np.testing.assert_array_equal(new_state[:, :f], D)
    np.testing.assert_array_equal(strategy.levels(new_state), levels_from_bias(new_beta, f, 2))


def test_density_weight_rule_and_its_clips() -> None:
    from protocol.families.lightfr import DENSITY_POWER, DENSITY_SCALE, density_weight

    # 10 devices with 50 positives each over 1000 items: density 0.05.
    assert density_weight(500.0, 10, 1000) == pytest.approx(DENSITY_SCALE * 0.05**DENSITY_POWER)
    # A noisy sum below one positive per device (or not finite) counts as one per device: the floor 1/m.
    floor = DENSITY_SCALE * (1 / 1000) ** DENSITY_POWER
    assert density_weight(-30.0, 10, 1000) == density_weight(float("nan"), 10, 1000) == pytest.approx(floor)
    assert density_weight(1e9, 10, 1000, cap=0.25) == 0.25  # density clipped to 1, w0 to the cap
    with pytest.raises(ValueError, match="devices and n_items"):
        density_weight(1.0, 0, 10)
    with pytest.raises(ValueError, match="scale and power"):
        density_weight(1.0, 1, 10, scale=0.0)


def test_server_derives_w0_from_the_counts_of_each_sum() -> None:
    """With unobserved_scale > 0 the strategy steps with κ·density^γ of the round's own counts and
    sends that w0 in the next plan; the step equals agg_full called with it."""
    from protocol.families.lightfr import density_weight

    rng = np.random.default_rng(5)
    n, m, f = 12, 40, 16
    indptr, items, _ = _batch(rng, n, m, 8)
    r = np.ones(items.size)
    strategy = LightFRServerStrategy(
        n_items=m,
        params=LightFRParams(unobserved_weight=0.05),
        server=LightFRServerParams(bits=f, flip_fraction=1.0, mean_field=False, unobserved_scale=0.6),
    )
    assert strategy.plan().unobserved_weight == 0.05  # round 1: the provisional value
    state = strategy.initialize(rng)
    B = random_signs(n, f, rng)
    beta = np.zeros(m)
    parts = lightfr.full_upload(indptr, items, r, B, state[:, :f], beta, 0.05, 0.0)
    total = UploadLayout(m, f, full=True).join(**parts)
    new_state = strategy.aggregate(state, total, n, np.random.default_rng(0), round_index=0)
    w0 = density_weight(float(items.size), n, m, scale=0.6)
    assert strategy.plan().unobserved_weight == pytest.approx(w0) and w0 != 0.05
    D, new_beta = agg_full(state[:, :f], beta, parts, n, w0, 0.0, flip_fraction=1.0)
    np.testing.assert_array_equal(new_state[:, :f], D)
    np.testing.assert_array_equal(strategy.levels(new_state), levels_from_bias(new_beta, f, 2))
    with pytest.raises(ValueError, match="unobserved_scale"):
        LightFRServerParams(bits=f, unobserved_scale=-1.0)
    with pytest.raises(ValueError, match="unobserved_scale: needs the all-items objective"):
        LightFRServerStrategy(
            n_items=m, params=LightFRParams(unobserved_weight=0.0), server=LightFRServerParams(unobserved_scale=0.6)
        )


def test_server_config_auto_weight_builds_a_density_strategy(tmp_path) -> None:
    from functools import partial

    from agg_server.config import config_from_dict as from_dict
    from agg_server.strategy import build_strategy
    from protocol.errors import ConfigError
    from protocol.families.lightfr import density_weight

    config_from_dict = partial(from_dict, base_dir=tmp_path)
    base = {"server": {"data_dir": str(tmp_path)}}
    st = build_strategy(config_from_dict({**base, "model": {"n_items": 500}}))
    assert st.server.unobserved_scale == 0.6 and st.plan().unobserved_weight == density_weight(0.0, 1, 500)
    fixed = build_strategy(config_from_dict({**base, "model": {"n_items": 500, "unobserved_weight": 0.1}}))
    assert fixed.server.unobserved_scale == 0.0 and fixed.plan().unobserved_weight == 0.1
    with pytest.raises(ConfigError, match='"auto" or a number'):
        config_from_dict({**base, "model": {"n_items": 500, "unobserved_weight": "automatic"}})
    with pytest.raises(ConfigError, match="unobserved_scale"):
        config_from_dict({**base, "model": {"n_items": 500, "unobserved_scale": 0}})
    # the mean-field step is the default, and with it ρ = 1; without it (or with sampled negatives) ρ = 0.3
    assert st.server.mean_field and st.rule.flip_fraction == 1.0
    jacobi = build_strategy(config_from_dict({**base, "model": {"n_items": 500, "mean_field": False}}))
    assert not jacobi.server.mean_field and jacobi.rule.flip_fraction == 0.3
    sampled = build_strategy(config_from_dict({**base, "model": {"n_items": 500, "unobserved_weight": 0}}))
    assert sampled.rule.flip_fraction == 0.3
    given = build_strategy(config_from_dict({**base, "model": {"n_items": 500, "flip_fraction": 0.5}}))
    assert given.server.mean_field and given.rule.flip_fraction == 0.5
    with pytest.raises(ConfigError, match="model.mean_field: must be true or false"):
        config_from_dict({**base, "model": {"n_items": 500, "mean_field": "yes"}})
    # the passes of the code step: one by default, as configured otherwise
    assert st.server.code_sweeps == 1
    assert (
        build_strategy(config_from_dict({**base, "model": {"n_items": 500, "code_sweeps": 10}})).server.code_sweeps
        == 10
    )
    for bad in (0, 101, 2.5, True):
        with pytest.raises(ConfigError, match="model.code_sweeps"):
            config_from_dict({**base, "model": {"n_items": 500, "code_sweeps": bad}})


def test_clip_parts_gives_the_counts_their_share_of_the_clip_norm() -> None:
    from protocol.families.lightfr import clip_parts

    m, f, clip = 30, 8, 4.0
    layout = UploadLayout(m, f, full=True)
    rng = np.random.default_rng(0)
    v = rng.normal(size=layout.length) * 3.0
    out = clip_parts(v, layout, clip, 0.25)
    counts = out[layout.counts]
    rest = np.delete(out, np.arange(layout.counts.start, layout.counts.stop))
    assert np.linalg.norm(counts) <= clip * 0.5 + 1e-12 and np.linalg.norm(rest) <= clip * np.sqrt(0.75) + 1e-12
    assert np.linalg.norm(out) <= clip + 1e-12
    # Each part is only scaled, never changed in direction.
    assert np.allclose(counts / np.linalg.norm(counts), v[layout.counts] / np.linalg.norm(v[layout.counts]))
    # A part already within its share is left alone; share 0 is the plain copy.
    small = np.zeros(layout.length)
    small[layout.counts.start] = 1.0
    assert np.array_equal(clip_parts(small, layout, clip, 0.25), small)
    assert np.array_equal(clip_parts(v, layout, clip, 0.0), v)
    with pytest.raises(ValueError, match="counts share"):
        clip_parts(v, layout, clip, 1.0)
    with pytest.raises(ValueError, match="all-items"):
        clip_parts(v[: m * f], UploadLayout(m, f, full=False), clip, 0.5)


def test_popularity_levels_follow_the_released_counts_and_average_over_rounds() -> None:
    from agg_server.strategy.lightfr import popularity_bias

    beta = popularity_bias(np.array([-3.0, 0.0, 1.0, 10.0, 100.0]), 2.0)
    assert beta[0] == beta[1] == 0.0 and np.all(np.diff(beta[1:]) > 0) and beta[-1] == pytest.approx(2.0)
    assert np.array_equal(popularity_bias(np.array([-1.0, 0.0]), 2.0), np.zeros(2))
    m, f = 6, 8
    st = LightFRServerStrategy(
        n_items=m,
        params=LightFRParams(unobserved_weight=0.1, counts_share=0.5),
        server=LightFRServerParams(bits=f, flip_fraction=1.0, mean_field=False, hamming_weight=1, popularity_span=2.0),
    )
    assert st.plan().counts_share == 0.5
    layout = st.layout
    state = st.initialize(np.random.default_rng(0))
    parts = {
        "gradient": np.zeros((m, f)),
        "bias": np.full(m, 50.0),  # ignored: the levels come from the counts
        "counts": np.array([0.0, 1.0, 3.0, 7.0, 15.0, 31.0]),
        "gram": np.eye(f),
        "code_sum": np.zeros(f),
    }
    first = st.aggregate(state, layout.join(**parts), 5, np.random.default_rng(1), round_index=0)
    lv1 = st.levels(first)
    assert lv1 is not None and np.all(np.diff(lv1.astype(int)) > 0) and lv1[0] == LEVEL_CENTER
    want = levels_from_bias(popularity_bias(parts["counts"], 2.0), f, 1)
    assert np.array_equal(lv1, want)
    # Round 2 releases the reverse order: the level is the mean of the two rounds' biases (flat here).
    parts["counts"] = parts["counts"][::-1].copy()
    second = st.aggregate(first, layout.join(**parts), 5, np.random.default_rng(2), round_index=1)
    lv2 = st.levels(second)
    assert lv2 is not None and int(lv2.max()) - int(lv2.min()) <= 1
    with pytest.raises(ValueError, match="all-items"):
        LightFRServerStrategy(
            n_items=m, params=LightFRParams(unobserved_weight=0.0), server=LightFRServerParams(popularity_span=1.0)
        )


# -- asymmetric scoring: real user vectors (as bit-planes) against binary item codes ---------------


def _dense_loss_real(u, D, beta, items, r, w0, alpha, reg) -> float:
    f = u.size
    x = D.astype(float) @ u / f + beta
    obs = np.zeros(D.shape[0], bool)
    obs[items] = True
    t = np.zeros(D.shape[0])
    t[items] = r
    return float(np.sum((1 + alpha) * (t - x)[obs] ** 2) + w0 * np.sum(x[~obs] ** 2) + reg * (u @ u) / f**2)


@pytest.mark.parametrize("seed", range(3))
def test_ridge_users_is_the_exact_minimiser_and_beats_the_dcd_code(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, m, f = 6, 40, 8
    indptr, items, r = _batch(rng, n, m, 9)
    D = random_signs(m, f, rng)
    beta = rng.normal(0, 0.1, m)
    w0, alpha, reg = 0.15, 1.5, 0.7
    U = lightfr.ridge_users(indptr, items, r, D, beta, w0, alpha, reg, budget=64)  # tiny chunks: several solves
    B, _ = lightfr.dcd_full(indptr, items, r, random_signs(n, f, rng), D, beta, w0, alpha)
    G = D.astype(float).T @ D
    for u in range(n):
        its, ru = items[indptr[u] : indptr[u + 1]], r[indptr[u] : indptr[u + 1]]
        best = _dense_loss_real(U[u], D, beta, its, ru, w0, alpha, reg)
        for _ in range(5):  # every nearby vector is worse: a minimiser
            assert best <= _dense_loss_real(U[u] + rng.normal(0, 0.05, f), D, beta, its, ru, w0, alpha, reg)
        assert best <= _dense_loss_real(B[u].astype(float), D, beta, its, ru, w0, alpha, reg) + 1e-12
        # the same solve on the touched rows with the catalogue's Gram (fold-in form)
        sub = lightfr.ridge_users(
            np.array([0, its.size]),
            np.arange(its.size),
            ru,
            D[its],
            beta[its],
            w0,
            alpha,
            reg,
            gram=(G, D.astype(float).T @ beta),
        )
        np.testing.assert_allclose(sub[0], U[u], rtol=1e-9, atol=1e-12)


def test_plane_scores_equal_the_float_reference_exactly() -> None:
    from device_sdk.topk import plane_scores
    from protocol.codes import pack_signs

    rng = np.random.default_rng(3)
    m, f, B = 300, 70, 2  # f not a multiple of 64: padding bits must not count
    D = random_signs(m, f, rng)
    levels = rng.integers(0, 256, m).astype(np.uint8)
    words = pack_signs(D)
    for planes in (1, 2, 3, 4):
        U = rng.normal(0, 1.0, (4, f))
        q, scale = lightfr.quantize_planes(U, planes)
        assert np.all(np.abs(q) <= 2**planes - 1) and np.all(q % 2 == 1)
        a, snapped = lightfr.snap_scale(scale, B)
        C = lightfr.sign_planes(q, planes)
        np.testing.assert_array_equal(sum((2**p) * C[p].astype(np.int64) for p in range(planes)), q)
        beta = bias_from_levels(levels, m, f, B)
        for u in range(4):
            S = plane_scores(pack_signs(C[:, u, :]).T.copy(), words, f, int(a[u]), levels, lightfr.LEVEL_SHIFT)
            exact = a[u] * (D.astype(np.int64) @ q[u].astype(np.int64)) + (
                levels.astype(np.int64) << lightfr.LEVEL_SHIFT
            )
            np.testing.assert_array_equal(S, exact)
            # S is an increasing affine map of the real score of the snapped vector: same ranking.
            real = snapped[u] * (D.astype(float) @ q[u]) / f + beta
            affine = (S - (LEVEL_CENTER << lightfr.LEVEL_SHIFT)) * 2.0 / (2**lightfr.LEVEL_SHIFT * B * f)
            np.testing.assert_allclose(affine, real, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="planes must be in"):
        lightfr.quantize_planes(np.ones((1, f)), 0)
    with pytest.raises(ValueError, match="odd integers"):
        lightfr.sign_planes(np.array([[2]]), 2)
    with pytest.raises(ValueError, match="scales must be finite"):
        lightfr.snap_scale(np.array([0.0]), B)
    with pytest.raises(ValueError, match="ridge weight"):
        lightfr.ridge_users(np.array([0, 1]), np.array([0]), np.ones(1), D, np.zeros(m), 0.1, 0.0, 0.0)


def test_real_user_upload_matches_the_item_side_loss() -> None:
    """With real user vectors the server's sign test for a bit equals the sign of the loss change."""
    rng = np.random.default_rng(11)
    n, m, f = 6, 25, 8
    indptr, items, r = _batch(rng, n, m, 7)
    D = random_signs(m, f, rng)
    beta = rng.normal(0, 0.1, m)
    w0, alpha = 0.2, 2.0
    U = rng.normal(0, 1.3, (n, f))
    total = lightfr.full_upload(indptr, items, r, U, D, beta, w0, alpha)
    np.testing.assert_allclose(total["gram"], U.T @ U)
    new_D, _ = agg_full(D, beta, total, n, w0, alpha, flip_fraction=1.0, learn_bias=False)

    item_loss = partial(_item_loss, U, beta, indptr, items, r, w0, alpha)

    for i in range(m):
        d_old = D[i].astype(float)
        d_new = d_old.copy()
        d_new[0] = new_D[i, 0]
        assert item_loss(i, d_new) <= item_loss(i, d_old) + 1e-9


def test_mean_field_step_is_exact_coordinate_descent_when_raters_look_alike() -> None:
    """When every user has the same vector, Σ_{u∈Ω_i} u uᵀ is exactly (counts_i / n)·G_U, so the mean-field
    server step is exact bit-by-bit descent: no item's loss goes up, whichever bits flip together."""
    rng = np.random.default_rng(5)
    n, m, f = 8, 30, 8
    indptr, items, r = _batch(rng, n, m, 10)
    D = random_signs(m, f, rng)
    beta = rng.normal(0, 0.1, m)
    w0, alpha = 0.05, 1.0
    U = np.tile(rng.normal(0, 2.0, f), (n, 1))
    total = lightfr.full_upload(indptr, items, r, U, D, beta, w0, alpha)

    item_loss = partial(_item_loss, U, beta, indptr, items, r, w0, alpha)

    new_D, _ = agg_full(D, beta, total, n, w0, alpha, flip_fraction=1.0, learn_bias=False, mean_field=True)
    assert np.count_nonzero(new_D != D) > 0
    for i in range(m):
        assert item_loss(i, new_D[i].astype(float)) <= item_loss(i, D[i].astype(float)) + 1e-9
    # the Jacobi step (every bit from the old codes) does overshoot on this data
    jacobi, _ = agg_full(D, beta, total, n, w0, alpha, flip_fraction=1.0, learn_bias=False)
    assert any(item_loss(i, jacobi[i].astype(float)) > item_loss(i, D[i].astype(float)) + 1e-9 for i in range(m))


@pytest.mark.parametrize("rank_planes", [0, 3])
def test_device_model_with_query_planes_uploads_and_ranks_like_the_reference(tmp_path, rank_planes: int) -> None:
    """A `LightFRModel` with query_planes: its upload is `full_upload` of the snapped vector solved against
    the whole catalogue, `recommend` ranks by the real score Δ'·qᵀd/f + β, and a save/load keeps it.  With
    rank_planes the kept (ranking) vector has that many planes and the upload still query_planes."""
    from device_sdk.models import LightFRConfig, LightFRModel

    rng = np.random.default_rng(21)
    m, f, P = 200, 64, 2
    cfg = LightFRConfig(
        bits=f,
        rating_range=None,
        binary_positives=True,
        unobserved_weight=0.05,
        query_planes=P,
        rank_planes=rank_planes,
    )
    model = LightFRModel(m, cfg, rng=np.random.default_rng(0))
    model.set_item_codes(random_signs(m, f, rng), 3)
    model.item_levels = rng.integers(100, 160, m).astype(np.uint8)
    model.hamming_weight = 2
    items = np.sort(rng.choice(m, 12, replace=False)).astype(np.int64)
    update = model.fit_local(items)
    # reference: the same solve on the whole catalogue, quantized and snapped the same way
    beta = bias_from_levels(model.item_levels, m, f, 2)
    ptr = np.array([0, items.size])
    U = lightfr.ridge_users(ptr, items, np.ones(items.size), model.item_codes, beta, 0.05, 0.0, 1.0)
    q, scale = lightfr.quantize_planes(U, P)
    a, snapped = lightfr.snap_scale(scale, 2)
    ref = lightfr.full_upload(ptr, items, np.ones(items.size), snapped[:, None] * q, model.item_codes, beta, 0.05, 0.0)
    for key, part in ref.items():
        np.testing.assert_allclose(update.parts[key], part, rtol=1e-9, atol=1e-9)
    if rank_planes:
        assert np.abs(model.user_q[0]).max() > 2**P - 1  # more levels than the upload's planes hold
        q, scale = lightfr.quantize_planes(U, rank_planes)
        a, snapped = lightfr.snap_scale(scale, 2)
    np.testing.assert_array_equal(model.user_q[0], q[0])
    assert model.user_weight[0] == a[0] and update.flips == 0
    real = snapped[0] * (model.item_codes.astype(float) @ q[0]) / f + beta
    real[items] = -np.inf
    ids, scores = model.recommend(items, N=10, filter_already_liked_items=True)
    np.testing.assert_allclose(scores, np.sort(real)[::-1][:10], rtol=1e-6)
    assert not np.isin(ids, items).any()
    np.testing.assert_allclose(model.similarity(ids), 0.5 + (real[ids] - beta[ids]) / 2, rtol=1e-9)
    model.save(tmp_path / "m.fedrec")
    again = LightFRModel.load(tmp_path / "m.fedrec")
    np.testing.assert_array_equal(again.user_q, model.user_q)
    np.testing.assert_array_equal(again.user_weight, model.user_weight)
    ids2, _ = again.recommend(items, N=10, filter_already_liked_items=True)
    assert set(ids2) == set(ids)
    # a ±1 code replaces the vector
    again.reset_user(np.random.default_rng(1))
    assert again.user_weight[0] == 0
    with pytest.raises(ValueError, match="query_planes must be an integer in"):
        LightFRConfig(query_planes=9)
    with pytest.raises(ValueError, match="user_reg must be a finite number > 0"):
        LightFRConfig(user_reg=0.0)
    with pytest.raises(ValueError, match="rank_planes must be an integer in"):
        LightFRConfig(rank_planes=9)


def test_device_model_trains_symmetric_and_ranks_with_its_ridge_vector(tmp_path) -> None:
    """rank_planes without query_planes: the device trains and uploads with its ±1 code exactly as without
    it, and ranks with its vector solved against the item codes (ridge rank_ridge·w0·m) as rank_planes
    planes; fold_in (what a device does on download) sets the same vector, and a save/load keeps it."""
    from device_sdk.models import LightFRConfig, LightFRModel

    rng = np.random.default_rng(22)
    m, f, w0 = 200, 64, 0.05
    codes, levels = random_signs(m, f, rng), rng.integers(100, 160, m).astype(np.uint8)
    items = np.sort(rng.choice(m, 12, replace=False)).astype(np.int64)
    models = {}
    for planes in (0, 3):
        cfg = LightFRConfig(
            bits=f, rating_range=None, binary_positives=True, unobserved_weight=w0, rank_planes=planes, rank_ridge=2.0
        )
        model = LightFRModel(m, cfg, rng=np.random.default_rng(0))
        model.set_item_codes(codes, 3)
        model.item_levels, model.hamming_weight = levels, 2
        models[planes] = (model, model.fit_local(items))
    (sym, up0), (ranked, up3) = models[0], models[3]
    for key, part in up0.parts.items():
        np.testing.assert_array_equal(up3.parts[key], part)
    np.testing.assert_array_equal(sym.user_codes, ranked.user_codes)
    assert sym.user_weight[0] == 0 and ranked.user_weight[0] > 0
    beta = bias_from_levels(levels, m, f, 2)
    ptr = np.array([0, items.size])
    U = lightfr.ridge_users(ptr, items, np.ones(items.size), codes, beta, w0, 0.0, 2.0 * w0 * m)
    q, scale = lightfr.quantize_planes(U, 3)
    a, snapped = lightfr.snap_scale(scale, 2)
    np.testing.assert_array_equal(ranked.user_q[0], q[0])
    assert ranked.user_weight[0] == a[0]
    real = snapped[0] * (codes.astype(float) @ q[0]) / f + beta
    real[items] = -np.inf
    ids, scores = ranked.recommend(items, N=10, filter_already_liked_items=True)
    np.testing.assert_allclose(scores, np.sort(real)[::-1][:10], rtol=1e-6)
    ranked.save(tmp_path / "m.fedrec")
    again = LightFRModel.load(tmp_path / "m.fedrec")
    assert again.config.rank_ridge == 2.0
    np.testing.assert_array_equal(again.user_q, ranked.user_q)
    fresh = LightFRModel(m, ranked.config, rng=np.random.default_rng(5))
    fresh.set_item_codes(codes, 4)
    fresh.item_levels, fresh.hamming_weight = levels, 2
    fresh.fold_in(items[::-1])
    np.testing.assert_array_equal(fresh.user_q[0], q[0])
    assert fresh.user_weight[0] == a[0]
    with pytest.raises(ValueError, match="rank_ridge must be a finite number"):
        LightFRConfig(rank_ridge=0.0)


def test_device_config_refuses_planes_without_the_all_items_objective_but_the_plan_path_works(tmp_path) -> None:
    """LightFRConfig(query_planes > 0, unobserved_weight = 0) trained ±1 codes while asking for planes: now
    refused, as the server's config and the plan refuse it.  A plan cannot lead a device there (it sets P and
    w0 together, and a plan with planes and w0 = 0 does not decode, tests/test_protocol_plan.py), the
    device's rank_planes survives a planes-off plan, and a store written with the old pairing still loads."""
    from dataclasses import replace

    from device_sdk.models import LightFRConfig, LightFRModel, apply_plan
    from protocol.plan import LightFRParams, TrainingPlan
    from protocol.spec import Aggregation

    with pytest.raises(ValueError, match=r"^query_planes: 2 planes .* need the all-items objective") as info:
        LightFRConfig(query_planes=2, unobserved_weight=0)
    assert "unobserved_weight=0" in str(info.value) and "query_planes=0" in str(info.value)
    with pytest.raises(ValueError, match=r"^query_planes: 1 planes"):
        replace(LightFRConfig(query_planes=0, unobserved_weight=0.0), query_planes=1)
    assert LightFRConfig(query_planes=2, unobserved_weight=0.05).params(Aggregation.GRAD).query_planes == 2

    m, f = 30, 16
    model = LightFRModel(m, LightFRConfig(bits=f, unobserved_weight=0.05, query_planes=2, rank_planes=3))
    sampled = TrainingPlan(params=LightFRParams(unobserved_weight=0.0, negatives=4), n_items=m, rank=f)
    apply_plan(model, sampled)  # a 1.5 server's sampled-negatives plan: P = 0, w0 = 0
    assert (model.config.query_planes, model.config.unobserved_weight, model.config.rank_planes) == (0, 0.0, 3)
    apply_plan(model, TrainingPlan(params=LightFRParams(unobserved_weight=0.1, query_planes=2), n_items=m, rank=f))
    assert (model.config.query_planes, model.config.rank_planes) == (2, 3)
    model.fit_local(np.array([1, 4, 9]))
    trained_q = model.user_q.copy()
    assert model.user_weight[0] > 0

    # A store written by the SDK that accepted P = 2 with w0 = 0 (its config set past the check here).
    object.__setattr__(model.config, "unobserved_weight", 0.0)
    model.save(tmp_path / "old.fedrec")
    again = LightFRModel.load(tmp_path / "old.fedrec")
    assert (again.config.query_planes, again.config.unobserved_weight, again.config.rank_planes) == (0, 0.0, 3)
    np.testing.assert_array_equal(again.user_q, trained_q)  # the vector it holds is kept and ranks as before
    assert again.user_weight[0] == model.user_weight[0]
    np.testing.assert_array_equal(again.recommend([1, 4, 9], N=10)[1], model.recommend([1, 4, 9], N=10)[1])


def test_mean_field_sweeps_end_where_no_single_bit_flip_helps() -> None:
    """Several mean-field passes on one round's sums: with raters that look alike the quadratic model is
    exact, so every item's loss only goes down and the step stops at codes no single bit flip improves,
    which one pass does not reach on this data."""
    rng = np.random.default_rng(8)
    n, m, f = 8, 40, 12
    indptr, items, r = _batch(rng, n, m, 12)
    D = random_signs(m, f, rng)
    beta = rng.normal(0, 0.1, m)
    w0, alpha = 0.05, 1.0
    U = np.tile(rng.normal(0, 2.0, f), (n, 1))  # every user the same vector: Σ_{u∈Ω_i} u uᵀ = (counts_i / n)·G_U
    total = lightfr.full_upload(indptr, items, r, U, D, beta, w0, alpha)

    item_loss = partial(_item_loss, U, beta, indptr, items, r, w0, alpha)

    def improvable(codes: np.ndarray) -> int:
        """Items for which one bit flip lowers the loss."""
        count = 0
        for i in range(m):
            d = codes[i].astype(float)
            here = item_loss(i, d)
            flips = [d * np.where(np.arange(f) == k, -1.0, 1.0) for k in range(f)]
            count += any(item_loss(i, e) < here - 1e-9 for e in flips)
        return count

    kw = {"flip_fraction": 1.0, "learn_bias": False, "mean_field": True}
    one, _ = agg_full(D, beta, total, n, w0, alpha, **kw)
    many, _ = agg_full(D, beta, total, n, w0, alpha, sweeps=20, **kw)
    assert improvable(one) > 0
    assert improvable(many) == 0
    for i in range(m):
        assert item_loss(i, many[i].astype(float)) <= item_loss(i, one[i].astype(float)) + 1e-9
    # sweeps = 1 is the one-pass step; a bad count is refused
    np.testing.assert_array_equal(agg_full(D, beta, total, n, w0, alpha, sweeps=1, **kw)[0], one)
    with pytest.raises(ValueError, match="sweeps must be"):
        agg_full(D, beta, total, n, w0, alpha, sweeps=0, **kw)


def test_server_strategy_runs_the_code_sweeps_it_is_given() -> None:
    """`LightFRServerStrategy(code_sweeps=…)` steps exactly as `agg_full(sweeps=…)`, and more passes change
    the step; it and the simulator's `FederationConfig` refuse a count that is not an integer >= 1."""
    from fedsim.federation.lightfr import FederationConfig

    rng = np.random.default_rng(3)
    n, m, f = 10, 40, 12
    indptr, items, _ = _batch(rng, n, m, 9)
    r = np.ones(items.size)
    U = rng.normal(0, 2.0, (n, f))
    steps = {}
    for sweeps in (1, 6):
        strategy = LightFRServerStrategy(
            n_items=m,
            params=LightFRParams(unobserved_weight=0.05),
            server=LightFRServerParams(bits=f, flip_fraction=1.0, mean_field=True, code_sweeps=sweeps),
        )
        state = strategy.initialize(np.random.default_rng(0))
        beta = np.zeros(m)
        parts = lightfr.full_upload(indptr, items, r, U, state[:, :f], beta, 0.05, 0.0)
        total = UploadLayout(m, f, full=True).join(**parts)
        new_state = strategy.aggregate(state, total, n, np.random.default_rng(0), round_index=0)
        D, _ = agg_full(state[:, :f], beta, parts, n, 0.05, 0.0, flip_fraction=1.0, mean_field=True, sweeps=sweeps)
        np.testing.assert_array_equal(new_state[:, :f], D)
        steps[sweeps] = D
    assert np.count_nonzero(steps[1] != steps[6]) > 0
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="code_sweeps"):
            LightFRServerParams(bits=f, code_sweeps=bad)
        with pytest.raises(ValueError, match="code_sweeps"):
            FederationConfig(code_sweeps=bad)


def test_a_private_round_makes_the_device_rank_with_its_code(tmp_path) -> None:
    """A round with DP noise (dp_mu > 0) makes a device that trains ±1 codes rank with its code, not its
    ridge vector (against noised codes and levels the vector fell to a third of popularity's HR@10 on real
    devices, docs/dp-accounting.md §8); fold_in then keeps the code, the store keeps the rule, and a round
    without noise brings the vector back."""
    from dataclasses import replace

    from device_sdk.models import LightFRConfig, LightFRModel
    from device_sdk.training import local_round
    from protocol.messages import RoundInvite
    from protocol.plan import LightFRParams, TrainingPlan
    from protocol.samplers import insecure_test_noise_stream

    rng = np.random.default_rng(23)
    m, f, w0 = 120, 64, 0.05
    items = np.sort(rng.choice(m, 10, replace=False)).astype(np.int64)
    plan = TrainingPlan(params=LightFRParams(unobserved_weight=w0), n_items=m, rank=f)
    bare = RoundInvite(
        round_id=1,
        device_id=7,
        vector_length=plan.vector_length,
        graph_k=3,
        graph_t=2,
        clip_norm=1e3,
        scale_bits=12,
        advertise_deadline=1.0,
        share_keys_deadline=2.0,
        masked_input_deadline=3.0,
        unmask_deadline=4.0,
    ).with_plan(plan)
    model = LightFRModel(m, LightFRConfig(bits=f, rating_range=None, binary_positives=True), rng=rng)
    model.set_item_codes(random_signs(m, f, rng), 1)
    assert model.config.rank_planes == 3  # the SDK default: rank with the ridge vector

    def train(dp_mu: float) -> None:
        invite = replace(bare, dp_mu=dp_mu, dp_t_min=2 if dp_mu else 0)
        local_round(model, invite, items, None, np.random.default_rng(1), coins=insecure_test_noise_stream(1))

    train(0.0)
    assert not model.private_rounds and model.user_weight[0] > 0
    train(50.0)
    assert model.private_rounds and model.user_weight[0] == 0
    _, scores = model.recommend(items, N=5)  # similarity of the ±1 code: 1/2 + bᵀd/(2f), on the 1/(2f) grid
    np.testing.assert_allclose(scores * 2 * f, np.round(scores * 2 * f), atol=1e-3)
    model.fold_in(items)
    assert model.user_weight[0] == 0
    model.save(tmp_path / "m.fedrec")
    again = LightFRModel.load(tmp_path / "m.fedrec")
    assert again.private_rounds and again.user_weight[0] == 0
    again.fold_in(items)
    assert again.user_weight[0] == 0
    train(0.0)
    assert not model.private_rounds and model.user_weight[0] > 0


def test_set_global_takes_the_servers_w0_and_dp_flag_and_refuses_hostile_values(tmp_path) -> None:
    """Protocol 1.7 on the device: a stated w0 (with its α) replaces the device's, as a plan's would, and
    drives the ranking ridge rank_ridge·w0·m; 0 keeps the device's own.  A w0 outside (0, 1 + α], a
    non-finite one, a bool, or a DP flag that is not a bool is refused before anything changes.  The DP flag
    (sticky on the server) makes the device rank with its ±1 code; a false flag from a lying server can
    only choose between the code and the planes of a vector that never leaves the device."""
    import re

    from device_sdk.models import LightFRConfig, LightFRModel
    from protocol.codes import pack_signs, to_bytes

    rng = np.random.default_rng(29)
    m, f = 90, 64
    items = np.sort(rng.choice(m, 8, replace=False)).astype(np.int64)
    words = to_bytes(pack_signs(random_signs(m, f, rng)))
    levels = rng.integers(100, 160, m).astype(np.uint8).tobytes()
    model = LightFRModel(m, LightFRConfig(bits=f, rating_range=None, unobserved_weight=0.1), rng=rng)
    model.set_global(words, b"", 2, item_levels=levels, hamming_weight=2)  # a 1.6 server: nothing stated
    assert model.config.unobserved_weight == 0.1 and not model.private_model
    for w0, alpha, why in (
        (float("nan"), 0.0, "must be a finite number"),
        (float("inf"), 0.0, "must be a finite number"),
        (0.01, float("nan"), "must be a finite number"),
        (True, 0.0, "must be a finite number"),
        ("0.1", 0.0, "must be a finite number"),
        (-0.01, 0.0, "unobserved_weight must be in (0, 1 + confidence]"),
        (1.01, 0.0, "unobserved_weight must be in (0, 1 + confidence]"),
        (2.6, 1.5, "unobserved_weight must be in (0, 1 + confidence]"),
        (0.0, 0.5, "unobserved_weight must be in (0, 1 + confidence]"),
        (0.5, -0.1, "unobserved_weight must be in (0, 1 + confidence]"),
    ):
        with pytest.raises(ValueError, match=re.escape(why)):
            model.set_global(words, b"", 3, item_levels=levels, unobserved_weight=w0, confidence=alpha)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dp_trained must be a bool"):
        model.set_global(words, b"", 3, item_levels=levels, dp_trained=1)  # type: ignore[arg-type]
    assert model.model_version == 2 and model.config.unobserved_weight == 0.1  # nothing changed

    model.set_global(words, b"", 3, item_levels=levels, hamming_weight=2, unobserved_weight=0.9, confidence=0.5)
    assert (model.config.unobserved_weight, model.config.confidence) == (0.9, 0.5)
    model.fold_in(items)
    planes = (model.user_q[0].copy(), int(model.user_weight[0]))
    assert planes[1] > 0
    ref = LightFRModel(m, LightFRConfig(bits=f, rating_range=None, unobserved_weight=0.9, confidence=0.5))
    ref.set_global(words, b"", 3, item_levels=levels, hamming_weight=2)
    ref.fold_in(items)
    assert np.array_equal(ref.user_q[0], planes[0]) and int(ref.user_weight[0]) == planes[1]

    # A DP-trained model: the vector gives way to the ±1 code at once, and fold_in solves none; stored.
    model.set_global(words, b"", 4, item_levels=levels, hamming_weight=2, unobserved_weight=0.9, dp_trained=True)
    assert model.private_model and model.user_weight[0] == 0
    model.fold_in(items)
    assert model.user_weight[0] == 0
    model.save(tmp_path / "m.fedrec")
    again = LightFRModel.load(tmp_path / "m.fedrec")
    assert again.private_model and again.config.unobserved_weight == 0.9
    # A later model without the flag brings the planes back at the next fold_in.
    again.set_global(words, b"", 5, item_levels=levels, hamming_weight=2, unobserved_weight=0.9, confidence=0.5)
    again.fold_in(items)
    assert not again.private_model and np.array_equal(again.user_q[0], planes[0])
