"""Tests of fedsim.data: the Ratings container, loaders (clean and malformed input), synthetic data, load_dataset."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fedsim.data.datasets import find_data_dir, load_amazon_book, load_dataset
from fedsim.data.kgat import TrainTestSplit, load_kgat
from fedsim.data.loaders import LightFRSplit, load_filmtrust, load_generic, load_lightfr_split, load_movielens
from fedsim.data.ratings import Ratings
from fedsim.data.synthetic import synthetic
from protocol.errors import DatasetError


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _tiny() -> Ratings:
    return Ratings(
        users=np.array([1, 0, 1, 2, 0], dtype=np.int64),
        items=np.array([0, 1, 2, 2, 0], dtype=np.int64),
        ratings=np.array([5.0, 3.0, 1.0, 4.0, 2.0]),
        timestamps=np.array([10, 20, 30, 40, 50], dtype=np.int64),
        n_users=3,
        n_items=3,
        user_ids=np.array([7, 8, 9]),
        item_ids=np.array([100, 200, 300]),
        name="tiny",
    )


# ---------------------------------------------------------------------------------------- Ratings


class TestRatings:
    def test_len_and_readonly(self) -> None:
        r = _tiny()
        assert len(r) == 5
        with pytest.raises(ValueError, match="read-only"):
            r.ratings[0] = 1.0

    def test_by_user_matches_reference(self) -> None:
        r = synthetic(n_users=50, n_items=60, ratings_per_user=10, seed=3)
        idx = r.by_user()
        for u in range(r.n_users):
            rows = np.flatnonzero(r.users == u)  # file order
            sl = slice(idx.indptr[u], idx.indptr[u + 1])
            np.testing.assert_array_equal(idx.items[sl], r.items[rows])
            np.testing.assert_array_equal(idx.ratings[sl], r.ratings[rows])
            np.testing.assert_array_equal(idx.order[sl], rows)
        assert idx.indptr[-1] == len(r)

    def test_normalized(self) -> None:
        r = _tiny()
        np.testing.assert_allclose(r.normalized(1, 5).ratings, [1.0, 0.5, 0.0, 0.75, 0.25])
        np.testing.assert_allclose(r.normalized().ratings, [1.0, 0.5, 0.0, 0.75, 0.25])
        with pytest.raises(ValueError, match="r_max > r_min"):
            r.normalized(3, 3)

    def test_popularity_and_subset(self) -> None:
        r = _tiny()
        np.testing.assert_array_equal(r.item_popularity(), [2, 1, 2])
        np.testing.assert_array_equal(r.user_counts(), [2, 2, 1])
        s = r.subset(r.users == 1, name="u1")
        assert len(s) == 2 and s.n_users == 3 and s.name == "u1"
        np.testing.assert_array_equal(s.items, [0, 2])
        assert s.timestamps is not None
        np.testing.assert_array_equal(s.timestamps, [10, 30])
        np.testing.assert_array_equal(r.subset(np.array([4, 0])).ratings, [2.0, 5.0])
        with pytest.raises(ValueError, match="mask"):
            r.subset(np.array([True, False]))

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            ({"users": np.array([0, 1], dtype=np.int64)}, "one length"),
            ({"users": np.array([0, 1, 2, 3, 0], dtype=np.int64)}, "user index outside"),
            ({"items": np.array([0, 1, 2, -1, 0], dtype=np.int64)}, "item index outside"),
            ({"ratings": np.array([1.0, np.nan, 1.0, 1.0, 1.0])}, "finite"),
            ({"users": np.array([0, 1, 2, 1, 0], dtype=np.int32)}, "int64"),
            ({"timestamps": np.array([1, 2], dtype=np.int64)}, "timestamps"),
            ({"item_ids": np.array([1, 2])}, "item_ids"),
        ],
    )
    def test_invalid_construction(self, change: dict[str, object], message: str) -> None:
        r = _tiny()
        fields: dict[str, object] = {
            "users": r.users,
            "items": r.items,
            "ratings": r.ratings,
            "timestamps": r.timestamps,
            "n_users": 3,
            "n_items": 3,
            "user_ids": r.user_ids,
            "item_ids": r.item_ids,
        }
        fields.update(change)
        with pytest.raises(DatasetError, match=message):
            Ratings(**fields)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------- clean input


class TestGeneric:
    @pytest.mark.parametrize("sep", [",", "\t", " ", "  ", ";"])
    def test_separators(self, tmp_path: Path, sep: str) -> None:
        lines = ["10", "20", "4.5", "1000"], ["11", "20", "3", "1001"], ["10", "30", "1", "999"]
        path = _write(tmp_path, "r.txt", "\n".join(sep.join(f) for f in lines) + "\n")
        r = load_generic(path, sep=";" if sep == ";" else None)
        assert (len(r), r.n_users, r.n_items) == (3, 2, 2)
        np.testing.assert_array_equal(r.user_ids, [10, 11])
        np.testing.assert_array_equal(r.item_ids, [20, 30])
        np.testing.assert_array_equal(r.users, [0, 1, 0])
        np.testing.assert_array_equal(r.items, [0, 0, 1])
        np.testing.assert_array_equal(r.ratings, [4.5, 3.0, 1.0])
        assert r.timestamps is not None
        np.testing.assert_array_equal(r.timestamps, [1000, 1001, 999])

    def test_header_comments_blank_lines_no_timestamps(self, tmp_path: Path) -> None:
        text = "# exported ratings\nuser,item,rating\n\n1,2,3.5\n  # comment\n2, 2 ,4\r\n\n"
        r = load_generic(_write(tmp_path, "r.csv", text))
        assert r.timestamps is None
        np.testing.assert_array_equal(r.ratings, [3.5, 4.0])
        assert r.name == "r"

    def test_a_byte_order_mark_and_quotes_are_not_part_of_the_values(self, tmp_path: Path) -> None:
        path = tmp_path / "bx.csv"  # the Book-Crossing layout: ';', every field quoted, a quoted header
        text = '"User-ID";"ISBN";"Book-Rating"\n"276725";"034545104X";"0"\n"276726";"0155061224";"5"\n'
        path.write_text(text, encoding="utf-8-sig")
        r = load_generic(path)
        assert (len(r), r.n_users, r.n_items) == (2, 2, 2)
        np.testing.assert_array_equal(r.user_ids, [276725, 276726])
        assert r.item_ids.tolist() == ["0155061224", "034545104X"]  # names as written: leading zeros kept
        np.testing.assert_array_equal(r.ratings, [0.0, 5.0])
        bom = tmp_path / "bom.csv"
        bom.write_text("7,1,4\n8,1,2\n", encoding="utf-8-sig")
        np.testing.assert_array_equal(load_generic(bom).user_ids, [7, 8])

    @pytest.mark.parametrize(
        ("text", "users"),
        [
            ("1 5\n1 6\n2 5\n", [1, 2]),
            ("user,item\n1,5\n1,6\n2,5\n", [1, 2]),
            ("u1,i5\nu1,i6\nu2,i5\n", ["u1", "u2"]),  # ids with digits: the first line is data
        ],
    )
    def test_user_item_lines_are_implicit_feedback(self, tmp_path: Path, text: str, users: list[object]) -> None:
        r = load_generic(_write(tmp_path, "r.txt", text))
        assert len(r) == 3 and r.user_ids.tolist() == users
        np.testing.assert_array_equal(r.ratings, [1.0, 1.0, 1.0])

    def test_named_ids_and_numeric_timestamps(self, tmp_path: Path) -> None:
        text = "A2SUAM1J3GNN3B,B000FA64PK,5.0,1365811200.0\nA1X,0132793040,4.0,1.3658e9\nA1X,B000FA64PK,3,1365811300\n"
        r = load_generic(_write(tmp_path, "amazon.csv", text))
        assert r.user_ids.tolist() == ["A1X", "A2SUAM1J3GNN3B"] and r.item_ids.tolist() == ["0132793040", "B000FA64PK"]
        np.testing.assert_array_equal(r.users, [1, 0, 0])
        assert r.timestamps is not None and r.timestamps.tolist() == [1365811200, 1365800000, 1365811300]

    def test_a_typo_in_a_file_of_integer_ids_is_still_an_error(self, tmp_path: Path) -> None:
        text = "".join(f"{u},{u + 1},3\n" for u in range(200)) + "1O,4,3\n"  # the letter O for a zero
        msg = str(pytest.raises(DatasetError, load_generic, _write(tmp_path, "r.csv", text)).value)
        assert ":201: user id is not an integer" in msg

    @pytest.mark.parametrize("kind", ["gz", "bz2", "xz", "zip"])
    def test_a_compressed_file_is_unpacked(self, tmp_path: Path, kind: str) -> None:
        import bz2
        import gzip
        import lzma
        import zipfile

        text = b"10,20,4.5,1000\n11,20,3,1001\n10,30,1,999\n"
        path = tmp_path / f"ratings.csv.{kind}"
        if kind == "zip":
            with zipfile.ZipFile(path, "w") as archive:
                archive.writestr("data/ratings.csv", text)
        else:
            path.write_bytes({"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}[kind](text))
        r = load_generic(path)
        assert (len(r), r.n_users, r.n_items, r.name) == (3, 2, 2, "ratings")
        np.testing.assert_array_equal(r.ratings, [4.5, 3.0, 1.0])

    def test_a_damaged_or_ambiguous_archive_is_one_error(self, tmp_path: Path) -> None:
        import gzip
        import zipfile

        cut = tmp_path / "r.csv.gz"
        cut.write_bytes(gzip.compress(b"1,2,3\n" * 1000)[:30])
        with pytest.raises(DatasetError, match=re.escape(f"{cut}: damaged gzip data")):
            load_generic(cut)
        two = tmp_path / "r.zip"
        with zipfile.ZipFile(two, "w") as archive:
            archive.writestr("a.csv", "1,2,3\n")
            archive.writestr("b.csv", "1,2,3\n")
        with pytest.raises(DatasetError, match=re.escape(f"{two}: a zip archive of 2 files (a.csv, b.csv)")):
            load_generic(two)

    def test_deduplicates_keeping_last(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "r.tsv", "1\t1\t2\n1\t1\t2\n1\t2\t5\n1\t2\t1\n2\t1\t3\n")
        r = load_generic(path)
        assert len(r) == 3
        np.testing.assert_array_equal(r.ratings, [2.0, 1.0, 3.0])
        assert r.meta["exact_duplicates"] == 1 and r.meta["conflicting_duplicates"] == 1
        assert len(load_generic(path, deduplicate=False)) == 5


class TestMovieLens:
    def test_u_data_file_and_folder(self, tmp_path: Path) -> None:
        _write(tmp_path, "u.data", "196\t242\t3\t881250949\n186\t302\t3\t891717742\n22\t377\t1\t878887116\n")
        for arg in (tmp_path, tmp_path / "u.data"):
            r = load_movielens(arg)
            assert (len(r), r.n_users, r.n_items, r.name) == (3, 3, 3, "ml-100k")
            np.testing.assert_array_equal(r.user_ids, [22, 186, 196])
            assert r.timestamps is not None and r.timestamps.dtype == np.int64

    def test_ratings_dat(self, tmp_path: Path) -> None:
        _write(tmp_path, "ratings.dat", "1::1193::5::978300760\n1::661::3::978302109\n2::1193::4::978298413\n")
        r = load_movielens(tmp_path)
        assert (len(r), r.n_users, r.n_items, r.name) == (3, 2, 2, "ml-1m")
        np.testing.assert_array_equal(r.ratings, [5.0, 3.0, 4.0])

    def test_missing(self, tmp_path: Path) -> None:
        with pytest.raises(DatasetError, match="no u.data or ratings.dat"):
            load_movielens(tmp_path)
        with pytest.raises(DatasetError, match=re.escape(str(tmp_path / "nope.data"))):
            load_movielens(tmp_path / "nope.data")


class TestFilmTrust:
    def test_duplicates(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "ratings.txt", "1 1 2\n1 1 2\n1 2 4\n3 2 1.5\n1 2 3.5\n")
        r = load_filmtrust(path)
        assert len(r) == 3 and r.timestamps is None
        # exact duplicate dropped; conflicting pair (1, 2) keeps the last line (3.5), file order kept
        np.testing.assert_array_equal(r.ratings, [2.0, 1.5, 3.5])
        assert r.meta["exact_duplicates"] == 1
        assert r.meta["conflicting_duplicates"] == 1


# ------------------------------------------------------------------------------- malformed input

BAD_LINES = [
    ("1,2", "expected 3 fields (as on line 1), got 2"),
    ("1,2,3,4,5", "expected 3 fields (as on line 1), got 5"),
    ("a,2,3", "user id is not an integer"),
    ("1,b,3", "item id is not an integer"),
    ("1.5,2,3", "user id is not an integer"),
    ("1,2,good", "rating is not a number"),
    ("1,2,nan", "rating is NaN or infinite"),
    ("1,2,inf", "rating is NaN or infinite"),
    ("1,2,-inf", "rating is NaN or infinite"),
    ("-1,2,3", "negative user id"),
    ("1,-2,3", "negative item id"),
    ("1,2,", "rating is not a number"),
    ("99999999999999999999,2,3", "user id is not an integer"),
]


class TestMalformed:
    @pytest.mark.parametrize(("line", "reason"), BAD_LINES)
    def test_each_kind_names_file_line_and_reason(self, tmp_path: Path, line: str, reason: str) -> None:
        # Among 200 clean lines: one value that is not an integer is a typo, not a column of names.
        clean = "".join(f"{u},{u % 7},5\n" for u in range(2, 202))
        path = _write(tmp_path, "r.csv", f"1,1,4\n# comment\n\n{line}\n{clean}")
        with pytest.raises(DatasetError) as info:
            load_generic(path)
        msg = str(info.value)
        assert f"{path}:4: {reason}" in msg
        assert "1 malformed line(s)" in msg

    def test_bad_timestamp(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "r.csv", "1,1,4,100\n1,2,4,noon\n1,3,4\n")
        msg = str(pytest.raises(DatasetError, load_generic, path).value)
        assert f"{path}:2: timestamp is not an integer" in msg
        assert f"{path}:3: expected 4 fields (as on line 1), got 3" in msg

    def test_reports_every_line_with_total(self, tmp_path: Path) -> None:
        good = [f"{u} {u} 3" for u in range(50)]
        bad = [f"{u} {u} x" for u in range(30)]
        path = _write(tmp_path, "r.txt", "\n".join(good + bad + ["1 2 nan nan nan"]) + "\n")
        msg = str(pytest.raises(DatasetError, load_generic, path).value)
        assert "31 malformed line(s)" in msg
        assert f"{path}:51: rating is not a number" in msg
        assert "... and 11 more" in msg
        assert msg.count(f"{path}:") == 1 + 20  # the headline and 20 listed lines

    def test_several_reasons_on_one_line(self, tmp_path: Path) -> None:
        clean = "".join(f"{u} {u} 3\n" for u in range(2, 202))  # x: a typo among integer items, not a name
        path = _write(tmp_path, "r.txt", "-1 x nan\n" + clean)
        msg = str(pytest.raises(DatasetError, load_generic, path).value)
        assert "1 malformed line(s)" in msg and ":1: negative user id" in msg
        assert "item id is not an integer" in msg and "NaN" in msg

    @pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "   \n"])
    def test_empty(self, tmp_path: Path, text: str) -> None:
        path = _write(tmp_path, "r.txt", text)
        with pytest.raises(DatasetError, match=re.escape(f"{path}: no data lines")):
            load_generic(path)

    def test_only_header(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "r.csv", "user,item,rating\n")
        with pytest.raises(DatasetError, match="only a header"):
            load_generic(path)

    def test_missing_file(self, tmp_path: Path) -> None:
        with pytest.raises(DatasetError, match=re.escape(f"{tmp_path / 'x.csv'}: file not found")):
            load_generic(tmp_path / "x.csv")

    def test_movielens_rating_range_and_no_header(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "u.data", "1\t1\t3\t5\n1\t2\t6\t5\nuser\titem\trating\tts\n1\t3\t0\t5\n")
        msg = str(pytest.raises(DatasetError, load_movielens, path).value)
        assert "3 malformed line(s)" in msg
        assert f"{path}:2: rating outside [1, 5]" in msg
        assert f"{path}:3: user id is not an integer" in msg
        assert f"{path}:4: rating outside [1, 5]" in msg

    def test_filmtrust_wrong_fields(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "ratings.txt", "1 1 2\n1 2 4 7\n")
        with pytest.raises(DatasetError, match=re.escape(f"{path}:2: expected 3 fields, got 4")):
            load_filmtrust(path)

    def test_latin1_bytes_are_reported_not_crashing(self, tmp_path: Path) -> None:
        path = tmp_path / "r.txt"
        path.write_bytes(b"1 1 3\n1 \xe9 3\n" + b"".join(b"%d %d 3\n" % (u, u) for u in range(2, 202)))
        with pytest.raises(DatasetError, match=re.escape(f"{path}:2: item id is not an integer")):
            load_generic(path)


# ------------------------------------------------------------------------------ LightFR split


def _write_split(folder: Path, blocks: dict[str, list[tuple[int, int, float]]]) -> Path:
    folder.mkdir(exist_ok=True)
    for part, rows in blocks.items():
        text = "user_id,item_id,ratings\n" + "".join(f"{u},{i},{r}\n" for u, i, r in rows)
        (folder / f"filmtrust_{part}.csv").write_text(text, encoding="utf-8")
    return folder


def _block(user: int, positive: int, negatives: range, rating: float = 4.0) -> list[tuple[int, int, float]]:
    return [(user, positive, rating)] + [(user, i, 0.0) for i in negatives][:49]


def _split_rows() -> dict[str, list[tuple[int, int, float]]]:
    train = [(0, 1, 0.5), (0, 2, 1.01), (1, 2, 0.01)]
    return {
        "train": train,
        "val": _block(0, 3, range(100, 149)) + _block(1, 4, range(100, 149)),
        "test": _block(0, 5, range(200, 249)) + _block(1, 6, range(200, 249), 0.5),
    }


class TestLightFRSplit:
    def test_layout_and_shared_mapping(self, tmp_path: Path) -> None:
        sp = load_lightfr_split(_write_split(tmp_path / "s", _split_rows()))
        assert isinstance(sp, LightFRSplit)
        assert (len(sp.train), sp.train.n_users) == (3, 2)
        assert sp.train.n_items == 6 + 49 + 49  # items only in val/test are indexed too
        assert sp.val.candidates.shape == (2, 50) and sp.test.candidates.shape == (2, 50)
        ids = sp.train.item_ids
        np.testing.assert_array_equal(ids[sp.test.candidates[:, 0]], [5, 6])
        np.testing.assert_array_equal(ids[sp.val.candidates[1, 1:]], np.arange(100, 149))
        np.testing.assert_array_equal(sp.test.positive_ratings, [4.0, 0.5])
        np.testing.assert_array_equal(sp.train.user_ids[sp.val.users], [0, 1])
        assert len(sp.val) == 2

    @pytest.mark.parametrize(
        ("edit", "message"),
        [
            (lambda t: t.__setitem__(10, (1, t[10][1], 0.0)), "mixes users"),
            (lambda t: t.__setitem__(0, (0, 5, 0.0)), "first row of a block must be the positive"),
            (lambda t: t.__setitem__(7, (0, t[7][1], 1.0)), "negative candidate must have rating 0.0"),
            (lambda t: t.__delitem__(7), "not a multiple of 50"),
            (lambda t: t.__setitem__(slice(50, 100), _block(0, 6, range(200, 249))), "more than one block"),
        ],
    )
    def test_block_violations(self, tmp_path: Path, edit: object, message: str) -> None:
        rows = _split_rows()
        edit(rows["test"])  # type: ignore[operator]
        folder = _write_split(tmp_path / "s", rows)
        with pytest.raises(DatasetError, match=message) as info:
            load_lightfr_split(folder)
        assert "filmtrust_test.csv" in str(info.value)

    def test_missing_file_names_path(self, tmp_path: Path) -> None:
        rows = _split_rows()
        del rows["val"]
        folder = _write_split(tmp_path / "s", rows)
        with pytest.raises(DatasetError, match=re.escape(str(folder / "filmtrust_val.csv"))):
            load_lightfr_split(folder)


# ---------------------------------------------------------------------------------- synthetic


class TestSynthetic:
    def test_deterministic_and_shaped(self) -> None:
        a, b, c = synthetic(seed=1), synthetic(seed=1), synthetic(seed=2)
        np.testing.assert_array_equal(a.items, b.items)
        np.testing.assert_array_equal(a.ratings, b.ratings)
        assert a.timestamps is not None and b.timestamps is not None
        np.testing.assert_array_equal(a.timestamps, b.timestamps)
        assert len(a) != len(c) or not np.array_equal(a.items, c.items)
        assert (a.n_users, a.n_items) == (600, 400)
        assert 35 < len(a) / a.n_users < 45
        assert set(np.unique(a.ratings).tolist()) <= {1.0, 2.0, 3.0, 4.0, 5.0}
        assert np.unique(a.users * a.n_items + a.items).size == len(a)  # no repeated pair
        assert a.user_counts().min() >= 3
        pop = np.sort(a.item_popularity())
        assert pop[-40:].sum() > 3 * pop[:40].sum()  # popularity skew

    def test_planted_clusters_are_recoverable(self) -> None:
        # users of one cluster share items: the nearest neighbour (by co-rated items) of most users
        # sits in the same taste cluster, visible as much larger overlap than between random pairs
        r = synthetic(n_users=200, n_items=200, n_clusters=4, ratings_per_user=30, seed=5)
        m = np.zeros((r.n_users, r.n_items))
        m[r.users, r.items] = 1.0
        overlap = m @ m.T
        np.fill_diagonal(overlap, 0.0)
        assert overlap.max(axis=1).mean() > 2.0 * overlap.mean()

    def test_invalid(self) -> None:
        with pytest.raises(ValueError, match="exceeds"):
            synthetic(n_items=10, ratings_per_user=6)
        with pytest.raises(ValueError, match=">= 1"):
            synthetic(n_users=0)


# ------------------------------------------------------------------------- finding datasets


class TestFindAndLoad:
    def test_env_variable_wins(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("FEDREC_DATA", str(tmp_path))
        assert find_data_dir() == tmp_path

    def test_load_dataset_names_and_paths(self, tmp_path: Path) -> None:
        syn = load_dataset("synthetic")
        assert isinstance(syn, Ratings) and syn.name == "synthetic"
        _write(tmp_path, "u.data", "1\t1\t3\t5\n")
        assert isinstance(load_dataset(tmp_path), Ratings)
        assert load_dataset(tmp_path / "u.data").name == "ml-100k"  # type: ignore[union-attr]
        generic = _write(tmp_path, "mine.csv", "1,2,3\n")
        assert load_dataset(generic).name == "mine"  # type: ignore[union-attr]
        with pytest.raises(DatasetError, match="neither a dataset name"):
            load_dataset("ml-10m")
        with pytest.raises(DatasetError, match="no data folder|not found; expected layout"):
            load_dataset("ml-100k", data_dir=tmp_path / "absent")


# ------------------------------------------------------------------------- KGAT (amazon-book) format


def _kgat(tmp_path: Path, train: str, test: str) -> Path:
    (tmp_path / "train.txt").write_bytes(train.encode("latin-1"))
    (tmp_path / "test.txt").write_bytes(test.encode("latin-1"))
    return tmp_path


class TestKgat:
    def test_known_answer(self, tmp_path: Path) -> None:
        # users out of order, CRLF on one line, a trailing space, a test line without items, no final newline
        folder = _kgat(tmp_path, "1 4 0\r\n0 2 3 5\n2 1\n", "0 1 \n1 \n2 0 6")
        sp = load_kgat(folder)
        assert isinstance(sp, TrainTestSplit) and sp.name == folder.name
        tr, te = sp.train, sp.test
        assert (tr.n_users, tr.n_items) == (te.n_users, te.n_items) == (3, 7)
        assert list(zip(tr.users.tolist(), tr.items.tolist(), strict=True)) == [
            (1, 4),
            (1, 0),
            (0, 2),
            (0, 3),
            (0, 5),
            (2, 1),
        ]
        assert list(zip(te.users.tolist(), te.items.tolist(), strict=True)) == [(0, 1), (2, 0), (2, 6)]
        assert (tr.ratings == 1.0).all() and tr.timestamps is None
        assert te.meta["users_without_test"] == 1  # user 1
        np.testing.assert_array_equal(tr.user_ids, [0, 1, 2])
        assert tr.name == f"{folder.name}[train]"

    def test_load_dataset_finds_the_folder(self, tmp_path: Path) -> None:
        (tmp_path / "mine").mkdir()
        assert isinstance(load_dataset(_kgat(tmp_path / "mine", "0 1\n", "0 2\n")), TrainTestSplit)
        (tmp_path / "amazon-book-kgat").mkdir()
        _kgat(tmp_path / "amazon-book-kgat", "0 1\n1 0\n", "0 0\n")
        sp = load_dataset("amazon-book", data_dir=tmp_path)
        assert isinstance(sp, TrainTestSplit) and sp.name == "amazon-book"
        assert load_amazon_book(tmp_path).train.name == "amazon-book[train]"

    @pytest.mark.parametrize(
        ("train", "test", "where", "reason"),
        [
            ("0 1 2\n1 -3\n", "0 4\n", "train.txt:2", "expected non-negative integer ids"),
            ("0 1 2.5\n", "0 4\n", "train.txt:1", "expected non-negative integer ids"),
            ("0 1\nuser 2\n", "0 4\n", "train.txt:2", "'user 2'"),
            ("0 1,2\n", "0 4\n", "train.txt:1", "expected non-negative integer ids"),
            ("0 1\n0 2\n", "0 4\n", "train.txt:2", "user 0 already has a line (line 1)"),
            ("0 1 7 1\n", "0 4\n", "train.txt:1", "item 1 listed twice"),
            ("0 1 2\n1 3\n", "1 2\n0 2\n", "test.txt:2", "item 2 of user 0 is also in train.txt"),
            ("0 1234567890123456789\n", "0 4\n", "train.txt:1", "longer than 18 digits"),
        ],
    )
    def test_malformed_names_file_line_and_reason(
        self, tmp_path: Path, train: str, test: str, where: str, reason: str
    ) -> None:
        _kgat(tmp_path, train, test)
        with pytest.raises(DatasetError, match=re.escape(where) + r": .*" + re.escape(reason)):
            load_kgat(tmp_path)

    def test_every_bad_line_reported(self, tmp_path: Path) -> None:
        _kgat(tmp_path, "0 1\n1 x\n2 3\n3 -1\n4 \u00e9\n", "0 2\n")
        with pytest.raises(DatasetError, match="3 malformed line") as info:
            load_kgat(tmp_path)
        assert [f"train.txt:{n}" in str(info.value) for n in (2, 4, 5)] == [True] * 3

    @pytest.mark.parametrize("text", ["", "\n \n"])
    def test_empty_and_missing(self, tmp_path: Path, text: str) -> None:
        _kgat(tmp_path, text, "0 1\n")
        with pytest.raises(DatasetError, match="no data lines"):
            load_kgat(tmp_path)
        (tmp_path / "test.txt").unlink()
        with pytest.raises(DatasetError, match="missing: .*test.txt"):
            load_kgat(tmp_path)

    def test_parse_is_fast(self, tmp_path: Path) -> None:
        import time

        rng = np.random.default_rng(0)
        lines = [f"{u} " + " ".join(map(str, rng.choice(25_000, 9, replace=False))) for u in range(70_000)]
        _kgat(tmp_path, "\n".join(lines) + "\n", "0 25001\n")
        t0 = time.process_time()  # CPU time: a loaded machine does not lengthen it
        sp = load_kgat(tmp_path)
        assert len(sp.train) == 630_000 and len(sp.test) == 1
        # 0.17-0.37 s of CPU here (a plain per-token Python loop is no slower on this file); the bound
        # catches a path that is superlinear in lines or tokens
        assert time.process_time() - t0 < 1.5


# ------------------------------------------------------------------------------- real data


@pytest.mark.data
class TestRealData:
    def test_ml_100k(self, shared_data: Path) -> None:
        r = load_movielens(shared_data / "ml-100k")
        assert (len(r), r.n_users, r.n_items) == (100_000, 943, 1_682)
        np.testing.assert_array_equal(np.unique(r.ratings), [1, 2, 3, 4, 5])
        assert r.timestamps is not None and r.timestamps.min() > 8.7e8
        np.testing.assert_array_equal(r.user_ids, np.arange(1, 944))

    def test_filmtrust(self, shared_data: Path) -> None:
        r = load_filmtrust(shared_data / "filmtrust" / "ratings.txt")
        assert (len(r), r.n_users, r.n_items) == (35_494, 1_508, 2_071)
        # 35,498 lines (the last has no newline): 2 exact duplicates, 2 conflicting pairs (user 308)
        assert r.meta["exact_duplicates"] == 2 and r.meta["conflicting_duplicates"] == 2
        np.testing.assert_array_equal(np.unique(r.ratings), np.arange(1, 9) / 2)

    def test_lightfr_split(self, shared_data: Path) -> None:
        sp = load_lightfr_split(shared_data / "filmtrust-lightfr-split")
        assert (len(sp.train), sp.train.n_users, sp.train.n_items) == (31_367, 1_002, 2_042)
        assert sp.val.candidates.shape == sp.test.candidates.shape == (1_002, 50)
        assert np.unique(sp.train.items).size == 2_016  # 26 items appear only in val/test
        assert 0.0 < sp.train.ratings.min() and sp.train.ratings.max() < 1.02
        # known quirks of the published split (negatives were drawn with replacement and without
        # excluding the user's train items):
        dup_blocks = sum(np.unique(row).size < 50 for row in sp.test.candidates)
        assert dup_blocks == 450
        train_keys = np.unique(sp.train.users * sp.train.n_items + sp.train.items)
        neg_keys = sp.test.users[:, None] * sp.train.n_items + sp.test.candidates[:, 1:]
        assert int(np.isin(neg_keys, train_keys).sum()) == 747

    def test_load_dataset_by_name(self, shared_data: Path) -> None:
        r = load_dataset("ml-100k", data_dir=shared_data)
        assert isinstance(r, Ratings) and len(r) == 100_000
        assert isinstance(load_dataset("filmtrust-lightfr", data_dir=shared_data), LightFRSplit)

    def test_amazon_book_published_counts(self, shared_data: Path) -> None:
        sp = load_dataset("amazon-book", data_dir=shared_data)
        assert isinstance(sp, TrainTestSplit)
        tr, te = sp.train, sp.test
        assert (tr.n_users, tr.n_items, len(tr), len(te)) == (70_679, 24_915, 652_514, 193_920)
        assert np.unique(tr.users).size == 70_679 and np.unique(tr.items).size == 24_915
        assert np.unique(te.users).size == 70_679 - 88 and te.meta["users_without_test"] == 88
