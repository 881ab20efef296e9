"""Resource limits under attack: one fedrec-server runs an honest round twice, alone and with 300
partial request bodies plus repeated 64 MiB garbage uploads in flight; reports ``/v1/health`` latency
(p50/p99/max over the attack's window, or the round's without attack, and p99/max during the round
itself; probed every 20 ms from a separate process) and the server's peak resident memory
(``VmHWM`` of ``/proc/<pid>/status``, a fresh server process per run).

Aims: health p99 <= 100 ms under attack, peak memory under attack < 2 x the honest run's.

The garbage goes to the masked-input route of the round the fleet is in (read from ``/v1/status``), so
the server reads it up to that route's limit (64 KiB + 4·L + 512·k) and tries to decode it.

Run: ``PYTHONPATH=. python benchmarks/bench_abuse.py --devices 20`` (default model 15,625 items x 64 bits:
L = 10^6, a 4 MB masked input per device; ``--n-items 1682`` is the ML-100k shape, 3706 the ML-1M
shape).  Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fedsim.data.synthetic import synthetic
from fedsim.fleets.demo import run_loadtest
from fedsim.fleets.local import FleetConfig
from fedsim.fleets.server_process import ServerProcess, write_server_config

_PROBE = r"""
import sys, time, urllib.request
url, out = sys.argv[1], sys.argv[2]
with open(out, "w") as f:
    while True:
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                r.read()
            ok = "1"
        except Exception as exc:
            ok = "0"
        f.write(f"{time.time():.3f} {time.perf_counter() - t0:.4f} {ok}\n")
        f.flush()
        time.sleep(0.02)
"""

# 300 connections that send a head and part of a body, then stall; and, in a loop, 64 MiB of garbage
# from a registered device to the masked-input route (declared, then chunked without a length).
_ATTACK = r"""
import asyncio, json, sys, time, urllib.request
host, port, seconds, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
sys.path.insert(0, ".")
from protocol.codec import decode, encode
from protocol.messages import RegisterRequest

def register():
    req = urllib.request.Request(f"http://{host}:{port}/v1/devices", data=encode(RegisterRequest(platform="abuse")),
                                 headers={"Content-Type": "application/msgpack"})
    with urllib.request.urlopen(req) as r:
        return decode(r.read()).token

def open_round():
    # the round the honest fleet is in (or round 1 before any): garbage to it is read up to the route's
    # limit and decoded, garbage to a round that is not open is refused before its body is read
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/v1/status", timeout=5) as r:
            current = json.loads(r.read()).get("round") or {}
        return int(current.get("round_id", 1))
    except Exception:
        return 1

async def garbage(token, chunked):
    reader, writer = await asyncio.open_connection(host, port)
    size = 64 * 1024 * 1024
    length = b"Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {size}\r\n".encode()
    round_id = await asyncio.to_thread(open_round)
    writer.write(f"POST /v1/rounds/{round_id}/masked HTTP/1.1\r\n".encode()
                 + b"Host: x\r\nContent-Type: application/msgpack\r\n"
                 + f"Authorization: Bearer {token}\r\n".encode() + length + b"\r\n")
    chunk = bytes(range(256)) * 4096
    answer = asyncio.create_task(reader.read(64))
    sent = 0
    try:
        while sent < size and not answer.done():
            writer.write(b"%x\r\n" % len(chunk) + chunk + b"\r\n" if chunked else chunk)
            await writer.drain()
            sent += len(chunk)
    except ConnectionError:
        pass
    try:
        head = await asyncio.wait_for(answer, 30)
    except Exception:
        head = b"no answer"
    writer.close()
    return head.split(b"\r\n")[0].decode(errors="replace"), sent, round_id

async def main():
    token = register()
    head = b"POST /v1/devices HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\nContent-Length: 60000\r\n\r\n"
    writers = []
    for _ in range(300):
        _, w = await asyncio.open_connection(host, port)
        w.write(head + b"\x91" * 100)
        writers.append(w)
    stop = time.time() + seconds
    with open(out, "w") as f:
        f.write(f"start {time.time():.3f}\n")
        while time.time() < stop:
            for chunked in (False, True):
                status, sent, round_id = await garbage(token, chunked)
                f.write(f"{time.time():.3f} round={round_id} chunked={chunked} sent={sent} answer={status}\n")
                f.flush()
        f.write(f"end {time.time():.3f}\n")
    for w in writers:
        w.close()

