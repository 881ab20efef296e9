"""How fast this machine runs the interpreter, for CPU-time budgets measured in a child process.

`CALIBRATE` is Python source defining ``calibrate()``: a fixed pure-Python workload (class creation,
dict building, a loop), the kind of work an import or a parser build does, so its CPU time scales a
budget taken on the reference machine, where it ran in `CALIBRATION_REFERENCE` seconds.
"""

from __future__ import annotations

__all__ = ["CALIBRATE", "CALIBRATION_REFERENCE", "scaled"]

CALIBRATION_REFERENCE = 0.017

CALIBRATE = """
def calibrate():
    t = time.process_time()
    for _ in range(300):
        class C:
            a = 1
            def f(self):
                return self.a
        d = {str(i): i for i in range(200)}
    x = 0
    for i in range(300000):
        x += i & 7
    return time.process_time() - t
"""


def scaled(budget: float, speed: float) -> float:
    """``budget`` (CPU seconds on the reference machine) on a machine whose calibration took ``speed``;
    never below the reference budget."""
    return budget * max(1.0, speed / CALIBRATION_REFERENCE)
