"""``fedrec-server`` as an operator meets it: the start lines and one server per data_dir."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from fedsim.fleets.server_process import write_server_config


def test_start_lines_and_a_second_server_on_the_same_data_dir_refuses(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    write_server_config(
        config,
        {"server": {"host": "127.0.0.1", "port": 0, "data_dir": str(tmp_path / "data")}, "model": {"n_items": 20}},
    )
    cmd = [sys.executable, "-m", "agg_server", "--config", str(config)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as first:
        _check_first(first, cmd, tmp_path)
    # The lock goes with the process: the folder is free again.
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as again:
        try:
            assert again.stdout is not None and "listening on" in again.stdout.readline()
        finally:
            again.send_signal(signal.SIGTERM)
            assert again.wait(timeout=30) == 0


def _check_first(first: subprocess.Popen[str], cmd: list[str], tmp_path: Path) -> None:
    try:
        assert first.stdout is not None
        listen = first.stdout.readline().strip()
        assert listen.startswith("fedrec-server listening on http://127.0.0.1:")
        url = listen.rsplit(" ", 1)[-1]
        assert first.stdout.readline().strip() == f"dashboard {url}/  metrics {url}/metrics  status {url}/v1/status"
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        assert second.returncode == 2 and second.stdout == ""
        assert second.stderr == (
            f"fedrec-server: error: data_dir {tmp_path / 'data'} is in use by another fedrec-server "
            f"(pid {first.pid}); stop it or choose another data_dir\n"
        )
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0


def test_a_data_dir_that_cannot_be_a_folder_is_one_line_naming_it(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    for data_dir, message in (
        (a_file, f"data_dir {a_file} is not a folder: File exists"),
        (a_file / "sub", f"data_dir {a_file / 'sub'} cannot be created or written: Not a directory"),
    ):
        config = tmp_path / "server.toml"
        write_server_config(
            config, {"server": {"host": "127.0.0.1", "port": 0, "data_dir": str(data_dir)}, "model": {"n_items": 20}}
        )
        proc = subprocess.run(
            [sys.executable, "-m", "agg_server", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr == f"fedrec-server: error: {message}\n"
