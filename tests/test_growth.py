"""When personalisation starts paying: `fedsim.evaluation.experiment.replicated` and `fedsim.cli.growth`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedsim.cli.growth import Growth, forecast_growth
from fedsim.data.synthetic import synthetic
from fedsim.evaluation.experiment import Candidates, Protocol, prepare, replicated


@pytest.fixture(scope="module")
def exp():  # type: ignore[no-untyped-def]
    return prepare(synthetic(), Protocol.LOO, n_negatives=49, seed=0)


def test_a_replica_copies_every_user_with_its_ratings_and_validation_block(exp) -> None:  # type: ignore[no-untyped-def]
    r = replicated(exp, 3)
    n = int(np.unique(exp.train.users).size)
    assert r.train.n_users == 3 * n and len(r.train) == 3 * len(exp.train) and r.train.n_items == exp.train.n_items
    for k in range(3):  # copy k of each user holds exactly that user's items, and its validation block
        for u in (0, 7, n - 1):
            own = np.sort(exp.train.items[exp.train.users == u])
            assert np.array_equal(np.sort(r.train.items[r.train.users == k * n + u]), own)
            assert np.array_equal(r.val.items[r.val.users == k * n + u], exp.val.items[exp.val.users == u])
    assert len(set(r.train.user_ids.tolist())) == 3 * n  # every copy is a device of its own
    assert len(r.test) == 0 and r.test.items.shape[1] == exp.test.items.shape[1]  # nothing to read the test by
    assert replicated(exp, 1).train.n_users == n


def test_a_replica_of_a_partial_fleet_keeps_only_the_users_with_ratings(exp) -> None:  # type: ignore[no-untyped-def]
    keep = np.asarray(exp.train.users) < 10  # the demo's --devices 10: the id space stays the dataset's
    part = replace(
        exp,
        train=exp.train.subset(keep),
        val=Candidates(exp.val.users[exp.val.users < 10], exp.val.items[exp.val.users < 10]),
    )
    r = replicated(part, 4)
    assert r.train.n_users == 40 and set(np.unique(r.val.users).tolist()) == set(range(40))


@pytest.mark.parametrize("copies", [0, -1, 1.5, True])
def test_a_replica_needs_a_whole_number_of_copies(exp, copies: object) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="copies must be a whole number >= 1"):
        replicated(exp, copies)  # type: ignore[arg-type]


def test_a_published_split_is_not_replicated(exp) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="cannot be replicated by blocks"):
        replicated(replace(exp, seen=exp.train), 2)


def test_the_forecast_reads_validation_only_and_stops_at_the_first_fleet_that_pays(exp) -> None:  # type: ignore[no-untyped-def]
    # Test blocks of items outside the catalogue: reading them anywhere would fail.
    poisoned = replace(exp, test=Candidates(exp.test.users, np.full_like(exp.test.items, 10**9)))
    g = forecast_growth(poisoned, 8.0, copies=(1, 2, 4))
    n = int(np.unique(exp.train.users).size)
    sizes = [d for d, _ in g.tried]
    assert sizes == [n * c for c in (1, 2, 4)[: len(sizes)]]
    assert all(not pays for _, pays in g.tried[:-1])  # it went on only while the list was served
    assert g.pays_from in (None, sizes[-1]) and (g.pays_from is not None or len(sizes) == 3)
    assert g == forecast_growth(exp, 8.0, copies=(1, 2, 4))  # seeded: the same forecast again
    record = g.record()
    assert record["pays_from_devices"] == g.pays_from and len(record["tried"]) == len(sizes)


def test_more_budget_never_needs_a_larger_fleet_here(exp) -> None:  # type: ignore[no-untyped-def]
    small, large = forecast_growth(exp, 8.0, copies=(1, 2)), forecast_growth(exp, 64.0, copies=(1, 2))
    big = 10**12
    assert (large.pays_from or big) <= (small.pays_from or big)


@pytest.mark.parametrize(
    ("tried", "expected"),
    [
        (((943, True),), "beats its private popularity list on validation at these 943 devices"),
        (
            ((943, False), (1886, False), (3772, True)),
            "starts paying at about 3,772 devices: the private-round simulator's learned model beats its private "
            "popularity list on validation with each user replicated 4× (fresh noise), not at 943 or 1,886",
        ),
        (((10, False), (20, False)), "does not pay up to 20 devices (each user replicated up to 2×)"),
    ],
)
def test_the_forecast_line(tried: tuple[tuple[int, bool], ...], expected: str) -> None:
    line = Growth(8.0, tried).line()
    assert line.startswith("growth: at ε = 8, ") and expected in line


@pytest.mark.parametrize(
    ("epsilon", "copies", "message"),
    [
        (0.0, (1, 2), "epsilon must be a positive number"),
        (8.0, (2, 4), "copies must rise from 1"),
        (8.0, (1, 1), "copies must rise from 1"),
    ],
)
def test_the_forecast_checks_its_arguments(exp, epsilon: float, copies: tuple[int, ...], message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        forecast_growth(exp, epsilon, copies=copies)


def test_plan_privacy_says_when_personalisation_starts_paying(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from fedsim.cli import main

    assert main(["plan-privacy", "--dataset", "synthetic", "--rounds", "1", "--growth"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("plan: at 600 devices and ε = 8") and out[-1].startswith("growth: at ε = 8, ")
    # A published split has no user log to replicate: one line, before any private run.
    kgat = tmp_path / "kgat"
    kgat.mkdir()
    (kgat / "train.txt").write_text("0 1 2 3\n1 2 3 4\n2 0 1\n")
    (kgat / "test.txt").write_text("0 4\n1 0\n2 2\n")
    assert main(["plan-privacy", "--dataset", str(kgat), "--growth"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--growth needs a rating log" in err
