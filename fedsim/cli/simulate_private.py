"""The private runs of ``fedrec simulate``: LightFR with ``--epsilon`` and MF on a published split, every
device in every round through the private-round simulator, evaluated beside the baselines."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from fedsim.cli.args import option_name, resolve_data_dir
from fedsim.cli.results import print_rows
from fedsim.cli.simulate_options import NOT_PRIVATE_LIGHTFR, mean_field, rank_ridge, unobserved_weight
from fedsim.data.datasets import TrainTestSplit, load_dataset
from fedsim.evaluation.experiment import Protocol, prepare, require_validation
from fedsim.evaluation.report import result_record, write_json
from protocol.errors import ConfigError

if TYPE_CHECKING:  # the simulator loads when the command runs, not to parse it
    from fedsim.private.served import ServedScore

__all__ = [
    "PrivateRun",
    "load_private_data",
    "private_ials_run",
    "private_lightfr_run",
    "report_private",
    "run_extra",
    "simulate_mf_published",
    "simulate_private_ials",
    "simulate_private_lightfr",
    "validate_run",
]


@dataclass(frozen=True)
class PrivateRun:
    """A private run planned from the options, not yet trained: its family ("lightfr" or "ials"), its
    settings, the privacy planner's plan (None when ``--pop-share`` was given) and the lines that describe it
    (the planner's verdict first)."""

    family: str
    settings: Any
    plan: Any
    header: str

    @property
    def rounds(self) -> int:
        return int(self.settings.rounds)


def load_private_data(args: argparse.Namespace) -> Any:
    """The data of a private run: a published split as it is, or a rating log split by the options."""
    data: Any = load_dataset(args.dataset, resolve_data_dir(args.data_dir))
    if not isinstance(data, TrainTestSplit):
        data = prepare(
            data,
            Protocol(args.protocol) if args.protocol else None,
            n_negatives=args.eval_negatives,
            seed=args.eval_seed,
        )
        require_validation(data)
    return data


def validate_run(run: PrivateRun, data: Any, args: argparse.Namespace, out: TextIO) -> ServedScore:
    """Print the run's description, train it through the private-round simulator and choose its served score
    on validation (the test split is not read)."""
    from fedsim.private.scaled_ials import validate_private_ials
    from fedsim.private.scaled_lightfr import validate_private

    out.write(run.header)

    def on_round(r: int, seconds: float) -> None:
        if not getattr(args, "quiet", False):
            out.write(f"  round {r}/{run.rounds}: {seconds:.1f} s\n")
            out.flush()

    def log(text: str) -> None:
        out.write(text + "\n")

    validate = validate_private if run.family == "lightfr" else validate_private_ials
    return validate(data, run.settings, eval_seed=args.eval_seed, on_round=on_round, log=log)


def run_extra(run: PrivateRun, served: ServedScore) -> dict[str, Any]:
    """The evaluation's ``extra`` map (`ServedScore.extra`) with the planner's record when it planned the run."""
    extra = served.extra()
    return extra if run.plan is None else {**extra, "plan": run.plan.record()}


def simulate_private_lightfr(args: argparse.Namespace, defaults: argparse.Namespace, out: TextIO) -> int:
    """``simulate --epsilon E`` for LightFR: the popularity release and private rounds of every device
    through the private-round simulator (`fedsim.private.scaled_lightfr`), evaluated beside the baselines;
    ``defaults`` holds every ``simulate`` option's value when not given."""
    if args.dataset is None:
        raise ValueError("--dataset is required (a dataset name, a ratings file, or synthetic)")
    from fedsim.private.served import evaluate_served

    t0 = time.perf_counter()
    data = load_private_data(args)
    run = private_lightfr_run(args, defaults, data)
    served = validate_run(run, data, args, out)
    metrics = evaluate_served(data, served, eval_seed=args.eval_seed)
    extra = run_extra(run, served)
    note = f"item level α={extra['alpha']} chosen on validation; random ties"
    return report_private(args, out, t0, metrics, extra, run.rounds, note, private=True)


def private_lightfr_run(args: argparse.Namespace, defaults: argparse.Namespace, data: Any) -> PrivateRun:
    """The private LightFR run the options ask for (every option checked first, one clear line), planned by
    the privacy planner unless ``--pop-share`` is given."""
    from fedsim.private.planner import MAX_SHARE, PRIVATE_ROUNDS
    from fedsim.private.scaled_lightfr import ScaledSettings, plan_run, with_plan

    rounds = args.rounds if args.rounds is not None else PRIVATE_ROUNDS
    if args.epsilon > 0 and rounds > 0 and args.pop_theta != 1 and args.pop_share is None:
        raise ConfigError("--pop-theta other than 1 needs --pop-share: the privacy planner plans θ = 1")
    for dest in NOT_PRIVATE_LIGHTFR:
        if getattr(args, dest) != getattr(defaults, dest):
            raise ConfigError(
                f"{option_name(dest)} does not apply to private LightFR runs (--epsilon): the private-round simulator "
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
        pop_share=args.pop_share if args.pop_share is not None else 0.5,
        pop_theta=args.pop_theta,
        seed=args.seed,
        # The server's objective unless asked: all items (w0 > 0, learned item levels), or sampled negatives.
        unobserved_weight=unobserved_weight(args),
        # Asymmetric scoring in the round plan (protocol 1.6) when asked; not the default under DP (validation,
        # docs/dp-accounting.md §8: the vector's u uᵀ/f part takes most of the clip norm).
        query_planes=args.query_planes,
        user_reg=args.user_reg,
        # The mean-field code step unless --no-mean-field (chosen on validation under DP as well).
        mean_field=mean_field(args),
        # Devices rank with their ±1 codes under DP unless --rank-planes P (the SDK's default, 3 planes of the
        # ridge vector, was chosen without DP; under DP it ties here and loses on the real server's devices:
        # docs/dp-accounting.md §8; real devices learn it from the model download, ModelPayload.dp_trained).
        rank_planes=(args.rank_planes or 0) if unobserved_weight(args) != 0 and not args.query_planes else 0,
        rank_ridge=rank_ridge(args),
    )
    if settings.query_planes and settings.unobserved_weight == 0:
        raise ConfigError("--query-planes needs the all-items objective (drop --unobserved-weight 0)")
    plan, head = None, ""
    if args.epsilon > 0 and args.pop_share is None:
        negatives = None if isinstance(data, TrainTestSplit) else data.n_negatives
        plan = plan_run(data.train, settings, negatives=negatives, rounds=rounds)
        head = plan.verdict() + "\n"
        if plan.rounds or args.rounds is None:
            settings = with_plan(settings, plan)
        else:  # --rounds asked for rounds the floor cannot spare: they get what the planner's largest share leaves
            settings = dataclasses.replace(settings, pop_share=MAX_SHARE)
            head += f"--rounds {rounds} given: the rounds get {1 - MAX_SHARE:g} of ε all the same\n"
        rounds = settings.rounds
    head += (
        f"private LightFR on {args.dataset}: {data.train.n_users} devices, every one in every round; "
        f"ε={args.epsilon:g} at "
        + (
            f"δ=1e-5 over a private popularity release alone (θ={settings.pop_theta}); no model round\n"
            if rounds == 0
            else f"δ=1e-5 over a private popularity release ({settings.pop_share:g} of ε, θ={settings.pop_theta}) "
            f"and T={rounds} rounds, θ={settings.example_cap} items per device, C={settings.clip_norm:g}, "
            + _round_description(args, settings)
        )
    )
    return PrivateRun("lightfr", settings, plan, head)


def simulate_private_ials(args: argparse.Namespace, defaults: argparse.Namespace, out: TextIO) -> int:
    """``simulate --model ials --epsilon E``: the popularity release and private iALS rounds of every device
    through the private-round simulator (`fedsim.private.scaled_ials`), the privacy planner's split unless
    ``--pop-share`` is given, evaluated beside the baselines."""
    from fedsim.private.served import evaluate_served

    t0 = time.perf_counter()
    data = load_private_data(args)
    run = private_ials_run(args, defaults, data)
    served = validate_run(run, data, args, out)
    metrics = evaluate_served(data, served, eval_seed=args.eval_seed)
    extra = run_extra(run, served)
    note = f"item level α={extra['alpha']} chosen on validation; random ties"
    return report_private(args, out, t0, metrics, extra, run.rounds, note, private=True, family="ials")


def private_ials_run(args: argparse.Namespace, defaults: argparse.Namespace, data: Any) -> PrivateRun:
    """The private iALS run the options ask for (checked first, one clear line), planned by the privacy
    planner unless ``--pop-share`` is given."""
    from fedsim.private.scaled_ials import PrivateIALSSettings, plan_private_ials, resolve_factors, with_plan

    if args.fraction != defaults.fraction:
        raise ConfigError("--fraction does not apply to private iALS runs (--epsilon): every device is in every round")
    given = {
        "rounds": args.rounds,
        "factors": args.rank,
        "alpha": args.alpha,
        "reg": args.reg,
        "pop_share": args.pop_share,
    }
    try:
        settings = dataclasses.replace(
            PrivateIALSSettings(),
            epsilon=args.epsilon,
            seed=args.seed,
            **{k: v for k, v in given.items() if v is not None},
        )
    except ValueError as exc:
        raise ConfigError(f"--{exc}") from None
    plan, head = None, ""
    if args.pop_share is None:
        negatives = None if isinstance(data, TrainTestSplit) else data.n_negatives
        plan = plan_private_ials(data.train, settings, negatives=negatives)
        head = plan.verdict() + "\n"
        settings = with_plan(settings, plan)
    settings, snr = resolve_factors(data.train, settings)
    chosen = "" if math.isnan(snr) or math.isinf(snr) else f" (chosen from the noise: S/σ = {snr:.3g})"
    s = settings
    head += (
        f"private iALS on {args.dataset}: {data.train.n_users} devices, every one in every round; ε={s.epsilon:g} at "
        + (
            f"δ={s.delta:g} over a private popularity release alone (θ={s.pop_theta}); no model round\n"
            if s.rounds == 0
            else f"δ={s.delta:g} over a private popularity release ({s.pop_share:g} of ε, θ={s.pop_theta}) and "
            f"T={s.rounds} rounds of bounded uploads (unit user vectors, item rows weighted 1/√max(|I|, {s.theta}), "
            f"Gram part ×{s.gram_weight:g}, C={s.clip_norm:.3g}); d={s.factors}{chosen}, α={s.alpha:g}, λ={s.reg:g}\n"
        )
    )
    return PrivateRun("ials", settings, plan, head)


def _round_description(args: argparse.Namespace, settings: Any) -> str:
    """The rest of the header line of a private LightFR run with model rounds: objective, scoring, step."""
    return (
        (
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
        f"noise-aware threshold {args.threshold:g}σ; rounds through the private-round simulator "
        "(fedsim.private.simulator)\n"
    )


def simulate_mf_published(
    args: argparse.Namespace, defaults: argparse.Namespace, data: TrainTestSplit, out: TextIO
) -> int:
    """``simulate --model mf`` on a published split (amazon-book): every user a device in every round through
    the simulator's sparse MF cohort (`fedsim.private.mf.evaluate_private_mf_scaled`), private with
    ``--epsilon`` (the private popularity channel taking half of it), full ranking beside the baselines.
    Options left at their defaults take `fedsim.private.mf.IMPLICIT_MF`'s (chosen on validation)."""
    from fedsim.private.mf import IMPLICIT_MF, evaluate_private_mf_scaled

    t0 = time.perf_counter()
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
        f"server step {s.server_lr:g}; rounds through the private-round simulator (fedsim.private.cohorts.MFCohort)\n"
    )

    def on_round(r: int, seconds: float) -> None:
        if not getattr(args, "quiet", False):
            out.write(f"  round {r}/{s.rounds}: {seconds:.1f} s\n")
            out.flush()

    metrics, extra = evaluate_private_mf_scaled(data, settings, eval_seed=args.eval_seed, on_round=on_round)
    note = f"u·v + α·level with α={extra['alpha']} chosen on validation; full ranking, random ties"
    return report_private(args, out, t0, metrics, extra, s.rounds, note, private=s.epsilon > 0)


def report_private(
    args: argparse.Namespace,
    out: TextIO,
    t0: float,
    metrics: dict[str, dict[str, float]],
    extra: dict[str, Any],
    rounds: int,
    note: str,
    *,
    private: bool,
    family: str | None = None,
    **fields: Any,
) -> int:
    """The end of a private-simulator run (LightFR or MF): the metrics table, the ε spent (or "no DP
    noise") with ``note``, the wall time, and with ``--json`` the result record (ε and δ when private, and
    ``fields``)."""
    keys = sorted({k for m in metrics.values() for k in m})
    rows = [["model", *keys]]
    for name, values in metrics.items():
        rows.append([name, *(f"{values[k]:.4f}" for k in keys)])
    print_rows(rows, out)
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
            **({"plan": extra["plan"]} if "plan" in extra else {}),
            **({"family": family} if family else {}),
            **fields,
        )
        write_json(record, sys.stdout)
    return 0
