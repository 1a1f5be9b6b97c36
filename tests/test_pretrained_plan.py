"""`memtrain plan` for a pretrained backbone (`model.backbone: hf`): the segment shapes a
Llama-family or GPT-2 decoder states (model/pretrained/shapes.py) against one BPTT window
measured on the CPU (train/memory_probe.py, the measurement of
tests/test_memory_plan.py), parameter counts made on the meta device against the built
model, frozen weights in the ZeRO model states, and the plan of a Llama-2-7B-shaped config
whose checkpoint directory holds only a config.json.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from pretrained_helpers import hf_model_section, tiny_gpt2, tiny_llama

from model import ModelConfig, build_model, resolve_shape
from planner.activations import count_params
from planner.plan import main_plan, model_states
from planner.window import predict_window
from train.memory_probe import measure

ROOT = Path(__file__).resolve().parents[1]

TINY = {"gpt2": tiny_gpt2, "llama": tiny_llama}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import Qwen2Config
    root = tmp_path_factory.mktemp("hf")
    paths = {name: make(root / name) for name, make in TINY.items()}
    # Another of the Llama family (biased q/k/v), as a config alone: the window's weights
    # are drawn from it (train/memory_probe.py `build_for_probe`).
    Qwen2Config(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                bos_token_id=0, eos_token_id=0).save_pretrained(root / "qwen2")
    return {**paths, "qwen2": root / "qwen2"}


def _cfg(checkpoints, arch: str, finetune: str, m: int = 4, tgt_len: int = 8,
         pattern: str = "paper", **hf) -> ModelConfig:
    section = hf_model_section(checkpoints[arch], m, tgt_len, finetune=finetune, **hf)
    section["rmt"]["pattern"] = pattern
    return resolve_shape(ModelConfig.from_dict(section))


@pytest.mark.parametrize("arch,finetune,depth,ckpt", [
    ("llama", "frozen", 2, False), ("llama", "lora", 1, False), ("llama", "full", 1, False),
    ("gpt2", "full", 2, False), ("gpt2", "lora", 2, True), ("qwen2", "lora", 2, False)])
def test_planned_window_matches_the_memory_measured_on_the_cpu(checkpoints, arch, finetune,
                                                               depth, ckpt):
    """One window of depth+1 segments, random weights: the allocator's peak within 3% of the
    plan (the planner's error on the native stack: -2.5% to +1.7%, BENCHMARKS.md "Memory
    planner"; its tests allow 15%) and autograd's saved tensors within 0.1%."""
    cfg = _cfg(checkpoints, arch, finetune)
    got = measure(cfg, 3, depth, ckpt)
    want = predict_window(cfg, 3, depth, ckpt)
    assert want["peak"] == pytest.approx(got["peak"], rel=0.03)
    if not ckpt:
        assert want["saved"] == pytest.approx(got["saved"], rel=0.001)


def test_the_causal_pattern_is_planned_without_a_mask_and_grouped_keys(checkpoints):
    """`model.rmt.pattern: causal` passes the base model no mask, so SDPA reads the grouped
    keys and values as they are (Llama: 2 KV heads of 4), not copies repeated per head
    (counting the copies plans 8% too much here). The plan still counts a mask per SDPA
    call that this call does not have: 0.6% above autograd's saved tensors, within 1%."""
    cfg = _cfg(checkpoints, "llama", "lora", pattern="causal")
    got = measure(cfg, 3, 1, False)
    want = predict_window(cfg, 3, 1, False)
    assert want["saved"] == pytest.approx(got["saved"], rel=0.01)
    assert want["peak"] == pytest.approx(got["peak"], rel=0.03)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_paper_pattern_is_planned_as_it_runs_split_or_masked(checkpoints, arch):
    """`model.hf.paper_attention`: "split" (the default; model/pretrained/
    paper_attention.py) runs three maskless calls on grouped keys and concatenates their
    outputs (o_proj keeps that copy); "mask" one masked call on keys repeated per head. Each
    is planned as it runs (saved tensors within 0.1%, peak 3%), and the two plans differ."""
    wanted = {}
    for mode in ("split", "mask"):
        cfg = _cfg(checkpoints, arch, "full", paper_attention=mode)
        got = measure(cfg, 3, 1, False)
        wanted[mode] = predict_window(cfg, 3, 1, False)
        assert wanted[mode]["saved"] == pytest.approx(got["saved"], rel=0.001)
        assert wanted[mode]["peak"] == pytest.approx(got["peak"], rel=0.03)
    assert wanted["split"]["saved"] != wanted["mask"]["saved"]


EXPERTS = ["q_proj", "experts.gate_up_proj", "experts.down_proj"]   # LoRA on the experts


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """Tiny mixtures of experts (d_model 32, 4 experts, top 2, the load-balancing loss on):
    Mixtral (model/pretrained/tiny.py) and Qwen2-MoE with its shared expert
    (tests/test_architectures.py's config)."""
    from test_architectures import ARCHS, _write

    from model.pretrained.tiny import tiny_mixtral
    root = tmp_path_factory.mktemp("moe")
    return {"mixtral": tiny_mixtral(root / "mixtral", d=32),
            "qwen2_moe": _write(root, "qwen2_moe", ARCHS["qwen2_moe"])}


@pytest.mark.parametrize("arch,finetune,targets", [
    ("mixtral", "full", None), ("mixtral", "frozen", None), ("mixtral", "lora", EXPERTS),
    ("qwen2_moe", "full", None), ("qwen2_moe", "frozen", None), ("qwen2_moe", "lora", EXPERTS)])
def test_a_mixture_of_experts_window_matches_the_memory_measured_on_the_cpu(
        moe_checkpoints, arch, finetune, targets):
    """Every expert's weights are parameters; autograd keeps the routed rows' activations
    (k x tokens rows through the experts as transformers' grouped_mm runs them), the
    router's softmax and top-k, the load-balancing loss's softmax and, with LoRA on the fused
    experts, each adapted expert tensor W + B·A: saved within 0.1%, the peak within 3%."""
    hf = {"finetune": finetune, "lora_r": 2, **({"lora_targets": targets} if targets else {})}
    cfg = resolve_shape(ModelConfig.from_dict(
        hf_model_section(moe_checkpoints[arch], 4, 8, **hf)))
    got = measure(cfg, 3, 1, False)
    want = predict_window(cfg, 3, 1, False)
    assert want["saved"] == pytest.approx(got["saved"], rel=0.001)
    assert want["peak"] == pytest.approx(got["peak"], rel=0.03)


@pytest.mark.parametrize("finetune", ["full", "frozen", "lora"])
def test_parameter_counts_on_the_meta_device_are_the_built_models(checkpoints, finetune):
    cfg = _cfg(checkpoints, "gpt2", finetune)
    model = build_model(cfg)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    p = count_params(cfg)
    assert p.total == model.num_params()
    assert p.trained_total == sum(q.numel() for n, q in model.named_parameters()
                                  if n in trained)
    assert set(model.trained_parameter_names()) == trained
    # GPT-2 ties its head to the token embedding: counted once, and a gradient buffer for
    # it only when that weight trains.
    assert p.tied == (32 * 64 if finetune == "full" else 0)


@pytest.mark.parametrize("stage,frozen_bytes", [(1, 2 * 1_000_000), (2, 2 * 1_000_000),
                                                (3, 2 * 1_000_000 / 8)])
def test_frozen_weights_are_held_in_the_model_dtype_only(stage, frozen_bytes):
    """DeepSpeed keeps no gradient, master copy or optimizer state for them; ZeRO-1/2 leave
    them whole on each rank, ZeRO-3 partitions them with every other parameter."""
    with_frozen = model_states(1000, stage, "bf16", 8, frozen=1_000_000)
    trained_only = model_states(1000, stage, "bf16", 8)
    assert [v for _, v in with_frozen[:3]] == [v for _, v in trained_only]
    assert len(with_frozen) == 4 and with_frozen[3][1] == pytest.approx(frozen_bytes)


def _largest(out: str, checkpointed: bool) -> int:
    flag = "true" if checkpointed else "false"
    return int(re.search(rf"largest bptt.depth that fits, checkpoint_segments {flag}: (\d+)",
                         out).group(1))


def test_the_llama2_7b_shape_is_planned_from_its_config_alone(capsys, monkeypatch):
    """configs/llama2-7b-shape holds only a config.json; LoRA keeps its adapters' inputs
    besides what a frozen base keeps, so it fits no deeper."""
    monkeypatch.chdir(ROOT)
    assert sorted(p.name for p in (ROOT / "configs/llama2-7b-shape").iterdir()) == \
        ["config.json"]
    args = ["--config", "llama2-7b-rmt", "--gpu", "a100-80gb", "--nodes", "4",
            "--gpus-per-node", "8"]
    assert main_plan(args) == 0
    lora = capsys.readouterr().out
    assert main_plan(args + ["model.hf.finetune=frozen"]) == 0
    frozen = capsys.readouterr().out
    assert "6,742,675,456 parameters (4,259,840 trained" in lora
    assert "6,738,481,152 parameters (65,536 trained" in frozen
    assert "ZeRO-3: bf16/fp16 frozen parameters (2 B/param, /N_d)" in frozen
    assert "RMT memory [1, 16, 4096]" in frozen
    assert "largest model.mem_len: not applicable" in frozen
    assert 0 < _largest(lora, False) <= _largest(frozen, False)
    assert _largest(frozen, False) < _largest(frozen, True)


def test_an_architecture_without_stated_shapes_is_refused_by_name(tmp_path, capsys):
    from transformers import GPTNeoXConfig
    GPTNeoXConfig(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128).save_pretrained(tmp_path)
    code = main_plan(["--config", str(ROOT / "configs/llama2-7b-rmt.yaml"), "--gpu",
                      "a100-80gb", f"model.hf.path={tmp_path}", "model.tgt_len=8"])
    assert code == 2
    err = capsys.readouterr().err
    assert "model.hf.path" in err and "'gpt_neox'" in err


@pytest.mark.parametrize("arch,finetune", [("gpt2", "full"), ("gpt2", "frozen"),
                                           ("llama", "lora")])
def test_model_flops_count_the_tables_apart_and_frozen_weights_at_four(checkpoints, arch,
                                                                      finetune):
    """train/throughput.py: N_body is every parameter but the embedding tables (GPT-2: tokens
    and positions, its head tied; Llama: its own head), N_head the d x V head; a parameter
    that does not train costs 4 FLOPs per row, not 6 (the trained share)."""
    from train.throughput import model_counts
    cfg = _cfg(checkpoints, arch, finetune)
    model = build_model(cfg)
    params = list(model.parameters())
    tables = sum(m.weight.numel() for m in model.base.modules()
                 if isinstance(m, torch.nn.Embedding))
    head = model.base.get_output_embeddings().weight
    untied = 0 if head is model.base.get_input_embeddings().weight else head.numel()
    counts = model_counts(cfg)
    assert counts.n_body == sum(p.numel() for p in params) - tables - untied
    assert counts.n_head == cfg.vocab_size * cfg.d_model
    trained = sum(p.numel() for p in params if p.requires_grad)
    assert counts.trained_share == pytest.approx(trained / sum(p.numel() for p in params))
    assert (counts.trained_share == 1.0) == (finetune == "full")


@pytest.mark.parametrize("arch,finetune,pattern", [("gpt2", "full", "paper"),
                                                   ("llama", "lora", "paper"),
                                                   ("llama", "frozen", "causal")])
def test_flops_read_without_a_layout_equal_the_planned_ones(checkpoints, arch, finetune,
                                                            pattern):
    """model/pretrained/flops.py (what an architecture with no planner layout reports):
    on a planned one, the same N_body, N_head, trained share, rows and attention as the
    planner's stated shapes."""
    from model import backbone_of
    from model.pretrained.flops import unplanned_counts, unplanned_terms
    from train.throughput import model_counts
    cfg = _cfg(checkpoints, arch, finetune, pattern=pattern)
    assert unplanned_counts(cfg) == dataclasses.astuple(model_counts(cfg))   # the planner's
    for seg_len in (8, 5):
        assert unplanned_terms(cfg, seg_len) == pytest.approx(
            backbone_of(cfg).flop_terms(cfg, seg_len))


def test_an_architecture_without_a_layout_reports_its_flops(tmp_path):
    """A tiny Gemma 3 (no planner layout): the loop's FLOP count is there, from the meta
    model's parameters (its scaled embedding a table, not a matmul) and the mechanism's
    rows."""
    from model.pretrained.tiny import TINY as BUILDERS
    from train.throughput import model_counts, segment_flops
    path = BUILDERS["gemma"](tmp_path / "gemma")
    section = hf_model_section(path, 4, 8, finetune="full")
    cfg = resolve_shape(ModelConfig.from_dict(section))
    model = build_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    counts = model_counts(cfg)
    assert counts.n_head == cfg.vocab_size * cfg.d_model
    assert counts.n_body == params - model.base.get_input_embeddings().weight.numel()
    q = 2 * 4 + 8
    flops = segment_flops(cfg, counts, 8)
    attention = cfg.n_layer * ((4 + 8) ** 2 + 4 * 4 + 4 * q) * cfg.n_head * cfg.d_head
    assert flops == pytest.approx(6 * counts.n_body * q + 6 * counts.n_head * 8
                                  + 12 * attention)
