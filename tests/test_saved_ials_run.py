"""``fedrec simulate --save`` for iALS and for the default ``--model auto``: the saved run re-scores to the figures
the run printed (``fedrec eval``), recommends what the device model it exports recommends (``fedrec recommend``,
``fedrec export``), and never repeats a training item."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from device_sdk.ials import IALSModel
from fedsim.cli import main
from fedsim.federation.runs import load_run

SMALL = ["--dataset", "synthetic", "--rounds", "2", "--quiet", "--json"]


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_an_ials_run_saves_and_its_file_re_scores_recommends_and_exports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.fedrec"
    rec = _json(["simulate", "--model", "ials", "--rank", "8", *SMALL, "--save", str(path)], capsys)
    run = load_run(path)
    assert (run.family, run.state["protocol"], run.state["rounds"]) == ("ials", rec["protocol"], 2)
    model, _ = run.device_model(None)
    assert isinstance(model, IALSModel) and model.rank == 8 and model.config.alpha == rec["alpha"]
    # `fedrec eval` rebuilds the split from the run file and scores the same model: the same test figures.
    again = _json(["eval", str(path), "--json"], capsys)
    assert again["metrics"]["model"] == rec["metrics"]["model"]
    # `fedrec recommend` ranks with the user's own device model, the one `fedrec export --user` writes.
    raw = "3"
    user = run.user_index(raw)  # the run's dense row of that dataset id
    shown = _json(["recommend", str(path), "--user", raw, "-n", "5", "--json"], capsys)
    ids = [row["index"] for row in shown["items"]]
    assert len(ids) == 5 and not set(ids) & set(run.train.of(user).tolist())
    assert main(["export", str(path), "--user", raw, "-o", str(tmp_path / "one.fedrec")]) == 0
    capsys.readouterr()
    one = IALSModel.load(tmp_path / "one.fedrec")
    assert one.n_users == 1 and np.array_equal(one.user_factors[0], model.user_factors[user])
    top, _ = one.recommend(run.train.of(user), N=5, rng=np.random.default_rng(0))
    assert top.tolist() == ids  # same model, same generator seed (recommend's --seed default 0)


def test_the_default_saves_the_family_it_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "auto.fedrec"
    rec = _json(["simulate", *SMALL, "--save", str(path)], capsys)
    run = load_run(path)
    assert run.family == rec["family"] and rec["family"] in ("lightfr", "ials")
    again = _json(["eval", str(path), "--json"], capsys)
    assert again["metrics"]["model"] == rec["metrics"]["model"]


def test_a_save_target_that_cannot_be_written_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "missing-folder" / "run.fedrec"
    assert main(["simulate", *SMALL, "--save", str(target)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("fedrec simulate: error: --save") and err.count("\n") == 1, err
    assert not target.exists()
