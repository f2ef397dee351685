"""A real Prefect server on a free loopback port, for the tests that need one (deployments, run_deployment)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PREFECT = shutil.which("prefect") or str(Path(sys.executable).with_name("prefect"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group we started (the worker ignores it outside its own group), then SIGKILL."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def cli(env: dict, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    out = subprocess.run([PREFECT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"prefect {' '.join(args)} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out


@contextlib.contextmanager
def running_server(home: Path) -> Iterator[dict]:
    """A real Prefect server on a free loopback port, its state under `home`; yields the environment that
    points a client (or a worker) at it."""
    port = _free_port()
    env = os.environ | {
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "OMP_NUM_THREADS": "1",
        "PWD": str(ROOT),  # prefect.yaml's pull step records the checkout through $PWD
        "RIDGEFILL_WORK": str(home / "work"),
    }
    log = open(home / "server.log", "w")
    cmd = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui", "--analytics-off"]
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, (home / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the Prefect server did not become healthy in 120 s"
            time.sleep(0.5)
        yield env
    finally:
        stop(server)
        log.close()


@pytest.fixture
def prefect_server(tmp_path):
    with running_server(tmp_path) as env:
        yield env
