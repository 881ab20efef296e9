"""Privacy–utility at scale, as a user gets it: Recall@20 against the number of devices on amazon-book for
user-level ε in {1, 2, 4, 8, ∞}, every figure from ``fedrec simulate --dataset FOLDER [--epsilon E] --json``
with the shipped defaults (the privacy planner's budget split and rounds; ε = ∞ is the non-private default),
with popularity and private popularity as the floor lines.

    python benchmarks/privacy_utility.py                                  # 1k, 5k, 20k, 70,679 devices
    python benchmarks/privacy_utility.py --sizes 1000 5000 --epsilons 8 inf --out /tmp/pu
    python benchmarks/privacy_utility.py --sizes 70679 --replicate 2 4 --epsilons 8   # toward 10^6 devices

Protocol: the KGAT amazon-book split; a subsample of n users (seeded) keeps all 24,915 items and is written
as a KGAT folder (``train.txt``, ``test.txt``) the CLI reads like any user's; ``--replicate R`` writes every
user R times (a fleet of R·n devices with the same data, each copy a device of its own, the noise drawn once
per release as always).  Every device takes part in every round (no amplification is claimed); ε at
δ = 1e-5 from the ledger.  Recall@20 / NDCG@20 rank every item not in the user's train set, random ties.

Writes ``privacy_utility.md`` (the table and the commands), ``privacy_utility.json`` (every record) and, with
matplotlib installed, ``privacy_utility.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedsim.cli import main as fedrec
from fedsim.data.datasets import find_data_dir


def write_subsample(source: Path, out: Path, n: int, seed: int, replicate: int = 1) -> int:
    """Write ``n`` seeded users of the KGAT folder ``source`` (each ``replicate`` times, renumbered) to ``out``;
    returns the number of devices written."""
    train = [line.split() for line in (source / "train.txt").read_text().splitlines() if line.strip()]
    test = {p[0]: p[1:] for p in (line.split() for line in (source / "test.txt").read_text().splitlines()) if p}
    pick = np.sort(np.random.default_rng(seed).choice(len(train), min(n, len(train)), replace=False))
    out.mkdir(parents=True, exist_ok=True)
    tr_lines, te_lines, new = [], [], 0
    for _ in range(replicate):
        for row in (train[i] for i in pick):
            tr_lines.append(" ".join([str(new), *row[1:]]))
            if test.get(row[0]):
                te_lines.append(" ".join([str(new), *test[row[0]]]))
            new += 1
    (out / "train.txt").write_text("\n".join(tr_lines) + "\n")
    (out / "test.txt").write_text("\n".join(te_lines) + "\n")
    return new


def simulate(folder: Path, epsilon: float) -> tuple[dict[str, Any], list[str], float]:
    """One ``fedrec simulate --dataset folder [--epsilon E] --json`` run: (its JSON record, the command, CPU s)."""
    argv = ["simulate", "--dataset", str(folder), "--json", "--quiet"]
    if math.isfinite(epsilon):
        argv += ["--epsilon", f"{epsilon:g}"]
    buf = io.StringIO()
    t = time.process_time()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        code = fedrec(argv)
    if code != 0:
        raise SystemExit(f"fedrec {' '.join(argv)} exited {code}")
    text = buf.getvalue()
    return json.loads(text[text.index("{") :]), ["fedrec", *argv], time.process_time() - t


def _row(devices: int, eps: float, record: dict[str, Any], cpu: float) -> dict[str, Any]:
    m = record["metrics"]
    model = m.get("model") or m.get("LightFR (Agg_grad)") or next(iter(m.values()))
    return {
        "devices": devices,
        "epsilon": eps,
        "spent": record.get("epsilon"),
        "model": model["recall@20"],
        "private_popularity": m.get("private_popularity", {}).get("recall@20", math.nan),
        "popularity": m["popularity"]["recall@20"],
        "plan": record.get("plan"),
        "seconds": record["seconds"],
        "cpu_seconds": cpu,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 20000, 70679])
    p.add_argument("--replicate", type=int, nargs="*", default=[], help="also every size × R devices (copies)")
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0, math.inf])
    p.add_argument("--seed", type=int, default=0, help="the subsample's seed")
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args()
    base = find_data_dir()
    if base is None or not (base / "amazon-book-kgat" / "train.txt").is_file():
        raise SystemExit("amazon-book not found: set FEDREC_DATA (docs/datasets.md)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    table = [
        "| devices | ε (spent) | model Recall@20 | private popularity | popularity (no DP) | plan | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="fedrec-pu-") as tmp:
        for n in args.sizes:
            for r in [1, *args.replicate]:
                folder = Path(tmp) / f"amazon-book-{n}x{r}"
                devices = write_subsample(base / "amazon-book-kgat", folder, n, args.seed, r)
                for eps in args.epsilons:
                    record, argv, cpu = simulate(folder, eps)
                    row = _row(devices, eps, record, cpu)
                    rows.append(row)
                    plan = row["plan"]
                    plan_text = (
                        "—"
                        if plan is None
                        else (
                            "popularity only"
                            if not plan["rounds"]
                            else f"{plan['pop_share']:g} pop, T={plan['rounds']}"
                        )
                    )
                    eps_text = f"{eps:g} ({row['spent']:.3f})" if math.isfinite(eps) else "∞ (non-private default)"
                    floor = row["private_popularity"]
                    floor_text = "—" if math.isnan(floor) else f"{floor:.4f}"
                    line = (
                        f"| {devices} | {eps_text} | {row['model']:.4f} | {floor_text} | "
                        f"{row['popularity']:.4f} | {plan_text} | {row['seconds']:.0f} |"
                    )
                    table.append(line)
                    print(line, flush=True)
    header = (
        f"amazon-book (KGAT split), users subsampled (seed {args.seed}), all 24,915 items; user-level ε at δ=1e-5, "
        "every device in every round; Recall@20 full ranking, random ties. Every row is "
        "`fedrec simulate --dataset FOLDER [--epsilon E] --json` with the shipped defaults on the subsample's "
        "KGAT folder. Command: python benchmarks/privacy_utility.py "
        + " ".join(
            [f"--sizes {' '.join(map(str, args.sizes))}", f"--epsilons {' '.join(f'{e:g}' for e in args.epsilons)}"]
            + ([f"--replicate {' '.join(map(str, args.replicate))}"] if args.replicate else [])
        )
    )
    (args.out / "privacy_utility.md").write_text(header + "\n\n" + "\n".join(table) + "\n")
    (args.out / "privacy_utility.json").write_text(json.dumps(rows, indent=1) + "\n")
    wrote = [args.out / "privacy_utility.md", args.out / "privacy_utility.json"]
    try:
        _plot(rows, args.out / "privacy_utility.png")
        wrote.append(args.out / "privacy_utility.png")
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install 'fedrec[plot]')")
    print("wrote " + ", ".join(map(str, wrote)))


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    eps_values = sorted({float(r["epsilon"]) for r in rows}, key=lambda e: (math.isinf(e), e))
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(eps_values)))
    for color, eps in zip(colors, eps_values, strict=True):
        sel = sorted((r for r in rows if r["epsilon"] == eps), key=lambda r: r["devices"])
        x = [r["devices"] for r in sel]
        label = "ε=∞ (non-private default)" if math.isinf(eps) else f"ε={eps:g}"
        ax.plot(x, [r["model"] for r in sel], "-o", color=color, label=label)
        if not math.isinf(eps):
            ax.plot(x, [r["private_popularity"] for r in sel], ":", color=color, alpha=0.8)
    sel = sorted((r for r in rows if r["epsilon"] == eps_values[0]), key=lambda r: r["devices"])
    ax.plot([r["devices"] for r in sel], [r["popularity"] for r in sel], "-", color="grey", label="popularity (no DP)")
    ax.set_xscale("log")
    ax.set_xlabel("devices (amazon-book users)")
    ax.set_ylabel("Recall@20 (full ranking, random ties)")
    ax.set_title("fedrec simulate defaults vs devices; dotted: private popularity at the same ε")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
