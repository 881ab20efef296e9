"""``fedrec simulate``'s default, ``--model auto``: LightFR and implicit ALS trained on the same split, compared on
the same validation figure, the better one tested once (fedsim.cli.simulate_auto); private runs likewise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedsim.cli import main
from fedsim.cli.simulate_auto import SELECTION_NOTE, keep_better
from fedsim.federation.ials import FACTOR_GRID


def _json_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    assert main([*argv, "--quiet", "--json"]) == 0
    cap = capsys.readouterr()
    return json.loads(cap.out), cap.err


def _kgat_folder(tmp_path: Path) -> Path:
    """A tiny published split (KGAT layout): 120 users, 50 items, 6 train and 2 test items each."""
    rng = np.random.default_rng(2)
    folder = tmp_path / "mini-kgat"
    folder.mkdir()
    lines = {u: rng.choice(50, 8, replace=False) for u in range(120)}
    (folder / "train.txt").write_text("".join(f"{u} {' '.join(map(str, it[:6]))}\n" for u, it in lines.items()))
    (folder / "test.txt").write_text("".join(f"{u} {' '.join(map(str, it[6:]))}\n" for u, it in lines.items()))
    return folder


def test_keep_better_takes_the_higher_figure_and_lightfr_on_a_tie() -> None:
    assert keep_better({"lightfr": 0.60, "ials": 0.65}) == "ials"
    assert keep_better({"ials": 0.10, "lightfr": 0.12}) == "lightfr"
    assert keep_better({"lightfr": 0.3317, "ials": 0.3317}) == "lightfr"  # equal: the binary codes, cheaper to rank
    # Without DP a near tie keeps them too: the other family must be better by more than the figure's noise.
    assert keep_better({"lightfr": 0.9471, "ials": 0.9481}, 0.0071) == "lightfr"
    assert keep_better({"lightfr": 0.4185, "ials": 0.4786}, 0.0090) == "ials"
    assert keep_better({"lightfr": 0.50, "ials": 0.40}, 0.01) == "lightfr"
    with pytest.raises(ValueError, match="no validation figure for ials"):
        keep_better({"lightfr": 0.5})


def test_auto_keeps_lightfr_on_a_near_tie_and_tests_that_very_model(capsys: pytest.CaptureFixture[str]) -> None:
    # The synthetic catalogue at 3 rounds: iALS 0.717 against LightFR 0.705 on the validation blocks, closer than
    # the noise bound √(p(1 − p)/n) of LightFR's figure: the binary codes are kept.
    argv = ["simulate", "--dataset", "synthetic", "--rounds", "3"]
    rec, err = _json_run(argv, capsys)
    assert rec["family"] == "lightfr" and rec["validation_metric"] == "hr@10"
    assert set(rec["validation"]) == {"lightfr", "ials"}
    p, n = rec["validation"]["lightfr"], 600  # the synthetic catalogue's validation blocks, one per user
    assert rec["validation_margin"] == pytest.approx((p * (1 - p) / n) ** 0.5)
    assert 0 < rec["validation"]["ials"] - p <= rec["validation_margin"]
    assert "kept: LightFR (iALS is higher by " in err and "within the noise bound" in err
    assert "LightFR (Agg_grad)" in err and "federated iALS (d=" not in err  # the loser is never tested
    assert f"validation hr@10, iALS: {rec['validation']['ials']:.4f}" in err
    # Nothing refitted: the test figures are those of the same run made alone ...
    alone, _ = _json_run([*argv, "--model", "lightfr"], capsys)
    assert rec["metrics"] == alone["metrics"]
    # ... and iALS was judged by the figure its own selection reports, on the same held-out items and negatives.
    ials, _ = _json_run([*argv, "--model", "ials"], capsys)
    assert rec["validation"]["ials"] == max(c["hr@10"] for c in ials["level_weights"])


def test_auto_keeps_ials_where_it_validates_better(shared_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # MovieLens-100K at 2 rounds: iALS 0.69 against LightFR 0.62 on the validation blocks.
    argv = ["simulate", "--dataset", "ml-100k", "--data-dir", str(shared_data), "--rounds", "2"]
    rec, err = _json_run(argv, capsys)
    assert rec["family"] == "ials" and rec["validation"]["ials"] > rec["validation"]["lightfr"] + 0.03
    assert f"kept: iALS (higher by more than the noise bound {rec['validation_margin']:.4f}); only it" in err
    assert "LightFR (Agg_grad)" not in err
    assert rec["rounds"] == 2 and (rec["factors"], rec["alpha"]) != (None, None)
    assert {c["factors"] for c in rec["candidates"]} == set(FACTOR_GRID)  # every candidate iALS tried
    alone, _ = _json_run([*argv, "--model", "ials"], capsys)
    assert rec["metrics"] == alone["metrics"]


def test_auto_on_a_published_split_compares_recall_of_the_carved_pairs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _kgat_folder(tmp_path)
    argv = ["simulate", "--dataset", str(folder), "--rounds", "2", "--eval-negatives", "20"]
    rec, err = _json_run(argv, capsys)
    assert rec["protocol"] == "full" and rec["validation_metric"] == "recall@20"
    assert rec["family"] == keep_better(rec["validation"], rec["validation_margin"])
    assert 0 < rec["validation_margin"] < 0.1  # √(p(1 − p)/n) over the carve's users
    assert all(set(v) == {"recall@20", "ndcg@20"} for v in rec["metrics"].values())
    assert "validation recall@20, LightFR: " in err and "validation recall@20, iALS: " in err


def test_private_auto_reports_the_kept_runs_epsilon_and_the_uncharged_choice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _kgat_folder(tmp_path)
    argv = ["simulate", "--dataset", str(folder), "--epsilon", "4"]
    rec, err = _json_run(argv, capsys)
    kept = rec["family"]
    assert kept == keep_better(rec["validation"]) and set(rec["validation"]) == {"lightfr", "ials"}
    assert 3.99 < rec["epsilon"] <= 4.0 and rec["delta"] == 1e-5
    assert rec["selection"] == SELECTION_NOTE and "the ledger does not charge it" in err
    assert set(rec["metrics"]) == {"model", "private_popularity", "popularity", "random"}
    # Both planners speak before the runs; each run's served score was chosen on the same carve.
    assert err.count("plan: at ") == 2 and "private LightFR on" in err and "private iALS on" in err
    # The kept run is the one its family gives alone (the same seeds, the same carve), tested once.
    alone, _ = _json_run([*argv, "--model", kept], capsys)
    assert rec["metrics"] == alone["metrics"] and rec["plan"] == alone["plan"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bits", "16"], "--bits applies to --model lightfr; with the default --model auto both families run: add "),
        (["--alpha", "5"], "--alpha applies to --model ials; with the default --model auto both families run: add "),
        (["--rank", "8"], "--rank applies to --model ials; with the default --model auto both families run"),
        (["--epsilon", "8", "--threshold", "1"], "--threshold applies to --model lightfr; with the default"),
        (["--eval-every", "2"], "--eval-every applies to --model lightfr; with the default --model auto"),
        (["--epsilon", "8", "--save", "run.fedrec"], "--save is not available for private runs (--epsilon) yet"),
        (["--plot", "q.png"], "--plot applies to --model lightfr; with the default --model auto both families run"),
        (["--secure"], "--secure applies to --model mf only; the default --model auto (lightfr and ials)"),
        (["--pop-share", "0.5"], "--pop-share applies to private runs only (with --epsilon)"),
        (["--epsilon", "8", "--fraction", "0.5"], "--fraction does not apply to private LightFR runs"),
    ],
)
def test_options_of_one_family_are_refused_with_auto(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--dataset", "synthetic", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("fedrec simulate: error: ") and message in err and err.count("\n") == 1, err
    assert out == ""  # refused before anything trains
    assert main(["simulate", "--dataset", "planted"]) == 2
    assert "add --model felb or --model fnmf" in capsys.readouterr().err
