"""Weights files and checkpoint directories people bring, refused cleanly: a file that is not
what it is handed as (text named .pt, a pickled nn.Module, bytes named .safetensors, a
safetensors file without memtrain's config) and a directory that is no pretrained checkpoint
get one line on stderr naming the path and what it is not, exit code 2, and nothing written
(model/weights_file.py reads them for every command). A few cases run the real CLI in a
subprocess; the rest call the commands' functions."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pretrained_helpers import hf_model_section
from safetensors.torch import load_file, save_file

from evaluation.generate_cli import main_generate
from model import ConfigError, ModelConfig, build_model, resolve_shape
from model.io import load_initial, read_config
from model.pretrained.tiny import tiny_gpt2
from model.weights_file import WeightsError, is_torch_file, read_weights
from train.cli import main_export, main_import
from train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SEG, M = 5, 3


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _memtrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memtrain.cli", *args], env=_env(),
                          capture_output=True, text=True, timeout=120)


def _one_line(err: str) -> str:
    """The command's own line, `memtrain <command>: ...`: exactly one (what libraries and
    the model's loading log, e.g. "memtrain: the checkpoint's activation ...", aside)."""
    lines = [x for x in err.splitlines() if x.startswith("memtrain ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The bad files, and `light-base`: a directory that passes the checks made before the
    state dict is read (config.json, JSON) without the cost of a real checkpoint."""
    root = tmp_path_factory.mktemp("bad")
    (root / "light-base").mkdir()
    (root / "light-base" / "config.json").write_text('{"model_type": "gpt2"}')
    (root / "text.pt").write_text("hello world, this is text\n")
    (root / "five.pt").write_bytes(b"abcde")
    torch.save(torch.nn.Linear(2, 2), root / "module.pt")
    torch.save({"model": torch.nn.Linear(2, 2).state_dict(),
                "args": argparse.Namespace(lr=1e-3)}, root / "namespace.pt")
    (root / "random.safetensors").write_bytes(bytes(range(256)) * 2)
    save_file({"a": torch.zeros(100)}, str(root / "whole.safetensors"))
    whole = (root / "whole.safetensors").read_bytes()
    (root / "cut.safetensors").write_bytes(whole[:-40])
    torch.save({"memory_cell.memory": torch.zeros(M, 4)}, root / "rmt.pt")  # never read
    return root


@pytest.fixture(scope="module")
def base(files):
    """A tiny GPT-2 checkpoint and a state dict of the authors' layout for it (rmt.pt), one
    without a base weight (rmt-missing.pt)."""
    root = files / "real"
    path = tiny_gpt2(root / "tiny-gpt2")    # no tokenizer: training one takes seconds
    weights = load_file(str(path / "model.safetensors"))
    state = {"memory_cell.model." + k: v for k, v in weights.items()}
    state["memory_cell.memory"] = torch.randn(M, weights["transformer.wte.weight"].shape[1])
    torch.save(state, root / "rmt.pt")
    del state["memory_cell.model.transformer.h.0.mlp.c_fc.weight"]
    torch.save(state, root / "rmt-missing.pt")
    return root


@pytest.fixture(scope="module")
def imported(base):
    """A good import of rmt.pt: the model directory."""
    out = base / "imported"
    if not out.exists():
        assert main_import(["--state-dict", str(base / "rmt.pt"), "--base",
                            str(base / "tiny-gpt2"), "--segment-size", str(SEG), "--out",
                            str(out)]) == 0
    return out


def _import(files, capsys, state: str | Path, base: str | Path | None = None,
            out: Path | None = None, segment_size: int = SEG) -> str:
    """`memtrain import` of `state` that must be refused: its one line; nothing at --out."""
    out = out or files / "never" / "out"
    capsys.readouterr()
    rc = main_import(["--state-dict", str(state), "--base", str(base or files / "light-base"),
                      "--segment-size", str(segment_size), "--out", str(out)])
    assert rc == 2
    assert not out.exists() and not (files / "never").exists()
    return _one_line(capsys.readouterr().err)


# ------------------------------------------------------------------ the real CLI, subprocess
def test_text_file_named_pt_is_refused_in_one_line_exit_2_nothing_written(files):
    out = files / "cli-out"
    run = _memtrain("import", "--state-dict", str(files / "text.pt"), "--base",
                    str(files / "light-base"), "--segment-size", str(SEG), "--out", str(out))
    assert run.returncode == 2
    line = _one_line(run.stderr)
    assert line.startswith(f"memtrain import: {files / 'text.pt'} is not a PyTorch "
                           "checkpoint (torch.load could not read it: ")
    assert not out.exists()


def test_missing_base_directory_is_named_before_the_state_dict_exit_2(files):
    out = files / "cli-out-base"
    run = _memtrain("import", "--state-dict", str(files / "module.pt"), "--base",
                    str(files / "nope"), "--segment-size", str(SEG), "--out", str(out))
    assert run.returncode == 2
    assert _one_line(run.stderr) == f"memtrain import: --base {files / 'nope'}: no such " \
                                    "directory"
    assert not out.exists()


def test_random_bytes_as_a_model_file_are_refused_by_export_in_one_line_exit_2(files):
    out = files / "cli-export.safetensors"
    run = _memtrain("export", "--model", str(files / "random.safetensors"), "--out", str(out))
    assert run.returncode == 2
    assert _one_line(run.stderr).startswith(
        f"memtrain export: {files / 'random.safetensors'} is not a safetensors file (")
    assert not out.exists()


# --------------------------------------------------------------- memtrain import, in process
def test_five_byte_pt_is_not_a_pytorch_checkpoint(files, capsys):
    line = _import(files, capsys, files / "five.pt")
    assert f"{files / 'five.pt'} is not a PyTorch checkpoint (torch.load could not read " \
           "it: it starts with b'abcde', neither a zip archive nor a pickle)" in line


def test_pickled_module_is_named_as_such_with_the_state_dict_fix(files, capsys):
    line = _import(files, capsys, files / "module.pt")
    assert line == (f"memtrain import: {files / 'module.pt'} is a pickled nn.Module "
                    "(torch.nn.modules.linear.Linear), not a state dict: save "
                    "model.state_dict()")


def test_pickled_objects_beside_tensors_are_refused_not_run(files, capsys):
    line = _import(files, capsys, files / "namespace.pt")
    assert "holds pickled objects (argparse.Namespace), not a state dict of tensors" in line


def test_random_and_cut_safetensors_are_not_safetensors_files(files, capsys):
    for name in ("random.safetensors", "cut.safetensors"):
        line = _import(files, capsys, files / name)
        assert line.startswith(f"memtrain import: {files / name} is not a safetensors file (")


def test_missing_state_dict_is_no_such_file(files, capsys):
    line = _import(files, capsys, files / "absent.pt")
    assert line == f"memtrain import: {files / 'absent.pt'}: no such file"


def test_base_that_is_no_checkpoint_directory_is_refused_by_what_it_lacks(files, capsys):
    nocfg = files / "nocfg"
    nocfg.mkdir(exist_ok=True)
    badjson = files / "badjson"
    badjson.mkdir(exist_ok=True)
    (badjson / "config.json").write_text("{oops")
    badweights = files / "badweights"
    badweights.mkdir(exist_ok=True)
    (badweights / "config.json").write_text('{"model_type": "gpt2"}')
    (badweights / "model.safetensors").write_bytes(b"\x00" * 3 + b"garbage" * 20)
    expect = {nocfg: f"--base {nocfg} holds no config.json",
              badjson: f"--base {badjson / 'config.json'} is not JSON (",
              badweights: f"--base {badweights / 'model.safetensors'} is not a safetensors",
              files / "text.pt": f"--base {files / 'text.pt'} is not a directory"}
    for base, text in expect.items():
        assert text in _import(files, capsys, files / "rmt.pt", base=base)


def test_state_dict_missing_a_base_weight_is_refused_and_nothing_written(base, capsys):
    line = _import(base, capsys, base / "rmt-missing.pt", base=base / "tiny-gpt2")
    assert "does not fit the base model" in line
    assert "transformer.h.0.mlp.c_fc.weight" in line


def test_a_failure_after_writing_began_leaves_no_out_and_no_staging(base, capsys):
    # A segment the base's 64 learned positions cannot hold is refused when the model is
    # built, after the base was saved: the staged import is removed, parents made included.
    line = _import(base, capsys, base / "rmt.pt", base=base / "tiny-gpt2", segment_size=500)
    assert "beyond the model's learned table" in line
    assert not [p.name for p in base.iterdir() if "importing" in p.name]


def test_an_existing_out_is_written_over_and_keeps_no_staging(base):
    out = base / "again"
    for _ in range(2):
        assert main_import(["--state-dict", str(base / "rmt.pt"), "--base",
                            str(base / "tiny-gpt2"), "--segment-size", str(SEG), "--out",
                            str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["base", "model.safetensors"]
    assert read_config(out / "model.safetensors").hf.path == str((out / "base").resolve())
    assert not [p.name for p in base.iterdir() if "importing" in p.name]


# ------------------------------------------------------------- model files: export, generate
def test_export_names_a_torch_file_and_a_foreign_safetensors_as_no_model_file(files, capsys):
    cases = {files / "rmt.pt": "is a PyTorch checkpoint, not a memtrain model file",
             files / "whole.safetensors": "is a safetensors file but not a memtrain model "
                                          "file (no 'memtrain_model_config' metadata"}
    for path, text in cases.items():
        capsys.readouterr()
        assert main_export(["--model", str(path), "--out", str(files / "x.safetensors")]) == 2
        assert _one_line(capsys.readouterr().err).startswith(f"memtrain export: {path} {text}")
        assert not (files / "x.safetensors").exists()


def test_generate_refuses_a_foreign_file_or_missing_path_in_one_line(files, capsys):
    cases = {files / "text.pt": f"{files / 'text.pt'} is not a safetensors file",
             files / "module.pt": f"{files / 'module.pt'} is a PyTorch checkpoint, not a "
                                  "memtrain model file",
             files / "absent": f"--checkpoint {files / 'absent'}: no such run directory"}
    for path, text in cases.items():
        capsys.readouterr()
        assert main_generate(["--checkpoint", str(path), "--prompt-ids", "1 2"]) == 2
        assert _one_line(capsys.readouterr().err).startswith(f"memtrain generate: {text}")


def test_generate_of_an_import_without_data_names_data_as_the_fix(imported, capsys):
    capsys.readouterr()
    model = imported / "model.safetensors"
    assert main_generate(["--checkpoint", str(model), "--prompt", "hi"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"memtrain generate: --prompt: {model} carries no vocabulary: "
                           "give --data")


# -------------------------------------------------------------------------------- init_from
def test_init_from_a_file_that_is_no_model_file_is_a_config_error_naming_it(files):
    for path, text in ((files / "text.pt", "is not a safetensors file"),
                       (files / "rmt.pt", "is a PyTorch checkpoint, not a memtrain model"),
                       (files / "absent.safetensors", ": no such file"),
                       (files / "light-base", "is a directory, not a weights file")):
        with pytest.raises(ConfigError) as err:
            load_config("copy-rmt-cpu", [f"init_from={path}"])
        assert str(err.value).startswith(f"init_from: {path}"), err.value
        assert text in str(err.value)


def test_load_initial_refuses_a_foreign_file_as_a_weights_error(files):
    model = build_model(ModelConfig.from_dict({"mechanism": "xl", "vocab_size": 16, "n_layer": 1,
                                               "d_model": 16, "n_head": 2, "d_inner": 32,
                                               "tgt_len": 4, "mem_len": 4}))
    with pytest.raises(WeightsError, match="is not a safetensors file"):
        load_initial(model, files / "random.safetensors")


# ---------------------------------------------------------------------------- model.hf.path
def test_hf_path_that_is_no_checkpoint_directory_is_a_config_error_naming_it(files, tmp_path):
    config = '{"model_type": "gpt2"}'
    nocfg, badjson, textbin = tmp_path / "nocfg", tmp_path / "badjson", tmp_path / "textbin"
    for d in (nocfg, badjson, textbin):
        d.mkdir()
    (badjson / "config.json").write_text("{oops")
    (textbin / "config.json").write_text(config)
    (textbin / "pytorch_model.bin").write_text("not weights")
    cases = {tmp_path / "nope": f"{tmp_path / 'nope'}: no such directory",
             files / "text.pt": f"{files / 'text.pt'} is not a directory",
             badjson: f"{badjson / 'config.json'} is not JSON (",
             nocfg: f"{nocfg} holds no config.json",
             textbin: f"{textbin / 'pytorch_model.bin'} is not a PyTorch checkpoint"}
    for path, text in cases.items():
        with pytest.raises(ConfigError) as err:
            resolve_shape(ModelConfig.from_dict(hf_model_section(path, M, SEG)))
        assert str(err.value).startswith(f"model.hf.path: {text}"), (path, err.value)


# ------------------------------------------------------------------------------ the reader
def test_read_weights_unwraps_one_wrapper_and_refuses_non_tensor_entries(tmp_path):
    lin = torch.nn.Linear(2, 2).state_dict()
    torch.save({"state_dict": lin}, tmp_path / "wrapped.pt")
    assert set(read_weights(tmp_path / "wrapped.pt")) == {"weight", "bias"}
    torch.save({**lin, "epoch": 3}, tmp_path / "mixed.pt")
    with pytest.raises(WeightsError, match=r"its entries \['epoch'\] are not tensors"):
        read_weights(tmp_path / "mixed.pt")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(WeightsError, match="holds a list, not a state dict"):
        read_weights(tmp_path / "list.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(WeightsError, match="is empty"):
        read_weights(tmp_path / "empty.pt")


def test_a_safetensors_header_starting_with_0x80_is_not_taken_for_a_pickle(tmp_path):
    # The first byte of a safetensors file is its header length's lowest: 0x80 happens.
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\x80\x00\x00\x00\x00\x00\x00\x00{" + b" " * 127)
    assert not is_torch_file(path)
    torch.save({"a": torch.zeros(1)}, tmp_path / "t.pt")
    torch.save({"a": torch.zeros(1)}, tmp_path / "legacy.pt",
               _use_new_zipfile_serialization=False)
    assert is_torch_file(tmp_path / "t.pt") and is_torch_file(tmp_path / "legacy.pt")


def test_a_torn_deepspeed_checkpoint_file_is_a_weights_error_naming_it(files):
    # `memtrain export --run-dir` and `memtrain eval` read a run's checkpoint files through
    # train/export.py: a file cut short or overwritten is named, not torch.load's traceback.
    from train.export import _load
    for name in ("text.pt", "five.pt"):
        with pytest.raises(WeightsError, match=f"{files / name} is not a PyTorch checkpoint"):
            _load(files / name)
    whole = files / "cut.pt"
    torch.save({"module": {"w": torch.zeros(64)}}, whole)
    whole.write_bytes(whole.read_bytes()[:200])
    with pytest.raises(WeightsError, match=r"cut.pt is not a PyTorch checkpoint \(torch.load "
                                           r"could not read it: RuntimeError"):
        _load(whole)
