"""A real single-node SLURM cluster for the tests (Debian's slurm-wlm + munge).

`start_cluster(dir)` writes slurm.conf under `dir` (CPUs and RealMemory from `slurmd -C`,
proctrack/linuxproc, task/none, state and logs in `dir`; `gpus=N` adds N fake GPUs as gres
gpu:fake:N), starts munged (if not running), slurmctld and slurmd, waits until the node is
idle and returns the environment (SLURM_CONF) plus a stop function that kills the daemons by
pid. Raises `SlurmUnavailable` with the reason when SLURM cannot be started here;
`start_cluster_for_test(dir)` turns that into a skip, or a failure under
MEMTRAIN_REQUIRE_SLURM=1 (CI), where the tests must run.

Each cluster listens on ports of its own: SlurmctldPort and SlurmdPort are free ports picked
when its slurm.conf is written (SLURM's defaults, 6817 and 6818, may be held by a site's
SLURM or another checkout's suite). Once the daemons are up, the processes listening on those
ports must be this cluster's slurmctld and slurmd; a foreign process there is refused by
name (`SlurmUnavailable`), never silently used. So clusters of test processes running side by
side (the suite's two workers, two checkouts' suites) run at the same time, each with its own
state and spool folders.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

from daemons import free_port, listeners


class SlurmUnavailable(RuntimeError):
    pass


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _run(cmd, env=None, timeout=30):
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def _munge() -> None:
    if _run(["sh", "-c", "munge -n | unmunge"]).returncode == 0:
        return
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    done = _run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"])
    for _ in range(50):
        if _run(["sh", "-c", "munge -n | unmunge"]).returncode == 0:
            return
        time.sleep(0.1)
    raise SlurmUnavailable(f"munged did not start: {done.stderr.strip()}")


def start_cluster(d: Path, gpus: int = 0):
    """`gpus` > 0: the node offers that many GPUs of type "fake" (gres gpu:fake:<gpus>),
    character devices made with /dev/null's numbers: SLURM allocates and binds them
    (CUDA_VISIBLE_DEVICES, SLURM_JOB_GPUS, SLURM_STEP_GPUS) as it would real ones."""
    for tool in ("slurmctld", "slurmd", "sbatch", "munged"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            raise SlurmUnavailable(f"{tool} not installed (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        raise SlurmUnavailable("starting slurmd needs root")
    d = Path(d).absolute()
    for sub in ("state", "spool", "log"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    probe = _run(["slurmd", "-C"]).stdout
    cpus = int(re.search(r"CPUs=(\d+)", probe).group(1))
    mem = int(re.search(r"RealMemory=(\d+)", probe).group(1)) - 512
    conf = d / "slurm.conf"
    ports = {"slurmctld": free_port(), "slurmd": free_port()}
    while ports["slurmd"] == ports["slurmctld"]:
        ports["slurmd"] = free_port()
    node = f"NodeName=localhost CPUs={cpus} RealMemory={mem}"
    if gpus:
        node += f" Gres=gpu:fake:{gpus}"
        for i in range(gpus):
            dev = d / f"fakegpu{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))   # as /dev/null
        # slurmd reads gres.conf from slurm.conf's folder.
        (d / "gres.conf").write_text(f"NodeName=localhost Name=gpu Type=fake "
                                     f"File={d}/fakegpu[0-{gpus - 1}]\n")
    conf.write_text("\n".join([
        "ClusterName=memtrain-test", "SlurmctldHost=localhost", "SlurmUser=root",
        f"SlurmctldPort={ports['slurmctld']}", f"SlurmdPort={ports['slurmd']}",
        "SlurmdUser=root", "AuthType=auth/munge", f"StateSaveLocation={d}/state",
        f"SlurmdSpoolDir={d}/spool", f"SlurmctldPidFile={d}/slurmctld.pid",
        f"SlurmdPidFile={d}/slurmd.pid", f"SlurmctldLogFile={d}/log/slurmctld.log",
        f"SlurmdLogFile={d}/log/slurmd.log", "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "MpiDefault=none", "ReturnToService=2",
        "MailProg=/bin/true", "JobRequeue=1", "KillWait=10",
        *(["GresTypes=gpu"] if gpus else []), f"{node} State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP", ""]))

    def stop() -> None:
        pids = []
        for name in ("slurmd.pid", "slurmctld.pid"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int((d / name).read_text()))
                os.kill(pids[-1], signal.SIGTERM)
        # Gone before the next test starts (a killed job's steps end with slurmd).
        deadline = time.time() + 30
        while time.time() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)

    # A job's ranks come from SLURM; a launcher's variables left in this process (RANK, ...)
    # would override SLURM_PROCID in every task (train.distributed.resolve_env).
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["SLURM_CONF"] = str(conf)
    _munge()
    for cmd in (["slurmctld", "-f", str(conf)], ["slurmd", "-f", str(conf), "-N", "localhost"]):
        done = _run(cmd, env=env)
        if done.returncode != 0:
            stop()
            raise SlurmUnavailable(f"{cmd[0]} failed: {done.stderr.strip()}")

    # The node registers within seconds on an idle machine; under load (slurmd and
    # slurmctld starting beside a busy test suite) it has taken 30 s.
    deadline, state = time.monotonic() + 120, ""
    while time.monotonic() < deadline:
        state = _run(["sinfo", "-h", "-o", "%T"], env=env).stdout.strip()
        if state == "idle":
            try:
                _own_ports(d, ports)
            except SlurmUnavailable:
                stop()
                raise
            return env, stop
        time.sleep(0.2)
    stop()
    raise SlurmUnavailable(f"node not idle after 120 s (state {state!r}); see {d}/log")


def _own_ports(d: Path, ports: dict[str, int]) -> None:
    """The processes listening on the cluster's ports are its own daemons (pid files)."""
    for daemon, port in ports.items():
        pid = int((d / f"{daemon}.pid").read_text())
        held = listeners(port)
        if pid not in held:
            foreign = ", ".join(f"pid {p} ({cmd})" for p, cmd in held.items()) or "nothing"
            raise SlurmUnavailable(f"{daemon} of {d} (pid {pid}) does not listen on its port "
                                   f"{port}: {foreign} does; see {d}/log")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"   # a daemon that exited but was not reaped holds no port


def start_cluster_for_test(d: Path, gpus: int = 0):
    """`start_cluster(d, gpus)` for a test: skip it where SLURM cannot start, fail instead when
    MEMTRAIN_REQUIRE_SLURM=1 says the SLURM tests must run."""
    import pytest

    try:
        return start_cluster(d, gpus)
    except SlurmUnavailable as err:
        if os.environ.get("MEMTRAIN_REQUIRE_SLURM") == "1":
            pytest.fail(f"SLURM is required here (MEMTRAIN_REQUIRE_SLURM=1): {err}")
        pytest.skip(f"SLURM cannot be started here: {err}")
