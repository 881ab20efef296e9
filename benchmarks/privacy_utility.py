"""Privacy–utility at scale: Recall@20 against the number of devices on amazon-book, for user-level ε in
{1, 2, 4, 8, ∞}, private LightFR and private MF, with private popularity as the floor.

    python benchmarks/privacy_utility.py                       # the full grid (about an hour on 2 cores)
    python benchmarks/privacy_utility.py --sizes 1000 5000 --epsilons 8 inf --out /tmp/pu

Protocol: the KGAT amazon-book split; a subsample of n users (seeded) keeps all 24,915 items; every user
of the subsample is one device and takes part in every round (no amplification is claimed); ε at
δ = 1e-5 from the ledger (docs/dp-accounting.md §6–7).  Recall@20 / NDCG@20 rank every item not in the
user's train set, random ties, over the subsample's users with a test item.

- LightFR: `fedsim.private.scaled_lightfr` (private popularity release with ``--pop-share`` of ε, T rounds through
  the private-round simulator, noise-aware aggregation, item level α chosen on a validation item carved
  from each user's train); the α = ∞ scorer is private popularity, the floor line.
- MF: `fedsim.private.mf.run_private_mf_scaled` (every device's `MFModel.local_update` batched by
  `fedsim.private.cohorts.MFCohort`: only the rows of its kept and negative items are built, clipped and rounded,
  and summed sparsely; the released noise drawn in one piece), the same private popularity channel,
  u·v + α·level ranked with α chosen on the carved validation item; at the sizes in ``--mf-sizes``.
  f = 32, R = 1, θ = 20 with one negative each, C, γ and T from ``--mf-clip``, ``--mf-server-lr``,
  ``--mf-rounds``.

Writes ``privacy_utility.md`` (the table) and ``privacy_utility.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from fedsim.data.datasets import load_amazon_book
from fedsim.data.kgat import TrainTestSplit
from fedsim.data.ratings import Ratings
from fedsim.private.scaled_lightfr import ScaledSettings, evaluate_private


def subsample(data: TrainTestSplit, n: int, seed: int) -> TrainTestSplit:
    """The first ``n`` users of a seeded permutation, renumbered 0..n-1 (all items kept)."""
    if n >= data.train.n_users:
        return data
    keep = np.sort(np.random.default_rng(seed).choice(data.train.n_users, n, replace=False))
    new_id = -np.ones(data.train.n_users, dtype=np.int64)
    new_id[keep] = np.arange(n)

    def cut(r: Ratings) -> Ratings:
        m = new_id[r.users] >= 0
        return replace(
            r,
            users=new_id[r.users[m]],
            items=r.items[m],
            ratings=r.ratings[m],
            timestamps=None if r.timestamps is None else r.timestamps[m],
            n_users=n,
            user_ids=r.user_ids[keep],
        )

    return TrainTestSplit(cut(data.train), cut(data.test), f"{data.name}[{n}]")


def run_mf(
    data: TrainTestSplit, epsilon: float, args: argparse.Namespace, *, test_users: int | None = None
) -> dict[str, object]:
    """Private MF over every user of ``data`` through the simulator's scale mode
    (`fedsim.private.mf.evaluate_private_mf_scaled`: u·v + α·level, α chosen on a carved validation item)."""
    from fedsim.private.mf import IMPLICIT_MF, evaluate_private_mf_scaled

    settings = replace(
        IMPLICIT_MF,
        epsilon=epsilon,
        rounds=args.mf_rounds,
        clip_norm=args.mf_clip,
        server_lr=args.mf_server_lr,
        pop_share=args.pop_share,
        seed=args.seed,
    )
    metrics, extra = evaluate_private_mf_scaled(data, settings, eval_seed=0, val_users=4000, test_users=test_users)
    return {
        "recall@20": metrics["model"]["recall@20"],
        "ndcg@20": metrics["model"]["ndcg@20"],
        "mf_alone": metrics["mf_alone"]["recall@20"],
        "alpha": extra["alpha"] if extra["alpha"] != "popularity only" else math.inf,
        "epsilon": extra["epsilon"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 20000, 70679])
    p.add_argument("--mf-sizes", type=int, nargs="*", default=[1000, 5000, 20000, 70679])
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0, math.inf])
    p.add_argument("--rounds", type=int, default=3, help="LightFR rounds")
    p.add_argument("--mf-rounds", type=int, default=5)
    # MF's C, γ and T: the best validation Recall@20 at 5,000 devices and ε = 8 among C in {0.25, 0.5, 2, 20},
    # γ in {30, 100} (0.3 to 3000 without DP) and T in {5, 10, 20} (docs/dp-accounting.md §8).
    p.add_argument("--mf-clip", type=float, default=0.5, help="MF clip norm C")
    p.add_argument("--mf-server-lr", type=float, default=100.0, help="MF server step γ (on the survivors' mean)")
    p.add_argument("--pop-share", type=float, default=0.5)
    p.add_argument("--threshold", type=float, default=0.0)
    p.add_argument(
        "--unobserved-weight",
        default="auto",
        help='LightFR w0: "auto" (the server default: all-items objective, w0 from the density) or a number '
        "(0 = sampled negatives, the objective of the figures before this option)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--test-users", type=int, default=None, help="evaluate a seeded sample of users (default all)")
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    full = load_amazon_book()
    rows: list[dict[str, object]] = []
    table = [
        "| devices | ε (spent) | LightFR Recall@20 | private popularity | MF Recall@20 | popularity (no DP) | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in args.sizes:
        data = subsample(full, n, args.seed)
        for eps in args.epsilons:
            t = time.perf_counter()
            private = math.isfinite(eps)
            settings = ScaledSettings(
                epsilon=eps if private else 0.0,
                rounds=args.rounds,
                example_cap=50,
                pop_share=args.pop_share,
                threshold=args.threshold,
                seed=args.seed,
                unobserved_weight=args.unobserved_weight
                if args.unobserved_weight == "auto"
                else float(args.unobserved_weight),
            )
            metrics, extra = evaluate_private(data, settings, eval_seed=0, val_users=4000, test_users=args.test_users)
            mf: dict[str, object] = {"recall@20": float("nan")}
            if n in args.mf_sizes:
                mf = run_mf(data, eps if private else 0.0, args, test_users=args.test_users)
            secs = time.perf_counter() - t
            spent = extra["epsilon"]
            pop = metrics["popularity"]["recall@20"]
            row = {
                "devices": data.train.n_users,
                "epsilon": eps,
                "spent": spent,
                "lightfr": metrics["model"]["recall@20"],
                "private_popularity": metrics["private_popularity"]["recall@20"],
                "mf": mf["recall@20"],
                "mf_alpha": mf.get("alpha"),
                "mf_alone": mf.get("mf_alone"),
                "popularity": pop,
                "alpha": extra["alpha"],
                "seconds": secs,
            }
            rows.append(row)
            eps_text = f"{eps:g} ({spent:.3f})" if private else "∞"
            mf_r = float(mf["recall@20"])  # type: ignore[arg-type]
            mf_text = "—" if math.isnan(mf_r) else f"{mf_r:.4f} (α={mf['alpha']}; u·v alone {mf['mf_alone']:.4f})"
            line = (
                f"| {data.train.n_users} | {eps_text} | {row['lightfr']:.4f} (α={extra['alpha']}) | "
                f"{row['private_popularity']:.4f} | {mf_text} | {pop:.4f} | {secs:.0f} |"
            )
            table.append(line)
            print(line, flush=True)
    header = (
        f"amazon-book (KGAT split), users subsampled (seed {args.seed}), all 24,915 items; user-level ε at "
        "δ=1e-5, every device in every round; Recall@20 full ranking, random ties. LightFR: "
        f"{args.rounds} rounds, f=64, θ=50, C=4, no negatives, noise-aware threshold {args.threshold}σ, "
        f"popularity share {args.pop_share}. MF: {args.mf_rounds} rounds, f=32, R=1, θ=20, 1 negative, "
        f"C={args.mf_clip}, γ={args.mf_server_lr}. Command: python benchmarks/privacy_utility.py"
    )
    (args.out / "privacy_utility.md").write_text(header + "\n\n" + "\n".join(table) + "\n")
    _plot(rows, args.out / "privacy_utility.png")
    print(f"wrote {args.out / 'privacy_utility.md'} and {args.out / 'privacy_utility.png'}")


def _plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    eps_values = sorted({float(r["epsilon"]) for r in rows}, key=lambda e: (math.isinf(e), e))  # type: ignore[arg-type]
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(eps_values)))
    for color, eps in zip(colors, eps_values, strict=True):
        sel = [r for r in rows if r["epsilon"] == eps]
        x = [r["devices"] for r in sel]
        label = "ε=∞" if math.isinf(eps) else f"ε={eps:g}"
        ax.plot(x, [r["lightfr"] for r in sel], "-o", color=color, label=f"LightFR {label}")
        mf = [(r["devices"], r["mf"]) for r in sel if not math.isnan(float(r["mf"]))]  # type: ignore[arg-type]
        if mf:
            ax.plot(*zip(*mf, strict=True), "--s", color=color, label=f"MF {label}")
        if not math.isinf(eps):
            ax.plot(x, [r["private_popularity"] for r in sel], ":", color=color, alpha=0.8)
    sel = [r for r in rows if r["epsilon"] == eps_values[0]]
    ax.plot([r["devices"] for r in sel], [r["popularity"] for r in sel], "-", color="grey", label="popularity (no DP)")
    ax.set_xscale("log")
    ax.set_xlabel("devices (amazon-book users)")
    ax.set_ylabel("Recall@20 (full ranking, random ties)")
    ax.set_title("Private LightFR / MF vs devices; dotted: private popularity at the same ε")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
