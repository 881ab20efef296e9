"""The ``fedrec`` command line: ``demo``, ``simulate``, ``eval`` and ``data``.

This is the edge of the program: it reads the environment, parses and validates arguments, and turns
every `FedRecError`/`ValueError` into one clear line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from agg_server.config import MIN_COHORT, default_flip_fraction
from device_sdk.models import LightFRConfig, LightFRModel
from device_sdk.store import save_store
from fedsim.datasets import DATASET_NAMES, LightFRSplit, TrainTestSplit, find_data_dir, load_dataset
from fedsim.evaluation import (
    EvalResult,
    RankingResult,
    Scorer,
    TieMode,
    evaluate_all_items,
    evaluate_candidates,
    popularity_scorer,
    random_scorer,
)
from fedsim.experiment import Experiment, Protocol, baselines, item_titles, prepare
from fedsim.families import FAMILY_DEFAULT_ROUNDS, simulate_family
from fedsim.federation import FederatedLightFR, FederationConfig, RoundReport, plane_vectors, run_lightfr, user_data
from fedsim.report import result_record, write_json
from fedsim.ui import progress, table
from protocol.enrollment import DEFAULT_VALID_DAYS
from protocol.errors import ConfigError, FedRecError
from protocol.families.lightfr import DENSITY_SCALE, density_weight
from protocol.plan import LightFRParams
from protocol.spec import MAX_LOCAL_STEPS, Aggregation

__all__ = ["main", "build_parser"]

_LIGHTFR = LightFRParams()  # the training defaults the CLI shows are the plan's
#: The most rounds `fedrec plan-privacy` plans (its accountant composes every round: 10^3 take about
#: 3 s, 10^4 about 25 s).
MAX_PLAN_ROUNDS = 1_000


def _parse_int(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _parse_int(text, 1)


def _local_steps(text: str) -> int:
    # Local epochs, sweeps and steps: the bounds every training plan has (`protocol.plan`).
    value = _parse_int(text, 1)
    if value > MAX_LOCAL_STEPS:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_LOCAL_STEPS}, got {value}")
    return value


def _nonneg_int(text: str) -> int:
    return _parse_int(text, 0)


def _parse_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not np.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
    return value


def _fraction(text: str) -> float:
    value = _parse_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _open_fraction(text: str) -> float:
    value = _parse_float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


def _plan_rounds(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_PLAN_ROUNDS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_PLAN_ROUNDS}, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = _parse_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _xor_fraction(text: str) -> float:
    value = _parse_float(text)
    if not 0 <= value <= 0.5:
        raise argparse.ArgumentTypeError(f"must be in [0, 0.5], got {text!r}")
    return value


def _nonneg_float(text: str) -> float:
    value = _parse_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return value


def _weight_or_auto(text: str) -> float | str:
    return "auto" if text.strip().lower() == "auto" else _nonneg_float(text)


#: Agg_grad damping ρ: `simulate` takes the server's default (`agg_server.config.default_flip_fraction`).
_FLIP_HELP = "default: 1 under the all-items objective with the mean-field step, else 0.3, as the server's"

_DATA_DIR_HELP = (
    "FOLDER holding the named datasets (ml-100k/, filmtrust/, filmtrust-lightfr-split/; default: $FEDREC_DATA, "
    "else a ../shared/data folder above the current directory; see docs/datasets.md)"
)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LightFR model")
    g.add_argument(
        "--model",
        choices=["lightfr", "mf", "felb", "fnmf"],
        default="lightfr",
        help="model family (default: lightfr); mf, felb and fnmf take the options of their own group below",
    )
    g.add_argument("--bits", type=_positive_int, default=64, help="code length f (default: 64)")
    g.add_argument(
        "--lam",
        type=_nonneg_float,
        default=0.0,
        help="balance weight λ (default 0; the paper's 0.6 learns nothing)",
    )
    g.add_argument(
        "--negatives",
        type=_nonneg_int,
        default=4,
        help="sampled unobserved items per rating, fitted as 0, when --unobserved-weight is 0 (default 4)",
    )
    g.add_argument(
        "--unobserved-weight",
        type=_weight_or_auto,
        default=None,
        help="w0: > 0 trains against every unobserved item and learns item levels; 'auto' (the default; "
        "0 with --aggregation para) derives it from the catalogue's density each round, w0 = 0.6·density^(2/3), "
        "chosen on validation; 0 = the paper's sampled negatives",
    )
    g.add_argument(
        "--confidence",
        type=_nonneg_float,
        default=0.0,
        help="α: observed items weigh 1 + α under the all-items objective (default 0)",
    )
    g.add_argument(
        "--query-planes",
        type=_nonneg_int,
        default=0,
        help="P >= 1: asymmetric scoring, the user's vector solved exactly against the binary item codes and "
        "kept as P ±1 bit-planes (all-items objective; items stay f-bit codes); 0 = ±1 user codes (default)",
    )
    g.add_argument(
        "--user-reg",
        type=_positive_float,
        default=1.0,
        help="ridge weight of the user solve with --query-planes (default 1)",
    )
    g.add_argument(
        "--rank-planes",
        type=_nonneg_int,
        default=None,
        metavar="P",
        help="symmetric training (±1 codes) under the all-items objective: each user ranks with its vector "
        "ridge-solved against the final item codes, kept as P bit-planes, as the device SDK's default "
        "(LightFRConfig.rank_planes); 0 ranks with the ±1 codes; default 3, and 0 with --epsilon (under DP "
        "the planes did not help on validation, docs/dp-accounting.md §8)",
    )
    g.add_argument(
        "--rank-ridge",
        type=_positive_float,
        default=None,
        help="ridge weight of that ranking-time solve in units of w0·m (LightFRConfig.rank_ridge; default 2)",
    )
    g.add_argument(
        "--targets",
        choices=["binary", "ratings"],
        default="binary",
        help="fit observed items as 1 (binary, default) or as their normalised rating",
    )
    g.add_argument(
        "--epochs", type=_local_steps, default=_LIGHTFR.local_epochs, help="local epochs E per round (default: 1)"
    )
    g.add_argument(
        "--sweeps", type=_local_steps, default=_LIGHTFR.max_sweeps, help="cap on DCD sweeps per epoch (default: 10)"
    )


def _add_fed_args(p: argparse.ArgumentParser, rounds: int) -> None:
    g = p.add_argument_group("federation")
    g.add_argument(
        "--rounds",
        type=_nonneg_int,
        default=None,
        help=f"global rounds T (default: {rounds} for lightfr, 20 for mf, 100 for felb, 10 for fnmf)",
    )
    g.add_argument("--fraction", type=_fraction, default=0.6, help="client fraction p per round (default: 0.6)")
    g.add_argument(
        "--aggregation",
        choices=[a.value for a in Aggregation],
        default="grad",
        help="server rule: grad (Agg_grad, eq. 16) or para (Agg_para, eq. 17)",
    )
    g.add_argument(
        "--flip-fraction",
        type=_fraction,
        default=None,
        help=f"probability that an item bit Agg_grad wants to flip is flipped ({_FLIP_HELP}; 1 = the paper's rule)",
    )
    g.add_argument(
        "--no-mean-field",
        dest="mean_field",
        action="store_false",
        default=None,
        help="all-items objective: step every item bit from the old codes (Jacobi) instead of the default mean-field "
        "step, which follows the item's bits already changed (raters' Gram taken as counts_i/n · G_U; the server's "
        "model.mean_field)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model and the federation: initial codes, cohorts, sampled training negatives "
        "(default: 0); the test split and candidates come from --eval-seed",
    )


def _add_family_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("MF, FELB and FNMF (--model mf|felb|fnmf)")
    g.add_argument(
        "--rank",
        type=_positive_int,
        default=None,
        help="factors f (mf, default 32) or components k (felb/fnmf: 5 on planted data, 20 on ratings)",
    )
    g.add_argument("--clients", type=_positive_int, default=None, help="felb/fnmf clients (default 10; 50 on ratings)")
    g.add_argument(
        "--local-steps",
        type=_local_steps,
        default=None,
        help="local iterations per round: felb b (default 10), fnmf T (default 100)",
    )
    g.add_argument(
        "--epsilon",
        type=_nonneg_float,
        default=0.0,
        help="lightfr/mf: user-level ε at δ=1e-5 over the whole run, every device eligible, rounds through the "
        "private-round simulator (0 = no DP)",
    )
    g.add_argument(
        "--pop-share",
        type=_open_fraction,
        default=0.5,
        help="lightfr private: share of ε calibrating the private popularity release, the rest pays for the "
        "rounds (default 0.5)",
    )
    g.add_argument(
        "--threshold",
        type=_nonneg_float,
        default=0.0,
        help="lightfr private: move a bit only when its summed gradient exceeds this many σ of the noise "
        "(default 0 = off: measured worse on ML-100K)",
    )
    g.add_argument(
        "--secure",
        action="store_true",
        help="mf: run every round through the real coordinator with SecAgg+ even without DP",
    )
    g.add_argument("--clip-norm", type=_positive_float, default=20.0, help="mf private: L2 clip C of an upload")
    g.add_argument("--example-cap", type=_nonneg_int, default=20, help="mf: θ ratings per user per round (0 = all)")
    g.add_argument("--silos", type=_nonneg_int, default=0, help="mf: K silo clients holding many users (HFL)")
    g.add_argument("--server-lr", type=_positive_float, default=1.0, help="mf: server step (default 1.0)")
    g.add_argument("--lr", type=_positive_float, default=0.1, help="mf: device step for user vectors (default 0.1)")
    g.add_argument("--max-norm2", type=_positive_float, default=None, help="mf: clipping bound R (default: top rating)")
    g.add_argument("--step-rule", choices=["lipschitz", "mu"], default="lipschitz", help="felb: FELB or FELB^MU")
    g.add_argument("--xor-noise", type=_xor_fraction, default=0.1, help="felb planted: XOR noise p (default 0.1)")
    g.add_argument("--noise-sigma", type=_nonneg_float, default=0.0, help="felb: Gaussian σ on each upload")
    g.add_argument("--binarize-at", type=float, default=4.0, help="felb on ratings: rating >= this is a 1")
    g.add_argument("--server-scale", type=_positive_float, default=None, help="felb: server prox scale s (default 1)")
    g.add_argument(
        "--alignment", choices=["lap", "lap_rho", "sinkhorn"], default="lap", help="fnmf: client-side alignment"
    )
    g.add_argument(
        "--aggregator",
        choices=["secure", "trusted-barycenter", "fedavg", "fedprox"],
        default="secure",
        help="fnmf: secure (sums only; default), trusted-barycenter (sees every client's matrix), fedavg, fedprox",
    )


_EVAL_SEED_HELP = (
    "seed of the evaluation (default 0): which ratings a file without timestamps holds out, the validation "
    "carve of a published split, the sampled negatives and random tie-breaking; --seed never changes them"
)
_JSON_HELP = (
    "print the result as one JSON object on the last line of stdout (everything else goes to stderr); "
    "schema in docs/cli.md"
)


def _add_data_args(p: argparse.ArgumentParser, default: str | None) -> None:
    g = p.add_argument_group("data and evaluation")
    g.add_argument(
        "--dataset",
        default=default,
        help=f"dataset name ({', '.join(DATASET_NAMES)}), a ratings file/folder, or planted "
        "(felb/fnmf recipe); required for lightfr and mf",
    )
    g.add_argument("--data-dir", type=Path, default=None, metavar="FOLDER", help=_DATA_DIR_HELP)
    g.add_argument(
        "--protocol",
        choices=[p.value for p in Protocol],
        default=None,
        help="loo (default) or chrono for rating logs; full (default) or sampled for amazon-book's own split; "
        "the filmtrust-lightfr split always uses its own blocks",
    )
    g.add_argument(
        "--eval-negatives",
        type=_positive_int,
        default=99,
        help="sampled negatives per test positive (default: 99)",
    )
    g.add_argument("--eval-seed", type=int, default=0, help=_EVAL_SEED_HELP)
    g.add_argument(
        "--eval-every",
        type=_positive_int,
        default=5,
        help="evaluate on validation every N rounds (default: 5)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``fedrec`` argument parser (also used to generate the CLI reference)."""
    parser = argparse.ArgumentParser(
        prog="fedrec",
        description="fedrec: on-device federated recommendation (LightFR binary codes).",
    )
    parser.add_argument("--version", action="version", version=f"fedrec {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="run a real server and a fleet of devices on loopback, then show recommendations",
        description="Starts fedrec-server on a free loopback port, registers one simulated device per user "
        "(MovieLens-100K when ../shared/data or --data-dir has it, else a built-in synthetic dataset), runs "
        "federated LightFR rounds with SecAgg+ and distributed DP, prints a per-round table, then each "
        "device's HR@10/NDCG@10 averaged beside popularity and a few recommendations for one device.",
    )
    demo.add_argument("--dataset", default="auto", help="dataset name or file (default: ml-100k if found)")
    demo.add_argument("--data-dir", type=Path, default=None, metavar="FOLDER", help=_DATA_DIR_HELP)
    # One round of every device: with DP each device's share of the released sum is largest when every
    # device is in it, and on ML-100K's validation blocks one round of all 943 ranked better (HR@10 0.451)
    # than three rounds of 300 (0.436); three of all 943 (0.462) would triple the demo's wall time.
    demo.add_argument("--rounds", type=_positive_int, default=1, help="server rounds (default: 1)")
    demo.add_argument("--cohort", type=_positive_int, default=None, help="devices per round (default: every device)")
    demo.add_argument("--devices", type=_positive_int, default=None, help="use only the first N users")
    demo.add_argument("--bits", type=_positive_int, default=64, help="code length f (default: 64)")
    demo.add_argument("--dropout", type=_nonneg_float, default=0.05, help="chance a device drops (default 0.05)")
    demo.add_argument(
        "--epsilon",
        type=_nonneg_float,
        default=8.0,
        help="DP budget ε over the run at δ=1e-5 (0 = no DP; default 8)",
    )
    demo.add_argument(
        "--flip-fraction",
        type=_fraction,
        default=None,
        help="Agg_grad damping ρ (default 0.3: the demo runs the server's Jacobi step, model.mean_field = false, "
        "the recipe its figures were measured with)",
    )
    demo.add_argument(
        "--query-planes",
        type=_nonneg_int,
        default=0,
        metavar="P",
        help="asymmetric scoring through the round plan (protocol 1.6, the server's model.query_planes): each "
        "device solves a real user vector against the item codes and keeps it as P ±1 bit-planes (0..8; "
        "default 0: ±1 user codes)",
    )
    demo.add_argument(
        "--user-reg",
        type=_positive_float,
        default=1.0,
        help="ridge weight of the devices' user solve under --query-planes (model.user_reg; default 1)",
    )
    demo.add_argument(
        "--seed",
        type=_nonneg_int,
        default=0,
        help="seed of everything the simulation decides: which devices each round invites, which drop and "
        "where, the devices' first codes and sampled negatives, the server's cohort graph and damping, and "
        "the evaluation's tie-breaks (default: 0). Without DP (--epsilon 0) two runs with one seed print "
        "the same output; with DP the noise is fresh from the OS each run, so figures differ by the noise "
        "only (see --insecure-seed-dp-noise)",
    )
    demo.add_argument(
        "--insecure-seed-dp-noise",
        action="store_true",
        help="TEST HOOK: derive every device's DP noise from --seed too, so DP runs repeat exactly; anyone "
        "who knows the seed can remove the noise, so the run's ε is NOT a privacy guarantee (it says so)",
    )
    demo.add_argument("--workdir", type=Path, default=None, help="keep server data and device stores here")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument(
        "--json", action="store_true", help="print the result as one JSON object, the last line of stdout"
    )

    lt = sub.add_parser(
        "loadtest",
        help="run simulated devices against a server",
        description="Simulated devices as asyncio tasks (in several worker processes when asked) against "
        "a running fedrec-server, with dropouts injected at every phase (including disconnects in the middle "
        "of a request); prints per-phase latency percentiles, rounds completed, server CPU and memory per "
        "round, bytes per device and errors by type.",
    )
    lt.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8080")
    lt.add_argument("--devices", type=_positive_int, default=100, help="number of devices (default: 100)")
    lt.add_argument("--dropout", type=_nonneg_float, default=0.2, help="chance a device drops per round")
    lt.add_argument("--rounds", type=_positive_int, default=3, help="stop after this many rounds (default: 3)")
    lt.add_argument(
        "--n-items",
        type=_positive_int,
        default=None,
        help="catalogue size the server trains (default: read from the server's /v1/status; a different value is "
        "an error)",
    )
    lt.add_argument(
        "--bits", type=_positive_int, default=None, help="code length of the server's model (default: read from it)"
    )
    lt.add_argument("--ratings-per-user", type=_positive_int, default=166, help="synthetic ratings per device")
    lt.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="shards of the fleet: worker processes, or Ray actors with --backend ray (default: 1)",
    )
    lt.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="where the shards run: local worker processes (default) or Ray actors, each hosting its devices as "
        "asyncio tasks (needs the 'ray' extra; RAY_ADDRESS selects an existing cluster, else a local Ray is "
        "started for the run)",
    )
    lt.add_argument(
        "--nice",
        type=_nonneg_int,
        default=0,
        help="lower the priority of the fleet's worker processes by N (a fleet on the server's own machine then "
        "leaves the server its CPU; --workers 1 runs the fleet in this process, which is not reniced)",
    )
    lt.add_argument(
        "--cohort",
        type=_positive_int,
        default=None,
        help="reproducible rounds: the fleet picks each round's N devices from --seed and only those check in, and "
        "the devices' training is seeded; with a server whose rounds.cohort_size is N and rounds.seed is set, "
        "runs with the same seeds commit the same rounds on every back-end and split, and with "
        "--insecure-seed-noise the same model (default: every device checks in whenever it is free)",
    )
    lt.add_argument(
        "--insecure-seed-noise",
        action="store_true",
        help="TEST HOOK: derive every device's noise stream (DP noise and stochastic-rounding coins) from --seed "
        "too, so seeded runs commit bit-identical models; anyone who knows the seed can remove the noise, so the "
        "run's ε is NOT a privacy guarantee (it says so)",
    )
    lt.add_argument(
        "--seed",
        type=_nonneg_int,
        default=0,
        help="seed of the devices' synthetic ratings and of which devices drop, where (default: 0); keys, masks "
        "and DP noise always come from the OS, and which devices the server invites depends on timing",
    )
    lt.add_argument("--time-limit", type=_nonneg_float, default=3600.0, help="seconds before giving up")
    lt.add_argument(
        "--announce-drops",
        action="store_true",
        help="dropped devices tell the server they leave, so phases close at quorum instead of waiting for their "
        "deadlines (default: drops are silent, and each phase with a silent drop lasts its full deadline)",
    )
    lt.add_argument("--quiet", action="store_true", help="no progress bar")
    lt.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="draw every per-phase latency the devices saw against time (needs the 'plot' extra)",
    )
    lt.add_argument("--json", action="store_true", help="print the report as one JSON object, the last line of stdout")
    lt.add_argument("--store", type=Path, default=None, help="device store folder (default: a temporary one)")
    lt.add_argument(
        "--ca-file",
        type=Path,
        default=None,
        help="PEM certificate to trust for an https server with a private or self-signed certificate",
    )
    lt.add_argument(
        "--authority-key",
        type=Path,
        default=None,
        metavar="FILE",
        help="the operator's enrollment authority key (fedrec enroll-ca init): each device gets a certificate for "
        "its identity key and registers with it; rounds run signed (the server's enrollment.authority_key)",
    )
    lt.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="file holding the server's admin token: the fleet asks the server for one one-time enrollment token "
        "per device and each device registers with its token (default without either: open registration, "
        "which a server accepts on loopback only)",
    )
    lt.add_argument(
        "--credential-sources",
        type=_positive_int,
        default=1,
        help="spread the devices' credentials over this many sources (certificate or token batches; default 1)",
    )

    sim = sub.add_parser(
        "simulate",
        help="run an in-process federated training and evaluate it",
        description="In-process federated training (no sockets) on a dataset, evaluated beside simple "
        "baselines. LightFR (default): HR@10/NDCG@10 in both tie modes beside popularity and random. "
        "--model mf: test RMSE and HR@10/NDCG@10, optionally private through the real coordinator "
        "(--epsilon). --model felb / fnmf: the planted recipes (or binarized ratings for felb) with F1 / "
        "Σ-RMSD figures.",
    )
    _add_model_args(sim)
    _add_fed_args(sim, rounds=50)
    _add_family_args(sim)
    _add_data_args(sim, default=None)
    sim.add_argument("--save", type=Path, default=None, help="write the trained run to this file")
    sim.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="draw validation HR@10/NDCG@10 per evaluated round (LightFR in-process runs; needs the 'plot' extra)",
    )
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    sim.add_argument("--json", action="store_true", help=_JSON_HELP)

    ev = sub.add_parser(
        "eval",
        help="evaluate a saved run or a baseline",
        description="Evaluate a run saved by 'fedrec simulate --save' on its test blocks, or a baseline "
        "(popularity, random) on a dataset.",
    )
    ev.add_argument("run", nargs="?", type=Path, help="a run file written by 'fedrec simulate --save'")
    ev.add_argument("--baseline", choices=["popularity", "random"], default=None, help="evaluate a baseline instead")
    ev.add_argument("--dataset", default=None, help="dataset (for --baseline; a run file names its own)")
    ev.add_argument("--data-dir", type=Path, default=None, metavar="FOLDER", help=_DATA_DIR_HELP)
    ev.add_argument(
        "--protocol",
        choices=[p.value for p in Protocol],
        default=None,
        help="with --baseline, as for simulate; a run file evaluates on its own (another one is refused)",
    )
    ev.add_argument(
        "--eval-negatives",
        type=_positive_int,
        default=None,
        help="sampled negatives per test positive, with --baseline (default: 99); a run file uses its own "
        "(another number is refused)",
    )
    ev.add_argument(
        "--eval-seed",
        type=int,
        default=None,
        help="seed of the evaluation (default: the run file's, else 0); see simulate --eval-seed",
    )
    ev.add_argument("--json", action="store_true", help=_JSON_HELP)

    plan = sub.add_parser(
        "plan-privacy",
        help="predict per-coordinate signal-to-noise of private LightFR choices before spending any ε",
        description="For a dataset and a target ε (user-level, δ=1e-5, every round charged), predicts for each "
        "number of rounds and clip norm the released noise σ per coordinate, the signal-to-noise of the median "
        "item, the share of interactions on items with SNR >= 2, and the noise of the private popularity "
        "release, using the accountant's own μ (docs/dp-accounting.md §6).",
    )
    plan.add_argument("--dataset", required=True, help="dataset name or ratings file")
    plan.add_argument("--data-dir", type=Path, default=None, metavar="FOLDER", help=_DATA_DIR_HELP)
    plan.add_argument("--epsilon", type=_positive_float, default=8.0, help="target ε over the run (default 8)")
    plan.add_argument("--bits", type=_positive_int, default=64, help="code length f (default 64)")
    plan.add_argument("--example-cap", type=_nonneg_int, default=50, help="θ items per device (default 50)")
    plan.add_argument("--negatives", type=_nonneg_int, default=0, help="sampled negatives per item (default 0)")
    plan.add_argument(
        "--pop-share",
        type=_open_fraction,
        default=0.5,
        help="share of ε for popularity, the rest pays for the rounds (default 0.5)",
    )
    plan.add_argument("--rounds", type=_plan_rounds, nargs="+", default=[1, 2, 3, 5, 10], help="rounds to plan")
    plan.add_argument("--clips", type=_positive_float, nargs="+", default=[1.0, 4.0], help="clip norms C to plan")

    rec = sub.add_parser(
        "recommend",
        help="top-N items for one user of a saved run",
        description="Recommend from a run saved by 'fedrec simulate --save' (any model family): the user's "
        "device model is rebuilt from the run and ranks every item the user did not rate in training, with the "
        "SDK's recommend (random ties from --seed).",
    )
    rec.add_argument("run", type=Path, help="a run file written by 'fedrec simulate --save'")
    rec.add_argument(
        "--user", required=True, help="user id as in the dataset (its raw id; planted data: the row number)"
    )
    rec.add_argument("-n", type=_positive_int, default=10, help="how many items (default: 10)")
    rec.add_argument("--seed", type=_nonneg_int, default=0, help="seed of the tie-breaking (default: 0)")
    rec.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    exp_ = sub.add_parser(
        "export",
        help="turn a saved run into the on-device model file the SDK loads",
        description="Write the model file a device loads (LightFRModel.load, MFModel.load, FELBModel.load, "
        "FNMFModel.load) from a run saved by 'fedrec simulate --save'. With --user: that user's device model "
        "(LightFR, MF: a one-user model; FELB, FNMF: the client model holding the user, and its row). Without: "
        "the whole run as one model (LightFR, MF).",
    )
    exp_.add_argument("run", type=Path, help="a run file written by 'fedrec simulate --save'")
    exp_.add_argument("-o", dest="output", type=Path, required=True, help="model file to write (e.g. model.fedrec)")
    exp_.add_argument("--user", default=None, help="export only this user's device model (raw id as in the dataset)")

    ca = sub.add_parser(
        "enroll-ca",
        help="the operator's enrollment authority: create it, certify devices",
        description="The enrollment authority (CA) certifies devices' long-term Ed25519 identity keys (protocol "
        "1.4).  Keep its key file away from the aggregation server: the server's configuration holds only the "
        "public key (enrollment.authority_key), and devices pin it.",
    )
    ca_sub = ca.add_subparsers(dest="ca_command", required=True, metavar="ACTION")
    ca_init = ca_sub.add_parser("init", help="create the authority key file and print its public key")
    ca_init.add_argument("--key", type=Path, required=True, metavar="FILE", help="key file to create (mode 0600)")
    ca_issue = ca_sub.add_parser("issue", help="certify a device's public key; prints the certificate as hex")
    ca_issue.add_argument("--key", type=Path, required=True, metavar="FILE", help="the authority key file")
    ca_issue.add_argument(
        "--device-key", required=True, metavar="HEX", help="the device's 32-byte Ed25519 public key, as 64 hex digits"
    )
    ca_issue.add_argument(
        "--batch",
        default="default",
        help="the batch (credential source) to issue under: the server rate-limits and caps each round's share "
        "per batch (default: 'default')",
    )
    ca_issue.add_argument(
        "--valid-days",
        type=float,
        default=DEFAULT_VALID_DAYS,
        metavar="DAYS",
        help=f"how long the certificate is valid from now (default {DEFAULT_VALID_DAYS}); the server refuses it "
        "at registration and devices refuse it in signed rounds outside that period",
    )
    ca_revoke = ca_sub.add_parser(
        "revoke",
        help="add device keys to the authority's signed revocation list (the file enrollment.revocation_list names)",
        description="Writes the next revocation list: the keys of the existing FILE (checked against the authority) "
        "plus the given ones (none: an empty first list), numbered one higher, signed by the authority, "
        "replacing FILE atomically.  The server reloads it when the file changes, refuses revoked devices at "
        "registration, in cohort draws and on every authenticated route, and serves it to devices "
        "(GET /v1/enrollment/revocations), which enforce it in signed rounds.",
    )
    ca_revoke.add_argument("--key", type=Path, required=True, metavar="FILE", help="the authority key file")
    ca_revoke.add_argument(
        "--crl", type=Path, required=True, metavar="FILE", help="the revocation list to update or create"
    )
    ca_revoke.add_argument(
        "--device-key", action="append", default=[], metavar="HEX", help="a device's Ed25519 public key (repeatable)"
    )
    ca_revoke.add_argument(
        "--certificate",
        action="append",
        default=[],
        metavar="HEX",
        help="a certificate whose key to revoke (repeatable)",
    )

    data = sub.add_parser("data", help="list the datasets fedrec can find")
    data.add_argument("--data-dir", type=Path, default=None, metavar="FOLDER", help=_DATA_DIR_HELP)
    return parser


