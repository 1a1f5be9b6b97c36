"""A real `mlflow server` on loopback for tests (sqlite store, proxied artifacts, 1 worker).

    uri, stop = start_mlflow_server(tmp_dir)    # "http://127.0.0.1:PORT", ready to use
    ...
    stop()

or, in a test module, `from mlflow_server import mlflow_server_fixture` and take the
`mlflow_server` fixture (one server per test module: starting one costs ~10 s). A server
that does not come up fails the test with its log; it never skips, because a skipped
server test proves nothing.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

READY_TIMEOUT_S = 60.0


def free_port() -> int:
    """A port nothing listens on right now (the kernel's pick for a throwaway socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the whole process group (the server forks uvicorn/gunicorn workers), then
    SIGKILL whatever is still there after 10 s."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def start_mlflow_server(tmp_dir: str | Path) -> tuple[str, Callable[[], None]]:
    """Start `mlflow server` with a sqlite store and proxied artifacts under tmp_dir; return
    (uri, stop) once /health answers. Raises RuntimeError with the server log otherwise."""
    tmp_dir = Path(tmp_dir).absolute()
    tmp_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    mlflow_bin = Path(sys.executable).parent / "mlflow"
    cmd = [str(mlflow_bin), "server",
           "--backend-store-uri", f"sqlite:///{tmp_dir}/mlflow.db",
           "--artifacts-destination", str(tmp_dir / "artifacts"),
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    # The job runner (huey) is not needed to track runs and only slows start-up.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    log_path = tmp_dir / "server.log"
    with open(log_path, "wb") as log:
        # Own session = own process group, so stop() reaches the workers too.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=tmp_dir, start_new_session=True)

    def stop() -> None:
        _stop_group(proc)

    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if _healthy(uri):
            return uri, stop
        if proc.poll() is not None:
            break
        time.sleep(0.25)
    stop()
    why = (f"exited with code {proc.returncode}" if proc.returncode is not None
           else f"not healthy after {READY_TIMEOUT_S:.0f} s")
    raise RuntimeError(f"mlflow server at {uri} {why}; log {log_path}:\n"
                       + log_path.read_text(errors="replace")[-5000:])


# Named apart from the fixture so that a test taking `mlflow_server` does not shadow the import.
@pytest.fixture(scope="module", name="mlflow_server")
def mlflow_server_fixture(tmp_path_factory) -> Iterator[str]:
    """URI of a real MLflow server shared by one test module."""
    uri, stop = start_mlflow_server(tmp_path_factory.mktemp("mlflow_server"))
    try:
        yield uri
    finally:
        stop()
