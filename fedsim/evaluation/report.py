"""The machine-readable result of a `fedrec` command (`--json`): one JSON object, written as the
last line of stdout; with `--json` every other line of the command goes to stderr.

Schema (`fedrec simulate` and `fedrec eval`; other commands reuse `fedsim.evaluation.report.result_record` and
`write_json`, and may add keys, never rename these):

    {"dataset": str, "protocol": str, "rounds": int | null, "seconds": float,
     "metrics": {"model": {...}, "popularity": {...}, "random": {...}}, ...extra keys}

- `dataset`: the dataset's name (e.g. `ml-100k`, `amazon-book`, a file's stem); `protocol`: `loo`,
  `chrono`, `lightfr-split`, `full` or `sampled` (see docs/datasets.md).
- `rounds`: training rounds run; 0 for `eval --baseline`; null for a run file saved without it.
- `seconds`: wall time of the command.
- `metrics`: one map per method evaluated (`model` is the trained model; `eval --baseline X` has only
  `X`), each holding the keys it measured among `hr@10`, `ndcg@10` (sampled negatives) and
  `recall@20`, `ndcg@20` (full ranking), always with random tie-breaking (seeded by `--eval-seed`).

`fedrec simulate` with its default `--model auto` adds `family` (the kept family, `lightfr` or `ials`),
`validation` (`{"lightfr": x, "ials": y}`, each family's figure on the same validation split) and
`validation_metric` (`hr@10` or `recall@20`); with `--epsilon` also `epsilon`, `delta` and `plan` (the kept
run's ledger and plan) and `selection` (the choice between the two private runs is a selection on private data
the ledger does not charge). When iALS is kept, `factors`, `alpha`, `reg`, `level_weight` (the weight w of the
item term: scores u·v + w·level, level the log-scale holder counts over [0, 1]), `cpu_seconds`, `candidates`
(every (d, α, λ) tried, with its validation figure) and `level_weights` (the kept model's figure at each w) come
too; `--model ials` reports the candidates as `validation`.

`fedrec demo --json` uses the same fixed keys (`metrics` holds `hr@10` / `ndcg@10` of the model the
server trained, popularity and random; `rounds` counts committed rounds) and adds `epsilon`, `delta`
(null without DP), `seed`, `epsilon_is_guarantee` (false without DP and with `--insecure-seed-dp-noise`)
and `server_rounds` (`round_id`, `status`, `cohort_size`, `survivors` of each round); with DP, `plan` (the privacy
planner's split) and `growth`: `pays_from_devices` (the smallest fleet at which the private-round simulator's
learned model beat its private popularity list on validation, or null) and `tried` (`devices`, `pays` of each
fleet tried).

`fedrec loadtest --json` is a report, not a quality figure: `devices`, `backend` (`local` or `ray`),
`workers`, `url`, `rounds_requested`, `rounds_finished`, `rounds_committed`, `seconds`, `ok` (the exit
status is 0), `failure` (the one-line reason, or null: fewer rounds committed than requested, or devices
failed for a reason other than an injected drop), `outcomes` and `drops` (counts by kind),
`latency_seconds` (per device-side phase: `n`, `p50`, `p95`, `p99`, `max`; null when no sample),
`round_seconds_max`, `server_cpu_ms_per_device_round` (server CPU from the fleet's start to its last
round's end, over the sum of the rounds' cohorts), `health` (`GET /v1/health` probed every 50 ms from a
separate process: `probes`, `failures`, `p50_ms`, `p99_ms`, `max_ms`, `probes_while_finishing`,
`p99_ms_while_finishing`; null for https), `instances` (per server: `url`, `rounds_committed`,
`peak_rss_mb`, `cpu_seconds`), `bytes_up_median` / `bytes_down_median` / `bytes_per_device_round_mean`,
`ledger` (`epsilon_spent`, `epsilon_budget`, `delta`, `rounds_charged`; null without DP), `final_model`
(`version`, `sha256` of the served model), `server_rounds` (per round: `round_id`, `status`, `reason`, `cohort`,
`survivors`, `seconds`, `phases` (seconds per SecAgg phase), `phase_ends` (how each phase ended:
`all_answered`, `drops_detected` (closed before its deadline, some devices dropped on a closed connection
or a new check-in), `deadline`, `aborted`; null for a round another process ran), `cpu_seconds`,
`cpu_ms_per_device`, `peak_rss_mb`), `errors` (counts by type), `error_examples` (the first message of each type) and
`device_errors` (the counts without the monitor's status reads and the time limit).

`fedrec recommend --json`: `{"run", "family", "user", "items": [{"item", "index", "score", "title"}, ...]}`,
best first; `item` / `user` are the dataset's raw ids when the run kept them, `index` the dense index
(0-based, the model's item order: what the SDK's `recommend` returns), `title` the MovieLens-100K title or null.

Invariants: values are finite floats (`allow_nan=False`), the object is one line, and extra keys
(e.g. `epsilon`, `delta`) never shadow the fixed ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, TextIO

__all__ = ["METRIC_KEYS", "result_record", "write_json"]

METRIC_KEYS = ("hr@10", "ndcg@10", "recall@20", "ndcg@20")
_FIXED = ("dataset", "protocol", "rounds", "seconds", "metrics")


def result_record(
    *,
    dataset: str,
    protocol: str,
    rounds: int | None,
    seconds: float,
    metrics: Mapping[str, Mapping[str, float]],
    **extra: Any,
) -> dict[str, Any]:
    """Build and validate one ``--json`` result.

    Parameters
    ----------
    dataset, protocol : str
        What was evaluated and how (e.g. ``"amazon-book"``, ``"full"``).
    rounds : int or None
        Training rounds run (0 for a baseline; None when unknown, e.g. an old run file).
    seconds : float
        Wall time of the command.
    metrics : mapping of method name to a mapping of metric key to value
        ``{"model": {...}, "popularity": {...}, "random": {...}}``; keys among `METRIC_KEYS`.
    **extra
        Further JSON-serialisable keys (e.g. ``epsilon``, ``delta``).

    Raises
    ------
    ValueError
        An unknown metric key, a non-finite value, or an extra key that shadows a fixed one.
    """
    clash = sorted(set(extra) & set(_FIXED))
    if clash:
        raise ValueError(f"extra keys may not replace the fixed ones: {', '.join(clash)}")
    if rounds is not None and rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"seconds must be a finite number >= 0, got {seconds}")
    clean: dict[str, dict[str, float]] = {}
    for method, values in metrics.items():
        unknown = sorted(set(values) - set(METRIC_KEYS))
        if unknown:
            raise ValueError(f"metrics[{method!r}]: unknown key(s) {', '.join(unknown)}; use {', '.join(METRIC_KEYS)}")
        bad = [k for k, v in values.items() if not math.isfinite(float(v))]
        if bad:
            raise ValueError(f"metrics[{method!r}]: non-finite value for {', '.join(bad)}")
        clean[method] = {k: float(values[k]) for k in METRIC_KEYS if k in values}
    return {
        "dataset": str(dataset),
        "protocol": str(protocol),
        "rounds": None if rounds is None else int(rounds),
        "seconds": round(float(seconds), 3),
        "metrics": clean,
        **extra,
    }


def write_json(record: Mapping[str, Any], out: TextIO) -> None:
    """Write ``record`` as one line of JSON (the last line a ``--json`` command prints on stdout)."""
    out.write(json.dumps(record, allow_nan=False, ensure_ascii=False) + "\n")
    out.flush()