# -- helpers ---------------------------------------------------------------------------------------


def _data_dir(arg: Path | None) -> Path | None:
    if arg is not None:
        return arg
    env = os.environ.get("FEDREC_DATA")
    return Path(env) if env else find_data_dir()


def _model_config(args: argparse.Namespace, exp: Experiment) -> LightFRConfig:
    return LightFRConfig(
        bits=args.bits,
        lam=args.lam,
        negatives=args.negatives,
        local_epochs=args.epochs,
        max_sweeps=args.sweeps,
        rating_range=exp.rating_range,
        binary_positives=args.targets == "binary",
        unobserved_weight=_first_weight(args, exp.train.n_items),
        confidence=args.confidence,
    )


def _unobserved_weight(args: argparse.Namespace) -> float | str:
    """The --unobserved-weight asked for: a number, or "auto" (the density rule)."""
    if args.unobserved_weight is not None:
        return args.unobserved_weight if args.unobserved_weight == "auto" else float(args.unobserved_weight)
    return "auto" if args.aggregation == Aggregation.GRAD.value else 0.0


def _first_weight(args: argparse.Namespace, n_items: int) -> float:
    """The w0 the first round trains with: the number asked for, or under "auto" the density rule at its
    floor (one positive per device; the server replaces it from the first round's counts)."""
    w = _unobserved_weight(args)
    return density_weight(0.0, 1, n_items) if w == "auto" else float(w)


