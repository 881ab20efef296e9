"""``/v1/health`` while hundreds of partial request bodies are being opened: one `fedrec-server` process, a
health probe every 20 ms from its own process, and an attacker process that keeps opening connections
which send a request head and part of a body, then stall, in waves (``--wave`` connections at a time,
held ``--hold`` seconds, then dropped and opened again) for ``--seconds``.

Reports health p50/p99/max and failures over the attack window (the opening bursts included, which a
measurement that starts after the connections are open does not see), the probe's figures with no
attack, and what the attacker's connections got (held open, answered, reset).

The attacker connects from 127.0.0.2 (``--attacker-address``), the probe from 127.0.0.1: on the server
they are two sources, as an abusive client and a load balancer are.  Every run starts a fresh server.

Run: ``PYTHONPATH=. python benchmarks/bench_health_flood.py`` (defaults: 300-connection waves for 20 s,
the shipped server defaults).  Prints one JSON object as its last line.
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
        except Exception:
            ok = "0"
        f.write(f"{time.time():.3f} {time.perf_counter() - t0:.4f} {ok}\n")
        f.flush()
        time.sleep(0.02)
"""

# Waves of connections that send a head and 100 bytes of a declared 60,000-byte body to the open
# registration route, then stall.  Counts per connection: still open at the end of the hold, answered
# (an HTTP status came back), or reset/closed without an answer.
_ATTACK = r"""
import asyncio, json, sys, time
host, port, seconds, wave, hold, source, out = (sys.argv[1], int(sys.argv[2]), float(sys.argv[3]),
    int(sys.argv[4]), float(sys.argv[5]), sys.argv[6], sys.argv[7])
HEAD = (b"POST /v1/devices HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
        b"Content-Length: 60000\r\n\r\n" + b"\x91" * 100)
counts = {"opened": 0, "held": 0, "answered": 0, "closed": 0, "refused": 0}

async def one(stop_at):
    try:
        reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
    except OSError:
        counts["refused"] += 1
        return
    counts["opened"] += 1
    try:
        writer.write(HEAD)
        try:
            data = await asyncio.wait_for(reader.read(64), max(0.0, stop_at - time.monotonic()))
        except asyncio.TimeoutError:
            counts["held"] += 1
            return
        counts["answered" if data.startswith(b"HTTP/") else "closed"] += 1
    except OSError:
        counts["closed"] += 1
    finally:
        writer.transport.abort()

async def main():
    end = time.time() + seconds
    with open(out, "w") as f:
        f.write(f"start {time.time():.3f}\n")
        waves = 0
        while time.time() < end:
            stop_at = time.monotonic() + hold
            await asyncio.gather(*(one(stop_at) for _ in range(wave)))
            waves += 1
        f.write(f"end {time.time():.3f}\n")
        f.write(json.dumps({"waves": waves, **counts}) + "\n")

asyncio.run(main())
"""


def _percentiles(samples: list[tuple[float, float, bool]], window: tuple[float, float]) -> dict[str, float]:
    inside = [(lat, ok) for t, lat, ok in samples if window[0] <= t <= window[1]]
    lat = np.array([x for x, _ in inside]) * 1000.0
    return {
        "probes": len(inside),
        "failures": sum(1 for _, ok in inside if not ok),
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else float("nan"),
        "max_ms": float(lat.max()) if lat.size else float("nan"),
    }


def _read_probe(path: Path) -> list[tuple[float, float, bool]]:
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.append((float(parts[0]), float(parts[1]), parts[2] == "1"))
    return out


def _run(root: Path, args: argparse.Namespace, attack: bool) -> dict[str, object]:
    cfg = root / "server.toml"
    server_table: dict[str, object] = {"host": "127.0.0.1", "port": 0, "data_dir": str(root / "data")}
    model = {"n_items": 1000, "bits": 32}
    write_server_config(cfg, {"server": server_table, "model": model, "log": {"level": "warning"}})
    with ServerProcess(cfg, root / "server.log") as server:
        host, port = server.url.split("//")[1].split(":")
        probe_out, attack_out = root / "health.txt", root / "attack.txt"
        probe = subprocess.Popen([sys.executable, "-c", _PROBE, f"{server.url}/v1/health", str(probe_out)])
        try:
            time.sleep(1.0)
            t0 = time.time()
            if attack:
                attacker = subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        _ATTACK,
                        host,
                        port,
                        str(args.seconds),
                        str(args.wave),
                        str(args.hold),
                        args.attacker_address,
                        str(attack_out),
                    ]
                )
                attacker.wait(timeout=args.seconds + args.hold + 120)
            else:
                time.sleep(args.seconds)
            t1 = time.time()
        finally:
            probe.terminate()
            probe.wait()
    result: dict[str, object] = {"attack": attack, **_percentiles(_read_probe(probe_out), (t0, t1))}
    if attack:
        result["attacker"] = json.loads(attack_out.read_text().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the attack (and of the calm run)")
    parser.add_argument("--wave", type=int, default=300, help="partial bodies opened at once")
    parser.add_argument("--hold", type=float, default=2.0, help="seconds each wave is held before it is dropped")
    parser.add_argument("--attacker-address", default="127.0.0.2", help="loopback source address of the attacker")
    parser.add_argument("--no-calm", action="store_true", help="skip the run without attack")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for attack in (False, True) if not args.no_calm else (True,):
            root = Path(tmp) / ("attack" if attack else "calm")
            root.mkdir()
            results.append(_run(root, args, attack))
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
