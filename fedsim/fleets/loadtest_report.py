"""``fedrec loadtest``'s report of a finished fleet run: the JSON record (`loadtest_record`, schema in
`fedsim.evaluation.report`), the summary tables (`format_loadtest`) and the devices' round outcomes in
words (`describe_outcomes`).  Pure functions of a `FleetReport`; nothing here talks to the server.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, TextIO

import numpy as np

from fedsim.fleets.local import PHASE_STEPS, FleetReport

__all__ = ["describe_outcomes", "loadtest_record", "format_loadtest"]


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def describe_outcomes(report: FleetReport) -> str:
    """What the devices' ``run_round`` calls ended in, in words."""
    o = report.outcomes
    parts = [f"{o.get('committed', 0)} took part in a committed round", f"{o.get('aborted', 0)} in an aborted one"]
    drops = ", ".join(f"{k} {v}" for k, v in sorted(report.drops.items()))
    parts.append(f"{o.get('dropped', 0)} dropped as injected" + (f" ({drops})" if drops else ""))
    if o.get("refused"):
        parts.append(f"{o['refused']} refused by the device's privacy floor")
    parts.append(f"{o.get('waited', 0)} check-ins were told to wait (not in the cohort, or no round open)")
    return "device rounds: " + "; ".join(parts)


def _round_rows(report: FleetReport) -> list[dict[str, Any]]:
    """The fleet's rounds as the server recorded them, with the server CPU spent since the previous one."""
    rows = []
    prev = report.cpu_start
    for rec in report.server_rounds:
        proc = rec.get("process") or {}
        cpu = proc.get("cpu_seconds")
        delta = None if cpu is None or prev is None else cpu - prev
        cohort = int(rec.get("cohort_size") or 0)
        rows.append(
            {
                "round_id": rec.get("round_id"),
                "status": rec.get("status"),
                "reason": rec.get("reason") or None,
                "cohort": cohort,
                "survivors": rec.get("survivors"),
                "seconds": _finite((rec.get("finished_at") or 0) - (rec.get("started_at") or 0)),
                "phases": {ph["phase"]: _finite(ph["seconds"]) for ph in rec.get("phases") or []},
                "phase_ends": {ph["phase"]: ph.get("ended") for ph in rec.get("phases") or []},
                "cpu_seconds": None if delta is None else _finite(delta),
                "cpu_ms_per_device": None if delta is None or not cohort else _finite(1e3 * delta / cohort),
                "peak_rss_mb": proc.get("max_rss_mb"),
            }
        )
        prev = cpu if cpu is not None else prev
    return rows


def _health(report: FleetReport) -> dict[str, Any] | None:
    if not report.health:
        return None
    lat = np.array([s[1] for s in report.health])
    finishing = np.array([s[1] for s in report.health if "finishing" in s[3]])

    def ms(values: np.ndarray, q: float) -> float | None:
        return _finite(1e3 * float(np.percentile(values, q))) if values.size else None

    return {
        "probes": int(lat.size),
        "failures": sum(1 for s in report.health if not s[2]),
        "p50_ms": ms(lat, 50),
        "p99_ms": ms(lat, 99),
        "max_ms": ms(lat, 100),
        "probes_while_finishing": int(finishing.size),
        "p99_ms_while_finishing": ms(finishing, 99),
    }


def loadtest_record(report: FleetReport, wanted: int, failure: str | None, **extra: Any) -> dict[str, Any]:
    """``fedrec loadtest --json``: the report as one JSON-able object (schema in `fedsim.evaluation.report`)."""
    latency = {
        step: {
            "n": len(v),
            "p50": _finite(_pct(v, 50)),
            "p95": _finite(_pct(v, 95)),
            "p99": _finite(_pct(v, 99)),
            "max": _finite(max(v)) if v else None,
        }
        for step, v in ((s, report.latencies.get(s, [])) for s in PHASE_STEPS)
    }
    rounds = _round_rows(report)
    cpu = [r["cpu_seconds"] for r in rounds if r["cpu_seconds"] is not None]
    device_rounds = sum(r["cohort"] for r in rounds if r["cpu_seconds"] is not None)
    final = report.final_status or {}
    model = final.get("model") or {}
    proc = final.get("process") or {}
    instance = {
        "url": extra.pop("url", None),
        "rounds_committed": report.committed,
        "peak_rss_mb": proc.get("max_rss_mb"),
        "cpu_seconds": _finite(sum(cpu)) if cpu else None,
    }
    privacy = final.get("privacy")
    return {
        **extra,
        "devices": report.devices,
        "rounds_requested": wanted,
        "rounds_finished": report.rounds_finished,
        "rounds_committed": report.committed,
        "seconds": round(report.seconds, 3),
        "ok": failure is None,
        "failure": failure,
        "outcomes": dict(report.outcomes),
        "drops": dict(report.drops),
        "latency_seconds": latency,
        "round_seconds_max": max((r["seconds"] for r in rounds if r["seconds"] is not None), default=None),
        "server_cpu_ms_per_device_round": _finite(1e3 * sum(cpu) / device_rounds) if device_rounds else None,
        "health": _health(report),
        "instances": [instance],
        "bytes_up_median": float(np.median(report.bytes_up)) if report.bytes_up else None,
        "bytes_down_median": float(np.median(report.bytes_down)) if report.bytes_down else None,
        "bytes_per_device_round_mean": _finite(float(np.mean(np.add(report.bytes_up, report.bytes_down))))
        if report.bytes_up
        else None,
        "ledger": None
        if not privacy
        else {k: privacy.get(k) for k in ("epsilon_spent", "epsilon_budget", "delta", "rounds_charged")},
        "final_model": {"version": model.get("version"), "sha256": model.get("sha256")} if model else None,
        "server_rounds": rounds,
        "errors": dict(report.errors),
        "error_examples": dict(report.error_examples),
        "device_errors": report.device_errors,
    }