def _flip_fraction(args: argparse.Namespace) -> float:
    """--flip-fraction, or the server's default for this objective (`agg_server.config.default_flip_fraction`)."""
    if args.flip_fraction is not None:
        return float(args.flip_fraction)
    full = _unobserved_weight(args) != 0 and args.aggregation == Aggregation.GRAD.value
    return default_flip_fraction(full, _mean_field(args))


def _mean_field(args: argparse.Namespace) -> bool:
    """The mean-field step is on unless --no-mean-field was given."""
    return getattr(args, "mean_field", None) is not False


def _fed_config(args: argparse.Namespace) -> FederationConfig:
    # Symmetric training under the all-items objective ranks as a device does by default: with its vector
    # ridge-solved against the final item codes, as planes (`LightFRConfig.rank_planes` / `rank_ridge`).
    ranked = not getattr(args, "query_planes", 0) and _unobserved_weight(args) != 0
    return FederationConfig(
        rounds=args.rounds,
        fraction=args.fraction,
        seed=args.seed,
        aggregation=Aggregation(args.aggregation),
        flip_fraction=_flip_fraction(args),
        unobserved_scale=DENSITY_SCALE if _unobserved_weight(args) == "auto" else 0.0,
        query_planes=getattr(args, "query_planes", 0),
        user_reg=getattr(args, "user_reg", 1.0),
        rank_planes=_rank_planes(args) if ranked else 0,
        rank_ridge=_rank_ridge(args),
        mean_field=_mean_field(args),
    )


