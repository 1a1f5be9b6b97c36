"""Which GPU a rank takes, simulated on the CPU with a fake torch.cuda: the single visible
GPU when the site binds one per task (CUDA_VISIBLE_DEVICES of length 1), cuda:LOCAL_RANK
when the whole node is visible, a clear error when two ranks would share one; and the CUDA
RNG of a checkpoint is the rank's own device's, so a checkpoint saved where a node showed
8 GPUs resumes where it shows 1. DeepSpeed, which takes cuda:LOCAL_RANK wherever it needs the
rank's device, is handed the same GPU (a fake accelerator records what it asks for)."""

import random
from types import SimpleNamespace

import deepspeed.comm.comm as ds_comm
import numpy as np
import pytest
import torch
from deepspeed.accelerator import real_accelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.utils import groups
from train_helpers import free_port, tiny_config

from model import build_model
from train import checkpoint as ckpt
from train import distributed, gpu_binding, process_group
from train.config import ConfigError, load_config
from train.engine import build_ds_config, initialize


class FakeCuda:
    """torch.cuda as a node showing `count` GPUs: set_device and the RNG calls fail like
    CUDA's "invalid device ordinal" for an index outside the visible ones."""

    def __init__(self, count: int, uuids: list[str] | None = None):
        self.count, self.current = count, 0
        self.uuids = uuids or [f"GPU-{i:04d}" for i in range(count)]
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(count)}

    def _check(self, index):
        if not 0 <= index < self.count:
            raise RuntimeError("CUDA error: invalid device ordinal")

    def set_device(self, index):
        self._check(int(index))
        self.current = int(index)

    def get_device_properties(self, index):
        self._check(index)
        return SimpleNamespace(uuid=self.uuids[index])

    def get_rng_state(self, device="cuda"):
        return self.states[self.current].clone()

    def set_rng_state(self, state, device="cuda"):
        index = device if isinstance(device, int) else self.current
        self._check(index)
        self.states[index] = state.clone()

    def get_rng_state_all(self):
        return [self.states[i].clone() for i in range(self.count)]

    def set_rng_state_all(self, states):
        for i, state in enumerate(states):     # what torch.cuda does: one device each
            self.set_rng_state(state, i)

    def install(self, monkeypatch):
        for name in ("set_device", "get_device_properties", "get_rng_state", "set_rng_state",
                     "get_rng_state_all", "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        return self


def test_one_gpu_per_task_takes_the_single_visible_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")      # --gpus-per-task=1, local rank 5
    cuda = FakeCuda(1).install(monkeypatch)
    assert gpu_binding.device_for(5) == torch.device("cuda", 0)
    assert cuda.current == 0


def test_a_whole_visible_node_gives_each_local_rank_its_own_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    cuda = FakeCuda(8).install(monkeypatch)
    assert gpu_binding.device_for(5) == torch.device("cuda", 5) and cuda.current == 5


def test_a_local_rank_beyond_the_visible_gpus_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    FakeCuda(2).install(monkeypatch)
    with pytest.raises(ConfigError) as err:
        gpu_binding.device_for(3)
    assert "would share cuda:1 with local rank 1" in str(err.value)
    assert "--gpus-per-task=1" in str(err.value)


def _fake_world(monkeypatch, owners):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: len(owners))

    def gather(out, _mine):
        out[:] = owners
    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)


