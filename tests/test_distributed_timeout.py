"""The process-group timeout is the run config's distributed.timeout_minutes (default 60, not
DeepSpeed's 10), and it reaches deepspeed.init_distributed from `memtrain train` and torch's
init_process_group from `memtrain eval`: rank 0 converts universal checkpoints, exports the
final weights and consolidates a checkpoint for evaluation while the others wait under it."""

from datetime import timedelta

import deepspeed
import pytest
import torch
import yaml
from train_helpers import tiny_config

from train import distributed, process_group, trainer
from train.config import ConfigError, load_config


@pytest.fixture
def init_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: calls.append(kw))
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS",
                 "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_init_process_group_passes_the_timeout_to_deepspeed(init_calls):
    env = distributed.DistEnv(0, 1, 0, "127.0.0.1", 12345, "single")
    process_group.init_process_group(env, timeout_minutes=90)
    process_group.init_process_group(env)
    assert [c["timeout"] for c in init_calls] == [timedelta(minutes=90), timedelta(minutes=60)]


class _Stop(Exception):
    pass


def test_memtrain_train_starts_the_process_group_with_the_configs_timeout(
        tmp_path, monkeypatch, init_calls):
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)      # restored after the test (resolve_env writes them)
    seen = {}

    def init(env, *args, **kwargs):
        seen.update(kwargs, args=args)
        raise _Stop

    monkeypatch.setattr(trainer, "init_process_group", init)
    cfg = load_config(tiny_config(tmp_path), ["distributed.timeout_minutes=77"])
    with pytest.raises(_Stop):
        trainer.train(cfg)
    assert seen.get("timeout_minutes") == 77


def test_the_default_is_an_hour_and_the_value_is_checked(tmp_path):
    path = tiny_config(tmp_path)
    assert load_config(path).distributed.timeout_minutes == 60
    with pytest.raises(ConfigError) as err:
        load_config(path, ["distributed.timeout_minutes=0"])
    assert err.value.field == "distributed.timeout_minutes"
    # Run directories written before the field existed still load.
    cfg = yaml.safe_load(path.read_text())
    cfg.pop("distributed", None)
    path.write_text(yaml.safe_dump(cfg))
    assert load_config(path).distributed.timeout_minutes == 60


def test_memtrain_eval_on_several_ranks_waits_the_run_configs_timeout(tmp_path, monkeypatch):
    """`memtrain eval` launched on N ranks: rank 0 consolidates the checkpoint while the
    others wait in its broadcast, under the run's distributed.timeout_minutes."""
    from evaluation.cli import main_eval
    from train.config import dump_yaml

    cfg = load_config(tiny_config(tmp_path), ["distributed.timeout_minutes=77"])
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    seen = {}

    def init(backend, **kwargs):
        seen.update(kwargs, backend=backend)
        raise _Stop                     # no second rank to meet

    monkeypatch.setattr(torch.distributed, "init_process_group", init)
    with pytest.raises(_Stop):
        main_eval(["--run-dir", str(run_dir), "--no-track"])
    assert seen.get("timeout") == timedelta(minutes=77)