def _rank_planes(args: argparse.Namespace) -> int:
    """--rank-planes, or the device SDK's default (`LightFRConfig.rank_planes`)."""
    planes = getattr(args, "rank_planes", None)
    return LightFRConfig().rank_planes if planes is None else int(planes)


def _rank_ridge(args: argparse.Namespace) -> float:
    """--rank-ridge, or the device SDK's default (`LightFRConfig.rank_ridge`)."""
    ridge = getattr(args, "rank_ridge", None)
    return LightFRConfig().rank_ridge if ridge is None else float(ridge)


def _score(state: FederatedLightFR, blocks: Any, tie_mode: TieMode) -> EvalResult:
    return evaluate_candidates(state.scores(blocks.users, blocks.items), 10, tie_mode)


def _table(rows: list[list[str]], out: TextIO) -> None:
    table(rows[0], rows[1:], out)


def _train(args: argparse.Namespace, exp: Experiment, out: TextIO, show_progress: bool) -> FederatedLightFR:
    cfg, fed = _model_config(args, exp), _fed_config(args)
    if fed.query_planes and getattr(args, "save", None) is not None:
        raise ValueError("--save stores ±1 user codes; a run with --query-planes keeps bit-plane user vectors")
    data = user_data(exp.train, cfg)
    bar: Any = None
    if show_progress and fed.rounds:
        bar = progress(fed.rounds, "training", "rounds")
    rows = [["round", "cohort", "user flips", "item flips", "seconds", "val HR@10", "val NDCG@10"]]

    def on_round(r: RoundReport) -> None:
        if bar is not None:
            bar.update(1)
            if r.metric is not None:
                bar.set_postfix(hr=f"{r.metric.hr:.3f}")
        if r.metric is not None:
            rows.append(
                [
                    str(r.round),
                    str(r.cohort),
                    str(r.user_flips),
                    str(r.item_flips),
                    f"{r.seconds:.2f}",
                    f"{r.metric.hr:.4f}",
                    f"{r.metric.ndcg:.4f}",
                ]
            )

    state = run_lightfr(
        data,
        cfg,
        fed,
        evaluate=lambda s: _score(s, exp.val, TieMode.RANDOM),
        eval_every=args.eval_every,
        on_round=on_round,
    )
    if bar is not None:
        bar.close()
    if len(rows) > 1:
        out.write("\nPer-round progress (validation blocks, random ties):\n")
        _table(rows, out)
    return state


def _report(exp: Experiment, results: dict[str, dict[TieMode, EvalResult]], out: TextIO) -> None:
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
    _table(rows, out)
    out.write(
        "Random ties: a positive tied with negatives lands at a uniformly random place among them (exact\n"
        "expectation). Optimistic: ties favour the positive, as the LightFR paper's evaluation does.\n"
    )


def _all_results(
    exp: Experiment, state: FederatedLightFR | None, label: str, eval_seed: int = 0
) -> dict[str, dict[TieMode, EvalResult]]:
    results: dict[str, dict[TieMode, EvalResult]] = {}
    if state is not None:
        results[label] = {t: _score(state, exp.test, t) for t in TieMode}
    base = {t: baselines(exp, t, seed=eval_seed) for t in TieMode}
    for name in ("popularity", "random"):
        results[name] = {t: base[t][name] for t in TieMode}
    return results


def _full_results(
    exp: Experiment, state: FederatedLightFR | None, eval_seed: int, only: str | None = None
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


def _evaluate_and_report(
    exp: Experiment,
    state: FederatedLightFR | None,
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
        _table([["model", "Recall@20", "NDCG@20"], *rows], out)
        return {name: r.metrics() for name, r in full.items()}
    results = _all_results(exp, state, label, eval_seed)
    names = {label: "model", "popularity": "popularity", "random": "random"}
    shown = {k: v for k, v in results.items() if only is None or names[k] == only}
    _report(exp, shown, out)
    return {names[k]: v[TieMode.RANDOM].metrics() for k, v in shown.items()}


def _resolve_dataset(args: argparse.Namespace, out: TextIO) -> tuple[Experiment, Path | None]:
    data_dir = _data_dir(args.data_dir)
    name = args.dataset
    if name == "auto":
        name = "ml-100k" if data_dir is not None and (data_dir / "ml-100k" / "u.data").is_file() else "synthetic"
        if name != "synthetic":
            out.write(f"dataset: ml-100k (from {data_dir})\n")
        else:
            out.write(f"dataset: synthetic (built-in generator): {_where_looked(args.data_dir, data_dir)}\n")
    protocol = Protocol(args.protocol) if getattr(args, "protocol", None) else None
    n_neg = getattr(args, "eval_negatives", 99)
    exp = prepare(name, protocol, n_negatives=n_neg, seed=getattr(args, "eval_seed", 0), data_dir=data_dir)
    return exp, data_dir


#: The --model values each model-specific `simulate` option applies to.  An option given (set to
#: anything but its default) for another model is an error naming the option and the model: a flag
#: that silently does nothing is worst when it is a privacy flag.
_APPLIES_TO: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        (
            "bits",
            "lam",
            "negatives",
            "unobserved_weight",
            "confidence",
            "targets",
            "epochs",
            "sweeps",
            "aggregation",
            "flip_fraction",
            "protocol",
            "query_planes",
            "user_reg",
            "rank_planes",
            "rank_ridge",
            "mean_field",
        ),
        ("lightfr",),
    ),
    "eval_every": ("lightfr",),
    "json": ("lightfr", "mf"),
    "eval_seed": ("lightfr", "mf"),
    "fraction": ("lightfr", "mf"),
    "eval_negatives": ("lightfr", "mf"),
    "rank": ("mf", "felb", "fnmf"),
    "clients": ("felb", "fnmf"),
    "local_steps": ("felb", "fnmf"),
    **dict.fromkeys(("secure", "clip_norm", "example_cap", "silos", "server_lr", "lr", "max_norm2"), ("mf",)),
    "epsilon": ("lightfr", "mf"),
    **dict.fromkeys(("pop_share", "threshold"), ("lightfr",)),
    **dict.fromkeys(("step_rule", "xor_noise", "noise_sigma", "binarize_at", "server_scale"), ("felb",)),
    **dict.fromkeys(("alignment", "aggregator"), ("fnmf",)),
}


# In-process LightFR options that the private-round simulator (`fedsim.private_scale.ScaledSettings`) does not take.
_NOT_PRIVATE_LIGHTFR = (
    "lam",
    "sweeps",
    "epochs",
    "confidence",
    "targets",
    "aggregation",
    "fraction",
    "eval_every",
)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_applicable(args: argparse.Namespace) -> None:
    """Refuse options that the chosen model would ignore (see `_APPLIES_TO`)."""
    defaults = build_parser().parse_args(["simulate"])
    model = args.model
    for dest, models in _APPLIES_TO.items():
        if model in models or getattr(args, dest) == getattr(defaults, dest):
            continue
        if dest in ("epsilon", "secure"):
            where = " or ".join(f"--model {m}" for m in models)
            raise ConfigError(
                f"{_flag(dest)} is not implemented for --model {model}: 'fedrec simulate' trains {model} "
                f"in-process with plain sums, without secure aggregation or DP noise ({_flag(dest)} works with "
                f"{where}; 'fedrec demo --epsilon E' runs LightFR through the real server with SecAgg+ and DP)"
            )
        only = " or ".join(f"--model {m}" for m in models)
        raise ConfigError(f"{_flag(dest)} applies to {only} only; --model {model} does not use it")
    if model == "mf" and not (args.epsilon > 0 or args.secure) and args.clip_norm != defaults.clip_norm:
        raise ConfigError("--clip-norm applies to private MF only (with --epsilon or --secure)")
    if model == "lightfr":
        _check_lightfr_objective(args, defaults)


