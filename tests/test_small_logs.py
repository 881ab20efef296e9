"""Rating logs at the small end: a catalogue too small for 99 sampled negatives, and users too few ratings to
validate on.  `fedrec simulate` ranks what it can and says how, or refuses in one line naming why."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedsim.cli import main
from fedsim.data.ratings import Ratings
from fedsim.evaluation.experiment import DEFAULT_NEGATIVES, prepare, require_validation
from protocol.errors import DatasetError


def _dense_log(n_users: int = 60, n_items: int = 40, fill: float = 0.5, seed: int = 0) -> Ratings:
    rng = np.random.default_rng(seed)
    held = rng.random((n_users, n_items)) < fill
    held[:, :4] = True  # every user holds at least 4 items
    held[:3] = True  # three users hold every item: nothing is left to rank theirs against
    users, items = np.nonzero(held)
    return Ratings(
        users=users.astype(np.int64),
        items=items.astype(np.int64),
        ratings=np.ones(users.size),
        timestamps=rng.permutation(users.size).astype(np.int64),
        n_users=n_users,
        n_items=n_items,
        user_ids=np.arange(n_users),
        item_ids=np.arange(n_items),
        name="dense",
    )


def test_a_small_catalogue_ranks_among_the_negatives_that_fit_and_says_so() -> None:
    log = _dense_log()
    exp = prepare(log, n_negatives=None)
    assert 1 <= exp.n_negatives < DEFAULT_NEGATIVES
    # every ranked row has its positive plus exactly that many distinct, never-held negatives
    assert exp.test.items.shape[1] == exp.val.items.shape[1] == exp.n_negatives + 1
    held = set(zip(log.users.tolist(), log.items.tolist(), strict=True))
    for u, row in zip(exp.test.users.tolist(), exp.test.items.tolist(), strict=True):
        assert len(set(row)) == len(row)
        assert not any((u, i) in held for i in row[1:])
    # the users holding every item are not ranked; at most a tenth of the held-out rows are left out
    assert not {0, 1, 2} & set(exp.test.users.tolist())
    assert len(exp.test) >= 0.9 * log.n_users - 3
    assert f"{log.n_items} items are too few for 99 negatives, so {exp.n_negatives}" in exp.describe()
    # an explicit count is taken as asked: one that does not fit is an error, as before
    with pytest.raises(ValueError, match="fewer than 99 items to sample from"):
        prepare(log, n_negatives=99)
    assert prepare(log.subset(log.users >= 3), n_negatives=3).n_negatives == 3


def test_a_catalogue_large_enough_keeps_99_and_every_row() -> None:
    log = _dense_log(n_users=30, n_items=400, fill=0.05)
    log = log.subset(log.users >= 3)  # no user holds everything
    exp = prepare(log, n_negatives=None)
    assert exp.n_negatives == DEFAULT_NEGATIVES
    assert exp.describe() == prepare(log, n_negatives=99).describe()


def test_a_log_with_nothing_to_validate_on_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [f"u{u}\ti{(7 * u + j) % 500}\t5\t{100 + 2 * u + j}" for u in range(300) for j in range(2)]
    path = tmp_path / "two_each.tsv"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(DatasetError, match="needs users with at least 3 ratings"):
        require_validation(prepare(str(path), n_negatives=None))
    for extra in ([], ["--epsilon", "8"]):
        code = main(["simulate", "--dataset", str(path), "--quiet", "--json", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code != 0
        assert err[-1].startswith("fedrec simulate: error: two_each: no validation rows to choose the model on")


@pytest.mark.integration
def test_simulate_and_eval_on_a_small_catalogue(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The CLI end to end: simulate with the defaults, keep the run, and re-score it on the same split.
    log = _dense_log()
    path = tmp_path / "dense.csv"
    path.write_text("".join(f"{u},{i},1,{t}\n" for u, i, t in zip(log.users, log.items, log.timestamps, strict=True)))
    run = tmp_path / "run.fedrec"
    assert main(["simulate", "--dataset", str(path), "--quiet", "--json", "--save", str(run)]) == 0
    first = json.loads(capsys.readouterr().out)
    n_neg = first["eval_negatives"]
    assert 1 <= n_neg < DEFAULT_NEGATIVES
    assert main(["eval", str(run), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["metrics"]["model"] == first["metrics"]["model"]