def _finite(x: float) -> float | None:
    return round(float(x), 4) if np.isfinite(x) else None


#: How a phase ended (`agg_server.status.PHASE_ENDINGS`), in the text report.
_ENDED = {
    "all_answered": "all answered",
    "drops_detected": "drops detected",
    "deadline": "DEADLINE",
    "aborted": "aborted",
}


def _phase_line(row: dict[str, Any]) -> str:
    """``advertise_keys 4.1 (all answered), share_keys 60.0 (DEADLINE), ...``: each phase that ran, with
    how it ended when the server said (a phase cut short by an abort and never run is left out)."""
    parts = []
    for phase, seconds in row["phases"].items():
        ended = row["phase_ends"].get(phase)
        if not seconds and ended in (None, "aborted"):
            continue
        how = _ENDED.get(str(ended), str(ended)) if ended else None
        parts.append(f"{phase} {seconds or 0:.1f}" + (f" ({how})" if how else ""))
    return ", ".join(parts)


def format_loadtest(report: FleetReport, out: TextIO) -> None:
    """The load-test summary tables."""
    out.write(
        f"\n{report.devices} devices, {report.rounds_finished} rounds finished ({report.committed} committed) "
        f"in {report.seconds:.1f} s\n"
    )
    out.write(describe_outcomes(report) + "\n")
    out.write("\nper-phase latency seen by devices (seconds; phases include the long-poll wait)\n")
    out.write(f"{'phase':<8} {'n':>7} {'p50':>8} {'p95':>8} {'p99':>8}\n")
    for step in PHASE_STEPS:
        v = report.latencies.get(step, [])
        out.write(f"{step:<8} {len(v):>7} {_pct(v, 50):>8.3f} {_pct(v, 95):>8.3f} {_pct(v, 99):>8.3f}\n")
    if report.bytes_up:
        out.write(
            f"\nbytes per device per committed round: up median {np.median(report.bytes_up) / 1e3:.1f} kB, "
            f"down median {np.median(report.bytes_down) / 1e3:.1f} kB\n"
        )
    out.write("\nserver, per round\n")
    out.write(
        f"{'round':>5} {'status':<10} {'cohort':>6} {'survivors':>9} {'seconds':>8} {'cpu s':>8} {'ms/device':>9} "
        f"{'peak RSS MB':>12}\n"
    )
    for row in _round_rows(report):
        cpu, per = row["cpu_seconds"], row["cpu_ms_per_device"]
        out.write(
            f"{row['round_id']:>5} {row['status']:<10} {row['cohort']:>6} {row['survivors'] or 0:>9} "
            f"{row['seconds'] or 0:>8.1f} {'—' if cpu is None else f'{cpu:.1f}':>8} "
            f"{'—' if per is None else f'{per:.1f}':>9} {row['peak_rss_mb'] or float('nan'):>12.0f}\n"
        )
        if row["phases"]:
            out.write("      phases (s): " + _phase_line(row) + "\n")
    record = loadtest_record(report, 0, None)
    endings = Counter(how for row in record["server_rounds"] for how in row["phase_ends"].values() if how)
    if endings:
        order = [k for k in _ENDED if k in endings] + sorted(set(endings) - set(_ENDED))
        out.write("phases ended: " + ", ".join(f"{_ENDED.get(k, k)} {endings[k]}" for k in order) + "\n")
    if record["server_cpu_ms_per_device_round"] is not None:
        out.write(f"server CPU per device-round: {record['server_cpu_ms_per_device_round']:.1f} ms\n")
    health = record["health"]
    if health:
        out.write(
            f"GET /v1/health: {health['probes']} probes, {health['failures']} failed, p50 {health['p50_ms']} ms, "
            f"p99 {health['p99_ms']} ms, max {health['max_ms']} ms; while finishing: "
            f"{health['probes_while_finishing']} probes, p99 {health['p99_ms_while_finishing']} ms\n"
        )
    if record["ledger"]:
        led = record["ledger"]
        out.write(
            f"privacy ledger: epsilon {led['epsilon_spent']:.4g} of {led['epsilon_budget']:.4g} spent, "
            f"{led['rounds_charged']} rounds charged\n"
        )
    if record["final_model"]:
        fm = record["final_model"]
        out.write(f"final model: version {fm['version']}, sha256 {fm['sha256']}\n")
    out.write(f"\nerrors by type: {dict(report.errors) if report.errors else 'none'}\n")