def _check_lightfr_objective(args: argparse.Namespace, defaults: argparse.Namespace) -> None:
    """Refuse LightFR options that the chosen objective would ignore: sampled negatives belong to the
    paper's objective (w0 = 0), α and asymmetric scoring to the all-items one (w0 > 0)."""
    full = _unobserved_weight(args) != 0
    if full:
        objective = "the all-items objective (the default with --aggregation grad) fits every unobserved item"
    else:
        why = "--aggregation para" if args.unobserved_weight is None else "--unobserved-weight 0"
        objective = f"the sampled-negatives objective ({why}) is in use"
    if full and args.negatives != defaults.negatives:
        raise ConfigError(f"--negatives applies with --unobserved-weight 0 only; {objective}")
    if not full and args.confidence != defaults.confidence:
        raise ConfigError(
            f"--confidence applies to the all-items objective (--unobserved-weight > 0) only; {objective}"
        )
    if not full and args.query_planes:
        raise ConfigError(f"--query-planes needs the all-items objective (--unobserved-weight > 0); {objective}")
    if not args.query_planes and args.user_reg != defaults.user_reg:
        raise ConfigError("--user-reg applies with --query-planes P >= 1 only (the ridge weight of the user solve)")
    asked = [_flag(d) for d in ("rank_planes", "rank_ridge") if getattr(args, d, None) is not None]
    if asked and (not full or args.query_planes):
        why = "--query-planes ranks with the plan's vector" if full else objective
        verb = "apply" if len(asked) > 1 else "applies"
        raise ConfigError(f"{' and '.join(asked)} {verb} to symmetric training under the all-items objective; {why}")
    if args.rank_planes is not None and args.rank_planes > 8:
        raise ConfigError(f"--rank-planes must be in [0, 8], got {args.rank_planes}")
    if args.rank_ridge is not None and not (math.isfinite(args.rank_ridge) and args.rank_ridge <= 1e6):
        raise ConfigError(f"--rank-ridge must be a finite number in (0, 1e6], got {args.rank_ridge}")
    try:  # the plan's own bounds (protocol.plan.LightFRParams), as the server and the device SDK check them
        LightFRParams(query_planes=args.query_planes, user_reg=args.user_reg)
    except ValueError as exc:
        raise ConfigError(f"--{str(exc).replace('_', '-', 1)}") from None


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


def _check_output_file(flag: str, path: Path) -> None:
    """Refuse, before any work, an output file that cannot be written: a missing folder or a folder
    in its place."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a folder; name a file")
    if not path.parent.is_dir():
        raise ConfigError(f"{flag} {path}: folder {path.parent} does not exist")


# -- commands --------------------------------------------------------------------------------------


def _cmd_simulate(args: argparse.Namespace, out: TextIO) -> int:
    _check_applicable(args)
    if args.plot is not None:
        from fedsim.plots import check_plot_target

        if args.model != "lightfr" or args.epsilon > 0:
            raise ConfigError("--plot draws in-process LightFR runs only (not --model mf|felb|fnmf or --epsilon) yet")
        check_plot_target(args.plot)
    if args.save is not None:
        _check_output_file("--save", args.save)
    if args.model == "lightfr" and args.epsilon > 0:
        if args.save is not None:
            raise ConfigError("--save is not available for private LightFR runs (--epsilon) yet; drop --save")
        return _simulate_private_lightfr(args, out)
    if args.model == "mf" and args.dataset not in (None, "planted", "synthetic"):
        published = load_dataset(args.dataset, _data_dir(args.data_dir))
        if isinstance(published, TrainTestSplit):
            return _simulate_mf_published(args, published, out)
    if args.rounds is None:
        args.rounds = FAMILY_DEFAULT_ROUNDS[args.model]
    if args.model != "lightfr":
        return simulate_family(args, _data_dir(args.data_dir), out)
    if args.dataset is None:
        raise ValueError("--dataset is required (a dataset name, a ratings file, or synthetic)")
    t0 = time.perf_counter()
    exp, data_dir = _resolve_dataset(args, out)
    out.write(exp.describe() + "\n")
    out.write(
        f"LightFR f={args.bits}, λ={args.lam}, "
        + (
            f"all items (w0={_unobserved_weight(args)}, α={args.confidence}, item levels)"
            if _unobserved_weight(args) != 0
            else f"{args.negatives} negatives per rating"
        )
        + f", E={args.epochs}; "
        f"T={args.rounds} rounds, p={args.fraction}, Agg_{args.aggregation} "
        f"(flip fraction {_flip_fraction(args):g}{', mean field' if _mean_field(args) else ''}), "
        f"seed {args.seed}\n"
    )
    state = _train(args, exp, out, show_progress=not getattr(args, "quiet", False))
    if args.plot is not None:
        from fedsim.plots import plot_training

        evaluated = [r for r in state.history if r.metric is not None]
        plot_training(
            args.plot,
            f"LightFR f={args.bits} on {exp.name}, Agg_{args.aggregation} ρ={_flip_fraction(args):g}",
            [r.round for r in evaluated],
            {
                "HR@10": [r.metric.hr for r in evaluated if r.metric],
                "NDCG@10": [r.metric.ndcg for r in evaluated if r.metric],
            },
            None,
        )
        out.write(f"plot: {args.plot}\n")
    label = f"LightFR (Agg_{args.aggregation})"
    metrics = _evaluate_and_report(exp, state, label, args.eval_seed, out)
    if getattr(args, "save", None) is not None:
        from fedsim.runs import LIGHTFR_RUN, TrainItems, lightfr_run_fields

        train = exp.train
        save_store(
            args.save,
            LIGHTFR_RUN,
            {
                "dataset": str(args.dataset),
                "protocol": exp.protocol.value,
                "eval_negatives": exp.n_negatives,
                "seed": args.seed,
                "eval_seed": args.eval_seed,
                "rounds": args.rounds,
                **lightfr_run_fields(
                    state.user_codes,
                    state.item_codes,
                    TrainItems.from_pairs(train.users, train.items, train.n_users),
                    item_levels=state.item_levels,
                    hamming_weight=state.hamming_weight,
                    user_ids=train.user_ids,
                    item_ids=train.item_ids,
                    user_q=state.user_q,
                    user_weight=state.user_weight,
                ),
            },
        )
        out.write(f"saved the run to {args.save}\n")
    seconds = time.perf_counter() - t0
    out.write(f"done in {seconds:.1f} s\n")
    if args.json:
        record = result_record(
            dataset=exp.name, protocol=exp.protocol.value, rounds=args.rounds, seconds=seconds, metrics=metrics
        )
        write_json(record, sys.stdout)
    return 0


def _simulate_private_lightfr(args: argparse.Namespace, out: TextIO) -> int:
    """``simulate --epsilon E`` for LightFR: the popularity release and private rounds of every device
    through the private-round simulator (`fedsim.private_scale`), evaluated beside the baselines."""
    from fedsim.private_scale import ScaledSettings, evaluate_private

    if args.dataset is None:
        raise ValueError("--dataset is required (a dataset name, a ratings file, or synthetic)")
    t0 = time.perf_counter()
    data_dir = _data_dir(args.data_dir)
    data: Any = load_dataset(args.dataset, data_dir)
    if not isinstance(data, TrainTestSplit):
        data = prepare(
            data,
            Protocol(args.protocol) if args.protocol else None,
            n_negatives=args.eval_negatives,
            seed=args.eval_seed,
        )
    rounds = args.rounds if args.rounds is not None else 3
    defaults = build_parser().parse_args(["simulate"])
    for dest in _NOT_PRIVATE_LIGHTFR:
        if getattr(args, dest) != getattr(defaults, dest):
            raise ConfigError(
                f"{_flag(dest)} does not apply to private LightFR runs (--epsilon): the private-round simulator "
                "trains every device in every round with its own fixed DCD settings; drop the flag"
            )
    settings = ScaledSettings(
        epsilon=args.epsilon,
        rounds=rounds,
        bits=args.bits,
        # No sampled negatives unless asked: they multiply a device's coordinates (and its clipped share of
        # the signal) by 1 + negatives, and cost validation HR@10 on ML-100K (0.116 vs 0.445, codes only).
        negatives=args.negatives if args.negatives != defaults.negatives else 0,
        # Every device is in every round, and few rounds: the paper's full Agg_grad step unless asked.
        flip_fraction=args.flip_fraction if args.flip_fraction != defaults.flip_fraction else 1.0,
        threshold=args.threshold,
        pop_share=args.pop_share,
        seed=args.seed,
        # The server's objective unless asked: all items (w0 > 0, learned item levels), or sampled negatives.
        unobserved_weight=_unobserved_weight(args),
        # Asymmetric scoring in the round plan (protocol 1.6) when asked; not the default under DP (validation,
        # docs/dp-accounting.md §8: the vector's u uᵀ/f part takes most of the clip norm).
        query_planes=args.query_planes,
        user_reg=args.user_reg,
        # The mean-field code step unless --no-mean-field (chosen on validation under DP as well).
        mean_field=_mean_field(args),
        # Devices rank with their ±1 codes under DP unless --rank-planes P (the SDK's default, 3 planes of the
        # ridge vector, was chosen without DP; under DP it ties here and loses on the real server's devices:
        # docs/dp-accounting.md §8; real devices learn it from the model download, ModelPayload.dp_trained).
        rank_planes=(args.rank_planes or 0) if _unobserved_weight(args) != 0 and not args.query_planes else 0,
        rank_ridge=_rank_ridge(args),
    )
    if settings.query_planes and settings.unobserved_weight == 0:
        raise ConfigError("--query-planes needs the all-items objective (drop --unobserved-weight 0)")
    n_users = data.train.n_users
    out.write(
        f"private LightFR on {args.dataset}: {n_users} devices, every one in every round; ε={args.epsilon:g} at "
        f"δ=1e-5 over a private popularity release ({args.pop_share:g} of ε) and T={rounds} rounds, θ="
        f"{settings.example_cap} items per device, C={settings.clip_norm:g}, "
        + (
            f"all-items objective (w0={settings.unobserved_weight}, learned item levels), "
            if settings.unobserved_weight != 0
            else f"{settings.negatives} negatives per item, "
        )
        + (
            f"asymmetric scoring ({settings.query_planes} bit-planes, ridge {settings.user_reg:g}), "
            if settings.query_planes
            else (
                f"ranking with the ridge vector ({settings.rank_planes} planes, ridge {settings.rank_ridge:g}·w0·m), "
                if settings.rank_planes
                else "ranking with ±1 codes, "
            )
        )
        + f"flip fraction {settings.flip_fraction:g}{', mean field' if settings.mean_field else ' (Jacobi step)'}, "
        f"noise-aware threshold {args.threshold:g}σ; rounds through the private-round simulator (fedsim.privsim)\n"
    )

    def on_round(r: int, seconds: float) -> None:
        if not getattr(args, "quiet", False):
            out.write(f"  round {r}/{rounds}: {seconds:.1f} s\n")
            out.flush()

    def log(text: str) -> None:
        out.write(text + "\n")

    metrics, extra = evaluate_private(data, settings, eval_seed=args.eval_seed, on_round=on_round, log=log)
    note = f"item level α={extra['alpha']} chosen on validation; random ties"
    return _report_private(args, out, t0, metrics, extra, rounds, note, private=True)


def _simulate_mf_published(args: argparse.Namespace, data: TrainTestSplit, out: TextIO) -> int:
    """``simulate --model mf`` on a published split (amazon-book): every user a device in every round through
    the simulator's sparse MF cohort (`fedsim.private_mf.evaluate_private_mf_scaled`), private with
    ``--epsilon`` (the private popularity channel taking half of it), full ranking beside the baselines.
    Options left at their defaults take `fedsim.private_mf.IMPLICIT_MF`'s (chosen on validation)."""
    from fedsim.private_mf import IMPLICIT_MF, evaluate_private_mf_scaled

    t0 = time.perf_counter()
    defaults = build_parser().parse_args(["simulate"])
    if args.silos:
        raise ConfigError("--silos runs MF on rating logs only; a published split has one device per user")
    if args.save is not None:
        raise ConfigError("--save is not available for MF on a published split yet; drop --save")

    def given(dest: str, fallback: Any) -> Any:
        value = getattr(args, dest)
        return fallback if value == getattr(defaults, dest) else value

    settings = dataclasses.replace(
        IMPLICIT_MF,
        epsilon=args.epsilon,
        rounds=args.rounds if args.rounds is not None else IMPLICIT_MF.rounds,
        factors=args.rank or IMPLICIT_MF.factors,
        clip_norm=given("clip_norm", IMPLICIT_MF.clip_norm),
        example_cap=given("example_cap", IMPLICIT_MF.example_cap),
        server_lr=given("server_lr", IMPLICIT_MF.server_lr),
        learning_rate=args.lr,
        max_norm2=args.max_norm2 if args.max_norm2 is not None else IMPLICIT_MF.max_norm2,
        seed=args.seed,
    )
    s = settings
    out.write(
        f"private MF on {args.dataset}: {data.train.n_users} devices, every one in every round; "
        + (f"ε={s.epsilon:g} at δ=1e-5 " if s.epsilon > 0 else "no DP noise, ")
        + f"over a private popularity release ({s.pop_share:g} of ε, θ={s.pop_theta}) and T={s.rounds} rounds, "
        f"f={s.factors}, R={s.max_norm2:g}, θ={s.example_cap} with {s.negatives} negative each, C={s.clip_norm:g}, "
        f"server step {s.server_lr:g}; rounds through the private-round simulator (fedsim.privsim.MFCohort)\n"
    )

    def on_round(r: int, seconds: float) -> None:
        if not getattr(args, "quiet", False):
            out.write(f"  round {r}/{s.rounds}: {seconds:.1f} s\n")
            out.flush()

    metrics, extra = evaluate_private_mf_scaled(data, settings, eval_seed=args.eval_seed, on_round=on_round)
    note = f"u·v + α·level with α={extra['alpha']} chosen on validation; full ranking, random ties"
    return _report_private(args, out, t0, metrics, extra, s.rounds, note, private=s.epsilon > 0)


