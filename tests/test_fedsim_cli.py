from __future__ import annotations

import contextlib
import gzip
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedsim.cli import build_parser, main
from fedsim.ui import parse_table

ROOT = Path(__file__).resolve().parents[1]


def test_simulate_prints_table_and_baselines(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run = tmp_path / "run.fedrec"
    code = main(
        [
            "simulate",
            "--model",
            "lightfr",
            "--dataset",
            "synthetic",
            "--rounds",
            "4",
            "--eval-every",
            "2",
            "--quiet",
            "--save",
            str(run),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "Per-round progress" in out and "popularity" in out and "random" in out
    assert "HR@10 (random ties)" in out and "HR@10 (optimistic)" in out
    assert run.exists()
    assert main(["eval", str(run)]) == 0
    again = capsys.readouterr().out
    assert "LightFR (saved run)" in again
    # The saved run evaluates to the same figures as the run itself.
    line = next(ln for ln in out.splitlines() if ln.startswith("LightFR (Agg_grad)"))
    line2 = next(ln for ln in again.splitlines() if ln.startswith("LightFR (saved run)"))
    assert line.split()[-4:] == line2.split()[-4:]
    # Each user ranks as a device does by default: with its ridge vector's planes, which the run keeps.
    from fedsim.federation.runs import load_run

    model = load_run(run).device_model(3)[0]
    assert model.user_weight[0] > 0 and np.abs(model.user_q[0]).max() <= 7


def test_simulate_with_asymmetric_scoring(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["simulate", "--model", "lightfr", "--dataset", "synthetic", "--rounds", "3", "--quiet"]
    argv += ["--query-planes", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "LightFR (Agg_grad)" in out and "popularity" in out
    # bit-plane user vectors are not ±1 codes: a run file would misstate them, so --save is refused
    assert main([*argv, "--save", str(tmp_path / "run.fedrec")]) == 2
    assert "--query-planes" in capsys.readouterr().err
    assert main([*argv, "--unobserved-weight", "0"]) == 2  # the sampled objective has no exact user solve
    assert "all-items objective" in capsys.readouterr().err
    # Private runs take it too (the simulator's devices follow the plan's query_planes, protocol 1.6).
    private = ["simulate", "--model", "lightfr", "--dataset", "synthetic", "--rounds", "1", "--epsilon", "8"]
    private += ["--query-planes", "2"]
    assert main(private) == 0
    assert "asymmetric scoring (2 bit-planes, ridge 1)" in capsys.readouterr().out
    assert main([*private, "--unobserved-weight", "0"]) == 2
    assert "all-items objective" in capsys.readouterr().err


def test_demo_runs_a_real_server_and_fleet(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fedsim.fleets.demo

    evaluated: list[Any] = []
    real_evaluate = fedsim.fleets.demo.evaluate_devices

    def watch(exp: Any, clients: list[Any], *args: Any, **kwargs: Any) -> Any:
        result = real_evaluate(exp, clients, *args, **kwargs)  # the demo's own evaluation, only observed
        evaluated.extend(c.model for c in clients)
        return result

    monkeypatch.setattr(fedsim.fleets.demo, "evaluate_devices", watch)
    # No --cohort: the cohort is every device the run has (12 of synthetic's 600 users), not the dataset's users.
    # --epsilon 8: at 12 devices the demo would run without DP by default (the privacy planner's call).
    argv = ["demo", "--dataset", "synthetic", "--devices", "12", "--rounds", "2", "--epsilon", "8"]
    assert main([*argv, "--dropout", "0.1", "--workdir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    assert out.startswith("synthetic: the first 12 of 600 users, ") and "; 2 rounds of up to 12 devices; " in out
    # The privacy planner's forecast comes before the run's own lines.
    plan_at = out.index("plan: at 12 devices and ε = 8")
    assert plan_at < out.index("verdict: private model over the real server")
    # Then the growth forecast: the simulator's private run on the fleet and on replicas of it, before the run.
    growth_at = out.index("growth: at ε = 8, ")
    assert plan_at < growth_at < out.index("LightFR over the server")
    # Under DP (ε = 8) the devices rank with their ±1 codes: the model download says DP noise
    # trained it (ModelPayload.dp_trained, protocol 1.7), so with the SDK's own setting (3 rank planes) each
    # device, invited or not, holds no ranking vector; and each takes the w0 the server derived after round 2.
    assert "devices rank with their ±1 codes" in out
    assert len(evaluated) == 12 and all(m.config.unobserved_weight > 0 for m in evaluated)
    assert all(m.private_model and m.config.rank_planes == 3 and m.user_weight[0] == 0 for m in evaluated)
    assert len({m.config.unobserved_weight for m in evaluated}) == 1
    assert "server: listening on http://127.0.0.1:" in err and "server: stopped (exit 0)" in err
    assert "LightFR over the server" in out and "popularity" in out
    assert "ε spent" in out and "verdict: " in out
    assert "Top-5 computed on device" in out and "1. " in out
    # The server really committed two rounds, and its database is intact.
    import sqlite3

    with sqlite3.connect(tmp_path / "server-data" / "fedrec.sqlite3") as db:
        rows = db.execute("SELECT status FROM rounds ORDER BY round_id").fetchall()
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
    assert [r[0] for r in rows][:2] == ["committed", "committed"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--dataset", "synthetic", "--fraction", "1.5"], "must be in (0, 1]"),
        (["simulate", "--dataset", "synthetic", "--bits", "zero"], "expected a whole number"),
        (["simulate", "--dataset", "synthetic", "--lam", "-1"], "finite number >= 0"),
        (["simulate", "--dataset", "synthetic", "--user-reg", "0"], "> 0"),
        (
            ["simulate", "--dataset", "synthetic", "--epsilon", "8", "--pop-share", "1"],
            "--pop-share: must be in (0, 1)",
        ),
        (["plan-privacy", "--dataset", "synthetic", "--pop-share", "1"], "--pop-share: must be in (0, 1)"),
        (["plan-privacy", "--dataset", "synthetic", "--rounds", "5", "1001"], "--rounds: must be at most 1000"),
    ],
)
def test_bad_arguments_name_the_problem(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_argument_errors_are_one_line_and_a_pointer_to_help(capsys: pytest.CaptureFixture[str]) -> None:
    """An argument error prints the error and where to look, not the command's whole usage (26 lines)."""
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--rounds", "abc"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "fedrec simulate: error: argument --rounds: expected a whole number, got 'abc'\n(see fedrec simulate --help)\n"
    )
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--roudns", "3"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "fedrec simulate: error: unrecognized arguments: --roudns 3; did you mean --rounds?\n"
        "(see fedrec simulate --help)\n"
    )
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--basline=popularity"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == "fedrec eval: error: unrecognized arguments: --basline=popularity; did you mean --baseline?\n" + (
        "(see fedrec eval --help)\n"
    )
    with pytest.raises(SystemExit) as exc:
        main(["recommend", "run.fedrec"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "fedrec recommend: error: the following arguments are required: --user\n(see fedrec recommend --help)\n"
    )


@pytest.mark.parametrize("damage", ["garbage", "flip"])
def test_commands_that_read_a_run_leave_a_damaged_file_where_it_is(
    damage: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """eval, recommend and export report a corrupt or foreign file and never rename it (only the device's own
    store moves a damaged file aside)."""
    path = tmp_path / "binary.dat"
    if damage == "garbage":
        data = bytes(range(256)) * 4
    else:
        argv = ["simulate", "--model", "lightfr", "--dataset", "synthetic", "--rounds", "1", "--quiet"]
        assert main([*argv, "--save", str(path)]) == 0
        raw = bytearray(path.read_bytes())
        raw[len(raw) - 100] ^= 0x01  # inside the payload: the checksum catches it
        data = bytes(raw)
    path.write_bytes(data)
    capsys.readouterr()
    for argv in (
        ["eval", str(path)],
        ["recommend", str(path), "--user", "1"],
        ["export", str(path), "-o", str(tmp_path / "model.fedrec")],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fedrec {argv[0]}: error: {path} is corrupt") and err.count("\n") == 1, err
        assert "moved" not in err and "left it unchanged" in err
        assert path.read_bytes() == data and sorted(p.name for p in tmp_path.iterdir()) == ["binary.dat"]


def test_runtime_errors_are_one_clear_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["simulate", "--dataset", str(tmp_path / "nope.csv"), "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedrec simulate: error:") and "nope.csv" in err
    bad = tmp_path / "bad.csv"
    bad.write_text("1,2,5\n1,3,four\n")
    assert main(["simulate", "--dataset", str(bad), "--rounds", "1"]) == 2
    assert "bad.csv:2" in capsys.readouterr().err
    junk = tmp_path / "run.fedrec"
    junk.write_bytes(b"\x00\x01")
    assert main(["eval", str(junk)]) == 2
    assert "corrupt" in capsys.readouterr().err
    assert main(["eval"]) == 2


def test_every_subcommand_has_help() -> None:
    parser = build_parser()
    text = parser.format_help()
    for cmd in ("demo", "simulate", "eval", "data"):
        assert cmd in text


def test_the_demo_leaves_dp_off_only_where_the_planner_finds_the_fleet_too_small(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The quick demo's 40 devices ran DP at a size where its noise swamps the signal (HR@10 0.108 against
    # popularity's 0.225); the planner now sends that fleet, and only such fleets, without DP, saying so.
    from fedsim.cli.demo import DEFAULT_EPSILON, _first_users, small_fleet_privacy
    from fedsim.evaluation.experiment import prepare

    exp = prepare("synthetic", None, n_negatives=99, seed=0)
    eps, note = small_fleet_privacy(_first_users(exp, 40), 40, 3, 64)
    assert eps == 0.0 and note is not None and note.startswith("no DP: at 40 devices and ε=8 ")
    assert f"--epsilon {DEFAULT_EPSILON:g} turns DP on" in note and "\n" not in note
    # The test hook that seeds DP noise asks for DP: without --epsilon at such a size, one error line says so.
    assert main(["demo", "--dataset", "synthetic", "--devices", "40", "--insecure-seed-dp-noise"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedrec demo: error: --insecure-seed-dp-noise: at 40 devices and ε=8 "), err
    assert err.count("\n") == 1, err
    # Every synthetic user, one round (the demo's default without MovieLens): DP on, as before.
    assert small_fleet_privacy(exp, exp.train.n_users, 1, 64) == (DEFAULT_EPSILON, None)


@pytest.mark.data
def test_the_full_demo_keeps_dp_on(shared_data: Path) -> None:
    from fedsim.cli.demo import DEFAULT_EPSILON, small_fleet_privacy
    from fedsim.evaluation.experiment import prepare

    exp = prepare("ml-100k", None, n_negatives=99, seed=0, data_dir=shared_data)
    assert small_fleet_privacy(exp, exp.train.n_users, 1, 64) == (DEFAULT_EPSILON, None)


@pytest.mark.slow
@pytest.mark.data
@pytest.mark.timeout(1800)
def test_readme_demo_on_movielens(capsys: pytest.CaptureFixture[str], shared_data: Path) -> None:
    """The README's main command with its defaults (several minutes; opt-in with `pytest -m slow`)."""
    assert main(["demo", "--data-dir", str(shared_data)]) == 0
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    # Results on stdout; where and when (the server's start and stop) on stderr.
    assert "dataset: ml-100k" in out and "server: stopped (exit 0)" in err
    assert out.count("\n") > 20 and "verdict: private model over the real server" in out and "ε spent 8.000" in out


def _table_row(out: str, label: str) -> list[str]:
    return parse_table(out, label)


def test_simulate_felb_on_the_planted_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "felb", "--rounds", "40", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    row = _table_row(out, "FELB")
    f1, f1_star, factor_f1, rmsd = (float(x) for x in row[1:5])
    zero_rmsd = float(_table_row(out, "all-zero model")[4])
    assert f1_star >= 0.9 and factor_f1 >= 0.95 and rmsd < 0.8 * zero_rmsd and 0.5 < f1 < f1_star


def test_simulate_fnmf_secure_and_trusted(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "fnmf", "--rounds", "3", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    secure = float(_table_row(out, "secure")[1])
    floor = float(_table_row(out, "noise floor")[1])
    assert secure <= 1.1 * floor and float(_table_row(out, "secure")[2]) >= 0.99
    assert (
        main(["simulate", "--model", "fnmf", "--rounds", "3", "--seed", "1", "--aggregator", "trusted-barycenter"]) == 0
    )
    out = capsys.readouterr().out
    assert "TRUSTED-AGGREGATOR MODE" in out
    assert float(_table_row(out, "trusted-barycenter")[1]) == pytest.approx(secure, rel=0.01)


def test_simulate_mf_in_process_and_private(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", "--model", "mf", "--dataset", "synthetic", "--quiet", "--rank", "8"]
    assert main([*base, "--rounds", "3"]) == 0
    out = capsys.readouterr().out
    assert "in-process (plain sums" in out and "item popularity" in out
    rmse = float(_table_row(out, "federated MF")[1])
    assert 0 < rmse < 5
    # Private: every round through the real coordinator with SecAgg+ and per-user DP.
    assert main([*base, "--rounds", "1", "--epsilon", "8", "--fraction", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "1 rounds committed; per-user ε 8" in out and "per-rating ε" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--model", "mf"], "--model mf needs --dataset"),
        (["simulate", "--model", "fnmf", "--dataset", "synthetic"], "planted"),
        (["simulate", "--model", "mf", "--dataset", "synthetic", "--silos", "3", "--epsilon", "1"], "--silos"),
        (
            ["simulate", "--model", "mf", "--dataset", "synthetic", "--epsilon", "1", "--save", "x"],
            "--save is not available for MF runs through the coordinator",
        ),
        (
            ["simulate", "--model", "lightfr", "--dataset", "synthetic", "--epsilon", "1", "--save", "x"],
            "--save is not available for private",
        ),
        (
            ["simulate", "--model", "lightfr", "--dataset", "synthetic", "--epsilon", "1", "--lam", "0.5"],
            "--lam does not apply to private LightFR runs",
        ),
        (["simulate"], "--dataset is required"),
    ],
)
def test_family_misuse_is_one_clear_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedrec simulate: error:") and message in err


# -- the first hour of a new user: flags that never silently do nothing, one line per failure ---------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--secure"], "--secure is not implemented for --model lightfr"),
        (["--model", "felb", "--lam", "0.5"], "--lam applies to --model lightfr only; --model felb"),
        (["--model", "fnmf", "--epsilon", "1"], "--epsilon is not implemented for --model fnmf"),
        (["--model", "mf", "--alignment", "sinkhorn"], "--alignment applies to --model fnmf only"),
        (["--model", "mf", "--clip-norm", "5"], "--clip-norm applies to private MF only"),
        # Within LightFR: options the chosen objective would drop (sampled negatives vs all items).
        (["--negatives", "3"], "--negatives applies with --unobserved-weight 0 only; the all-items objective"),
        (["--epsilon", "8", "--negatives", "2"], "--negatives applies with --unobserved-weight 0 only"),
        (["--unobserved-weight", "0", "--confidence", "1"], "--confidence applies to the all-items objective"),
        (["--aggregation", "para", "--query-planes", "2"], "objective (--aggregation para) is in use"),
        (["--user-reg", "2"], "--user-reg applies with --query-planes P >= 1 only"),
        (["--query-planes", "2", "--rank-planes", "3"], "--query-planes ranks with the plan's vector"),
        (["--unobserved-weight", "0", "--rank-ridge", "1"], "--rank-ridge applies to symmetric training"),
        (["--rank-planes", "9"], "--rank-planes must be in [0, 8], got 9"),
        # The plan's bounds, as the server and the SDK check them, before the run (no header line first).
        (["--query-planes", "9"], "--query-planes: must be an integer in [0, 8], got 9"),
        (["--query-planes", "2", "--user-reg", "1e9"], "--user-reg: must be a finite number in [1e-06, 1000000.0]"),
    ],
)
def test_inapplicable_flags_are_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    # LightFR's own refusals (an argv's own --model comes later and wins).
    assert main(["simulate", "--dataset", "synthetic", "--rounds", "1", "--model", "lightfr", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("fedrec simulate: error: ") and message in err and err.count("\n") == 1
    assert out == ""  # refused before the run


def test_lightfr_options_of_the_objective_in_use_still_run(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--unobserved-weight", "0", "--negatives", "3"],
        ["--aggregation", "para", "--negatives", "2"],
        ["--confidence", "1"],
        ["--query-planes", "2", "--user-reg", "2"],
    ):
        argv = ["--model", "lightfr", *argv]
        assert main(["simulate", "--dataset", "synthetic", "--rounds", "1", "--bits", "16", "--quiet", *argv]) == 0
    capsys.readouterr()
    assert main(["demo", "--dataset", "synthetic", "--user-reg", "2"]) == 2
    assert capsys.readouterr().err == (
        "fedrec demo: error: --user-reg applies with --query-planes P >= 1 only (the ridge weight of the user solve)\n"
    )


def _fedrec(*argv: str, stdin: bytes | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedsim.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )


_STAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ round (\d+) (\w+): (\d+)/(\d+) devices")


@pytest.mark.integration
def test_demo_prints_timestamped_phase_lines_when_stderr_is_not_a_terminal() -> None:
    """With stderr a pipe (CI, a log file) the demo says what each round is doing, one stamped line per
    phase change; stdout is the same report as with --quiet, which prints no such lines."""
    argv = ("demo", "--dataset", "synthetic", "--devices", "40", "--cohort", "20", "--rounds", "2")
    proc = _fedrec(*argv)
    assert proc.returncode == 0, proc.stderr
    stamped = [m for m in map(_STAMPED.match, proc.stderr.splitlines()) if m]
    ends = [(m[1], m[2]) for m in stamped if m[2] in ("committed", "aborted")]
    assert [rid for rid, _ in ends] == ["1", "2"], proc.stderr
    phases = {"advertise_keys", "share_keys", "masked_input", "unmask", "committed", "aborted"}
    assert all(m[2] in phases for m in stamped)
    assert not _STAMPED.search(proc.stdout) and "\r" not in proc.stderr  # no bar, no stray lines on stdout
    quiet = _fedrec(*argv, "--quiet")
    assert quiet.returncode == 0 and not any(map(_STAMPED.match, quiet.stderr.splitlines())), quiet.stderr

    def shape(text: str) -> list[str]:  # the first words of the header and round table, not the numbers
        return [(line.split() or [""])[0] for line in text.splitlines()[:6]]  # (the verdict's length varies)

    assert shape(proc.stdout) == shape(quiet.stdout)
    assert "Top-5 computed on device" in proc.stdout


def test_round_progress_logs_each_phase_once_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    from fedsim.fleets.demo import RoundProgress

    bar = RoundProgress(2, "demo")  # pytest's stderr is not a terminal: stamped lines, no bar
    cur = {"round_id": 1, "phase": "share_keys", "alive": 19, "cohort": 20}
    bar.on_status({"recent_rounds": [], "round": None})
    bar.on_status({"recent_rounds": [], "round": cur})
    bar.on_status({"recent_rounds": [], "round": {**cur, "alive": 18}})  # same phase: no new line
    done = {"round_id": 1, "status": "committed", "survivors": 18, "cohort_size": 20, "reason": ""}
    bar.on_status({"recent_rounds": [done], "round": None})
    bar.on_status({"recent_rounds": [done], "round": None})
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert [m and m.groups() for m in map(_STAMPED.match, lines)] == [
        ("1", "share_keys", "19", "20"),
        ("1", "committed", "18", "20"),
    ], lines
    RoundProgress(2, "demo", enabled=False).on_status({"recent_rounds": [], "round": cur})  # --quiet
    assert capsys.readouterr().err == ""


def test_bad_input_is_one_line_and_an_exit_code(tmp_path: Path) -> None:
    binary = tmp_path / "ratings.bin"  # not a known compressed layout: refused as binary
    binary.write_bytes(b"\x00\x01" + gzip.compress(b"1,2,5\n" * 5000))
    cases = [
        (("demo", "--devices", "2"), "--devices 2: a secure-aggregation round needs at least 3 devices"),
        (("simulate", "--dataset", str(binary)), "binary content (a NUL byte at offset"),
        (("simulate", "--dataset", "ml-100k", "--data-dir", str(tmp_path)), "expected layout: DATA/ml-100k/u.data"),
        (("simulate", "--model", "fnmf", "--epsilon", "8"), "--epsilon is not implemented"),
    ]
    for argv, message in cases:
        proc = _fedrec(*argv)
        assert proc.returncode == 2, proc
        assert proc.stdout == "" and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
        assert len(proc.stderr) < 400


def test_loadtest_names_a_bad_credential_file_before_contacting_the_server(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_text("not a key\n")
    missing = tmp_path / "missing"
    # Port 1 refuses connections: each error below must come from the local file, not the network.
    url = ("--url", "https://127.0.0.1:1", "--devices", "5")
    cases = [
        (("--authority-key", str(missing)), f"cannot read the enrollment authority key {missing}"),
        (("--authority-key", str(junk)), f"{junk} is not a fedrec enrollment authority key file"),
        (("--admin-token-file", str(missing)), f"cannot read {missing}"),
        (("--ca-file", str(missing)), f"cannot load CA certificates from {missing}: No such file"),
        (("--ca-file", str(junk)), f"cannot load CA certificates from {junk}"),
    ]
    for argv, message in cases:
        proc = _fedrec("loadtest", *url, *argv)
        assert proc.returncode == 2, proc
        assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr  # no "Unclosed client session"
        assert proc.stderr.startswith("fedrec loadtest: error: ") and message in proc.stderr, proc.stderr


def test_unwritable_output_files_are_refused_before_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fedsim.cli.simulate as simulate

    missing = tmp_path / "no-such-folder" / "run.fedrec"
    # The whole 50-round default run would come before the write: the refusal must come first, before
    # the data is even loaded (each step of a run records itself here instead of running).
    started: list[str] = []

    def step(name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            started.append(name)
            raise AssertionError(f"{name} ran before the output file was checked")

        return record

    import fedsim.cli.results
    import fedsim.data.datasets
    import fedsim.federation.families

    # `simulate` imports the steps of a run when it runs: each is patched where it is defined.
    for module, name in (
        (fedsim.cli.results, "resolve_dataset"),
        (simulate, "train_lightfr"),
        (fedsim.federation.families, "simulate_family"),
        (fedsim.data.datasets, "load_dataset"),
    ):
        monkeypatch.setattr(module, name, step(name))
    assert main(["simulate", "--model", "lightfr", "--dataset", "synthetic", "--save", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == f"fedrec simulate: error: --save {missing}: folder {missing.parent} does not exist\n"
    assert main(["simulate", "--model", "mf", "--dataset", "synthetic", "--save", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"fedrec simulate: error: --save {tmp_path}: is a folder; name a file\n"
    assert started == []
    assert main(["export", str(tmp_path / "absent.fedrec"), "-o", str(missing)]) == 2
    assert capsys.readouterr().err == f"fedrec export: error: -o {missing}: folder {missing.parent} does not exist\n"


def test_demo_refuses_a_dataset_too_small_for_a_round_and_a_file_as_workdir(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tiny = tmp_path / "tiny.csv"
    tiny.write_text("1,2,5\n")
    assert main(["demo", "--dataset", str(tiny)]) == 2
    assert capsys.readouterr().err == (
        f"fedrec demo: error: --dataset {tiny}: 1 user(s) with training ratings; a secure-aggregation round "
        "needs at least 3 devices\n"
    )  # was: the server's own start-up error about rounds.cohort_size
    assert main(["demo", "--dataset", "synthetic", "--workdir", str(tiny)]) == 2
    assert capsys.readouterr().err == f"fedrec demo: error: --workdir {tiny}: is not a folder\n"


def test_enroll_ca_names_the_valid_days_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    key = tmp_path / "ca.key"  # never read: the flag is checked first
    for days in ("0", "-5", "1e9", "nan"):
        argv = ["enroll-ca", "issue", "--key", str(key), "--device-key", "00" * 32, "--batch", "b1"]
        assert main([*argv, "--valid-days", days]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fedrec enroll-ca: error: --valid-days must be a number of days in (0, 3653]"), err


def test_closed_stdout_ends_quietly() -> None:
    cmd = f"{shlex.quote(sys.executable)} -m fedsim.cli simulate --dataset synthetic --rounds 2 --quiet | head -1"
    proc = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )
    assert proc.stdout.startswith("synthetic: ") and proc.stdout.count("\n") == 1
    assert proc.stderr == "" and proc.returncode == 141  # what a tool killed by SIGPIPE reports


def test_version_and_data_listing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("fedrec ")
    assert main(["data", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("synthetic") == 1 and "expected layout" in out


def test_loadtest_failure_is_one_line_naming_the_cause() -> None:
    from fedsim.fleets.loadtest_report import describe_outcomes
    from fedsim.fleets.local import FleetReport

    rep = FleetReport(devices=60)
    rep.server_rounds = [{"round_id": 4, "status": "committed"}, {"round_id": 5, "status": "aborted", "reason": "x"}]
    rep.errors.update({"ConfigError": 40, "status: TimeoutError": 2})
    rep.error_examples["ConfigError"] = "invite n_items 1682 != device 3706"
    assert rep.failure(2) == (
        "1 of 2 rounds committed; aborted: x ×1; "
        "devices failed 40× with ConfigError (invite n_items 1682 != device 3706)"
    )
    # Every requested round committed, but devices failed: still a failure (injected drops are not errors).
    assert rep.failure(1) == (
        "1 of 1 rounds committed; aborted: x ×1; "
        "devices failed 40× with ConfigError (invite n_items 1682 != device 3706)"
    )
    # A server whose privacy budget is spent (the example server runs with DP) says so in its status.
    rep.final_status = {"stopped": "privacy budget exhausted: round 11 would raise epsilon from 8 to 8.491"}
    assert rep.failure(2) == (
        "1 of 2 rounds committed; aborted: x ×1; devices failed 40× with ConfigError (invite n_items 1682 != device "
        "3706); the server opens no more rounds: privacy budget exhausted: round 11 would raise epsilon from 8 to 8.491"
    )
    rep.final_status = None
    del rep.errors["ConfigError"]
    assert rep.failure(1) is None  # the monitor's status read timing out is not a device failure
    rep.outcomes.update({"committed": 50, "waited": 700, "dropped": 3})
    rep.drops.update({"before_keys": 3})
    assert describe_outcomes(rep) == (
        "device rounds: 50 took part in a committed round; 0 in an aborted one; 3 dropped as injected "
        "(before_keys 3); 700 check-ins were told to wait (not in the cohort, or no round open)"
    )


def test_simulate_private_lightfr_reports_the_ledgers_epsilon(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    argv = ["simulate", "--model", "lightfr", "--dataset", "synthetic", "--epsilon", "4", "--rounds", "2"]
    argv += ["--bits", "16", "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ε spent 4.000 at δ=1e-05" in out
    for name in ("private_popularity", "popularity", "random"):
        assert f"\n{name} " in out
    assert main([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 3.99 < record["epsilon"] <= 4.0 and record["delta"] == 1e-5
    assert set(record["metrics"]) == {"model", "private_popularity", "popularity", "random"}
    # Under DP the simulator ranks with ±1 codes unless --rank-planes P (docs/dp-accounting.md §8).
    assert "ranking with ±1 codes" in out
    assert main([*argv, "--rank-planes", "3"]) == 0
    assert "ranking with the ridge vector (3 planes, ridge 2·w0·m)" in capsys.readouterr().out
    assert main([*argv, "--rank-planes", "2", "--rank-ridge", "0.5"]) == 0
    assert "ranking with the ridge vector (2 planes, ridge 0.5·w0·m)" in capsys.readouterr().out


def test_sigterm_or_sigint_stops_the_demo_and_removes_its_folder(tmp_path: Path) -> None:
    """SIGTERM (and SIGINT, the same path) to ``fedrec demo``: the server child stops, the temporary folder
    with the authority's private key, the server database and every device store is removed, one line
    says so, and the status is 128 + the signal.  The key material in it was never readable by others."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        err_path = tmp_path / f"demo-{signum}.err"
        with open(err_path, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fedsim.cli", "demo", "--dataset", "synthetic", "--devices", "40"]
                + ["--cohort", "20", "--rounds", "50", "--quiet"],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=err,
                # a background child of a non-interactive shell starts with SIGINT ignored; the demo sets its own
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
            )
        try:
            deadline = time.monotonic() + 120
            while "listening on" not in err_path.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, err_path.read_text()
                time.sleep(0.2)
            found = re.search(r"starting fedrec-server \((.+)/server\.toml\)", err_path.read_text())
            assert found, err_path.read_text()
            folder = Path(found.group(1))
            key = folder / "enrollment-authority.key"
            while not list(folder.glob("devices/*/signing-key.fedrec")) and time.monotonic() < deadline:
                time.sleep(0.2)
            private = [key, *folder.glob("devices/*/signing-key.fedrec"), *folder.glob("devices/*/identity.fedrec")]
            assert len(private) > 1
            for path in private:
                with contextlib.suppress(FileNotFoundError):  # a file replaced this instant
                    assert path.stat().st_mode & 0o777 == 0o600, path
            server = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            assert server, "no fedrec-server child"
            proc.send_signal(signum)
            assert proc.wait(timeout=60) == 128 + signum
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        name = signal.Signals(signum).name
        last = err_path.read_text().splitlines()[-1]
        assert last == f"fedrec demo: stopped by {name}; removed {folder}", err_path.read_text()
        assert "Traceback" not in err_path.read_text()
        assert not folder.exists()
        for pid in server:  # the server child is gone, not left to its parent-death signal
            assert not Path(f"/proc/{pid}").exists() or "agg_server" not in Path(f"/proc/{pid}/cmdline").read_text()


@pytest.mark.slow  # two demo runs: about 35 s on 2 cores
def test_two_demo_runs_with_one_seed_print_the_same(capsys: pytest.CaptureFixture[str]) -> None:
    """Cohorts, dropouts, training and (through the loudly named test hook) the DP noise all follow --seed."""
    argv = ["demo", "--dataset", "synthetic", "--devices", "10", "--cohort", "8", "--rounds", "2", "--dropout", "0.2"]
    argv += ["--epsilon", "8"]  # DP on (at 10 devices the demo would leave it off by default)
    outputs = []
    for _ in range(2):
        assert main([*argv, "--quiet", "--insecure-seed-dp-noise"]) == 0
        captured = capsys.readouterr()
        outputs.append(captured.out)
        assert "NOT a privacy guarantee" in captured.err
    assert outputs[0] == outputs[1]
    assert "NOT a privacy guarantee" in outputs[0] and "Top-5 computed on device" in outputs[0]
    assert main([*argv, "--quiet", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (
        record["rounds"] == 2
        and record["epsilon_is_guarantee"] is True
        and set(record["metrics"])
        == {
            "model",
            "popularity",
            "random",
        }
    )
    # The planner's plan, printed before the run, is in the record too.
    assert record["plan"]["pop_theta"] == 1 and {"pop_share", "rounds", "forecast_ratio"} <= set(record["plan"])


@pytest.mark.slow  # two demo runs: about 10 s on 2 cores
def test_two_demo_runs_without_dp_with_one_seed_print_the_same(capsys: pytest.CaptureFixture[str]) -> None:
    """Without DP no test hook is needed: cohorts, dropouts, training and the stochastic-rounding coins of
    the devices' updates all follow --seed, so the printed results (metrics and top-5 scores) repeat."""
    argv = ["demo", "--dataset", "synthetic", "--devices", "10", "--cohort", "8", "--rounds", "2", "--dropout", "0.2"]
    argv += ["--epsilon", "0", "--quiet"]
    outputs = []
    for _ in range(2):
        assert main(argv) == 0
        captured = capsys.readouterr()
        assert "NOT a privacy guarantee" not in captured.out + captured.err
        outputs.append(captured.out)
    assert outputs[0] == outputs[1]
    assert "no DP" in outputs[0] and "Top-5 computed on device" in outputs[0]


@pytest.mark.parametrize(
    ("family", "argv", "loader"),
    [
        ("lightfr", ["--model", "lightfr", "--dataset", "synthetic", "--rounds", "3"], "LightFRModel"),
        ("mf", ["--model", "mf", "--dataset", "synthetic", "--rank", "8", "--rounds", "2"], "MFModel"),
        ("felb", ["--model", "felb", "--rounds", "3"], "FELBModel"),
        ("fnmf", ["--model", "fnmf", "--rounds", "2"], "FNMFModel"),
    ],
)
def test_saved_runs_recommend_and_export_to_sdk_models(
    family: str, argv: list[str], loader: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import device_sdk
    from fedsim.federation.runs import load_run

    run_file, model_file = tmp_path / "run.fedrec", tmp_path / "model.fedrec"
    assert main(["simulate", *argv, "--quiet", "--save", str(run_file)]) == 0
    assert f"saved the run to {run_file}" in capsys.readouterr().out
    run = load_run(run_file)
    user = str(run.user_label(3))
    assert main(["recommend", str(run_file), "--user", user, "-n", "5", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["family"] == family and len(record["items"]) == 5
    picked = [it["index"] for it in record["items"]]
    assert not set(picked) & set(run.train.of(3).tolist())  # never an item the user rated in training
    scores = [it["score"] for it in record["items"]]
    assert scores == sorted(scores, reverse=True)
    # The exported file is what the SDK loads, and its device recommends the same items.
    assert main(["export", str(run_file), "--user", user, "-o", str(model_file)]) == 0
    assert f"a {loader}" in capsys.readouterr().out
    model = getattr(device_sdk, loader).load(model_file)
    if family == "lightfr":  # the item Gram comes in the file: a fold-in on the device needs no pass for it
        assert model._gram_sums is not None and model._gram_sums[0] is model._item_words
        want = device_sdk.LightFRModel(model.n_items, model.config)
        want.set_item_codes(model._item_words, 1)
        want.item_levels, want.hamming_weight = model.item_levels, model.hamming_weight
        for a, b in zip(model.item_gram(), want.item_gram(), strict=True):
            assert np.array_equal(a, b)
    row = run.device_model(3)[1]
    ids, _ = model.recommend(run.train.of(3), N=5, userid=row, rng=np.random.default_rng(0))
    assert ids.tolist() == picked
    # Not a run file: one line naming it.
    assert main(["recommend", str(model_file), "--user", user]) == 2
    assert "not a run written by 'fedrec simulate --save'" in capsys.readouterr().err


def _movielens_like(folder: Path) -> Path:
    """A tiny ratings log in MovieLens-100K's layout (``u.data`` beside ``u.item``), raw ids from 101."""
    folder.mkdir()
    rng = np.random.default_rng(5)
    lines = [
        f"{101 + u}\t{1001 + i}\t{int(rng.integers(1, 6))}\t{880000000 + 7 * u + i}"
        for u in range(40)
        for i in sorted(rng.choice(150, size=12, replace=False).tolist())
    ]
    (folder / "u.data").write_text("\n".join(lines) + "\n")
    titles = [f"{1001 + i}|Film number {i} (1990)|01-Jan-1990||http://x|0" for i in range(150)]
    (folder / "u.item").write_text("\n".join(titles) + "\n", encoding="latin-1")
    return folder / "u.data"


def test_recommend_shows_dataset_ids_and_titles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`fedrec recommend` names items by the dataset's ids and, beside a MovieLens ``u.item``, their titles;
    the SDK's 0-based indices map back through `Run.item_label`."""
    from fedsim.federation.runs import load_run

    ratings, run_file = _movielens_like(tmp_path / "ml"), tmp_path / "run.fedrec"
    argv = ["simulate", "--model", "lightfr", "--dataset", str(ratings), "--rounds", "2", "--quiet"]
    assert main([*argv, "--save", str(run_file)]) == 0
    capsys.readouterr()
    run = load_run(run_file)
    assert run.item_label(0) == 1001 and run.user_label(0) == 101 and run.user_index("101") == 0
    assert main(["recommend", str(run_file), "--user", "107", "-n", "3", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["user"] == 107 and len(record["items"]) == 3
    for it in record["items"]:
        assert it["item"] == 1001 + it["index"] == run.item_label(it["index"])
        assert it["title"] == f"Film number {it['index']} (1990)"
    assert main(["recommend", str(run_file), "--user", "107", "-n", "3"]) == 0
    out = capsys.readouterr().out
    assert "rank  item   score  title" in out
    first = record["items"][0]
    assert re.search(rf"^1 +{first['item']} +{first['score']:.4f}  {re.escape(first['title'])}$", out, re.M), out
    # No u.item beside the ratings: ids only, and the JSON title is null.
    (tmp_path / "ml" / "u.item").unlink()
    assert main(["recommend", str(run_file), "--user", "107", "-n", "3", "--json"]) == 0
    assert [it["title"] for it in json.loads(capsys.readouterr().out)["items"]] == [None] * 3


def test_recommend_titles_movielens(shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_file = tmp_path / "run.fedrec"
    argv = ["--model", "lightfr", "--dataset", "ml-100k", "--data-dir", str(shared_data)]
    assert main(["simulate", *argv, "--rounds", "2", "--quiet", "--save", str(run_file)]) == 0
    capsys.readouterr()
    assert main(["recommend", str(run_file), "--user", "196", "-n", "10", "--data-dir", str(shared_data)]) == 0
    out = capsys.readouterr().out
    assert "top 10 for user 196" in out and "title" in out and "(19" in out  # e.g. "Star Wars (1977)"


def test_plan_privacy_prints_one_row_per_choice(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan-privacy", "--dataset", "synthetic", "--epsilon", "4", "--rounds", "1", "5", "--clips", "2"])
    out = capsys.readouterr().out
    assert code == 0
    rows = [ln for ln in out.splitlines() if ln[:2] in ("1 ", "5 ")]
    assert len(rows) == 2
    # More rounds at the same ε: more noise per coordinate and round (the σ/coord column).
    assert float(rows[0].split()[3]) < float(rows[1].split()[3])
    # The σ are those of the released sum: noise sized for the colluding devices the default policy assumes.
    from fedsim.private.scaled_lightfr import colluder_inflation

    n = int(out.split(" devices")[0].split()[-1])
    assert f"collude and add none: {colluder_inflation(n):.3f}× the variance" in out and colluder_inflation(n) > 1


def test_plots_are_written_and_bad_targets_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="plots need the 'plot' extra (part of 'dev')")
    from fedsim.cli.plots import plot_loadtest

    png = tmp_path / "quality.png"
    argv = ["simulate", "--model", "lightfr", "--dataset", "synthetic", "--rounds", "4", "--eval-every", "2", "--quiet"]
    assert main([*argv, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {png}" in capsys.readouterr().out
    assert main([*argv, "--plot", str(tmp_path / "q.jpg")]) == 2
    assert "must end in .png, .svg, .pdf" in capsys.readouterr().err
    assert main([*argv, "--model", "felb", "--plot", str(png)]) == 2
    latency = tmp_path / "latency.svg"
    plot_loadtest(latency, [(0.5, "keys", 0.2), (1.0, "masked", 1.5), (1.2, "keys", 0.1)], ["keys", "masked"], "t")
    assert b"<svg" in latency.read_bytes()
