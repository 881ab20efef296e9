"""LightFRModel: the implicit-style contract, persistence, and the on-device store's failure modes."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgpack
import numpy as np
import pytest
import scipy.sparse as sp

import device_sdk.store as store
from device_sdk.models import LightFRConfig, LightFRModel
from device_sdk.store import load_store
from fedsim.federation.lightfr import FederationConfig, UserData, run_lightfr
from protocol.codes import pack_signs, random_signs
from protocol.errors import ModelError, StorageError
from protocol.spec import Aggregation


def _checkerboard(n_users: int = 40, n_items: int = 20) -> UserData:
    """Even users like the even items, odd users the odd items (implicit's checkerboard idea)."""
    rows, cols = np.nonzero((np.arange(n_users)[:, None] + np.arange(n_items)[None, :]) % 2 == 0)
    indptr = np.concatenate(([0], np.cumsum(np.bincount(rows, minlength=n_users)))).astype(np.int64)
    return UserData(indptr, cols.astype(np.int64), np.ones(cols.size), n_items)


@pytest.fixture(scope="module")
def trained_items() -> np.ndarray:
    cfg = LightFRConfig(bits=32, negatives=2, rating_range=None)
    fed = FederationConfig(rounds=30, fraction=1.0, seed=0, flip_fraction=0.3)
    return run_lightfr(_checkerboard(), cfg, fed).item_codes


class ModelContract:
    """Checks every model family must pass; subclasses provide `make`."""

    def make(self, n_items: int) -> LightFRModel:
        raise NotImplementedError

    def test_withheld_item_liked_by_similar_users_ranks_first(self, trained_items: np.ndarray) -> None:
        model = self.make(trained_items.shape[0])
        model.set_item_codes(trained_items, version=1)
        liked = np.arange(0, 20, 2)[1:]  # an "even" user who has not seen item 0
        model.fold_in(liked)
        ids, scores = model.recommend(liked, N=5)
        assert ids[0] == 0
        assert np.all(np.diff(scores) <= 0)
        assert not np.isin(ids, liked).any()

    def test_recommend_filters_and_batches(self, trained_items: np.ndarray) -> None:
        model = self.make(trained_items.shape[0])
        model.set_item_codes(trained_items, version=1)
        model.fold_in(np.arange(0, 20, 2))
        ids, _ = model.recommend(np.arange(0, 20, 2), N=20)
        assert ids.size == 10 and set(ids) == set(range(1, 20, 2))
        ids, _ = model.recommend(np.array([2]), N=20, filter_items=np.array([0, 4]))
        assert not np.isin(ids, [0, 2, 4]).any() and ids.size == 17
        ids, _ = model.recommend(np.array([2]), N=20, filter_already_liked_items=False)
        assert 2 in ids and ids.size == 20
        ids, _ = model.recommend(None, N=3, items=np.array([1, 3, 5, 7]))
        assert set(ids) <= {1, 3, 5, 7} and ids.size == 3

    def test_misuse_raises_value_error(self, trained_items: np.ndarray) -> None:
        model = self.make(trained_items.shape[0])
        with pytest.raises(ModelError):
            model.recommend(np.array([1]))  # no user code trained yet
        model.fold_in(np.array([1, 2]))
        with pytest.raises(ValueError, match="out of range"):
            model.recommend(np.array([99]))
        with pytest.raises(ValueError):
            model.recommend(np.array([1]), N=-1)
        with pytest.raises(ValueError, match="userid"):
            model.recommend(np.array([1]), userid=3)


class TestLightFRContract(ModelContract):
    def make(self, n_items: int) -> LightFRModel:
        return LightFRModel(
            n_items, LightFRConfig(bits=32, negatives=2, rating_range=None), rng=np.random.default_rng(0)
        )


def test_batch_recommend_pads_and_matches_single_calls(trained_items: np.ndarray) -> None:
    cfg = LightFRConfig(bits=32, negatives=2, rating_range=None)
    model = LightFRModel(20, cfg, n_users=3, rng=np.random.default_rng(0))
    model.set_item_codes(trained_items, 1)
    for u, liked in enumerate([np.arange(0, 20, 2), np.arange(1, 20, 2), np.arange(19)]):
        model.fold_in(liked, userid=u)
    user_items = sp.csr_matrix(
        (
            np.ones(39),
            (
                np.r_[np.zeros(10), np.ones(10), np.full(19, 2)],
                np.r_[np.arange(0, 20, 2), np.arange(1, 20, 2), np.arange(19)],
            ),
        ),
        shape=(3, 20),
    )
    ids, scores = model.recommend(user_items, N=2, userid=np.arange(3))
    assert ids.shape == (3, 2)
    assert ids[2].tolist() == [19, -1] and scores[2, 1] == -np.inf
    single, _ = model.recommend(np.arange(1, 20, 2), N=2, userid=1, rng=np.random.default_rng(5))
    assert set(single) <= set(range(0, 20, 2))


def test_fit_local_uploads_dense_update_and_trains_user_code() -> None:
    rng = np.random.default_rng(3)
    model = LightFRModel(50, LightFRConfig(bits=16, negatives=4, unobserved_weight=0.0), rng=rng)
    update = model.fit_local(np.array([1, 5, 9]), np.array([5.0, 4.0, 1.0]))
    assert update.values.shape == (50, 16) and update.aggregation is Aggregation.GRAD
    assert update.n_examples == 3 + 12
    assert model.user_trained[0]
    para = model.fit_local(np.array([1, 5, 9]), aggregation=Aggregation.PARA)
    assert np.isin(para.values, (-1, 1)).all()
    with pytest.raises(ValueError, match="ratings"):
        model.fit_local(np.array([1, 2]), np.array([1.0]))
    with pytest.raises(ValueError, match="finite"):
        model.fit_local(np.array([1]), np.array([np.inf]))


def test_config_validation_names_the_field() -> None:
    for kwargs, word in [
        ({"bits": 0}, "bits"),
        ({"lam": -1.0}, "lam"),
        ({"negatives": -1}, "negatives"),
        ({"local_epochs": 0}, "local_epochs"),
        ({"rating_range": (5.0, 1.0)}, "rating_range"),
        # Wrong types are a ValueError naming the field too (were: accepted, or a bare TypeError).
        ({"bits": 64.0}, "bits"),
        ({"bits": "64"}, "bits"),
        ({"bits": True}, "bits"),
        ({"rating_range": ("1", "5")}, "rating_range"),
        ({"rating_range": (1.0,)}, "rating_range"),
        ({"rating_range": (1.0, float("nan"))}, "rating_range"),
    ]:
        with pytest.raises(ValueError, match=word):
            LightFRConfig(**kwargs)  # type: ignore[arg-type]


# -- persistence ----------------------------------------------------------------------------------


def _model() -> LightFRModel:
    rng = np.random.default_rng(9)
    model = LightFRModel(300, LightFRConfig(bits=70), rng=rng)
    model.set_item_codes(random_signs(300, 70, rng), version=7)
    model.fold_in(np.array([1, 2, 3]), np.array([5.0, 4.0, 2.0]))
    return model


def test_save_load_roundtrip(tmp_path: Path) -> None:
    model = _model()
    path = tmp_path / "model.fedrec"
    model.save(path)
    back = LightFRModel.load(path, rng=np.random.default_rng(0))
    assert back.config == model.config and back.model_version == 7
    assert np.array_equal(back.item_codes, model.item_codes)
    assert np.array_equal(back.user_codes, model.user_codes) and back.user_trained.all()
    a, _ = model.recommend(np.array([1, 2, 3]), N=20, rng=np.random.default_rng(1))
    b, _ = back.recommend(np.array([1, 2, 3]), N=20, rng=np.random.default_rng(1))
    assert np.array_equal(a, b)
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary file left behind


def test_load_installs_the_stored_codes_without_drawing_random_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load reads its codes from the file: no random codes are drawn to be thrown away (at 10^6 items that
    was most of a load's time), and what it holds is the model's own, writable, so it trains as before."""
    import device_sdk.models as models

    path = tmp_path / "model.fedrec"
    model = _model()
    model.save(path)

    def no_draws(*args: object, **kwargs: object) -> None:
        raise AssertionError("load drew random codes")

    monkeypatch.setattr(models, "random_signs", no_draws)
    back = LightFRModel.load(path, rng=np.random.default_rng(0))
    for name in ("item_codes", "user_codes", "_item_words", "_user_words"):
        held = getattr(back, name)
        assert held.flags.c_contiguous and 0 not in held.strides, name  # not a placeholder
        assert held.flags.writeable is (name != "item_codes"), name  # the item codes change only by set_item_codes
        assert np.array_equal(held, getattr(model, name)), name
    monkeypatch.undo()
    for m in (model, back):  # the same local round from the same state and generator
        m.fit_local(np.array([4, 5, 6]), np.array([5.0, 1.0, 3.0]), rng=np.random.default_rng(2))
    assert np.array_equal(back.user_codes, model.user_codes)


def test_packed_item_codes_are_installed_as_given_less_their_padding() -> None:
    """`set_item_codes` keeps packed words as they are (no unpacking and packing again), clearing any bit
    above the code length as that round trip did."""
    rng = np.random.default_rng(4)
    signs = random_signs(50, 70, rng)
    words = pack_signs(signs)
    dirty = words.copy()
    dirty[1] |= np.uint64(0xFFFF) << np.uint64(6)  # bits 70..85 of each code: padding
    model = LightFRModel(50, LightFRConfig(bits=70), rng=rng)
    model.set_item_codes(dirty, version=1)
    assert np.array_equal(model._item_words, words) and np.array_equal(model.item_codes, signs)
    assert dirty[1, 0] != words[1, 0]  # the caller's array is not touched


@pytest.mark.parametrize("config", [LightFRConfig(), LightFRConfig(bits=70, rank_planes=0), LightFRConfig(bits=130)])
def test_a_ranking_device_never_unpacks_the_catalogue(tmp_path: Path, config: LightFRConfig) -> None:
    """Download (load), fold in and recommend read the packed words and the rows they need: the (m, f) ±1
    matrix (f bytes an item) is never built, and every result equals that of a model holding the matrix."""
    rng = np.random.default_rng(5)
    m, f = 40_000, config.bits
    signs = random_signs(m, f, rng)
    levels = rng.integers(0, 256, m)
    liked = np.sort(rng.choice(m, 30, replace=False))
    ratings = rng.uniform(1, 5, liked.size)
    model = LightFRModel(m, config, rng=np.random.default_rng(1))
    model.set_item_codes(pack_signs(signs), 3)
    model.item_levels = levels
    model.save(tmp_path / "model.fedrec")
    device = LightFRModel.load(tmp_path / "model.fedrec", rng=np.random.default_rng(1))
    held = LightFRModel(m, config, rng=np.random.default_rng(1))
    held.set_item_codes(signs, 3)
    held.item_levels = levels
    assert np.array_equal(held.item_codes, signs) and held._item_signs is not None  # unpacked once, then held
    results = []
    for one in (device, held):
        code = one.fold_in(liked, ratings)
        top = one.recommend(liked, N=20, rng=np.random.default_rng(2))
        some = one.recommend(liked, N=5, items=np.arange(100), rng=np.random.default_rng(2))
        results.append((code, *top, *some, *one.item_gram()))
    assert device._item_signs is None
    for a, b in zip(*results, strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(device.item_codes, signs) and device._item_signs is not None


def test_the_item_gram_is_stored_and_a_loaded_model_folds_in_without_recomputing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model that computed its item Gram (any fold-in under the all-items objective) saves its sums; the
    loaded model folds in from them, the same Gram bit for bit and the same code, without a pass over the
    catalogue.  A file without them (written before, or before any fold-in) computes them as before."""
    import device_sdk.lightfr as kernels

    rng = np.random.default_rng(3)
    model = LightFRModel(500, LightFRConfig(), rng=np.random.default_rng(1))
    model.set_item_codes(random_signs(500, 64, rng), 2)
    model.item_levels = rng.integers(0, 256, 500)
    fresh_path, used_path = tmp_path / "fresh.fedrec", tmp_path / "used.fedrec"
    model.save(fresh_path)
    model.fold_in(np.array([1, 2, 3]), np.array([5.0, 4.0, 2.0]))
    model.save(used_path)
    assert "item_gram" not in load_store(fresh_path, "lightfr") and "item_gram" in load_store(used_path, "lightfr")
    fresh = LightFRModel.load(fresh_path, rng=np.random.default_rng(4))
    want = fresh.item_gram()  # computed from the codes

    def no_pass(*args: object) -> None:
        raise AssertionError("the Gram was computed again")

    monkeypatch.setattr(kernels, "gram_sums", no_pass)
    used = LightFRModel.load(used_path, rng=np.random.default_rng(4))
    for a, b in zip(used.item_gram(), want, strict=True):
        assert np.array_equal(a, b)
    items, ratings = np.array([7, 8, 9, 10]), np.array([5.0, 1.0, 4.0, 3.0])
    assert np.array_equal(used.fold_in(items, ratings), fresh.fold_in(items, ratings))
    used.hamming_weight = 3  # Dᵀβ = 2/(f·B)·Dᵀ(level − 128): rescaled from the same sums, no pass
    np.testing.assert_allclose(used.item_gram()[1], want[1] / 3, rtol=1e-12)
    assert np.array_equal(used.item_gram()[0], want[0])


def test_a_model_swap_during_an_unpack_leaves_no_stale_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unpacked ±1 matrix and the Gram are kept with the words they came from: a new model adopted while
    one is being computed (the client adopts downloads in a worker thread) never leaves the old one in use,
    in memory or in the store file."""
    import device_sdk.lightfr as kernels
    import device_sdk.models as models

    old, new = (random_signs(50, 64, np.random.default_rng(s)) for s in (1, 2))
    model = LightFRModel(50, LightFRConfig(), rng=np.random.default_rng(0))
    model.set_item_codes(old, 1)
    unpack, sums = models.unpack_signs, kernels.gram_sums

    def unpack_then_swap(words: np.ndarray, f: int) -> np.ndarray:
        out = unpack(words, f)  # the old words unpacked, then the other thread adopts new codes
        monkeypatch.setattr(models, "unpack_signs", unpack)
        model.set_item_codes(new, 2)
        return out

    monkeypatch.setattr(models, "unpack_signs", unpack_then_swap)
    assert np.array_equal(model.item_codes, old)  # the call that raced sees the model it started with
    assert np.array_equal(model.item_codes, new)  # every later one the new

    def sums_then_swap(words: np.ndarray, f: int, levels: object) -> object:
        out = sums(words, f, levels)
        monkeypatch.setattr(kernels, "gram_sums", sums)
        model.set_item_codes(old, 3)
        return out

    monkeypatch.setattr(kernels, "gram_sums", sums_then_swap)
    model.item_gram()
    model.save(tmp_path / "model.fedrec")
    assert "item_gram" not in load_store(tmp_path / "model.fedrec", "lightfr")  # not the codes the file holds
    G = model.item_gram()[0]
    assert np.array_equal(G, old.T.astype(float) @ old)
    model.save(tmp_path / "model.fedrec")
    back = LightFRModel.load(tmp_path / "model.fedrec")
    assert np.array_equal(back.item_gram()[0], G)


@pytest.mark.parametrize(
    "damage",
    ["diagonal", "asymmetric", "fraction", "parity", "nan", "size", "no levels", "level parity", "level bound", "type"],
)
def test_a_stored_item_gram_that_cannot_be_the_codes_is_refused(tmp_path: Path, damage: str) -> None:
    """The stored sums are checked against what any m codes of ±1 and the stored levels can give (the file's
    checksum covers accidents; this covers a file written wrong): a refusal names item_gram and leaves the
    file where it is."""
    rng = np.random.default_rng(2)
    model = LightFRModel(200, LightFRConfig(), rng=np.random.default_rng(1))
    model.set_item_codes(random_signs(200, 64, rng), 1)
    if damage.startswith("level"):
        model.item_levels = rng.integers(0, 256, 200)
    model.fold_in(np.array([1, 2]), np.array([5.0, 3.0]))
    path = tmp_path / "model.fedrec"
    model.save(path)
    state = load_store(path, "lightfr")
    G = np.frombuffer(state["item_gram"]["codes"], "<f8").reshape(64, 64).copy()
    Dl = np.frombuffer(state["item_gram"]["levels"], "<f8").copy()
    if damage == "diagonal":
        G[3, 3] = 198.0
    elif damage == "asymmetric":
        G[0, 1] += 2.0
    elif damage == "fraction":
        G[0, 1] = G[1, 0] = G[0, 1] + 0.5
    elif damage == "parity":  # 200 codes: every entry of DᵀD is even
        G[0, 1] = G[1, 0] = G[0, 1] + 1.0
    elif damage == "nan":
        G[2, 5] = G[5, 2] = np.nan
    elif damage == "no levels":
        Dl[0] = 4.0
    elif damage == "level parity":
        Dl[0] += 1.0
    elif damage == "level bound":
        Dl[0] = 128.0 * 200
    codes = G.tobytes()[:-8] if damage == "size" else G.tobytes()
    state["item_gram"] = {"codes": 1, "levels": 2} if damage == "type" else {"codes": codes, "levels": Dl.tobytes()}
    store.save_store(path, "lightfr", state)
    with pytest.raises(StorageError, match="item_gram"):
        LightFRModel.load(path)
    assert path.exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_file_raises_and_is_moved_aside(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "model.fedrec"
    _model().save(path)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) - 100] ^= 0x01  # inside the payload: checksum must catch it
    elif damage == "garbage":
        data = bytearray(b"\xc1not msgpack at all")
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="device_sdk.store"), pytest.raises(StorageError, match="corrupt"):
        LightFRModel.load(path)
    assert not path.exists()
    aside = tmp_path / "model.fedrec.corrupt-1"
    assert f"store file {path} is corrupt" in caplog.text and "moved it aside to model.fedrec.corrupt-1" in caplog.text
    assert aside.read_bytes() == bytes(data)  # kept byte for byte, never overwritten
    # A second corrupt file gets its own name.
    path.write_bytes(bytes(data))
    with pytest.raises(StorageError):
        LightFRModel.load(path)
    assert (tmp_path / "model.fedrec.corrupt-2").exists() and aside.read_bytes() == bytes(data)


def test_a_reader_of_the_users_file_leaves_a_corrupt_one_where_it_is(tmp_path: Path) -> None:
    """``load_store(..., move_aside=False)``: the error names the file, and the file is not renamed."""
    path = tmp_path / "model.fedrec"
    path.write_bytes(b"\xc1not msgpack at all")
    with pytest.raises(StorageError, match="corrupt or not a fedrec store file .*left it unchanged"):
        load_store(path, "lightfr", move_aside=False)
    assert path.read_bytes() == b"\xc1not msgpack at all" and sorted(tmp_path.iterdir()) == [path]


def test_key_material_is_created_readable_by_its_owner_only(tmp_path: Path) -> None:
    """The device's identity key and its credential file are created with mode 0600 (not chmod-ed after)."""
    from device_sdk.persistence import (
        IDENTITY_FILE,
        SIGNING_KEY_FILE,
        Identity,
        load_or_create_signing_key,
        save_identity,
    )

    old = os.umask(0o022)
    try:
        load_or_create_signing_key(tmp_path)
        save_identity(tmp_path, Identity(device_id=1, token="secret", certificate=b""))
        _model().save(tmp_path / "model.fedrec")
    finally:
        os.umask(old)
    assert (tmp_path / SIGNING_KEY_FILE).stat().st_mode & 0o777 == 0o600
    assert (tmp_path / IDENTITY_FILE).stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "model.fedrec").stat().st_mode & 0o777 == 0o644  # not key material: as before


def test_crash_during_save_keeps_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "model.fedrec"
    first = _model()
    first.save(path)
    before = path.read_bytes()
    calls = {"n": 0}

    def failing_write(fh: object, chunk: bytes) -> None:
        calls["n"] += 1
        fh.write(chunk[: len(chunk) // 2])  # type: ignore[attr-defined]
        raise OSError("disk full (simulated, half-way through the write)")

    monkeypatch.setattr(store, "_write_chunk", failing_write)
    second = _model()
    second.set_item_codes(-second.item_codes, version=8)
    with pytest.raises(StorageError, match="disk full"):
        second.save(path)
    assert calls["n"] == 1
    assert path.read_bytes() == before
    assert LightFRModel.load(path).model_version == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.fedrec"]


def test_crash_before_rename_keeps_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "model.fedrec"
    _model().save(path)
    before = path.read_bytes()

    def boom(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # the process dies between fsync and rename

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        _model().save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.fedrec"]


def test_wrong_kind_and_future_format_are_refused_without_moving(tmp_path: Path) -> None:
    path = tmp_path / "other.fedrec"
    store.save_store(path, "mf", {"x": 1})
    with pytest.raises(StorageError, match="'mf' model"):
        LightFRModel.load(path)
    assert path.exists()
    blob = msgpack.unpackb(path.read_bytes())
    blob["format"] = [2, 0]
    path.write_bytes(msgpack.packb(blob))
    with pytest.raises(StorageError, match="format 2.0"):
        store.load_store(path, "mf")
    assert path.exists()
    with pytest.raises(StorageError, match="no store file"):
        LightFRModel.load(tmp_path / "missing.fedrec")


def test_valid_store_with_invalid_state_is_a_storage_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.fedrec"
    store.save_store(path, "lightfr", {"config": {"bits": 64}, "n_items": 3})
    with pytest.raises(StorageError, match="LightFR state is invalid"):
        LightFRModel.load(path)


def test_fold_in_all_items_objective_uses_the_cached_gram_and_matches_the_full_kernel() -> None:
    from device_sdk import lightfr
    from protocol.families.lightfr import bias_from_levels

    rng = np.random.default_rng(11)
    m, f, w0, alpha = 400, 32, 0.1, 2.0
    cfg = LightFRConfig(bits=f, rating_range=None, unobserved_weight=w0, confidence=alpha)
    model = LightFRModel(m, cfg, rng=np.random.default_rng(0))
    D = random_signs(m, f, rng)
    model.set_item_codes(D, version=3)
    model.item_levels = rng.integers(100, 156, m).astype(np.uint8)
    model.hamming_weight = 2
    items = np.sort(rng.choice(m, 25, replace=False))
    code = model.fold_in(items)
    held = model._gram
    assert held is not None
    gram = held[3]  # (G, Dᵀβ, β), kept with the words, levels and weight it was made from
    # The same DCD on the whole catalogue (the kernel computes G and Dᵀβ itself) from the same start.
    beta = bias_from_levels(model.item_levels, m, f, 2)
    r = np.ones(items.size)
    c = 1.0 + alpha
    lin = -(c * r - (c - w0) * beta[items]) @ D[items].astype(float) + w0 * (D.T.astype(float) @ beta)
    B0 = np.where(lin > 0, -1, 1).astype(np.int8)[None, :]
    ref, _ = lightfr.dcd_full(np.array([0, items.size]), items, r, B0, D, beta, w0, alpha, max_sweeps=cfg.max_sweeps)
    assert np.array_equal(code, ref[0])
    np.testing.assert_allclose(gram[0], D.T.astype(float) @ D)
    # Cached per model version: a second fold-in reuses it, new codes or levels recompute it.
    model.fold_in(items[:5])
    assert model._gram is held
    model.item_levels = None
    assert model._gram is None
    model.fold_in(items[:5])
    model.set_item_codes(-D, version=4)
    assert model._gram is None


def test_substring_index_setting_is_validated_kept_and_reaches_the_index(tmp_path: Path) -> None:
    """`LightFRConfig.substring_index` is a device setting: a non-bool is refused, the store keeps it,
    and the model's retrieval index takes it (False: no substring tables, only the scan)."""
    with pytest.raises(ValueError, match="substring_index must be a bool"):
        LightFRConfig(substring_index=1)  # type: ignore[arg-type]
    model = LightFRModel(30, LightFRConfig(bits=64, substring_index=False), n_users=2, rng=np.random.default_rng(0))
    model.set_item_codes(random_signs(30, 64, np.random.default_rng(1)), 1)
    assert model._hamming_index()._mih_allowed is False
    path = tmp_path / "model.fedrec"
    model.save(path)
    back = LightFRModel.load(path)
    assert back.config.substring_index is False and back._hamming_index()._mih_allowed is False
    assert LightFRModel(30, LightFRConfig(bits=64), rng=np.random.default_rng(0))._hamming_index()._mih_allowed