def test_two_ranks_on_one_physical_gpu_are_refused(monkeypatch):
    """--gres=gpu:1 with 2 tasks per node: both see CUDA_VISIBLE_DEVICES=0, both pick cuda:0."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    FakeCuda(1, ["GPU-aaaa"]).install(monkeypatch)
    _fake_world(monkeypatch, [("n1", "GPU-aaaa"), ("n1", "GPU-aaaa"), ("n2", "GPU-aaaa")])
    with pytest.raises(ConfigError) as err:
        gpu_binding.device_for(1)
    assert "ranks [0, 1] all use GPU GPU-aaaa on n1" in str(err.value)
    # Bound one per task, the GPUs differ: nothing to refuse (same UUID on another host too).
    _fake_world(monkeypatch, [("n1", "GPU-aaaa"), ("n1", "GPU-bbbb"), ("n2", "GPU-aaaa")])
    assert gpu_binding.device_for(1) == torch.device("cuda", 0)


def test_only_the_current_devices_cuda_rng_is_saved_and_restored(monkeypatch):
    cuda = FakeCuda(8).install(monkeypatch)
    cuda.set_device(5)
    state = ckpt.rng_state()
    assert torch.equal(state["cuda"], cuda.states[5])      # one tensor, not 8
    # Resumed on a node that shows this rank only its own GPU.
    one = FakeCuda(1).install(monkeypatch)
    ckpt.set_rng_state(state)
    assert torch.equal(one.states[0], torch.full((16,), 5, dtype=torch.uint8))


def test_a_checkpoint_with_every_visible_gpus_rng_resumes_where_one_is_visible(monkeypatch):
    """Checkpoints of earlier versions hold torch.cuda.get_rng_state_all() of 8 GPUs."""
    legacy = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
              "python": random.getstate(),
              "cuda": [torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(8)]}
    monkeypatch.setenv("LOCAL_RANK", "3")
    one = FakeCuda(1).install(monkeypatch)
    ckpt.set_rng_state(legacy)                               # no invalid device ordinal
    assert torch.equal(one.states[0], legacy["cuda"][3])    # the GPU local rank 3 drew on


def test_cpu_rng_states_still_restore_exactly():
    state = ckpt.rng_state()
    before = (torch.rand(5), np.random.rand(3), random.random())
    ckpt.set_rng_state(state)
    after = (torch.rand(5), np.random.rand(3), random.random())
    assert torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1])
    assert before[2] == after[2]


class RecordingAccelerator(CPU_Accelerator):
    """DeepSpeed's accelerator on a node with GPUs, recording every device index DeepSpeed
    asks it to set or name. Tensors stay on the CPU (this machine has no GPU); `cuda_name`
    makes it answer 'cuda' where DeepSpeed asks which kind of device it runs on, as its
    CUDA accelerator does."""

    def __init__(self, cuda_name: bool = False):
        super().__init__()
        self.indices: list[int] = []
        self.cuda_name = cuda_name

    def _record(self, index):
        # An int, a string ("5", from os.environ), or a torch.device this accelerator named
        # (already recorded then: it names the CPU, which has no index).
        if isinstance(index, torch.device):
            index = index.index
        if index is not None:
            self.indices.append(int(index))

    def device_name(self, device_index=None):
        self._record(device_index)
        return "cuda" if self.cuda_name and device_index is None else "cpu"

    def device(self, device_index=None):
        self._record(device_index)
        return torch.device("cuda", int(device_index)) if self.cuda_name else None

    def set_device(self, device_index):
        self._record(device_index)


def _one_gpu_per_task(monkeypatch, world_size: int, cuda_name: bool = False):
    """Rank 0 of `world_size` with local rank 5, bound by the site to one GPU (physical GPU
    3, seen as device 0), with DeepSpeed's accelerator recording."""
    for key, value in {"RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_RANK": "5",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                       "CUDA_VISIBLE_DEVICES": "3", "MEMTRAIN_LOCAL_RANK": "5"}.items():
        monkeypatch.setenv(key, value)      # restored after the test (bind_gpu rewrites two)
    cuda = FakeCuda(1).install(monkeypatch)
    accel = RecordingAccelerator(cuda_name)
    monkeypatch.setattr(real_accelerator, "ds_accelerator", accel)
    monkeypatch.setattr(ds_comm, "cdb", None)           # no DeepSpeed backend from before
    env = distributed.DistEnv(0, world_size, 5, "127.0.0.1", 0, "slurm")
    return env, cuda, accel


class _Stop(Exception):
    pass


def test_deepspeed_binds_the_process_group_to_the_single_visible_gpu(monkeypatch):
    """deepspeed.init_distributed gives torch's init_process_group device_id=cuda:LOCAL_RANK
    (deepspeed/comm/torch.py) when the world has more than one rank."""
    env, cuda, accel = _one_gpu_per_task(monkeypatch, world_size=2, cuda_name=True)
    seen = {}

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1,
                           rank=-1, store=None, group_name="", pg_options=None,
                           device_id=None):
        seen.update(backend=backend, device_id=device_id)
        raise _Stop                      # the rendezvous itself is not what is tested

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(_Stop):
        process_group.init_process_group(env)
    assert seen == {"backend": "nccl", "device_id": torch.device("cuda", 0)}
    assert accel.indices == [0] and cuda.current == 0


def test_deepspeed_engine_and_zero3_use_the_single_visible_gpu(monkeypatch, tmp_path):
    """deepspeed.initialize at ZeRO-3 sets and names the engine's device from LOCAL_RANK
    (runtime/engine.py) and again in zero.Init (runtime/zero/partition_parameters.py)."""
    env, cuda, accel = _one_gpu_per_task(monkeypatch, world_size=1)
    cfg = load_config(tiny_config(tmp_path), ["deepspeed.zero_stage=3"])
    # No NCCL here: a gloo group of one, which deepspeed.init_distributed then adopts.
    torch.distributed.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
    try:
        process_group.init_process_group(env)
        assert gpu_binding.device_for(env.local_rank) == torch.device("cuda", 0)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # tensors: CPU
        engine, _ = initialize(build_model(cfg.model), cfg, build_ds_config(cfg, 1))
    finally:
        torch.distributed.destroy_process_group()
        # DeepSpeed's cached groups of it go too (as deepspeed.comm.destroy_process_group
        # does), or the next engine made in this process finds them.
        groups._release_process_group_references(None)
    # The engine's set_device and device_name, then zero.Init's device_name (its set_device
    # is given the device so named).
    assert accel.indices == [0, 0, 0], accel.indices
    assert engine.local_rank == 0 and cuda.current == 0


def test_older_checkpoints_rng_follows_the_launchers_local_rank_after_binding(monkeypatch):
    """bind_gpu rewrites LOCAL_RANK for DeepSpeed; a checkpoint holding every visible GPU's
    RNG (earlier versions) still resumes the state of the GPU the rank drew on."""
    env, _, _ = _one_gpu_per_task(monkeypatch, world_size=1)
    assert gpu_binding.bind_gpu(env) == 0
    legacy = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
              "python": random.getstate(),
              "cuda": [torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(8)]}
    one = FakeCuda(1).install(monkeypatch)
    ckpt.set_rng_state(legacy)
    assert torch.equal(one.states[0], legacy["cuda"][5])