def _report_private(
    args: argparse.Namespace,
    out: TextIO,
    t0: float,
    metrics: dict[str, dict[str, float]],
    extra: dict[str, Any],
    rounds: int,
    note: str,
    *,
    private: bool,
) -> int:
    """The end of a private-simulator run (LightFR or MF): the metrics table, the ε spent (or "no DP
    noise") with ``note``, the wall time, and with ``--json`` the result record (ε and δ when private)."""
    keys = sorted({k for m in metrics.values() for k in m})
    rows = [["model", *keys]]
    for name, values in metrics.items():
        rows.append([name, *(f"{values[k]:.4f}" for k in keys)])
    _table(rows, out)
    spent = f"ε spent {extra['epsilon']:.3f} at δ={extra['delta']:g} (the ledger's RDP composition of every release)"
    out.write((spent if private else "no DP noise") + f"; {note}\n")
    seconds = time.perf_counter() - t0
    out.write(f"done in {seconds:.1f} s\n")
    if args.json:
        record = result_record(
            dataset=str(args.dataset),
            protocol=str(extra["protocol"]),
            rounds=rounds,
            seconds=seconds,
            metrics=metrics,
            **({"epsilon": extra["epsilon"], "delta": extra["delta"]} if private else {}),
        )
        write_json(record, sys.stdout)
    return 0


def _cmd_eval(args: argparse.Namespace, out: TextIO) -> int:
    if (args.run is None) == (args.baseline is None):
        raise ValueError("give either a run file or --baseline")
    t0 = time.perf_counter()
    if args.baseline is not None:
        if args.dataset is None:
            raise ValueError("--baseline needs --dataset")
        eval_seed = 0 if args.eval_seed is None else args.eval_seed
        exp = prepare(
            args.dataset,
            Protocol(args.protocol) if args.protocol else None,
            n_negatives=99 if args.eval_negatives is None else args.eval_negatives,
            seed=eval_seed,
            data_dir=_data_dir(args.data_dir),
        )
        out.write(exp.describe() + "\n")
        metrics = _evaluate_and_report(exp, None, "", eval_seed, out, only=args.baseline)
        rounds: int | None = 0
    else:
        exp, state, eval_seed, rounds = _load_run(args)
        out.write(exp.describe() + "\n")
        metrics = _evaluate_and_report(exp, state, "LightFR (saved run)", eval_seed, out)
    if args.json:
        seconds = time.perf_counter() - t0
        record = result_record(
            dataset=exp.name, protocol=exp.protocol.value, rounds=rounds, seconds=seconds, metrics=metrics
        )
        write_json(record, sys.stdout)
    return 0


def _load_run(args: argparse.Namespace) -> tuple[Experiment, FederatedLightFR, int, int | None]:
    """A saved LightFR run and the experiment it was trained on (same split, same evaluation seed)."""
    from fedsim.runs import load_run

    run = load_run(args.run)
    if run.family != "lightfr":
        raise ConfigError(
            f"{args.run} is a {run.family} run: 'fedrec eval' re-scores LightFR runs ('fedrec simulate' printed "
            f"the {run.family} figures); 'fedrec recommend {args.run} --user ID' uses it"
        )
    model = run.device_model(None)[0]
    state_dict = run.state
    try:
        n_users, n_items = run.n_users, run.n_items
        state = FederatedLightFR(
            user_codes=model.user_codes.copy(),
            item_codes=model.item_codes.copy(),
            item_levels=model.item_levels,
            hamming_weight=model.hamming_weight,
        )
        if np.all(model.user_weight > 0):  # the run saved the vectors its users rank with
            state.user_vectors = plane_vectors(model.user_q, model.user_weight, model.hamming_weight)
        dataset, protocol = str(state_dict["dataset"]), Protocol(state_dict["protocol"])
        n_neg = int(state_dict["eval_negatives"])
        # runs saved before --eval-seed existed drew their split and candidates from --seed
        run_eval_seed = int(state_dict.get("eval_seed", state_dict["seed"]))
        rounds = int(state_dict["rounds"]) if "rounds" in state_dict else None
    except (KeyError, TypeError, ValueError) as exc:
        raise FedRecError(f"{args.run}: not a valid run file ({exc})") from exc
    if args.eval_seed is not None and args.eval_seed != run_eval_seed:
        raise ConfigError(
            f"{args.run} was trained on the split of evaluation seed {run_eval_seed}; --eval-seed {args.eval_seed} "
            "would draw another split, whose test ratings the model may have trained on"
        )
    data_dir = _data_dir(args.data_dir)
    if dataset == "auto":
        dataset = "ml-100k" if data_dir is not None and (data_dir / "ml-100k").is_dir() else "synthetic"
    # A run is evaluated as it was trained: another dataset, protocol or candidate count would be ignored.
    for flag, asked, own in (
        ("--dataset", args.dataset, dataset),
        ("--protocol", args.protocol, protocol.value),
        ("--eval-negatives", args.eval_negatives, n_neg),
    ):
        if asked is not None and asked != own:
            raise ConfigError(
                f"{flag} {asked}: {args.run} is evaluated on the split and candidates it was trained with "
                f"({flag} {own}); leave {flag} out, or evaluate a baseline with --baseline"
            )
    exp = prepare(dataset, protocol, n_negatives=n_neg, seed=run_eval_seed, data_dir=data_dir)
    if (exp.train.n_users, exp.train.n_items) != (n_users, n_items):
        raise FedRecError(
            f"{args.run} was trained on {n_users}×{n_items}, the dataset is {exp.train.n_users}×{exp.train.n_items}"
        )
    return exp, state, run_eval_seed, rounds


