"""A real `mlflow server` on loopback for tests (sqlite store, proxied artifacts, 1 worker).

    uri, stop = start_mlflow_server(tmp_dir)    # "http://127.0.0.1:PORT", ready to use
    ...
    stop()

or, in a test module, `from mlflow_server import mlflow_server_fixture` and take the
`mlflow_server` fixture (one server per test module: starting one costs ~10 s). A server
that does not come up fails the test with its log; it never skips, because a skipped
server test proves nothing.

The port is a free one (tests/daemons.py), and the server is used only once the process
listening there is its own: a port taken by another process between the choice and the
server's bind is tried again on another port (up to 3 times), and a foreign server that
answers there is never taken for this one (it is named in the error).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemons import free_port, listeners

# Start-up imports mlflow and its web stack: ~10 s alone, several times that beside a busy
# suite on 2 cores. The wait ends as soon as the server answers, or its process exits.
READY_TIMEOUT_S = 180.0
PORT_TRIES = 3


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


def _own(proc: subprocess.Popen, port: int) -> dict[int, str]:
    """The processes listening on `port` that are not the server's (its process group)."""
    foreign = {}
    for pid, cmd in listeners(port).items():
        try:
            if os.getpgid(pid) == proc.pid:
                continue
        except ProcessLookupError:
            continue
        foreign[pid] = cmd
    return foreign


def start_mlflow_server(tmp_dir: str | Path) -> tuple[str, Callable[[], None]]:
    """Start `mlflow server` with a sqlite store and proxied artifacts under tmp_dir; return
    (uri, stop) once /health answers from this server. Raises RuntimeError with the server
    log otherwise."""
    tmp_dir = Path(tmp_dir).absolute()
    tmp_dir.mkdir(parents=True, exist_ok=True)
    mlflow_bin = Path(sys.executable).parent / "mlflow"
    # The job runner (huey) is not needed to track runs and only slows start-up.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    log_path = tmp_dir / "server.log"
    for _ in range(PORT_TRIES):
        port = free_port()
        uri = f"http://127.0.0.1:{port}"
        cmd = [str(mlflow_bin), "server",
               "--backend-store-uri", f"sqlite:///{tmp_dir}/mlflow.db",
               "--artifacts-destination", str(tmp_dir / "artifacts"),
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        with open(log_path, "wb") as log:
            # Own session = own process group, so stop() reaches the workers too.
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=tmp_dir, start_new_session=True)

        def stop(proc=proc) -> None:
            _stop_group(proc)

        deadline, why = time.monotonic() + READY_TIMEOUT_S, None
        while time.monotonic() < deadline and proc.poll() is None:
            foreign = _own(proc, port)
            if foreign:
                why = "port taken by " + ", ".join(f"pid {p} ({c})" for p, c in foreign.items())
                break
            if listeners(port) and _healthy(uri):
                return uri, stop
            time.sleep(0.25)
        stop()
        text = log_path.read_text(errors="replace")
        if why is None and "address already in use" in text.lower():
            why = "port taken"
        if why is None:
            why = (f"exited with code {proc.returncode}" if proc.returncode is not None
                   else f"not healthy after {READY_TIMEOUT_S:.0f} s")
            break
    raise RuntimeError(f"mlflow server at {uri}: {why}; log {log_path}:\n" + text[-5000:])


# Named apart from the fixture so that a test taking `mlflow_server` does not shadow the import.
@pytest.fixture(scope="module", name="mlflow_server")
def mlflow_server_fixture(tmp_path_factory) -> Iterator[str]:
    """URI of a real MLflow server shared by one test module."""
    uri, stop = start_mlflow_server(tmp_path_factory.mktemp("mlflow_server"))
    try:
        yield uri
    finally:
        stop()
