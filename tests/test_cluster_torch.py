"""A GPU job on a venv whose torch cannot use the GPUs is refused, at submit time (the torch
of --python) and at start (a rank with GPUs allocated but no CUDA does not fall back to the
CPU); both errors name the fix (TORCH_SPEC and the CUDA wheel; cu126 for V100). --dry-run
only warns."""

import subprocess
import sys

import pytest
import torch

from cluster import torch_check
from cluster.submit import main_submit
from train import distributed, gpu_binding, process_group
from train.config import ConfigError

CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]


@pytest.fixture(autouse=True)
def no_sbatch(tmp_path, monkeypatch):
    """A real submit (no --dry-run) must stop before sbatch in these tests."""
    run = subprocess.run

    def refuse(cmd, *args, **kwargs):
        assert cmd[0] != "sbatch", f"sbatch called: {cmd}"
        return run(cmd, *args, **kwargs)
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.chdir(tmp_path)


def _submit(capsys, monkeypatch, info, *argv, dry_run=False):
    """Exit code and stderr of `memtrain submit`; an accepted job is shown (--dry-run)."""
    monkeypatch.setattr(torch_check, "probe", lambda python: info)
    argv = ["--config", "copy-rmt", "--nodes", "4", *argv]
    code = main_submit([*argv, "--dry-run"] if dry_run else argv)
    return code, capsys.readouterr().err


def _accepted(capsys, monkeypatch, info, *argv):
    code, err = _submit(capsys, monkeypatch, info, *argv, dry_run=True)
    return code == 0 and "warning" not in err


def test_the_probe_reads_this_venvs_torch():
    info = torch_check.probe(sys.executable)
    assert info["version"] == torch.__version__ and info["cuda"] == torch.version.cuda


def test_a_gpu_job_on_a_cpu_torch_is_refused_at_submit_with_the_wheel_to_install(
        capsys, monkeypatch):
    cpu = {"version": "2.13.0+cpu", "cuda": None, "archs": None}
    code, err = _submit(capsys, monkeypatch, cpu, "--gpus-per-node", "8", "--gpu-type", "v100")
    assert code == 2
    assert "a CPU-only build" in err and "TORCH_SPEC=torch==2.13.0+cu126" in err
    assert "download.pytorch.org/whl/cu126" in err
    # --dry-run shows the script and the problem as a warning.
    code, err = _submit(capsys, monkeypatch, cpu, "--gpus-per-node", "8", dry_run=True)
    assert code == 0 and "warning (an error without --dry-run)" in err
    # A CPU job does not need CUDA; --skip-torch-check leaves the question to the user.
    assert _accepted(capsys, monkeypatch, cpu, "--gpus-per-node", "0")
    assert _accepted(capsys, monkeypatch, cpu, "--gpus-per-node", "8", "--skip-torch-check")


def test_a_cuda_13_wheel_is_refused_for_v100_and_accepted_for_a100(capsys, monkeypatch):
    cu130 = {"version": "2.13.0+cu130", "cuda": "13.0", "archs": CU130}
    code, err = _submit(capsys, monkeypatch, cu130, "--gpus-per-node", "8", "--gpu-type",
                        "v100")
    assert code == 2 and "no kernels for v100 (sm_70)" in err and "cu126" in err
    assert _accepted(capsys, monkeypatch, cu130, "--gpus-per-node", "8", "--gpu-type", "a100")
    cu126 = {"version": "2.13.0+cu126", "cuda": "12.6", "archs": CU126}
    assert _accepted(capsys, monkeypatch, cu126, "--gpus-per-node", "8", "--gpu-type", "v100")
    # An A10 (8.6) runs sm_80 code; an H100 (9.0) does not run sm_86 code without PTX.
    assert torch_check._has_kernels(["sm_80"], (8, 6))
    assert not torch_check._has_kernels(["sm_80", "sm_86"], (9, 0))
    assert torch_check._has_kernels(["sm_80", "compute_80"], (9, 0))


def test_a_python_that_cannot_run_here_is_a_warning_not_an_error(capsys, monkeypatch):
    code, err = _submit(capsys, monkeypatch, None, "--gpus-per-node", "8", dry_run=True)
    assert code == 0 and "could not run" in err


# ----------------------------------------------------------------------------- at start
@pytest.fixture
def no_cuda(monkeypatch):
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS",
                 "CUDA_VISIBLE_DEVICES", "MEMTRAIN_ALLOW_CPU"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_binding, "node_has_nvidia_gpus", lambda: True)  # a GPU node
    calls = []
    import deepspeed
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: calls.append(kw))
    return calls


@pytest.mark.parametrize("name, value", [
    ("SLURM_GPUS_ON_NODE", "8"), ("SLURM_JOB_GPUS", "0,1,2,3"), ("SLURM_STEP_GPUS", "5"),
    ("CUDA_VISIBLE_DEVICES", "0")])
def test_gpus_allocated_without_cuda_fail_at_start_instead_of_training_on_the_cpu(
        monkeypatch, no_cuda, name, value):
    monkeypatch.setenv(name, value)
    env = distributed.DistEnv(0, 1, 0, "127.0.0.1", 12345, "single")
    with pytest.raises(ConfigError) as err:
        process_group.init_process_group(env)
    assert no_cuda == []                        # no gloo process group was made
    assert f"{name}={value}" in str(err.value) and "TORCH_SPEC" in str(err.value)
    with pytest.raises(ConfigError):
        gpu_binding.device_for(0)


def test_cuda_visible_devices_on_a_node_without_nvidia_devices_is_not_a_gpu_allocation(
        monkeypatch, no_cuda):
    """The deepspeed launcher sets CUDA_VISIBLE_DEVICES=0,1 on any machine, a CPU one too."""
    monkeypatch.setattr(gpu_binding, "node_has_nvidia_gpus", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert gpu_binding.allocated_gpus() is None
    process_group.init_process_group(distributed.DistEnv(0, 1, 0, "127.0.0.1", 1, "single"))
    assert no_cuda[0]["dist_backend"] == "gloo"
    monkeypatch.setenv("SLURM_JOB_GPUS", "0,1")    # SLURM's word counts on any node
    assert gpu_binding.allocated_gpus() == "SLURM_JOB_GPUS=0,1"


@pytest.mark.parametrize("env", [
    {}, {"SLURM_GPUS_ON_NODE": "0"}, {"CUDA_VISIBLE_DEVICES": ""},
    {"CUDA_VISIBLE_DEVICES": "-1"}, {"SLURM_GPUS_ON_NODE": "8", "MEMTRAIN_ALLOW_CPU": "1"}])
def test_no_gpus_or_an_explicit_cpu_choice_still_run_on_the_cpu(monkeypatch, no_cuda, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert gpu_binding.device_for(0) == torch.device("cpu")
    process_group.init_process_group(distributed.DistEnv(0, 1, 0, "127.0.0.1", 1, "single"))
    assert no_cuda[0]["dist_backend"] == "gloo"