def _cmd_data(args: argparse.Namespace, out: TextIO) -> int:
    base = _data_dir(args.data_dir)
    out.write(f"data folder: {base if base is not None else 'not found (set FEDREC_DATA or --data-dir)'}\n")
    names = [n for n in DATASET_NAMES if n != "synthetic"] if base is not None else []
    for name in ["synthetic", *names]:
        try:
            data = load_dataset(name, base)
        except FedRecError as exc:
            out.write(f"  {name:<18} unavailable: {exc}\n")
            continue
        if isinstance(data, TrainTestSplit):
            out.write(
                f"  {name:<18} {data.train.n_users:>6} users {data.train.n_items:>6} items "
                f"{len(data.train):>8} train + {len(data.test)} test pairs (implicit, its own split)\n"
            )
            continue
        train = data.train if isinstance(data, LightFRSplit) else data
        out.write(f"  {name:<18} {train.n_users:>6} users {train.n_items:>6} items {len(train):>8} ratings\n")
    return 0


def _cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    from fedsim.demo import run_demo_fleet, simulated_beside, verdict

    if not 0 <= args.dropout < 1:
        raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.devices is not None and args.devices < MIN_COHORT:
        raise ConfigError(f"--devices {args.devices}: a secure-aggregation round needs at least {MIN_COHORT} devices")
    if args.cohort is not None and args.cohort < MIN_COHORT:
        raise ConfigError(f"--cohort {args.cohort}: a secure-aggregation round needs at least {MIN_COHORT} devices")
    if not args.query_planes and args.user_reg != build_parser().parse_args(["demo"]).user_reg:
        raise ConfigError("--user-reg applies with --query-planes P >= 1 only (the ridge weight of the user solve)")
    try:  # the plan's own bounds (protocol.plan.LightFRParams), before a server is started
        LightFRParams(query_planes=args.query_planes, user_reg=args.user_reg)
    except ValueError as exc:
        raise ConfigError(f"--{str(exc).replace('_', '-', 1)}") from None
    if args.workdir is not None and args.workdir.exists() and not args.workdir.is_dir():
        raise ConfigError(f"--workdir {args.workdir}: is not a folder")
    exp, data_dir = _resolve_dataset(args, out)
    if exp.train.n_users < MIN_COHORT:
        raise ConfigError(
            f"--dataset {args.dataset}: {exp.train.n_users} user(s) with training ratings; a secure-aggregation "
            f"round needs at least {MIN_COHORT} devices"
        )
    n_devices = exp.train.n_users
    if args.devices is not None and args.devices < exp.train.n_users:
        exp = _first_users(exp, args.devices)  # keeps the id space: train.n_users stays the dataset's
        n_devices = args.devices
    if args.cohort is None:
        args.cohort = n_devices
    head = exp.describe()
    if n_devices < exp.train.n_users:  # the id space stays the dataset's; say who takes part
        head = head.replace(f"{exp.train.n_users} users,", f"the first {n_devices} of {exp.train.n_users} users,", 1)
    out.write(head + "\n")
    eps = args.epsilon or None
    out.write(
        f"LightFR f={args.bits}; {args.rounds} rounds of up to {min(args.cohort, n_devices)} devices; "
        f"SecAgg+ (ω=0.33); "
        + (f"distributed DP ε={eps:g} at δ=1e-5 over the run, devices rank with their ±1 codes; " if eps else "no DP; ")
        + f"dropout {args.dropout:.0%} per device and round"
        + (
            f"; asymmetric scoring in the round plan: {args.query_planes} bit-planes, ridge {args.user_reg:g}\n"
            if args.query_planes
            else "\n"
        )
    )
    res = run_demo_fleet(
        exp,
        rounds=args.rounds,
        cohort=args.cohort,
        bits=args.bits,
        dropout=args.dropout,
        privacy_epsilon=eps,
        flip_fraction=args.flip_fraction,
        seed=args.seed,
        out=out,
        query_planes=args.query_planes,
        user_reg=args.user_reg,
        workdir=args.workdir,
        show_progress=False if args.quiet else None,
        insecure_seed_noise=args.insecure_seed_dp_noise,
    )
    results = {"LightFR over the server": res["results"]}
    for name in ("popularity", "random"):
        results[name] = {t: res["baselines"][t][name] for t in TieMode}
    _report(exp, results, out)
    privacy = res["status"].get("privacy")
    ours, pop = res["results"][TieMode.RANDOM], res["baselines"][TieMode.RANDOM]["popularity"]
    spent = privacy["epsilon_spent"] if privacy else None
    out.write(verdict("private model over the real server" if privacy else "model", ours.hr, pop.hr, spent) + "\n")
    if privacy and args.insecure_seed_dp_noise:
        out.write("ε is NOT a privacy guarantee here: --insecure-seed-dp-noise derived the DP noise from the seed\n")
    if privacy and ours.hr < pop.hr:
        out.write(
            "The real server's LightFR model did not beat popularity here: with user-level DP over "
            f"{n_devices} devices\n"
            "the noise each code coordinate needs is larger than the per-item signal the sum carries, and its item\n"
            "levels (the private counts of the uploads) did not make up for it. The private-round simulator on the\n"
            "same data and ε, every device in every round, a separate private popularity release feeding the\n"
            "item level (fedsim.private_scale):\n"
        )
        metrics, extra = simulated_beside(exp, float(args.epsilon), args.seed)
        sim_hr = metrics["model"]["hr@10"]
        out.write(
            verdict("simulated private model", sim_hr, pop.hr, float(extra["epsilon"]))
            + f" (private popularity alone {metrics['private_popularity']['hr@10']:.3f})\n"
        )
    client = res["clients"][int(exp.test.users[0])]
    _show_device(exp, client.model, data_dir, out)
    print(f"done in {res['seconds']:.1f} s", file=sys.stderr)
    if args.json:
        base = res["baselines"][TieMode.RANDOM]
        figures = {"model": ours, "popularity": base["popularity"], "random": base["random"]}
        rounds_run = res["report"].server_rounds
        record = result_record(
            dataset=exp.name,
            protocol=exp.protocol.value,
            rounds=sum(1 for r in rounds_run if r.get("status") == "committed"),
            seconds=res["seconds"],
            metrics={k: {"hr@10": v.hr, "ndcg@10": v.ndcg} for k, v in figures.items()},
            epsilon=None if not privacy else float(privacy["epsilon_spent"]),
            delta=None if not privacy else float(privacy["delta"]),
            seed=args.seed,
            epsilon_is_guarantee=bool(privacy) and not args.insecure_seed_dp_noise,
            server_rounds=[
                {k: r.get(k) for k in ("round_id", "status", "cohort_size", "survivors")} for r in rounds_run
            ],
        )
        write_json(record, sys.stdout)
    return 0


def _first_users(exp: Experiment, n: int) -> Experiment:
    from dataclasses import replace

    from fedsim.experiment import Candidates

    keep = np.asarray(exp.train.users) < n
    train = exp.train.subset(keep)

    def cut(c: Candidates) -> Candidates:
        sel = c.users < n
        return Candidates(c.users[sel], c.items[sel])

    return replace(exp, train=train, val=cut(exp.val), test=cut(exp.test))


def _show_device(exp: Experiment, model: LightFRModel, data_dir: Path | None, out: TextIO) -> None:
    titles = item_titles(exp, data_dir)
    user = int(exp.test.users[0])
    train = exp.train
    liked = np.asarray(train.items[train.users == user], dtype=np.int64)
    ids, scores = model.recommend(liked, N=5)

    def name(i: int) -> str:
        return titles[i] if titles else f"item {train.item_ids[i]}"

    held = int(exp.test.items[0, 0])
    out.write(
        f"\nTop-5 computed on device {user} (offline, XOR + popcount; {liked.size} rated items, "
        f"e.g. {', '.join(name(int(i)) for i in liked[:3])}):\n"
    )
    for rank, (i, s) in enumerate(zip(ids, scores, strict=True), start=1):
        mark = "   <- its held-out test item" if int(i) == held else ""
        out.write(f"  {rank}. {name(int(i))}  (score {s:.3f}){mark}\n")


