"""The batched device kernels (`device_sdk.batched`) against the per-device path, device by device, on
small random cohorts: exact where the simulator relies on bit-identity (gradient rows, coin words, the
device's dense `quantize`, the vectors), within the floating-point slack of a closed-form norm where the
simulator says so (the all-items clip factors), and by law where only the law is the device's (θ cap)."""

from __future__ import annotations

import numpy as np
import pytest

from device_sdk import batched, lightfr
from device_sdk import mf as mf_kernels
from device_sdk.models import LightFRConfig, LightFRModel
from protocol.codes import random_signs
from protocol.families.lightfr import UploadLayout, clip_parts
from protocol.quantization import QuantizationConfig, clip_l2, quantize, stochastic_round
from protocol.samplers import insecure_test_noise_stream

M, F = 40, 8


def _cohort(seed: int, n: int = 9, most: int = 12, repeats: bool = False):
    """(indptr, items, targets) of n devices with 0 … ``most`` distinct items each (device 2 has none)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, most + 1, n)
    counts[2] = 0
    rows = [rng.choice(M, int(c), replace=False) for c in counts]
    if repeats:
        rows[0] = np.r_[rows[0], rows[0][:2]]
    items = np.concatenate(rows).astype(np.int64)
    targets = rng.integers(0, 9, items.size) / 8.0
    return batched.csr_indptr(np.array([r.size for r in rows])), items, targets


def _row(indptr, arr, u):
    return arr[indptr[u] : indptr[u + 1]]


def test_cap_examples_keeps_theta_of_each_devices_own_ratings_in_order() -> None:
    indptr, items, targets = _cohort(0)
    before = np.random.default_rng(1)
    kp, ki, kt, owner = batched.cap_examples(indptr, items, targets, 5, before)
    for u in range(indptr.size - 1):
        own, kept = _row(indptr, items, u), _row(kp, ki, u)
        assert kept.size == min(own.size, 5)
        pos = np.flatnonzero(np.isin(own, kept))
        assert np.array_equal(own[pos], kept)  # a subset, in the device's order
        assert np.array_equal(_row(indptr, targets, u)[pos], _row(kp, kt, u))
        assert np.all(owner[kp[u] : kp[u + 1]] == u)
    rng = np.random.default_rng(2)
    same = batched.cap_examples(indptr, items, targets, 0, rng)
    assert same[0] is indptr and same[1] is items
    assert rng.random() == np.random.default_rng(2).random()  # θ = 0 draws nothing


def test_cap_examples_is_uniform_over_each_devices_ratings() -> None:
    indptr = np.array([0, 4], dtype=np.int64)
    items, targets = np.arange(4, dtype=np.int64), np.ones(4)
    rng = np.random.default_rng(3)
    hits = np.zeros(4)
    for _ in range(4000):
        hits[batched.cap_examples(indptr, items, targets, 2, rng)[1]] += 1
    assert np.allclose(hits / 4000, 0.5, atol=0.04)


def test_unique_examples_is_the_devices_unique() -> None:
    indptr, items, targets = _cohort(4, repeats=True)
    owner = np.repeat(np.arange(indptr.size - 1), np.diff(indptr))
    up, ui, ut, uo = batched.unique_examples(items, targets, owner, indptr.size - 1, M)
    for u in range(indptr.size - 1):
        want, first = np.unique(_row(indptr, items, u), return_index=True)  # LightFRModel._fit_full
        assert np.array_equal(_row(up, ui, u), want)
        assert np.array_equal(_row(up, ut, u), _row(indptr, targets, u)[first])
    assert np.array_equal(uo, np.repeat(np.arange(indptr.size - 1), np.diff(up)))


def test_merge_negatives_is_each_devices_example_order() -> None:
    indptr, items, targets = _cohort(5)
    neg_ptr, neg = lightfr.sample_negatives(indptr, items, M, 2, np.random.default_rng(6))
    mp, mi, mt = batched.merge_negatives(indptr, items, targets, neg_ptr, neg)
    for u in range(indptr.size - 1):  # LightFRModel._user_csr: ratings, then negatives at r = 0
        assert np.array_equal(_row(mp, mi, u), np.r_[_row(indptr, items, u), _row(neg_ptr, neg, u)])
        assert np.array_equal(_row(mp, mt, u), np.r_[_row(indptr, targets, u), np.zeros(np.diff(neg_ptr)[u])])


def _device(D, code, **config) -> LightFRModel:
    """One LightFR device holding item codes ``D`` and user code ``code`` (targets in [0, 1] taken as given)."""
    device = LightFRModel(M, LightFRConfig(bits=F, rating_range=None, **config))
    device.set_item_codes(D, 1)
    device.set_user_code(code)
    return device


@pytest.mark.parametrize("epochs", [1, 2])
def test_gradient_rows_are_fit_local_device_by_device(epochs: int) -> None:
    # Every device's sparse rows, densified, are its own fit_local upload bit for bit, and its code the same.
    indptr, items, targets = _cohort(7)
    rng = np.random.default_rng(8)
    D, B0 = random_signs(M, F, rng), random_signs(indptr.size - 1, F, rng)
    config = {"lam": 0.01, "local_epochs": epochs, "unobserved_weight": 0.0, "negatives": 0}
    B, parts = B0, []
    for _ in range(epochs):  # the simulator's cohort: every device's DCD at once, then its eq. 12 rows
        B, _ = lightfr.dcd_update(indptr, items, targets, B, D, 0.01, max_sweeps=LightFRConfig().max_sweeps)
        parts.append(batched.entry_gradients(indptr, items, targets, B, D))
    g_items, g_owner, g_rows = (np.concatenate(x) for x in zip(*parts, strict=True))
    owner, item, vals = batched.device_item_sums(g_owner, g_items, g_rows, M, epochs)
    assert np.all(np.diff(owner * M + item) > 0)  # one row per (device, item), sorted
    for u in range(indptr.size - 1):
        device = _device(D, B0[u], **config)
        update = device.fit_local(_row(indptr, items, u), _row(indptr, targets, u), rng=np.random.default_rng(0))
        got = np.zeros((M, F))
        got[item[owner == u]] = vals[owner == u]
        np.testing.assert_array_equal(got, update.values)
        np.testing.assert_array_equal(B[u], device.user_codes[0])


def test_rounded_rows_with_device_streams_are_the_devices_quantize() -> None:
    # Each device's own coin words (m·f of them, as its dense quantize reads): its ring vector bit for bit.
    indptr, items, targets = _cohort(9)
    rng = np.random.default_rng(10)
    D, B = random_signs(M, F, rng), random_signs(indptr.size - 1, F, rng)
    owner, item, vals = batched.device_item_sums(*_swap(batched.entry_gradients(indptr, items, targets, B, D)), M)
    qcfg = QuantizationConfig(clip_norm=1.5, scale_bits=12)  # C inside the spread of the norms
    n = indptr.size - 1
    alive = np.ones(n, dtype=bool)
    alive[[1, 4]] = False
    out = np.zeros(M * F, dtype=np.int64)
    streams = [insecure_test_noise_stream(3, u) for u in range(n)]
    batched.add_rounded_rows(out, owner, item, vals, alive, qcfg, None, streams=streams)
    want = np.zeros(M * F, dtype=np.int64)
    clipped = []
    for u in range(n):
        dense = np.zeros((M, F))
        dense[item[owner == u]] = vals[owner == u]
        ring, stats = quantize(dense.ravel(), qcfg, insecure_test_noise_stream(3, u))
        clipped.append(stats.clipped)
        if alive[u]:
            want += ring.view(np.int32)
    assert any(clipped) and not all(clipped)
    np.testing.assert_array_equal(out, want)
    assert all(s.words_read == M * F for s in streams)  # every device read its words, survivor or not


def test_rounded_rows_from_one_stream_read_the_devices_words_in_order() -> None:
    indptr, items, targets = _cohort(11)
    rng = np.random.default_rng(12)
    D, B = random_signs(M, F, rng), random_signs(indptr.size - 1, F, rng)
    owner, item, vals = batched.device_item_sums(*_swap(batched.entry_gradients(indptr, items, targets, B, D)), M)
    qcfg = QuantizationConfig(clip_norm=1.5, scale_bits=12)
    alive = np.arange(indptr.size - 1) % 3 != 1
    out = np.zeros(M * F, dtype=np.int64)
    batched.add_rounded_rows(out, owner, item, vals, alive, qcfg, insecure_test_noise_stream(4))
    coins, want = insecure_test_noise_stream(4), np.zeros(M * F, dtype=np.int64)
    for u in np.flatnonzero(alive):  # device by device: clip its rows, round them (its k·f coin words)
        if not np.any(owner == u):
            continue
        c, _ = clip_l2(vals[owner == u], qcfg.clip_norm)
        want[(item[owner == u][:, None] * F + np.arange(F)).ravel()] += stochastic_round(c * qcfg.scale, coins).ravel()
    np.testing.assert_array_equal(out, want)


def _swap(entries):
    items, owner, rows = entries
    return owner, items, rows


@pytest.mark.parametrize(("share", "real"), [(0.0, False), (0.3, False), (0.3, True)])
def test_full_terms_and_clip_factors_are_each_devices_clipped_full_upload(share: float, real: bool) -> None:
    # real: asymmetric scoring, each device's snapped vector u in place of its code b.
    indptr, items, targets = _cohort(13)
    rng = np.random.default_rng(14)
    n = indptr.size - 1
    D, beta = random_signs(M, F, rng), rng.normal(0, 0.1, M)
    w0, alpha, C = 0.05, 1.0, 2.0
    owner = np.repeat(np.arange(n), np.diff(indptr))
    Df = D.astype(np.float64)
    if real:
        B = batched.snapped_vectors(lightfr.ridge_users(indptr, items, targets, D, beta, w0, alpha, 1.0), 2, 2)
        Bf = B
        s_e = np.einsum("ef,ef->e", Df[items], Bf[owner])
    else:
        B = random_signs(n, F, rng)
        Bf = B.astype(np.float64)
        s_e = lightfr.inner_products(indptr, items, B, D).astype(np.float64)
    grad, bias = batched.full_entry_terms(items, owner, targets, Bf, Df, s_e, beta, w0, alpha, real=real)
    fc, fr = batched.full_clip_factors(owner, grad, bias, Bf, C, share)
    layout = UploadLayout(M, F, full=True)
    for u in range(n):
        one = np.array([0, np.diff(indptr)[u]], np.int64)
        parts = lightfr.full_upload(
            one, _row(indptr, items, u), _row(indptr, targets, u), B[u : u + 1], D, beta, w0, alpha
        )
        g = np.zeros((M, F))
        g[_row(indptr, items, u)] = grad[owner == u]
        np.testing.assert_allclose(g, parts["gradient"], rtol=1e-12, atol=1e-12)
        b = np.bincount(_row(indptr, items, u), weights=bias[owner == u], minlength=M)
        np.testing.assert_allclose(b, parts["bias"], rtol=1e-12, atol=1e-12)
        # the device: clip_parts for the counts share, then quantize's own clip to C
        device, _ = clip_l2(clip_parts(layout.join(**parts), layout, C, share), C)
        mine = layout.join(
            g * fr[u], b * fr[u], parts["counts"] * fc[u], parts["gram"] * fr[u], parts["code_sum"] * fr[u]
        )
        np.testing.assert_allclose(mine, device, rtol=1e-9, atol=1e-12)


def test_rounded_full_parts_are_within_one_of_the_clipped_values() -> None:
    indptr, items, targets = _cohort(15)
    rng = np.random.default_rng(16)
    n = indptr.size - 1
    D, B = random_signs(M, F, rng), random_signs(n, F, rng)
    beta = np.zeros(M)
    owner = np.repeat(np.arange(n), np.diff(indptr))
    Bf, Df = B.astype(np.float64), D.astype(np.float64)
    s_e = lightfr.inner_products(indptr, items, B, D).astype(np.float64)
    grad, bias = batched.full_entry_terms(items, owner, targets, Bf, Df, s_e, beta, 0.05, 0.0, real=False)
    factors = batched.full_clip_factors(owner, grad, bias, Bf, 2.0, 0.2)
    alive = np.ones(n, dtype=bool)
    scale = 2.0**10
    for u in range(n):  # one device alone: its rounded parts are its clipped parts ± 1 per coordinate
        out = {"gradient": np.zeros(M * F), "bias": np.zeros(M), "counts": np.zeros(M)}
        out |= {"gram": np.zeros((F, F)), "code_sum": np.zeros(F)}
        only = alive & (np.arange(n) == u)
        batched.add_rounded_full_parts(
            out, items, owner, grad, bias, Bf, factors, only, scale, insecure_test_noise_stream(u)
        )
        fc, fr = factors[0][u], factors[1][u]
        g = np.zeros((M, F))
        g[items[owner == u]] = grad[owner == u]
        exact = {
            "gradient": g.ravel() * fr * scale,
            "bias": np.bincount(items[owner == u], weights=bias[owner == u], minlength=M) * fr * scale,
            "counts": np.bincount(items[owner == u], minlength=M) * fc * scale,
            "gram": np.outer(Bf[u], Bf[u]) * fr * scale / F,
            "code_sum": Bf[u] * fr * scale / F,
        }
        for name, value in exact.items():
            assert np.all(np.abs(out[name] - value) < 1.0), name
            assert np.all(out[name] == np.rint(out[name]))


def test_snapped_and_refreshed_vectors_row_by_row() -> None:
    indptr, items, targets = _cohort(17)
    rng = np.random.default_rng(18)
    n = indptr.size - 1
    D, beta = random_signs(M, F, rng), rng.normal(0, 0.05, M)
    q, a, vec = batched.refreshed_vectors(indptr, items, targets, D, beta, 0.05, 1.0, 2.0, 3, 2)
    U = lightfr.ridge_users(indptr, items, targets, D, beta, 0.05, 1.0, 2.0)
    np.testing.assert_array_equal(vec, batched.snapped_vectors(U, 3, 2))
    np.testing.assert_array_equal(vec, batched.plane_vectors(q, a, 2))
    for u in range(n):  # a device alone gets the same vector
        one = np.array([0, np.diff(indptr)[u]], np.int64)
        qu, au, vu = batched.refreshed_vectors(
            one, _row(indptr, items, u), _row(indptr, targets, u), D, beta, 0.05, 1.0, 2.0, 3, 2
        )
        np.testing.assert_array_equal(qu[0], q[u])
        assert au[0] == a[u]
        np.testing.assert_allclose(vu[0], vec[u], rtol=0, atol=0)


def test_mf_gradient_rows_are_each_devices_item_gradient_sum() -> None:
    indptr, items, targets = _cohort(19, repeats=True)
    rng = np.random.default_rng(20)
    n = indptr.size - 1
    U, V = rng.normal(0, 0.5, (n, F)), rng.normal(0, 0.5, (M, F))
    owner = np.repeat(np.arange(n), np.diff(indptr))
    o, it, vals = batched.mf_gradient_rows(owner, items, targets * 5, U, V)
    for u in range(n):
        k = np.diff(indptr)[u]
        want = mf_kernels.item_gradient_sum(
            U[u : u + 1], V, np.zeros(k, np.int64), _row(indptr, items, u), _row(indptr, targets, u) * 5
        )
        got = np.zeros((M, F))
        got[it[o == u]] = vals[o == u]
        np.testing.assert_array_equal(got.ravel(), want)
