"""What the tests that start daemons (tests/slurm_cluster.py, tests/mlflow_server.py) and
run commands need: a free port, who listens on a port, and a command run whose failure
shows its output.

    port = free_port()                # nothing listens there now
    listeners(port)                   # {pid: command line} of the processes listening there
    run_ok(["sbatch", ...], env=env)  # CompletedProcess; on a non-zero exit an AssertionError
                                      # with the command, its exit code, stdout and stderr

A daemon started on a free port may still lose it to another process between the choice and
its bind, and a client would then talk to the other daemon without noticing: so the helpers
that start daemons check that the process listening is theirs (`listeners`) and refuse,
naming the other process, when it is not.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path


def free_port() -> int:
    """A TCP port nothing listens on right now (the kernel's pick for a throwaway socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes of the TCP sockets in state LISTEN (0A) on `port`, IPv4 and IPv6."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                inodes.add(fields[9])
    return inodes


def listeners(port: int) -> dict[int, str]:
    """{pid: command line} of every process holding a listening socket on `port` (all
    processes are visible to root; others only their own)."""
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port)}
    found = {}
    if not inodes:
        return found
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if inodes.intersection(_links(proc / "fd")):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found[int(proc.name)] = cmdline.strip()
        except OSError:   # gone meanwhile, or not ours to read
            continue
    return found


def _links(fd_dir: Path) -> set[str]:
    """What a process's file descriptors point at; one closed while listed is skipped (the
    listing's own descriptor, in this process)."""
    out = set()
    for fd in fd_dir.iterdir():
        try:
            out.add(os.readlink(fd))
        except OSError:
            continue
    return out


def run_ok(cmd, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) that fails the test with the
    command's stdout and stderr when it exits non-zero (check=True says only "returned
    non-zero exit status 1", and the reason is in the stderr it drops)."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited with {done.returncode}\n"
                             f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n"
                             f"{done.stderr[-5000:]}")
    return done
