"""What a run computes in (train/precision.py): which device takes which precision, the
ds_config sections each precision renders, and the fp32 matmul mode on GPUs. No engine is
built here; tests/test_bf16_engine.py trains through it."""

from __future__ import annotations

import pytest
import torch

from train.config import ConfigError, load_config
from train.engine import build_ds_config
from train.precision import check_precision, configure_matmul

CPU = torch.device("cpu")


def test_bf16_is_allowed_on_the_cpu_and_fp16_is_refused_with_the_reason():
    check_precision("bf16", CPU)       # DeepSpeed's CPU accelerator runs bf16
    check_precision("fp32", CPU)
    with pytest.raises(ConfigError, match=r"deepspeed.precision: fp16 is not supported by "
                       r"DeepSpeed's 'cpu' accelerator.*CUDA GPUs, e.g. V100"):
        check_precision("fp16", CPU)


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda answering for one GPU of the given name and compute capability."""
    def install(name, capability):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda device=None: capability)
        return torch.device("cuda", 0)
    saved = torch.get_float32_matmul_precision()
    yield install
    torch.set_float32_matmul_precision(saved)


def test_bf16_on_a_v100_is_refused_and_fp16_allowed(fake_gpu):
    gpu = fake_gpu("Tesla V100-SXM2-32GB", (7, 0))
    with pytest.raises(ConfigError, match=r"bf16 needs compute capability 8.0.*Tesla V100"
                       r"-SXM2-32GB is 7.0: use fp16"):
        check_precision("bf16", gpu)
    check_precision("fp16", gpu)
    check_precision("bf16", fake_gpu("NVIDIA A100-SXM4-80GB", (8, 0)))


def test_half_precision_sums_gradients_in_fp32_by_default(tmp_path):
    for precision in ("bf16", "fp16"):
        ds = build_ds_config(load_config("quickstart", [f"deepspeed.precision={precision}"]), 1)
        assert ds["data_types"] == {"grad_accum_dtype": "fp32"}, precision
        assert ds["communication_data_type"] == "fp32", precision
    # grad_dtype=half: DeepSpeed's defaults (sums in the training dtype), nothing rendered.
    ds = build_ds_config(load_config("quickstart", ["deepspeed.precision=bf16",
                                                    "deepspeed.grad_dtype=half"]), 1)
    assert "data_types" not in ds and "communication_data_type" not in ds
    ds = build_ds_config(load_config("quickstart", []), 1)   # fp32: nothing to choose
    assert "data_types" not in ds and "communication_data_type" not in ds
    with pytest.raises(ConfigError, match="deepspeed.grad_dtype"):
        load_config("quickstart", ["deepspeed.grad_dtype=fp8"])


def test_fp32_gradient_sums_without_zero_are_refused_naming_the_way_out():
    cfg = load_config("quickstart", ["deepspeed.precision=bf16", "deepspeed.zero_stage=0"])
    with pytest.raises(ConfigError, match=r"deepspeed.grad_dtype: fp32 gradient sums under "
                       r"bf16 need ZeRO stage 1, 2 or 3.*grad_dtype=half"):
        build_ds_config(cfg, 1)
    cfg = load_config("quickstart", ["deepspeed.precision=bf16", "deepspeed.zero_stage=0",
                                     "deepspeed.grad_dtype=half"])
    assert build_ds_config(cfg, 1)["bf16"]["enabled"]


def test_the_fp16_ds_config_a_v100_job_runs_with_is_pinned():
    ds = build_ds_config(load_config("quickstart", ["deepspeed.precision=fp16"]), 2)
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                          "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    assert ds["bf16"] == {"enabled": False}
    assert ds["zero_optimization"]["stage"] == 1
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds["communication_data_type"] == "fp32"
    assert ds["gradient_clipping"] == 0.25
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"]) == (8, 16)


def test_fp32_on_an_ampere_gpu_multiplies_in_tf32_and_says_so_loudly(fake_gpu, capsys):
    gpu = fake_gpu("NVIDIA A100-SXM4-80GB", (8, 0))
    text = configure_matmul("fp32", True, gpu, is_main=True)
    assert torch.get_float32_matmul_precision() == "high"   # TF32 for fp32 matmuls
    assert text == "fp32 (TF32 matmuls) on NVIDIA A100-SXM4-80GB (compute capability 8.0)"
    err = capsys.readouterr().err
    assert "WARNING: this GPU job trains in fp32" in err and "deepspeed.precision=bf16" in err
    configure_matmul("fp32", False, gpu, is_main=True)     # deepspeed.tf32: false
    assert torch.get_float32_matmul_precision() == "highest"


def test_fp32_on_a_v100_keeps_full_fp32_and_points_to_fp16(fake_gpu, capsys):
    gpu = fake_gpu("Tesla V100-SXM2-32GB", (7, 0))
    torch.set_float32_matmul_precision("high")
    assert "full fp32 matmuls" in configure_matmul("fp32", True, gpu, is_main=True)
    assert torch.get_float32_matmul_precision() == "highest"
    assert "deepspeed.precision=fp16" in capsys.readouterr().err


def test_half_precision_and_cpu_runs_leave_the_matmul_mode_and_stay_quiet(fake_gpu, capsys):
    before = torch.get_float32_matmul_precision()
    gpu = fake_gpu("NVIDIA H100 80GB HBM3", (9, 0))
    assert configure_matmul("bf16", True, gpu, True) == ("bf16 on NVIDIA H100 80GB HBM3 "
                                                         "(compute capability 9.0)")
    assert configure_matmul("fp32", True, CPU, True) == "fp32 on cpu"
    assert torch.get_float32_matmul_precision() == before
    assert capsys.readouterr().err == ""
