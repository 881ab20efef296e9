"""What ``simulate``, ``eval`` and ``demo`` share: the experiment a command runs on, and the test
table it prints beside the baselines."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, TextIO
from typing import Protocol as TypingProtocol

import numpy as np
from numpy.typing import NDArray

from fedsim.cli.args import resolve_data_dir
from fedsim.evaluation.experiment import Experiment, Protocol, baselines, prepare
from fedsim.evaluation.ranking import (
    EvalResult,
    RankingResult,
    Scorer,
    TieMode,
    evaluate_all_items,
    evaluate_candidates,
    popularity_scorer,
    random_scorer,
)
from fedsim.ui import table

__all__ = ["ScoredModel", "evaluate_and_report", "print_rows", "report_sampled", "resolve_dataset", "score_blocks"]


class ScoredModel(TypingProtocol):
    """What the test table needs of a trained model (`FederatedLightFR`, `fedsim.federation.ials.IALSRun`)."""

    def scores(self, users: NDArray[np.int64], candidates: NDArray[np.int64]) -> Any:
        """Each user's scores of its candidate items, (n, c)."""
        ...

    def all_scores(self, users: NDArray[np.int64]) -> Any:
        """Scores against every item, (len(users), m)."""
        ...


def score_blocks(state: ScoredModel, blocks: Any, tie_mode: TieMode) -> EvalResult:
    return evaluate_candidates(state.scores(blocks.users, blocks.items), 10, tie_mode)


def print_rows(rows: list[list[str]], out: TextIO) -> None:
    table(rows[0], rows[1:], out)


def report_sampled(exp: Experiment, results: dict[str, dict[TieMode, EvalResult]], out: TextIO) -> None:
    out.write(
        f"\nTest: {len(exp.test)} positives, each ranked among {exp.n_negatives} sampled negatives "
        f"({exp.protocol.value}); HR@10 / NDCG@10\n"
    )
    rows = [
        [
            "model",
            "HR@10 (random ties)",
            "NDCG@10 (random ties)",
            "HR@10 (optimistic)",
            "NDCG@10 (optimistic)",
        ]
    ]
    for name, res in results.items():
        r, o = res[TieMode.RANDOM], res[TieMode.OPTIMISTIC]
        rows.append([name, f"{r.hr:.4f}", f"{r.ndcg:.4f}", f"{o.hr:.4f}", f"{o.ndcg:.4f}"])
    print_rows(rows, out)
    out.write(
        "Random ties: a positive tied with negatives lands at a uniformly random place among them (exact\n"
        "expectation). Optimistic: ties favour the positive, as the LightFR paper's evaluation does.\n"
    )


def _all_results(
    exp: Experiment, state: ScoredModel | None, label: str, eval_seed: int = 0
) -> dict[str, dict[TieMode, EvalResult]]:
    results: dict[str, dict[TieMode, EvalResult]] = {}
    if state is not None:
        results[label] = {t: score_blocks(state, exp.test, t) for t in TieMode}
    base = {t: baselines(exp, t, seed=eval_seed) for t in TieMode}
    for name in ("popularity", "random"):
        results[name] = {t: base[t][name] for t in TieMode}
    return results


def _full_results(
    exp: Experiment, state: ScoredModel | None, eval_seed: int, only: str | None = None
) -> dict[str, RankingResult]:
    """The published full-ranking protocol (protocol full): Recall@20 / NDCG@20, random ties."""
    if exp.seen is None or exp.test_pairs is None:
        raise ValueError(f"protocol {exp.protocol.value} needs a dataset with its own train/test split")
    scorers: dict[str, Scorer] = {}
    if state is not None:
        scorers["model"] = state.all_scores  # the trained score, item levels included
    scorers["popularity"] = popularity_scorer(exp.train)
    scorers["random"] = random_scorer(exp.train.n_items, eval_seed)
    return {
        name: evaluate_all_items(sc, exp.seen, exp.test_pairs, k=20, seed=eval_seed)
        for name, sc in scorers.items()
        if only is None or name == only
    }


def evaluate_and_report(
    exp: Experiment,
    state: ScoredModel | None,
    label: str,
    eval_seed: int,
    out: TextIO,
    only: str | None = None,
) -> dict[str, dict[str, float]]:
    """Evaluate the model (if any) and the baselines on the test split, print the table, and return
    the ``--json`` metric maps (random ties) keyed "model", "popularity", "random"."""
    if exp.protocol is Protocol.FULL:
        full = _full_results(exp, state, eval_seed, only)
        n_users = next(iter(full.values())).n_users
        out.write(
            f"\nTest: {n_users} users of the dataset's own test split, each ranking all {exp.train.n_items} items "
            f"minus its train items; Recall@20 / NDCG@20, random ties (seed {eval_seed})\n"
        )
        rows = [[label if name == "model" else name, f"{r.recall:.4f}", f"{r.ndcg:.4f}"] for name, r in full.items()]
        print_rows([["model", "Recall@20", "NDCG@20"], *rows], out)
        return {name: r.metrics() for name, r in full.items()}
    results = _all_results(exp, state, label, eval_seed)
    names = {label: "model", "popularity": "popularity", "random": "random"}
    shown = {k: v for k, v in results.items() if only is None or names[k] == only}
    report_sampled(exp, shown, out)
    return {names[k]: v[TieMode.RANDOM].metrics() for k, v in shown.items()}


def resolve_dataset(args: argparse.Namespace, out: TextIO) -> tuple[Experiment, Path | None]:
    data_dir = resolve_data_dir(args.data_dir)
    name = args.dataset
    if name == "auto":
        name = "ml-100k" if data_dir is not None and (data_dir / "ml-100k" / "u.data").is_file() else "synthetic"
        if name != "synthetic":
            out.write(f"dataset: ml-100k (from {data_dir})\n")
        else:
            out.write(f"dataset: synthetic (built-in generator): {_where_looked(args.data_dir, data_dir)}\n")
    protocol = Protocol(args.protocol) if getattr(args, "protocol", None) else None
    n_neg = getattr(args, "eval_negatives", None)
    exp = prepare(name, protocol, n_negatives=n_neg, seed=getattr(args, "eval_seed", 0), data_dir=data_dir)
    return exp, data_dir


def _where_looked(arg: Path | None, found: Path | None) -> str:
    """Where the demo looked for MovieLens-100K, for the line that says it fell back to synthetic data."""
    if arg is not None:
        return f"no ml-100k/u.data under --data-dir {arg}"
    env = os.environ.get("FEDREC_DATA")
    if env:
        return f"no ml-100k/u.data under $FEDREC_DATA={env}"
    if found is not None:
        return f"no ml-100k/u.data under {found}"
    return (
        f"no ml-100k/u.data found ($FEDREC_DATA is not set; no ../shared/data above {Path.cwd()} or the fedrec "
        "package); pass --data-dir FOLDER or see docs/datasets.md"
    )
