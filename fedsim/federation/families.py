"""`fedrec simulate --model mf|felb|fnmf`: in-process runs of the other model families, with the
figures each family is judged by.

- MF: a rating dataset, per-user leave-one-out; test RMSE and HR@10/NDCG@10 (99 sampled negatives,
  random ties) beside popularity, random and the global-mean rating.  ``--epsilon > 0`` (or
  ``--secure``) runs every round through the real coordinator (SecAgg+ with dropouts, distributed
  DP with per-user accounting); otherwise plain sums in-process, optionally cross-silo (``--silos``).
- FELB: the planted Boolean recipe (default) or a rating dataset binarized at rating >= 4, split by
  rows over ``--clients``; F1, F1* and factor-F1 against the planted truth, Σ-RMSD beside the
  all-zero model.
- FNMF: the planted non-negative recipe; Σ-RMSD beside the noise floor, matched cosine of the
  components, orthogonality gap; ``--aggregator`` picks secure FNMF (client-side alignment, sums
  only), the trusted barycenter (the aggregator sees every client's matrix; says so), FedAvg or
  FedProx.

Invariants: every figure comes from a run made here; nothing is looked up or hard-coded.  All
randomness derives from ``--seed``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import numpy as np

from fedsim.data.datasets import load_dataset
from fedsim.data.planted import planted_binary, planted_nonnegative
from fedsim.data.ratings import Ratings
from fedsim.data.splits import leave_one_out
from fedsim.evaluation.experiment import baselines, prepare
from fedsim.evaluation.ranking import TieMode
from fedsim.ui import table
from protocol.errors import ConfigError
from protocol.plan import FELBParams, FNMFParams

if TYPE_CHECKING:  # the runners import their families lazily, when the CLI asks for one
    from agg_server.strategy.mf import MFStrategy
    from fedsim.evaluation.experiment import Experiment
    from fedsim.federation.mf import FederatedMF, MFEvaluation, MFSchedule

__all__ = ["FAMILY_DEFAULT_ROUNDS", "simulate_family"]

#: Rounds each family runs when ``--rounds`` is not given.
FAMILY_DEFAULT_ROUNDS = {"lightfr": 50, "mf": 20, "felb": 100, "fnmf": 10}


def _rows(out: TextIO, header: list[str], rows: list[list[str]]) -> None:
    table(header, rows, out)  # the one table style of every fedrec command


def _ratings(args: argparse.Namespace, data_dir: Path | None) -> Ratings:
    data = load_dataset(args.dataset, data_dir)
    if not isinstance(data, Ratings):
        raise ConfigError(f"--model {args.model} needs a rating log; {args.dataset!r} is a pre-split LightFR set")
    return data


def simulate_family(args: argparse.Namespace, data_dir: Path | None, out: TextIO) -> int:
    """Run ``args.model`` (mf, felb or fnmf) and print its figures."""
    runner = {"mf": _mf, "felb": _felb, "fnmf": _fnmf}[args.model]
    start = time.perf_counter()
    runner(args, data_dir, out)
    out.write(f"done in {time.perf_counter() - start:.1f} s\n")
    return 0


# -- MF --------------------------------------------------------------------------------------------


def _mf(args: argparse.Namespace, data_dir: Path | None, out: TextIO) -> None:
    if args.dataset in (None, "planted"):
        raise ConfigError("--model mf needs --dataset (a rating log such as ml-100k or synthetic)")
    if getattr(args, "json", False):
        raise ConfigError("--json for --model mf is implemented on a published split (amazon-book) only")
    data = _ratings(args, data_dir)
    eval_seed = getattr(args, "eval_seed", 0)  # the split and the test candidates: never the model seed
    exp = prepare(data, n_negatives=args.eval_negatives, seed=eval_seed)
    train, val, test = leave_one_out(data, seed=eval_seed)
    R = float(args.max_norm2 if args.max_norm2 is not None else max(5.0, float(np.max(train.ratings))))
    rank = args.rank or 32
    out.write(exp.describe() + "\n")
    secure = args.epsilon > 0 or args.secure
    extra_rows: list[list[str]] = []
    if secure and getattr(args, "save", None) is not None:
        raise ConfigError("--save is not available for MF runs through the coordinator (--epsilon/--secure) yet")
    if secure:
        if args.silos:
            raise ConfigError("--silos runs in-process without secure aggregation; drop --epsilon/--secure")
        ev, extra_rows = _mf_private(args, exp, train, val, test, rank, R, out)
    else:
        ev = _mf_plain(args, exp, train, test, rank, R, out)
    assert ev.ranking is not None
    b = baselines(exp, TieMode.RANDOM)
    mean = float(np.mean(train.ratings))
    rows = [
        ["federated MF", f"{ev.rmse:.4f}", f"{ev.ranking.hr:.4f}", f"{ev.ranking.ndcg:.4f}"],
        *extra_rows,
        ["item popularity", "—", f"{b['popularity'].hr:.4f}", f"{b['popularity'].ndcg:.4f}"],
        ["random", "—", f"{b['random'].hr:.4f}", f"{b['random'].ndcg:.4f}"],
        [f"global mean {mean:.2f}", f"{float(np.sqrt(np.mean((test.ratings - mean) ** 2))):.4f}", "—", "—"],
    ]
    _rows(out, ["model", "test RMSE", "HR@10", "NDCG@10"], rows)


def _mf_private(
    args: argparse.Namespace,
    exp: Experiment,
    train: Ratings,
    val: Ratings,
    test: Ratings,
    rank: int,
    R: float,
    out: TextIO,
) -> tuple[MFEvaluation, list[list[str]]]:
    """MF through the private rounds (`fedsim.private.mf`); the test figures and the extra table rows
    of the private popularity channel."""
    from fedsim.private.coordinator_rounds import PrivateRun
    from fedsim.private.mf import PrivateMFSettings, run_private_mf

    settings = PrivateMFSettings(
        epsilon=args.epsilon,
        rounds=args.rounds,
        cohort=max(3, int(round(args.fraction * train.n_users))),
        clip_norm=args.clip_norm,
        example_cap=args.example_cap,
        factors=rank,
        max_norm2=R,
        server_lr=args.server_lr,
        learning_rate=args.lr,
        seed=args.seed,
    )
    out.write(
        f"MF f={rank}, R={R:g}, θ={args.example_cap}, C={args.clip_norm:g}; T={args.rounds} private rounds "
        f"through the private-round simulator (the released SecAgg+ sums, 30% tolerated dropout"
        + (f", per-user ε={args.epsilon:g} at δ=1e-5)" if args.epsilon > 0 else ", no DP noise)")
        + f"; seed {args.seed}\n"
    )

    def progress(run: PrivateRun) -> None:
        if not args.quiet:
            out.write(f"  round {run.coordinator.model_version - 1}/{args.rounds} committed\n")
            out.flush()

    res = run_private_mf(train, test, exp.test, settings, val=(val, exp.val), on_round=progress)
    extra_rows = []
    if res.alpha is not None and res.mf_only is not None and res.private_popularity is not None:
        for label, e in (("MF alone (u·v)", res.mf_only), ("private popularity", res.private_popularity)):
            assert e.ranking is not None
            rmse = f"{e.rmse:.4f}" if label.startswith("MF") else "—"
            extra_rows.append([label, rmse, f"{e.ranking.hr:.4f}", f"{e.ranking.ndcg:.4f}"])
        out.write(
            f"private popularity channel: {settings.pop_share:g} of ε on a release of each device's items clipped "
            f"to √{settings.pop_theta}; ranking by u·v + α·level, α={res.alpha:g} chosen on validation (inf = "
            "the level alone); the RMSE is u·v's\n"
        )
    eps = f"per-user ε {res.epsilon_user:.3g}, per-rating ε {res.epsilon_rating:.3g} (δ=1e-5)"
    out.write(f"{res.committed} rounds committed; {eps if args.epsilon > 0 else 'no DP noise'}\n")
    return res.test, extra_rows


def _mf_plain(
    args: argparse.Namespace, exp: Experiment, train: Ratings, test: Ratings, rank: int, R: float, out: TextIO
) -> MFEvaluation:
    """MF in-process with plain sums (one device per user, or cross-silo); the test figures."""
    from agg_server.strategy.mf import MFStrategy
    from fedsim.federation.mf import MFSchedule, evaluate_mf, run_federated_mf

    strategy = MFStrategy(train.n_items, rank=rank, max_norm2=R, server_lr=args.server_lr, learning_rate=args.lr)
    schedule = MFSchedule(
        rounds=args.rounds,
        fraction=args.fraction,
        example_cap=args.example_cap,
        silos=args.silos,
        seed=args.seed,
    )
    mode = f"{args.silos} silos (cross-silo HFL)" if args.silos else "one device per user"
    out.write(
        f"MF f={rank}, R={R:g}, θ={args.example_cap or 'all'}; T={args.rounds} rounds in-process (plain sums, "
        f"no noise), {mode}, fraction {args.fraction}; seed {args.seed}\n"
    )
    state = run_federated_mf(train, strategy, schedule)
    ev = evaluate_mf(state.user_factors, state.item_factors, test, exp.test)
    if getattr(args, "save", None) is not None:
        _save_mf_run(args, train, strategy, schedule, state, out)
    return ev


def _save_mf_run(
    args: argparse.Namespace,
    train: Ratings,
    strategy: MFStrategy,
    schedule: MFSchedule,
    state: FederatedMF,
    out: TextIO,
) -> None:
    """Write the trained factors as a saved run (``--save``)."""
    from device_sdk.mf import MFModel
    from fedsim.federation.mf import device_config
    from fedsim.federation.runs import TrainItems, save_family_run

    model = MFModel(train.n_items, device_config(strategy, schedule), n_users=train.n_users)
    model.item_factors = np.array(state.item_factors, dtype=np.float64)
    model.user_factors = np.array(state.user_factors, dtype=np.float64)
    model.user_trained[:] = True
    model.model_version = args.rounds + 1
    save_family_run(
        args.save,
        "mf",
        [(model, train.n_users)],
        TrainItems.from_pairs(train.users, train.items, train.n_users),
        {"dataset": str(args.dataset), "seed": args.seed, "n_items": train.n_items},
        user_ids=train.user_ids,
        item_ids=train.item_ids,
    )
    out.write(f"saved the run to {args.save}\n")


# -- FELB ------------------------------------------------------------------------------------------


def _felb(args: argparse.Namespace, data_dir: Path | None, out: TextIO) -> None:
    from agg_server.strategy.felb import FELBStrategy
    from fedsim.federation.felb import evaluate_felb, run_felb

    rng = np.random.default_rng(args.seed)
    signal = planted_v = None
    if args.dataset in (None, "planted"):
        clients_n = args.clients or 10
        rank = args.rank or 5
        planted = planted_binary(clients_n, 100, 100, rank, xor_noise=args.xor_noise, rng=rng)
        blocks = [np.asarray(c, dtype=np.uint8) for c in planted.clients]
        signal, planted_v = planted.signal, planted.v
        what = (
            f"planted Boolean tiles ({clients_n} clients × 100 rows, 100 columns, k={rank}, XOR noise {args.xor_noise})"
        )
    else:
        data = _ratings(args, data_dir)
        clients_n = args.clients or 50
        rank = args.rank or 20
        A = np.zeros((data.n_users, data.n_items), dtype=np.uint8)
        keep = data.ratings >= args.binarize_at
        A[data.users[keep], data.items[keep]] = 1
        blocks = list(np.array_split(A, clients_n))
        what = (
            f"{args.dataset} binarized at rating >= {args.binarize_at:g} (density {A.mean():.4f}), {clients_n} clients"
        )
    strategy = FELBStrategy(
        rank=rank,
        n_items=blocks[0].shape[1],
        local_epochs=args.local_steps or FELBParams().local_epochs,
        step_rule=args.step_rule,
        server_scale=args.server_scale if args.server_scale is not None else 1.0,
    )
    out.write(
        f"FELB ({'FELB^MU' if args.step_rule == 'mu' else 'Lipschitz steps'}) on {what}; T={args.rounds} rounds, "
        f"b={strategy.local_epochs}; upload noise σ={args.noise_sigma:g}; seed {args.seed}\n"
    )
    run = run_felb(blocks, strategy, rounds=args.rounds, rng=rng, noise_sigma=args.noise_sigma)
    m = evaluate_felb(run, blocks, signal=signal, planted_v=planted_v)
    if getattr(args, "save", None) is not None:
        from fedsim.federation.runs import TrainItems, save_family_run

        stacked = np.vstack(blocks)
        users, items = np.nonzero(stacked)  # a row's 1s are its "rated" items: never recommended again
        save_family_run(
            args.save,
            "felb",
            [(model, block.shape[0]) for model, block in zip(run.models, blocks, strict=True)],
            TrainItems.from_pairs(users, items, stacked.shape[0]),
            {"dataset": str(args.dataset or "planted"), "seed": args.seed, "n_items": int(stacked.shape[1])},
        )
        out.write(f"saved the run to {args.save}\n")
    rows = [
        ["FELB", f"{m.f1:.4f}", f"{m.f1_star:.4f}", f"{m.factor_f1:.4f}", f"{m.rmsd:.4f}", f"{m.gap:.4f}"],
        ["all-zero model", "0.0000", "—", "—", f"{m.zero_rmsd:.4f}", "—"],
    ]
    _rows(out, ["model", "F1", "F1* (signal)", "factor-F1", "Σ-RMSD", "integrality gap"], rows)


# -- FNMF ------------------------------------------------------------------------------------------


def _fnmf(args: argparse.Namespace, data_dir: Path | None, out: TextIO) -> None:
    from fedsim.federation.fnmf import FNMFRunConfig, Method, run_fnmf
    from fedsim.federation.fnmf import sigma_rmsd as fnmf_sigma_rmsd

    if args.dataset not in (None, "planted"):
        raise ConfigError("--model fnmf runs on the planted non-negative recipe (--dataset planted)")
    rng = np.random.default_rng(args.seed)
    clients_n = args.clients or 10
    rank = args.rank or 5
    planted = planted_nonnegative(clients_n, 100, 100, rank, rng=rng)
    clients = [np.asarray(c, dtype=np.float64) for c in planted.clients]
    method = {
        "secure": Method.FNMF,
        "trusted-barycenter": Method.FNMF_TRUSTED,
        "fedavg": Method.FEDAVG,
        "fedprox": Method.FEDPROX,
    }[args.aggregator]
    if method is Method.FNMF_TRUSTED:
        out.write(
            "TRUSTED-AGGREGATOR MODE: the barycenter needs every client's item matrix, so the aggregator sees "
            "each one; this mode cannot run under secure aggregation and exists only in-process.\n"
        )
    cfg = FNMFRunConfig(
        method=method,
        alignment=args.alignment,
        rounds=args.rounds,
        local_steps=args.local_steps or FNMFParams().local_steps,
    )
    out.write(
        f"FNMF ({args.aggregator}, alignment {args.alignment}) on planted non-negative blocks ({clients_n} clients × "
        f"100 rows, 100 columns, k={rank}); T={args.rounds} rounds × {cfg.local_steps} local steps; seed {args.seed}\n"
    )
    run = run_fnmf(clients, rank, cfg, rng, truth=planted.v)
    floor = fnmf_sigma_rmsd(clients, list(np.split(planted.signal, clients_n)))
    if getattr(args, "save", None) is not None:
        from fedsim.federation.runs import TrainItems, save_family_run

        n_rows = sum(c.shape[0] for c in clients)
        empty = np.zeros(0, dtype=np.int64)  # dense non-negative rows: no item counts as already rated
        save_family_run(
            args.save,
            "fnmf",
            [(model, c.shape[0]) for model, c in zip(run.models, clients, strict=True)],
            TrainItems.from_pairs(empty, empty, n_rows),
            {"dataset": "planted", "seed": args.seed, "n_items": int(clients[0].shape[1])},
        )
        out.write(f"saved the run to {args.save}\n")
    rows = [
        [args.aggregator, f"{run.sigma_rmsd:.4f}", f"{run.matched_cosine:.4f}", f"{run.orthogonality_gap:.4f}"],
        ["noise floor Σ RMSD(X_i, S_i)", f"{floor:.4f}", "—", "—"],
    ]
    _rows(out, ["model", "Σ-RMSD", "matched cosine", "orthogonality gap"], rows)
    out.write(f"secure-sum rounds used: {run.sync_rounds}\n")
