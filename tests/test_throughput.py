"""train/throughput.py: the model FLOPs of a training step against hand counts (PaLM's
6N + 12·l·d·T, memory rows counted, recompute not), the peak table, MFU in the training
loop's metrics and progress line only where a peak is known, and `peak_tflops` checked.
A pretrained base's counts: tests/test_pretrained_plan.py (its tiny checkpoints are made
there once)."""

import math

import pytest
import torch

from data_pipeline.streams import SegmentBatch
from model import build_model
from train.bptt import StreamWindows, TrainState
from train.config import ConfigError, from_dict
from train.loop import LoopParts, TrainingLoop
from train.progress import Progress
from train.throughput import (
    matmul_dtype,
    model_counts,
    peak_flops,
    segment_flops,
    training_flops,
)

B, L, M, V, D, LAYERS, HEADS = 2, 4, 4, 16, 16, 2, 2


def run_config(mechanism="xl", **top):
    model = {"mechanism": mechanism, "vocab_size": V, "n_layer": LAYERS, "d_model": D,
             "n_head": HEADS, "d_inner": 32, "tgt_len": L, "mem_len": M, "dropout": 0.0}
    if mechanism == "rmt":
        model.update(mem_len=0, rmt={"num_mem_tokens": 3})
    return from_dict({"model": model, "data": {"path": "unused", "global_batch": B},
                      "log_every": 1000, "max_steps": 1000, **top})


def core_params(cfg) -> int:
    """N_body counted on a real model (not the meta build train/throughput.py makes)."""
    return sum(p.numel() for p in build_model(cfg.model).core.parameters())


def test_the_formula_is_six_flops_per_parameter_and_row_plus_twelve_per_attention_pair():
    # 6 (10 x 5 + 3 x 2) + 12 x 7; frozen weights: 4 per parameter and row, not 6
    assert training_flops(10, 3, 5, 2, 7) == 6 * 56 + 84
    assert training_flops(10, 3, 5, 2, 7, trained_share=0.0) == 4 * 56 + 84
    assert training_flops(10, 3, 5, 2, 7, trained_share=0.5) == 5 * 56 + 84


def test_xl_counts_its_cached_keys_in_the_attention_and_its_tokens_in_the_head():
    cfg = run_config("xl")
    counts = model_counts(cfg.model)
    assert counts.n_body == core_params(cfg) and counts.n_head == V * D
    # L rows through each layer and the head; L queries against M + L keys per layer
    hand = 6 * core_params(cfg) * L + 6 * V * D * L + 12 * LAYERS * D * L * (M + L)
    assert segment_flops(cfg.model, counts, L) == hand
    # another segment length (a curriculum's), the memory as long as before
    assert segment_flops(cfg.model, counts, 2) == (6 * core_params(cfg) * 2 + 6 * V * D * 2
                                                   + 12 * LAYERS * D * 2 * (M + 2))


def test_rmt_memory_rows_run_through_every_layer_but_not_the_head():
    cfg = run_config("rmt")
    counts = model_counts(cfg.model)
    rows = L + 2 * 3                     # [read | tokens | write], RMT §3
    hand = 6 * core_params(cfg) * rows + 6 * V * D * L + 12 * LAYERS * D * rows * rows
    assert segment_flops(cfg.model, counts, L) == hand


def test_the_peak_comes_from_the_device_name_and_the_matmul_dtype():
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA H200", "bf16") == 989.4e12
    assert peak_flops("NVIDIA A10", "bf16") == 125e12        # not A100's
    assert peak_flops("NVIDIA A10G", "bf16") is None         # not the A10's either
    assert peak_flops("NVIDIA H200 NVL", "bf16") == 835e12
    assert peak_flops("Tesla V100-SXM2-16GB", "fp16") == 125e12
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None   # Volta has no bf16
    assert peak_flops("NVIDIA GeForce GTX 1080", "fp32") is None
    assert peak_flops(None) is None
    assert matmul_dtype("fp32", True, "NVIDIA A100-SXM4-80GB") == "tf32"
    assert matmul_dtype("fp32", False, "NVIDIA A100-SXM4-80GB") == "fp32"
    assert matmul_dtype("fp32", True, "Tesla V100-SXM2-16GB") == "fp32"
    assert matmul_dtype("bf16", True, "NVIDIA H200") == "bf16"


class FakeEngine:
    """The model behind the engine interface the loop's micro-step uses."""

    def __init__(self, model):
        self.module = model

    def __call__(self, tokens, state, **kw):
        return self.module(tokens, state, **kw)

    def backward(self, loss):
        pass

    def step(self):
        pass

    def is_gradient_accumulation_boundary(self):
        return True


def loop_of(cfg) -> TrainingLoop:
    torch.manual_seed(0)
    return TrainingLoop(LoopParts(
        cfg=cfg, engine=FakeEngine(build_model(cfg.model)),
        state=TrainState(plan=StreamWindows(cfg.bptt)), device=torch.device("cpu"), stage=1,
        signals=type("NoSignal", (), {"received": None})()))


def batches():
    g = torch.Generator().manual_seed(1)
    for t in range(100):
        yield SegmentBatch(torch.randint(0, V, (B, L + 1), generator=g),
                           torch.full((B,), t == 0), None, 0, t)


@pytest.mark.parametrize("depth", [0, 2])
def test_the_loop_counts_every_segment_it_runs_and_reports_mfu_with_a_peak(depth):
    cfg = run_config("xl", peak_tflops=2e-3, bptt={"depth": depth})
    loop, data = loop_of(cfg), batches()
    for _ in range(3):
        loop._micro_step(data)
    per_row = segment_flops(cfg.model, model_counts(cfg.model), L)
    flops = 3 * (depth + 1) * B * per_row
    metrics = loop.throughput.read(0.5)
    assert metrics["model_tflops_per_s"] == pytest.approx(flops / 0.5 / 1e12)
    assert metrics["mfu"] == pytest.approx(flops / 0.5 / 2e9)
    assert loop.throughput.read(0.5)["model_tflops_per_s"] == 0   # a new interval


def test_without_a_peak_the_cpu_reports_flops_and_no_mfu_and_says_why(capsys):
    loop, data = loop_of(run_config("xl")), batches()
    loop._micro_step(data)
    metrics = loop.throughput.read(1.0)
    assert "mfu" not in metrics and metrics["model_tflops_per_s"] > 0
    assert "MFU not reported" in loop.throughput.note and "peak_tflops" in loop.throughput.note


def test_the_progress_line_shows_mfu_only_when_it_is_known(capsys):
    base = {"loss": 2.5, "lr": 1e-3, "tokens_per_s": 1234.0, "peak_mem_mb": 10.0}
    progress = Progress(10, 0, enabled=True)
    progress.update(1, {**base, "mfu": 0.4123, "model_tflops_per_s": 1.0})
    progress.update(2, {**base, "model_tflops_per_s": 1.0})
    first, second = capsys.readouterr().out.splitlines()
    assert "1234 tok/s | MFU 41.2% | grad norm" in first
    assert "MFU" not in second and "1234 tok/s | grad norm" in second


@pytest.mark.parametrize("value", [0, -312, math.inf, math.nan, "fast"])
def test_peak_tflops_must_be_a_positive_number(value):
    with pytest.raises(ConfigError, match="peak_tflops"):
        run_config("xl", peak_tflops=value)


def test_peak_tflops_accepts_a_number_or_null():
    assert run_config("xl", peak_tflops=312).peak_tflops == 312.0
    assert run_config("xl").peak_tflops is None
