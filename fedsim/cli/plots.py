"""``--plot FILE.png``: pictures of a run (``fedrec simulate``) and of a load test (``fedrec loadtest``).

matplotlib is an optional extra (``pip install 'fedrec[plot]'``); `check_plot_target` runs before any
work starts, so a missing matplotlib or an unsupported file type costs the user nothing.

Invariants: figures are drawn with the non-interactive Agg backend (no display needed) from figures
the command measured; nothing is interpolated or smoothed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from protocol.errors import ConfigError

__all__ = ["check_plot_target", "plot_training", "plot_loadtest"]

_FORMATS = (".png", ".svg", ".pdf")


def check_plot_target(path: Path) -> None:
    """Refuse, before the run, a file type matplotlib will not write here or a missing matplotlib."""
    if path.suffix.lower() not in _FORMATS:
        raise ConfigError(f"--plot {path}: the file name must end in {', '.join(_FORMATS)}")
    if not path.parent.exists():
        raise ConfigError(f"--plot {path}: folder {path.parent} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'fedrec[plot]'") from None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_training(
    path: Path,
    title: str,
    rounds: Sequence[int],
    quality: dict[str, Sequence[float]],
    epsilon: Sequence[float] | None,
) -> None:
    """Validation quality per evaluated round and, for a private run, ε spent per round."""
    plt = _pyplot()
    panels = 2 if epsilon is not None else 1
    fig, axes = plt.subplots(panels, 1, figsize=(7, 3.2 * panels), sharex=True, squeeze=False)
    ax = axes[0][0]
    for name, values in quality.items():
        ax.plot(rounds, values, marker="o", label=name)
    ax.set_ylabel("validation (random ties)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    if epsilon is not None:
        axes[1][0].plot(rounds, epsilon, marker="o", color="tab:red")
        axes[1][0].set_ylabel("ε spent")
        axes[1][0].grid(alpha=0.3)
    else:
        ax.text(0.99, 0.02, "no DP in this run (ε = ∞)", transform=ax.transAxes, ha="right", fontsize=8)
    axes[-1][0].set_xlabel("round")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_loadtest(path: Path, series: Sequence[tuple[float, str, float]], phases: Sequence[str], title: str) -> None:
    """Every latency a device measured, per phase, against the time it finished (seconds since the
    fleet started); log scale, since long-polls span milliseconds to deadlines.  The "model" phase has a point
    only where a device asked the server for the model (`device_sdk.RoundOutcome.timings`), so it is labelled
    as the download it is."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for phase in phases:
        pts = [(t, v) for t, step, v in series if step == phase and v > 0]
        if pts:
            label = "model download" if phase == "model" else phase
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, alpha=0.6, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the fleet started")
    ax.set_ylabel("latency seen by the device (s)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(markerscale=3, fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
