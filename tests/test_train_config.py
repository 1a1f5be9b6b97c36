"""The run config: YAML + dotted overrides into one typed tree; every bad value fails
before any compute with the field's name (exit code 2); the shipped configs load and carry
the papers' settings; the DeepSpeed config is derived from the run config."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from shipped_configs import CONFIGS, load_shipped

from model import ConfigError
from train.cli import main_train
from train.config import PROJECT_ROOT, load_config
from train.engine import build_ds_config


def test_overrides_are_typed_as_yaml_and_reach_nested_sections():
    cfg = load_config("quickstart", ["model.mem_len=64", "bptt.depth=3", "optim.lr=1e-4",
                                     "model.rmt.num_mem_tokens=5", "eval.same_length=true",
                                     "deepspeed.overrides={zero_optimization: {stage: 2}}"])
    assert cfg.model.mem_len == 64 and cfg.bptt.depth == 3 and cfg.optim.lr == 1e-4
    assert cfg.model.rmt.num_mem_tokens == 5 and cfg.eval.same_length is True
    assert build_ds_config(cfg, 1)["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize("override, field, reason", [
    ("model.mem_len=-1", "model.mem_len", "must be >= 0"),
    ("model.n_head=3", "model.n_head", "does not divide"),
    ("model.mechanism=lstm", "model.mechanism", "unknown mechanism"),
    ("model.mechanism=rmt model.rmt.num_mem_tokens=0", "model.rmt.num_mem_tokens",
     "must be > 0"),
    ("model.colour=red", "model.colour", "unknown field"),
    ("bptt.mode=zigzag", "bptt.mode", "unknown 'zigzag'"),
    ("bptt.depth=-2", "bptt.depth", "must be >= 0"),
    ("optim.lr=fast", "optim.lr", "expected a number"),
    ("optim.schedule=plateau eval.every=0", "eval.every", "needs periodic validation"),
    ("max_steps=100 optim.warmup_steps=100", "optim.warmup_steps",
     "must be in [0, max_steps=100)"),
    ("data.global_batch=0", "data.global_batch", "must be > 0"),
    ("data.colour=red", "data.colour", "unknown field"),
    ("deepspeed.zero_stage=4", "deepspeed.zero_stage", "must be 0, 1, 2 or 3"),
    ("deepspeed.precision=fp8", "deepspeed.precision", "unknown 'fp8'"),
    ("deepspeed.config=nope.json", "deepspeed.config", "no such file"),
    ("eval.mem_len=-5", "eval.mem_len", "must be >= 0"),
    ("max_steps=true", "max_steps", "expected an integer"),
    ("eval.split=dev", "eval.split", "none of the data splits"),
])
def test_an_invalid_value_names_its_field_and_reason(override, field, reason):
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", override.split())
    assert err.value.field == field
    assert reason in str(err.value)


def test_eval_lengths_go_through_the_models_own_checks():
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", ["model.mechanism=rmt", "model.mem_len=0",
                                   "eval.same_length=true"])
    assert err.value.field == "eval.same_length"


def test_the_command_line_exits_2_on_a_bad_config_before_any_compute(capsys):
    assert main_train(["--config", "quickstart", "model.d_model=-2"]) == 2
    err = capsys.readouterr().err
    assert "invalid config: model.d_model" in err
    assert main_train(["--config", "no-such-config"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main_train(["--config", "quickstart", "just-a-word"]) == 2
    assert "section.field=value" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["memtrain", "train"], ["python", "-m", "train"]])
def test_the_process_exit_code_is_2_on_a_bad_config(command):
    done = subprocess.run([str(Path(sys.executable).parent / command[0]), *command[1:],
                           "--config", "quickstart", "model.d_model=-2"], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "invalid config: model.d_model" in done.stderr


def test_print_config_shows_the_resolved_tree(capsys):
    assert main_train(["--config", "quickstart", "model.mem_len=48", "--print-config"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert tree["model"]["mem_len"] == 48 and tree["name"] == "quickstart"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_loads(path):
    cfg = load_shipped(path)
    assert cfg.name == path.stem


def test_paper_configs_carry_the_papers_hyper_parameters():
    xl = load_config("enwik8-xl-base")
    m = xl.model
    assert (m.n_layer, m.d_model, m.n_head, m.d_head, m.d_inner) == (12, 512, 8, 64, 2048)
    assert (m.tgt_len, m.mem_len, xl.data.global_batch, xl.max_steps) == (512, 512, 22, 400000)
    assert (xl.eval.tgt_len, xl.eval.mem_len, xl.eval.clamp_len, xl.eval.same_length) == \
        (80, 2100, 820, True)
    assert (xl.optim.lr, xl.optim.schedule, xl.optim.grad_clip) == (2.5e-4, "cosine", 0.25)
    wt = load_config("wt103-xl-base").model
    assert (wt.n_layer, wt.d_model, wt.n_head, wt.d_inner, wt.tgt_len) == (16, 410, 10, 2100, 150)
    assert wt.cutoffs == [20000, 40000, 200000] and wt.tie_projs == [False, True, True, True]
    lamemo = load_config("enwik8-lamemo-base")
    assert lamemo.model.mechanism == "lamemo" and lamemo.max_steps == 100000
    assert lamemo.data.global_batch == 40
    rmt = load_config("wt103-rmt")
    assert rmt.model.rmt.num_mem_tokens == 10 and rmt.bptt.mode == "sliding"
    copy = load_config("copy-rmt")
    assert (copy.model.n_layer, copy.model.n_head, copy.optim.lr, copy.optim.schedule) == \
        (4, 4, 1e-4, "plateau")
    assert copy.optim.plateau_factor == 0.5


def test_ds_config_batch_sizes_follow_the_run_config():
    cfg = load_config("quickstart", ["data.global_batch=8", "deepspeed.grad_accum=3",
                                     "deepspeed.precision=bf16", "optim.grad_clip=0.5"])
    ds = build_ds_config(cfg, world_size=2)
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 24
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    fp16 = build_ds_config(load_config("quickstart", ["deepspeed.precision=fp16"]), 1)["fp16"]
    assert fp16["enabled"] and fp16["loss_scale"] == 0  # dynamic loss scaling


def test_optimizer_in_the_deepspeed_json_is_refused(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{"optimizer": {"type": "Adam"}}')
    cfg = load_config("quickstart", [f"deepspeed.config={bad}"])
    with pytest.raises(ValueError, match="set the optimizer and schedule in the run config"):
        build_ds_config(cfg, 1)
