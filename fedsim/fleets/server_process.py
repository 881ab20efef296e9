"""A `fedrec-server` child process on a free loopback port (`ServerProcess`), the TOML file it reads
(`write_server_config`), and a child process that times its ``GET /v1/health`` (`HealthProbe`).

Invariants:
- `ServerProcess` always stops its server (SIGTERM, then SIGKILL after a grace period), and on Linux the
  server gets SIGTERM when the process that started it dies, however it dies.
- The health probe runs in its own process, so the fleet's own load on its event loop does not count as
  server latency.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from protocol.errors import FedRecError

__all__ = ["ServerProcess", "write_server_config", "HealthProbe"]


def write_server_config(path: Path, settings: dict[str, dict[str, Any]]) -> None:
    """Write a server TOML file from nested {table: {key: value}} (strings, numbers, booleans)."""
    lines = []
    for table, values in settings.items():
        lines.append(f"[{table}]")
        for key, value in values.items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str | Path):
                text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
            else:
                text = repr(value)
            lines.append(f"{key} = {text}")
        lines.append("")
    path.write_text("\n".join(lines))


def _die_with_parent() -> None:
    """In the server child (Linux): get SIGTERM when the process that started it dies, however it dies
    (a killed demo must not leave its server running)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


class ServerProcess:
    """`python -m agg_server --config FILE` as a child process on a free loopback port."""

    def __init__(self, config: Path, log_path: Path) -> None:
        self.config = config
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> ServerProcess:
        log = open(self.log_path, "a")  # noqa: SIM115 - the child keeps its own descriptor
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agg_server", "--config", str(self.config), "--port", "0"],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
            )
        finally:
            log.close()
        assert self.proc.stdout is not None
        try:
            line = self.proc.stdout.readline()
        except BaseException:  # interrupted (SIGINT, a demo's SIGTERM) while the server starts: stop it too
            self.stop()
            raise
        if "listening on" not in line:
            self.stop()
            raise FedRecError(f"the server did not start: {self.last_error()}")
        self.url = line.strip().rsplit(" ", 1)[-1]
        return self

    def last_error(self) -> str:
        """The server's own error line from its log (its last line when none says 'error')."""
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        errors = [ln for ln in lines if "error" in ln.lower()]
        return (errors or lines or [f"no output (log {self.log_path})"])[-1]

    def stop(self, grace: float = 20.0) -> int | None:
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode

    def __exit__(self, *exc: object) -> None:
        self.stop()


_PROBE = r"""
import sys, time, urllib.request
url = sys.argv[1]
while True:
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            state = r.read().decode().replace(" ", "")
        ok = 1
    except Exception as exc:
        state, ok = type(exc).__name__, 0
    print(f"{time.time():.3f} {time.perf_counter() - t0:.4f} {ok} {state}", flush=True)
    time.sleep(0.05)
"""


class HealthProbe:
    """``GET /v1/health`` every 50 ms from a child process (so the fleet's own load on its event loop
    does not count as server latency); `samples` holds (unix time, seconds, ok, body) per probe."""

    def __init__(self, url: str, *, enabled: bool = True) -> None:
        self.url, self.enabled = url, enabled
        self.samples: list[tuple[float, float, bool, str]] = []
        self._proc: subprocess.Popen[str] | None = None
        self._out: Any = None

    def __enter__(self) -> HealthProbe:
        if self.enabled and self.url.startswith("http://"):  # https would need the CA: not probed
            self._out = tempfile.TemporaryFile("w+")
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _PROBE, f"{self.url}/v1/health"], stdout=self._out, text=True
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        self._proc.wait()
        self._out.seek(0)
        for line in self._out.read().splitlines():
            parts = line.split(" ", 3)
            if len(parts) == 4:
                self.samples.append((float(parts[0]), float(parts[1]), parts[2] == "1", parts[3]))
        self._out.close()