def _cmd_loadtest(args: argparse.Namespace, out: TextIO) -> int:
    import tempfile

    from fedsim.datasets import synthetic
    from fedsim.demo import RoundProgress, format_loadtest, loadtest_record, run_loadtest
    from fedsim.fleet import FleetConfig, get_status

    if not 0 <= args.dropout < 1:
        raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.plot is not None:
        from fedsim.plots import check_plot_target

        check_plot_target(args.plot)
    # The operator's own files first: a missing or malformed one is named before the server is contacted.
    admin_token = _read_secret(args.admin_token_file) if args.admin_token_file else None
    if args.authority_key is not None:
        from protocol.enrollment import EnrollmentAuthority

        EnrollmentAuthority.load(args.authority_key)
    url = args.url.rstrip("/")
    model = get_status(url, args.ca_file).get("model") or {}
    if model.get("kind", "lightfr") != "lightfr":
        raise ConfigError(f"the server at {url} trains model.kind={model.get('kind')!r}; the load test drives LightFR")
    for flag, key in (("n_items", "n_items"), ("bits", "bits")):
        served = model.get(key)
        given = getattr(args, flag)
        if given is None:
            if served is None:
                raise ConfigError(f"the server at {url} does not report model.{key}; pass {_flag(flag)}")
            setattr(args, flag, int(served))
        elif served is not None and int(served) != given:
            raise ConfigError(
                f"{_flag(flag)} {given} but the server at {url} trains model.{key}={served}; drop {_flag(flag)} "
                "to use the server's"
            )
    data = synthetic(n_users=args.devices, n_items=args.n_items, ratings_per_user=args.ratings_per_user, seed=args.seed)
    idx = data.by_user()
    users = [
        (
            np.asarray(idx.items[idx.indptr[u] : idx.indptr[u + 1]]),
            np.asarray(idx.ratings[idx.indptr[u] : idx.indptr[u + 1]]),
        )
        for u in range(data.n_users)
    ]
    shard = "Ray actor" if args.backend == "ray" else "worker process"
    out.write(
        f"load test: {args.devices} devices ({args.workers} {shard}(s)) against {url}; "
        f"m={args.n_items}, f={args.bits} (as the server trains), ~{args.ratings_per_user} ratings each; "
        f"dropout {args.dropout:.0%} ({'announced' if args.announce_drops else 'silent'}); {args.rounds} rounds\n"
    )
    out.flush()
    bar = RoundProgress(args.rounds, "load test", enabled=False if args.quiet else None)
    try:
        with tempfile.TemporaryDirectory(prefix="fedrec-loadtest-") as tmp:
            cfg = FleetConfig(
                url=url,
                store_root=args.store or Path(tmp),
                n_items=args.n_items,
                bits=args.bits,
                rounds=args.rounds,
                dropout=args.dropout,
                seed=args.seed,
                time_limit=args.time_limit,
                ca_file=args.ca_file,
                announce_drops=args.announce_drops,
                authority_key_file=args.authority_key,
                admin_token=admin_token,
                credential_sources=args.credential_sources,
                cohort=args.cohort,
                seed_training=args.cohort is not None,
                insecure_reproducible=args.insecure_seed_noise,
            )
            report = run_loadtest(
                cfg,
                users,
                args.workers,
                progress=bar,
                backend=args.backend,
                keep_store=args.store is not None,
                probe_health=True,
                worker_nice=args.nice,
            )
    finally:
        bar.close()
    format_loadtest(report, out)
    if args.plot is not None:
        from fedsim.fleet import PHASE_STEPS
        from fedsim.plots import plot_loadtest

        title = f"{args.devices} devices, dropout {args.dropout:.0%}, {report.rounds_finished} rounds ({url})"
        plot_loadtest(args.plot, report.latency_series, PHASE_STEPS, title)
        out.write(f"plot: {args.plot}\n")
    failure = report.failure(args.rounds)
    if args.json:
        write_json(
            loadtest_record(report, args.rounds, failure, url=url, backend=args.backend, workers=args.workers),
            sys.stdout,
        )
    if failure is not None:
        out.flush()
        print(f"fedrec loadtest: error: {failure}", file=sys.stderr)
        return 1
    return 0


def _cmd_recommend(args: argparse.Namespace, out: TextIO) -> int:
    from fedsim.runs import load_run

    run = load_run(args.run)
    user = run.user_index(str(args.user))
    ids, scores = run.recommend(user, args.n, seed=args.seed)
    rows = [(run.item_label(int(i)), int(i), float(sc)) for i, sc in zip(ids, scores, strict=True)]
    if args.json:
        record = {
            "run": str(args.run),
            "family": run.family,
            "user": run.user_label(user),
            "items": [{"item": label, "index": index, "score": score} for label, index, score in rows],
        }
        write_json(record, sys.stdout)
        return 0
    out.write(
        f"{run.family} run {args.run}: top {len(rows)} for user {run.user_label(user)} "
        f"({run.train.of(user).size} items rated in training, not recommended again)\n"
    )
    table(["rank", "item", "score"], [[str(k), str(r[0]), f"{r[2]:.4f}"] for k, r in enumerate(rows, 1)], out)
    return 0


def _cmd_export(args: argparse.Namespace, out: TextIO) -> int:
    from fedsim.runs import load_run

    _check_output_file("-o", args.output)
    run = load_run(args.run)
    user = None if args.user is None else run.user_index(str(args.user))
    model, row = run.device_model(user)
    model.save(args.output)
    cls = type(model).__name__
    who = "every user of the run" if user is None else f"user {run.user_label(user)} as userid={row}"
    out.write(f"wrote {args.output}: a {cls} ({who}); load it with {cls}.load({str(args.output)!r})\n")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedrec")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown (not installed)"


def _read_secret(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not text:
        raise ConfigError(f"{path} is empty")
    return text


def _cmd_enroll_ca(args: argparse.Namespace, out: TextIO) -> int:
    from protocol.enrollment import EnrollmentAuthority

    if args.ca_command == "init":
        authority = EnrollmentAuthority.generate()
        authority.save(args.key)
        out.write(f"enrollment authority key written to {args.key} (keep it away from the aggregation server)\n")
        out.write("server configuration ([enrollment] table):\n")
        out.write(f'authority_key = "{authority.public_key.hex()}"\n')
        return 0
    if args.ca_command == "issue":
        from protocol.enrollment import MAX_VALID_DAYS

        if not (math.isfinite(args.valid_days) and 0 < args.valid_days <= MAX_VALID_DAYS):
            raise ConfigError(
                f"--valid-days must be a number of days in (0, {MAX_VALID_DAYS}], got {args.valid_days:g}"
            )
    authority = EnrollmentAuthority.load(args.key)
    if args.ca_command == "revoke":
        return _revoke(authority, args, out)
    device_key = _hex_key("--device-key", args.device_key)
    out.write(authority.issue(device_key, args.batch, valid_days=args.valid_days).hex() + "\n")
    return 0


def _hex_key(flag: str, text: str) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"{flag} must be 64 hex digits, got {text!r}") from None
    if len(key) != 32:
        raise ConfigError(f"{flag} must be 64 hex digits (32 bytes), got {len(key)} bytes")
    return key


def _revoke(authority: Any, args: argparse.Namespace, out: TextIO) -> int:
    from protocol.enrollment import read_revocation_list, write_revocation_list
    from protocol.identity import read_certificate, verify_revocation_list

    keys = [_hex_key("--device-key", k) for k in args.device_key]
    for text in args.certificate:
        try:
            cert = bytes.fromhex(text)
        except ValueError:
            raise ConfigError(f"--certificate must be hex, got {text[:20]!r}...") from None
        # revoking an expired certificate's key is fine: only the signature matters here
        keys.append(read_certificate(cert, authority.public_key, check_period=False).subject)
    if not keys and args.crl.exists():
        raise ConfigError("enroll-ca revoke: name at least one --device-key or --certificate to add")
    previous = None
    if args.crl.exists():
        read_revocation_list(args.crl, authority.public_key)  # refuses a tampered or foreign list by name
        previous = args.crl.read_bytes()
    data = authority.revoke(previous, keys)
    write_revocation_list(args.crl, data)
    crl = verify_revocation_list(data, authority.public_key)
    out.write(f"revocation list #{crl.number} written to {args.crl}: {len(crl.device_keys)} device keys revoked\n")
    return 0


def _run(args: argparse.Namespace, out: TextIO) -> int:
    commands = {
        "enroll-ca": _cmd_enroll_ca,
        "demo": _cmd_demo,
        "loadtest": _cmd_loadtest,
        "simulate": _cmd_simulate,
        "eval": _cmd_eval,
        "recommend": _cmd_recommend,
        "export": _cmd_export,
        "plan-privacy": _cmd_plan_privacy,
        "data": _cmd_data,
    }
    return commands[args.command](args, out)


def _cmd_plan_privacy(args: argparse.Namespace, out: TextIO) -> int:
    from fedsim.private_scale import plan_privacy

    data: Any = load_dataset(args.dataset, _data_dir(args.data_dir))
    train = data.train if isinstance(data, TrainTestSplit | LightFRSplit) else data
    out.write(
        f"{args.dataset}: {train.n_users} devices, {train.n_items} items; target ε={args.epsilon:g} at δ=1e-5, "
        f"f={args.bits}, θ={args.example_cap}, {args.negatives} negatives, popularity share {args.pop_share:g}\n"
    )
    rows = plan_privacy(
        train,
        epsilon=args.epsilon,
        bits=args.bits,
        example_cap=args.example_cap,
        negatives=args.negatives,
        pop_share=args.pop_share,
        rounds=tuple(args.rounds),
        clips=tuple(args.clips),
    )
    header = ["rounds", "C", "s", "σ/coord", "median item SNR", "interactions at SNR>=2", "popularity σ", "top-100 gap"]
    body = [
        [
            str(r.rounds),
            f"{r.clip_norm:g}",
            str(r.scale_bits),
            f"{r.sigma:.3g}",
            f"{r.median_snr:.3f}",
            f"{r.covered:.1%}",
            f"{r.pop_noise:.3g}",
            f"{r.pop_top_gap:.3g}",
        ]
        for r in rows
    ]
    _table([header, *body], out)
    best = max(rows, key=lambda r: (r.covered, -r.rounds))
    out.write(
        f"most interactions above SNR 2: T={best.rounds}, C={best.clip_norm:g} ({best.covered:.1%}); the SNR "
        "assumes the gradients of an item's devices agree, so it is an upper bound on what a round can learn\n"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fedrec``; returns the exit status.

    Expected failures (bad input, a missing or malformed file, a server that refuses) print one line
    ``fedrec COMMAND: error: ...`` on stderr and exit 2; an interrupt exits 130; a closed stdout (``| head``)
    ends the command quietly with status 141, as a killed-by-SIGPIPE tool would.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    # --json: the last line of stdout is the result object (fedsim.report); everything else to stderr
    out = sys.stderr if getattr(args, "json", False) else sys.stdout
    try:
        code = _run(args, out)
        out.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return code
    except (FedRecError, ValueError, OSError) as exc:
        if isinstance(exc, BrokenPipeError):
            return _broken_pipe()
        msg = " ".join(str(exc).split()) if not isinstance(exc, FedRecError) else str(exc)
        if isinstance(exc, OSError) and not isinstance(exc, FedRecError):
            where = f"{exc.filename}: " if exc.filename else ""
            msg = f"{where}{exc.strerror or exc}"
        print(f"fedrec {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fedrec {args.command}: interrupted", file=sys.stderr)
        return 130


def _broken_pipe() -> int:
    # The reader went away (``fedrec ... | head -1``): stop writing, and keep Python from reporting the
    # failed flush of stdout at exit.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
