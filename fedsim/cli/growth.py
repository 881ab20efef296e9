"""When personalisation starts paying: the private LightFR run of ``fedrec simulate --model lightfr --epsilon E``
(the privacy planner's split, the private-round simulator, the served score chosen on validation) on the data as
given, then on the same users replicated into fleets 2, 4, 8 and 16 times larger, until the learned score beats
the private popularity list on validation by the planner's margin (`fedsim.private.planner.choose_with_margin`).

A replicated fleet has the data's shape with more devices: every release's signal grows with the copies while
its noise does not, which is what more devices like these would give.  Only validation is read (the replicas
carry no test blocks, `fedsim.evaluation.experiment.replicated`); the runs are the simulator's, nothing is
released.
"""

from __future__ import annotations

import argparse
import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["GROWTH_COPIES", "Growth", "forecast_growth"]

#: The fleet sizes tried, as multiples of the data's devices (the first whose learned score pays ends it).
GROWTH_COPIES: tuple[int, ...] = (1, 2, 4, 8, 16)


@dataclass(frozen=True, slots=True)
class Growth:
    """The forecast: ``tried`` holds (devices, whether the learned score beat the private list) per fleet tried,
    smallest first; ``epsilon`` the budget of every run."""

    epsilon: float
    tried: tuple[tuple[int, bool], ...]

    @property
    def devices(self) -> int:
        """The fleet as given."""
        return self.tried[0][0]

    @property
    def pays_from(self) -> int | None:
        """The smallest fleet tried whose learned score beat the private list (None: none did)."""
        return next((n for n, pays in self.tried if pays), None)

    def line(self) -> str:
        """The forecast in one line, printed after the plan."""
        head = f"growth: at ε = {self.epsilon:g}, "
        pays = self.pays_from
        if pays == self.devices:
            return head + (
                f"the private-round simulator's learned model beats its private popularity list on validation at "
                f"these {self.devices:,} devices"
            )
        smaller = [f"{n:,}" for n, _ in self.tried if n != pays]
        below = smaller[0] if len(smaller) == 1 else ", ".join(smaller[:-1]) + " or " + smaller[-1]
        if pays is not None:
            return head + (
                f"personalisation starts paying at about {pays:,} devices: the private-round simulator's learned "
                f"model beats its private popularity list on validation with each user replicated "
                f"{pays // self.devices}× (fresh noise), not at {below}"
            )
        return head + (
            f"personalisation does not pay up to {self.tried[-1][0]:,} devices (each user replicated up to "
            f"{self.tried[-1][0] // self.devices}×): on data like this the private model is the private popularity list"
        )

    def record(self) -> dict[str, Any]:
        """The forecast as a JSON object."""
        return {"pays_from_devices": self.pays_from, "tried": [{"devices": n, "pays": p} for n, p in self.tried]}


def forecast_growth(
    exp: Any, epsilon: float, *, seed: int = 0, bits: int = 64, copies: tuple[int, ...] = GROWTH_COPIES
) -> Growth:
    """`Growth` of the private LightFR run (codes of ``bits`` bits) on ``exp`` (an `Experiment` with candidate
    blocks) at ``epsilon``, trying the fleets ``copies`` times the data's devices in order until one pays.

    Raises
    ------
    ValueError
        ``epsilon`` not positive and finite, ``copies`` empty or not increasing from 1, or a published split.
    """
    from fedsim.cli import simulate
    from fedsim.cli.args import option_defaults
    from fedsim.cli.simulate_private import private_lightfr_run, validate_run
    from fedsim.evaluation.experiment import replicated

    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be a positive number, got {epsilon!r}")
    if not copies or copies[0] != 1 or any(b <= a for a, b in zip(copies, copies[1:], strict=False)):
        raise ValueError(f"copies must rise from 1, got {copies!r}")
    defaults = option_defaults(simulate._add_options)
    args = argparse.Namespace(**vars(defaults))
    args.model, args.dataset, args.epsilon, args.seed, args.quiet = "lightfr", exp.name, float(epsilon), seed, True
    args.bits = bits
    devices = int(np.unique(exp.train.users).size)
    tried: list[tuple[int, bool]] = []
    for r in copies:
        data = exp if r == 1 else replicated(exp, r)
        run = private_lightfr_run(args, defaults, data)
        served = validate_run(run, data, args, io.StringIO())
        tried.append((devices * r, not math.isinf(served.alpha)))
        if tried[-1][1]:
            break
    return Growth(float(epsilon), tuple(tried))
