"""``--json`` on ``fedrec simulate`` / ``fedrec eval`` (fedsim.evaluation.report), and the evaluation seed kept
apart from the model seed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedsim.cli import main
from fedsim.evaluation.report import METRIC_KEYS, result_record, write_json
from fedsim.ui import parse_table


def _json_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    assert main(argv) == 0
    cap = capsys.readouterr()
    lines = cap.out.splitlines()
    assert len(lines) == 1, "with --json, stdout holds the JSON object only"
    return json.loads(lines[-1]), cap.err


def _no_timestamps(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    rows = {(u, int(i)) for u in range(60) for i in rng.choice(80, 12, replace=False)}
    path = tmp_path / "ratings.csv"
    path.write_text("".join(f"{u},{i},{1 + (u * i) % 5}\n" for u, i in sorted(rows)))
    return path


def test_simulate_and_eval_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run = tmp_path / "run.fedrec"
    argv = ["simulate", "--model", "lightfr", "--dataset", "synthetic", "--rounds", "2", "--quiet", "--json"]
    argv += ["--save", str(run)]
    rec, err = _json_run(argv, capsys)
    assert list(rec) == ["dataset", "protocol", "rounds", "seconds", "metrics"]
    assert (rec["dataset"], rec["protocol"], rec["rounds"]) == ("synthetic", "loo", 2)
    assert rec["seconds"] > 0 and set(rec["metrics"]) == {"model", "popularity", "random"}
    for values in rec["metrics"].values():
        assert set(values) == {"hr@10", "ndcg@10"} and all(0 <= v <= 1 for v in values.values())
    # the human report went to stderr, and it agrees with the JSON (random ties)
    assert "HR@10 (random ties)" in err
    assert float(parse_table(err, "popularity")[1]) == pytest.approx(rec["metrics"]["popularity"]["hr@10"], abs=5e-5)
    again, _ = _json_run(["eval", str(run), "--json"], capsys)
    assert again["metrics"] == rec["metrics"] and again["rounds"] == 2
    base, _ = _json_run(["eval", "--baseline", "random", "--dataset", "synthetic", "--json"], capsys)
    assert base["rounds"] == 0 and base["metrics"] == {"random": rec["metrics"]["random"]}


def test_full_ranking_protocol_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    folder = tmp_path / "mini-kgat"
    folder.mkdir()
    lines = {u: rng.choice(50, 8, replace=False) for u in range(40)}
    (folder / "train.txt").write_text("".join(f"{u} {' '.join(map(str, it[:6]))}\n" for u, it in lines.items()))
    (folder / "test.txt").write_text("".join(f"{u} {' '.join(map(str, it[6:]))}\n" for u, it in lines.items()))
    base = ["eval", "--baseline", "popularity", "--dataset", str(folder), "--json", "--eval-negatives", "20"]
    rec, err = _json_run(base, capsys)
    assert (rec["dataset"], rec["protocol"]) == ("mini-kgat", "full")
    assert set(rec["metrics"]["popularity"]) == {"recall@20", "ndcg@20"}
    assert "Recall@20" in err and "validation carved from train" in err
    sampled, _ = _json_run(
        [
            "eval",
            "--baseline",
            "popularity",
            "--dataset",
            str(folder),
            "--protocol",
            "sampled",
            "--json",
            "--eval-negatives",
            "20",
        ],
        capsys,
    )
    assert sampled["protocol"] == "sampled" and set(sampled["metrics"]["popularity"]) == {"hr@10", "ndcg@10"}


def test_model_seed_never_changes_the_test(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = str(_no_timestamps(tmp_path))
    common = ["simulate", "--dataset", data, "--rounds", "1", "--quiet", "--json", "--eval-negatives", "20"]
    a, err = _json_run([*common, "--seed", "0"], capsys)
    b, _ = _json_run([*common, "--seed", "1"], capsys)
    c, _ = _json_run([*common, "--seed", "0", "--eval-seed", "1"], capsys)
    assert "uniformly random (no timestamps; seed 0)" in err  # the split says how it held out ratings
    # baselines depend on the test split and candidates only: equal across model seeds
    assert a["metrics"]["popularity"] == b["metrics"]["popularity"]
    assert a["metrics"]["random"] == b["metrics"]["random"]
    assert a["metrics"]["model"] != b["metrics"]["model"]
    assert c["metrics"]["popularity"] != a["metrics"]["popularity"]  # another evaluation seed, another split


def test_eval_refuses_another_split_than_the_run_trained_on(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run = tmp_path / "run.fedrec"
    data = str(_no_timestamps(tmp_path))
    assert (
        main(
            [
                "simulate",
                "--model",
                "lightfr",
                "--dataset",
                data,
                "--rounds",
                "1",
                "--quiet",
                "--eval-seed",
                "3",
                "--eval-negatives",
                "20",
                "--save",
                str(run),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["eval", str(run), "--eval-seed", "4"]) == 2
    assert "trained on the split of evaluation seed 3" in capsys.readouterr().err
    assert main(["eval", str(run), "--eval-seed", "3"]) == 0
    # Options a run file would ignore are refused, naming the flag and the run's own value.
    ignored = (("--eval-negatives", "50", "20"), ("--protocol", "chrono", "loo"), ("--dataset", "x", data))
    for flag, value, own in ignored:
        capsys.readouterr()
        assert main(["eval", str(run), flag, value]) == 2
        err = capsys.readouterr().err
        assert f"{flag} {value}: " in err and f"({flag} {own})" in err, err
    assert main(["eval", str(run), "--eval-negatives", "20", "--protocol", "loo", "--dataset", data]) == 0


def test_json_is_refused_where_not_implemented(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "felb", "--dataset", "planted", "--json"]) == 2
    assert (
        "--json applies to --model auto or --model lightfr or --model mf or --model ials only"
        in capsys.readouterr().err
    )
    assert main(["simulate", "--model", "mf", "--dataset", "synthetic", "--json"]) == 2
    assert "published split (amazon-book) only" in capsys.readouterr().err


def test_private_mf_on_a_published_split_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # MF on a KGAT-style split: every user a device through the sparse MF cohort, private with --epsilon,
    # full ranking beside u·v alone, private popularity and the baselines.
    rng = np.random.default_rng(2)
    folder = tmp_path / "mini-kgat"
    folder.mkdir()
    lines = {u: rng.choice(50, 8, replace=False) for u in range(120)}
    (folder / "train.txt").write_text("".join(f"{u} {' '.join(map(str, it[:6]))}\n" for u, it in lines.items()))
    (folder / "test.txt").write_text("".join(f"{u} {' '.join(map(str, it[6:]))}\n" for u, it in lines.items()))
    argv = ["simulate", "--model", "mf", "--dataset", str(folder), "--rounds", "2", "--quiet", "--json"]
    rec, err = _json_run([*argv, "--epsilon", "4"], capsys)
    assert (rec["dataset"], rec["protocol"], rec["rounds"]) == (str(folder), "full", 2)
    assert 3.99 < rec["epsilon"] <= 4.0 and rec["delta"] == 1e-5
    assert set(rec["metrics"]) == {"model", "mf_alone", "private_popularity", "popularity", "random"}
    assert all(set(v) == {"recall@20", "ndcg@20"} for v in rec["metrics"].values())
    assert "MFCohort" in err and "ε spent" in err
    plain, err = _json_run(argv, capsys)
    assert "epsilon" not in plain and "no DP noise" in err


def test_result_record_validates(tmp_path: Path) -> None:
    ok = result_record(
        dataset="d",
        protocol="full",
        rounds=None,
        seconds=1.5,
        metrics={"model": {"ndcg@20": 0.1, "recall@20": 0.2}},
        epsilon=8.0,
    )
    assert list(ok["metrics"]["model"]) == ["recall@20", "ndcg@20"] and ok["epsilon"] == 8.0
    path = tmp_path / "out.json"
    with path.open("w") as fh:
        write_json(ok, fh)
    assert json.loads(path.read_text()) == ok and path.read_text().count("\n") == 1
    with pytest.raises(ValueError, match="unknown key"):
        result_record(dataset="d", protocol="p", rounds=0, seconds=0, metrics={"model": {"hr@20": 0.1}})
    with pytest.raises(ValueError, match="non-finite"):
        result_record(dataset="d", protocol="p", rounds=0, seconds=0, metrics={"model": {"hr@10": float("nan")}})
    assert METRIC_KEYS == ("hr@10", "ndcg@10", "recall@20", "ndcg@20")


def test_data_lists_a_split_dataset(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = tmp_path / "amazon-book-kgat"
    folder.mkdir()
    (folder / "train.txt").write_text("0 1 2\n1 0\n")
    (folder / "test.txt").write_text("0 3\n1\n")
    assert main(["data", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("amazon-book"))
    assert "2 users" in line and "3 train + 1 test pairs (implicit, its own split)" in line
    assert out.count("synthetic") == 1