asyncio.run(main())
"""


def _vmhwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def _run(root: Path, users: list, args: argparse.Namespace, attack: bool) -> dict:
    cfg = root / "server.toml"
    write_server_config(
        cfg,
        {
            "server": {
                "host": "127.0.0.1",
                "port": 0,
                "data_dir": str(root / "data"),
                "body_timeout": args.body_timeout,
            },
            "model": {"n_items": args.n_items, "bits": args.bits, "unobserved_weight": 0.0},
            "rounds": {
                "cohort_size": args.devices,
                "min_cohort": 3,
                "advertise_timeout": 60.0,
                "share_keys_timeout": 60.0,
                "masked_input_timeout": 60.0,
                "unmask_timeout": 60.0,
                "round_interval": 0.5,
            },
            "log": {"level": "warning"},
        },
    )
    with ServerProcess(cfg, root / "server.log") as server:
        assert server.proc is not None
        host, port = server.url.split("//")[1].split(":")
        probe_out, attack_out = root / "health.txt", root / "attack.txt"
        probe = subprocess.Popen([sys.executable, "-c", _PROBE, f"{server.url}/v1/health", str(probe_out)])
        attacker = None
        if attack:
            attacker = subprocess.Popen(
                [sys.executable, "-c", _ATTACK, host, port, str(args.attack_seconds), str(attack_out)]
            )
            time.sleep(2.0)  # the partial bodies are open before the round starts
        try:
            fleet = FleetConfig(
                url=server.url, store_root=root / "devices", n_items=args.n_items, bits=args.bits, rounds=args.rounds
            )
            t0 = time.time()
            report = run_loadtest(fleet, users, args.workers, worker_nice=args.worker_nice)
            t1 = time.time()
            if attacker is not None:
                attacker.wait(timeout=args.attack_seconds + 120)
        finally:
            probe.terminate()
            probe.wait()
            if attacker is not None and attacker.poll() is None:
                attacker.kill()
                attacker.wait()
        peak = _vmhwm_mb(server.proc.pid)
    lines = [ln.split() for ln in probe_out.read_text().splitlines() if ln.count(" ") == 2]
    window = (t0, t1)
    attack_lines: list[str] = []
    if attack:
        attack_lines = attack_out.read_text().splitlines()
        start = float(attack_lines[0].split()[1])
        end = float(attack_lines[-1].split()[1]) if attack_lines[-1].startswith("end") else t1
        window = (start, end)
    lat = np.array([float(b) for a, b, ok in lines if window[0] <= float(a) <= window[1]])
    fails = sum(1 for a, b, ok in lines if window[0] <= float(a) <= window[1] and ok != "1")
    in_round = np.array([float(b) for a, b, ok in lines if t0 <= float(a) <= t1])
    answers: dict[str, int] = {}
    for ln in attack_lines[1:-1]:
        key = ln.split("answer=")[1] if "answer=" in ln else ln
        answers[key] = answers.get(key, 0) + 1
    return {
        "attack": attack,
        "rounds_finished": report.rounds_finished,
        "outcomes": dict(report.outcomes),
        "round_seconds": round(t1 - t0, 2),
        "health_probes": int(lat.size),
        "health_failures": fails,
        "health_p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 1) if lat.size else None,
        "health_p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 1) if lat.size else None,
        "health_max_ms": round(float(lat.max()) * 1e3, 1) if lat.size else None,
        "round_probes": int(in_round.size),
        "round_health_p99_ms": round(float(np.percentile(in_round, 99)) * 1e3, 1) if in_round.size else None,
        "round_health_max_ms": round(float(in_round.max()) * 1e3, 1) if in_round.size else None,
        "server_peak_rss_mb": round(peak, 1),
        "garbage_uploads": answers,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--n-items", type=int, default=15625)
    p.add_argument("--bits", type=int, default=64)
    p.add_argument("--attack-seconds", type=float, default=20.0)
    p.add_argument("--body-timeout", type=float, default=30.0, help="server.body_timeout")
    p.add_argument("--workers", type=int, default=1, help="fleet worker processes (1: the fleet runs in this process)")
    p.add_argument(
        "--worker-nice",
        type=int,
        default=0,
        help="with --workers > 1, lower the fleet workers' priority by this much, so that the honest devices "
        "(which share this machine's cores with the server only in a benchmark) do not set the server's latency",
    )
    args = p.parse_args()
    data = synthetic(n_users=args.devices, n_items=args.n_items, ratings_per_user=40, seed=0)
    users = []
    for u in range(data.n_users):
        mask = data.users == u
        users.append((np.asarray(data.items[mask]), np.asarray(data.ratings[mask], dtype=np.float64)))
    results = []
    for attack in (False, True):
        with tempfile.TemporaryDirectory(prefix="fedrec-abuse-") as tmp:
            results.append(_run(Path(tmp), users, args, attack))
            print(json.dumps(results[-1]), flush=True)
    honest, attacked = results
    summary = {
        "L": args.n_items * args.bits,
        "devices": args.devices,
        "workers": args.workers,
        "worker_nice": args.worker_nice,
        "honest": honest,
        "attacked": attacked,
        "peak_ratio": round(attacked["server_peak_rss_mb"] / honest["server_peak_rss_mb"], 2),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
