"""Who am I: rank, world and master from torchrun/deepspeed, from SLURM (srun), or alone."""

import os
import subprocess
import sys
import time

import pytest
from train_helpers import ROOT

from train.deepspeed_setup import STALE_LOCK_S, clear_stale_build_locks, use_environments_ninja
from train.distributed import first_slurm_host, resolve_env


def test_torchrun_and_deepspeed_variables_are_taken_as_they_are():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node7",
           "MASTER_PORT": "29501"}
    who = resolve_env(env)
    assert (who.rank, who.world_size, who.local_rank, who.master_addr, who.master_port) == \
        (3, 4, 1, "node7", 29501)
    assert who.launcher == "torchrun/deepspeed"


def test_srun_tasks_are_translated_from_slurm_variables():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu-a", "SLURM_JOB_ID": "12345"}
    who = resolve_env(env)
    assert (who.rank, who.world_size, who.local_rank, who.launcher) == (5, 8, 1, "slurm")
    assert who.master_addr == "gpu-a"
    assert who.master_port == 10000 + 12345 % 10000  # the same on every task, no talking
    # The standard variables are filled in for torch.distributed's env:// rendezvous.
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == \
        ("5", "8", "1", "gpu-a")


def test_a_slurm_node_range_gives_its_first_host_without_scontrol(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the fallback parser
    assert first_slurm_host("gpu[03-06,09],cpu1") == "gpu03"
    assert first_slurm_host("nodeA,nodeB") == "nodeA"


def test_a_plain_process_is_a_world_of_one_on_a_free_port():
    env: dict = {}
    who = resolve_env(env)
    assert (who.rank, who.world_size, who.launcher) == (0, 1, "single")
    assert who.master_addr == "127.0.0.1" and who.master_port > 0
    assert env["WORLD_SIZE"] == "1"


def test_deepspeed_imported_by_a_rank_leaves_mlflow_unimported_and_still_importable():
    # DeepSpeed's autotuner imports MLflow with `import deepspeed` (2.2 s of CPU on every
    # rank, for logging memtrain never uses); a rank that tracks nothing must not pay it, and
    # the rank that tracks imports MLflow afterwards as usual. A fresh process: this one
    # has imported both.
    code = ("import sys\n"
            "from train.deepspeed_setup import import_deepspeed\n"
            "import_deepspeed()\n"
            "import deepspeed.autotuning.autotuner as tuner\n"
            "print('mlflow' in sys.modules, tuner.has_mlflow)\n"
            "import mlflow\n"
            "print(mlflow.MlflowClient.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[-2:] == ["False False", "MlflowClient"]   # after DeepSpeed's own log lines


def test_a_stale_op_build_lock_is_removed_with_a_warning_and_a_fresh_one_kept(tmp_path):
    # A DeepSpeed op build killed midway leaves <op>/lock; every later start waited on it.
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    with pytest.warns(UserWarning, match="deepspeed_shm_comm/lock.*left by a build"):
        assert clear_stale_build_locks(tmp_path) == [stale]
    assert not stale.exists() and fresh.exists()   # a build may hold that one now


@pytest.mark.parametrize("has_ninja", [True, False])
def test_the_environments_ninja_comes_first_on_path_so_ops_build_once(tmp_path, monkeypatch,
                                                                      has_ninja):
    # Two ninjas on one op folder rebuilt DeepSpeed's op at every switch (a minute each):
    # every rank builds with the ninja of its own environment, wherever PATH put it.
    env_bin = tmp_path / "env" / "bin"
    env_bin.mkdir(parents=True)
    if has_ninja:
        (env_bin / "ninja").write_text("#!/bin/sh\n")
    monkeypatch.setattr(sys, "executable", str(env_bin / "python"))
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/local/bin", "/usr/bin", str(env_bin)]))
    assert use_environments_ninja() is has_ninja
    want = [str(env_bin), "/usr/local/bin", "/usr/bin"] if has_ninja else \
        ["/usr/local/bin", "/usr/bin", str(env_bin)]
    assert os.environ["PATH"].split(os.pathsep) == want
    assert use_environments_ninja() is False   # already first: nothing to do
