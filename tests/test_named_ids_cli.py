"""A rating file with names for ids, end to end through the CLI: simulate, save, recommend by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedsim.cli import main


def _amazon_like(path: Path) -> None:
    rng = np.random.default_rng(3)
    with path.open("w", encoding="utf-8-sig") as f:  # as a spreadsheet program saves it
        f.write('"reviewerID","asin","overall","unixReviewTime"\n')
        for u in range(300):
            for i in rng.choice(400, size=int(rng.integers(4, 20)), replace=False):
                f.write(f'"A{u:05d}XQ","B00{i:07d}","{int(rng.integers(1, 6))}.0","{1365811200 + u * 97 + int(i)}.0"\n')


def test_a_file_of_named_ids_trains_saves_and_recommends_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, run = tmp_path / "reviews.csv", tmp_path / "run.fedrec"
    _amazon_like(data)
    assert main(["simulate", "--dataset", str(data), "--json", "--quiet", "--save", str(run)]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["dataset"] == "reviews" and record["metrics"]["model"]["hr@10"] > 0
    assert main(["recommend", str(run), "--user", "A00007XQ"]) == 0
    out = capsys.readouterr().out
    assert "for user A00007XQ" in out and out.count("B00") >= 5  # items by their names
    assert main(["recommend", str(run), "--user", "A99999XQ"]) == 2
    assert "no user 'A99999XQ' in this run" in capsys.readouterr().err
