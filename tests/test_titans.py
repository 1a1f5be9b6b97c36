"""Titans, memory as a context (model/mechanisms/titans/core.py,
model/mechanisms/titans/mechanism.py), on the native stack: the bounds of its options, causality
inside a segment, the memory crossing segments, the BPTT cut through the inner updates, and the
state's round trip. The neural memory's update itself is pinned against the equations in
tests/test_neural_memory.py."""

from __future__ import annotations

import math

import pytest
import torch
from bptt_reach import CUTS, random_segments, segments_reached
from titans_helpers import L, V, titans_model, token_4_changed

from model import ConfigError, ModelConfig, build_model
from model.mechanisms.titans.neural_memory import NeuralMemoryState
from model.memory import MemoryState


@pytest.mark.parametrize(("field", "value"), [
    ("max_lr", 0.0), ("max_lr", 1.5), ("max_momentum", 1.0), ("max_momentum", -0.1),
    ("memory_depth", 0), ("memory_depth", 5), ("max_forget", 1.5), ("max_grad_norm", 0.0),
    ("max_grad_norm", float("inf")), ("chunk_size", 0), ("d_mem", 0), ("num_persistent", -1),
    ("variant", "mat"), ("conv_size", 1), ("conv_size", -1), ("update_input", "y"),
    ("read_as", "rows"), ("lr_bias", float("inf")), ("momentum_bias", float("nan")),
    ("forget_bias", float("-inf")), ("read_init_std", -0.1), ("read_init_std", float("inf"))])
def test_each_bound_of_the_options_is_refused_by_its_field(field, value):
    with pytest.raises(ConfigError) as err:
        ModelConfig(mechanism="titans", mem_len=0, titans={field: value})
    assert err.value.field == f"model.titans.{field}"


def test_mag_and_mal_are_refused_around_a_pretrained_decoder():
    with pytest.raises(ConfigError) as err:
        ModelConfig(mechanism="titans", backbone="hf", mem_len=0, titans={"variant": "mag"},
                    hf={"path": "unused"})
    assert err.value.field == "model.titans.variant"


def test_an_xl_cache_is_refused_at_construction_and_for_evaluation():
    with pytest.raises(ConfigError) as err:
        ModelConfig(mechanism="titans", mem_len=4)
    assert err.value.field == "model.mem_len"
    with pytest.raises(ConfigError) as err:
        ModelConfig(mechanism="titans", mem_len=0).check_lengths(8, -1, False, "eval")
    assert err.value.field == "eval.mem_len"


# (variant, model.titans.conv_size): every variant, and with §4.4's convolutions
VARIANTS_CONV = [("mac", 0), ("mag", 0), ("mal", 0), ("mac", 3), ("mal", 3)]


@pytest.mark.parametrize("variant,conv_size", VARIANTS_CONV)
def test_a_token_sees_neither_later_tokens_nor_their_memory_reads(variant, conv_size):
    """Token j may attend to the read h_i only for i <= j (h_i is read with token i's query)
    and every other read is of the memory of the chunks before its own: changing token 4 of
    a segment (chunk 4) leaves the log-probs of tokens 0-3 exactly as they were, in this
    segment, and changes the next segment through the memory (and, with convolutions,
    their carried tail)."""
    model = titans_model(variant=variant, conv_size=conv_size)
    x = torch.randint(0, V, (2, 2 * L), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a1, b1, a2, b2 = token_4_changed(model, x)
    assert torch.equal(a1.log_probs[:, :4], b1.log_probs[:, :4])
    assert (a1.log_probs[:, 4:] - b1.log_probs[:, 4:]).abs().max() > 1e-5
    assert (a2.log_probs - b2.log_probs).abs().max() > 1e-5


@pytest.mark.parametrize("variant,conv_size", VARIANTS_CONV)
def test_the_memory_crosses_segments_and_a_reset_row_is_a_fresh_document(variant, conv_size):
    model = titans_model(variant=variant, conv_size=conv_size)
    x = torch.randint(0, V, (2, 2 * L), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        first = model(x[:, :L], None)
        carried = model(x[:, L:], first.state, return_log_probs=True).log_probs
        fresh = model(x[:, L:], None, return_log_probs=True).log_probs
        reset = model(x[:, L:], first.state.reset_rows(torch.tensor([True, False])),
                      return_log_probs=True).log_probs
    assert (carried - fresh).abs().max() > 1e-4
    assert torch.equal(reset[0], fresh[0]) and torch.equal(reset[1], carried[1])


@pytest.mark.parametrize("variant,conv_size", VARIANTS_CONV)
def test_every_parameter_is_used_and_trained_from_the_first_segment_pair(variant, conv_size):
    """No parameter a variant leaves without a gradient over two segments (MAG has no
    W_H, MAL no Eq. 25 gate: neither is built; the convolutions, where present, train)."""
    model = titans_model(sharpen=False, variant=variant, conv_size=conv_size).train()
    x = torch.randint(0, V, (2, 2 * L + 1), generator=torch.Generator().manual_seed(6))
    first = model(x[:, :L], None, targets=x[:, 1:L + 1])
    second = model(x[:, L:2 * L], first.state, targets=x[:, L + 1:])
    (first.loss + second.loss).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


def test_at_initialisation_the_memory_gate_is_the_identity():
    model = titans_model(sharpen=False)
    x = torch.randint(0, V, (2, L))
    core = model.core
    with torch.no_grad():
        y = torch.randn(2, L, 16)
        assert torch.equal(core.memory_gate[0](y, torch.randn(2, L, 8)), y)
        assert model(x, None).state.weights[0].abs().sum() > 0


@pytest.mark.parametrize("checkpoint_segments", [False, True])
@pytest.mark.parametrize(("detach_before", "reached"), CUTS)
def test_gradient_reaches_exactly_the_segments_after_the_last_cut(detach_before, reached,
                                                                  checkpoint_segments):
    # Only the last of 4 segments has a loss; it reaches earlier segments only through the
    # memory's weights and momentum, i.e. through the inner updates (§3.2) of each segment.
    model = titans_model().train()
    assert segments_reached(model, random_segments(4, V, L, seed=4), detach_before,
                            checkpoint_segments) == reached


@pytest.mark.parametrize("variant", ["mag", "mal"])
def test_mag_and_mal_carry_the_gradient_through_their_updates_to_the_cut(variant):
    model = titans_model(variant=variant).train()
    assert segments_reached(model, random_segments(4, V, L, seed=4), frozenset({2}),
                            False) == [False, False, True, True]


@pytest.mark.parametrize("conv_size", [0, 3])
def test_the_state_saves_loads_and_moves_to_bf16_exactly(conv_size, tmp_path):
    model = titans_model(conv_size=conv_size)
    x = torch.randint(0, V, (2, 2 * L))
    with torch.no_grad():
        state = model(x[:, :L], None).state
        want = model(x[:, L:], state, return_log_probs=True).log_probs
    torch.save(state.state_dict(), tmp_path / "memory.pt")
    back = MemoryState.from_state_dict(torch.load(tmp_path / "memory.pt", weights_only=True))
    assert isinstance(back, NeuralMemoryState) and back.kind == "titans"
    with torch.no_grad():
        assert torch.equal(model(x[:, L:], back, return_log_probs=True).log_probs, want)
    moved = back.to(dtype=torch.bfloat16)
    assert all(w.dtype == torch.float32 for w in moved.weights + moved.momentum)
    assert [w.shape for w in back.weights] == [(2, 2, 8, 16), (2, 2, 16, 8)]
    # the convolutions' tails: MAC's two streams, the last c - 1 rows, in the model dtype
    assert [t.shape for t in back.tails] == ([(2, 2, 2, 16)] * 2 if conv_size else [])
    assert all(t.dtype == torch.bfloat16 for t in moved.tails)
    if not conv_size:   # a state saved before the tails existed loads as one without them
        old = {k: v for k, v in state.state_dict().items() if k != "tails"}
        assert MemoryState.from_state_dict(old).tails == []


def test_a_bf16_model_keeps_a_float32_state_close_to_the_float32_model():
    model = titans_model()
    x = torch.randint(0, V, (2, 4 * L), generator=torch.Generator().manual_seed(3))
    states = {}
    with torch.no_grad():
        for name, m in (("f32", model), ("bf16", titans_model().to(torch.bfloat16))):
            state = None
            for s in range(4):
                state = m(x[:, s * L:(s + 1) * L], state).state
            states[name] = state
    got, want = states["bf16"], states["f32"]
    for a, b in zip(got.weights + got.momentum, want.weights + want.momentum, strict=True):
        assert a.dtype == torch.float32 and torch.isfinite(a).all()
        assert (a - b).norm() / b.norm() < 0.05


@pytest.mark.slow
def test_titans_under_zero3_bf16_resumes_bit_for_bit_evaluates_and_generates(tmp_path, capsys):
    """`memtrain train` under ZeRO-3 and bf16 (the memory's parameters
    gathered where they are called, its state float32), BPTT depth 1 with segment
    checkpointing, 5 steps saving at step 3; a copy of it rewound to that checkpoint (the
    run stopped there) continues with the memory it saved to the same losses; then
    `memtrain eval` and `memtrain generate` from the exported model. The trainings run as
    processes of their own: ZeRO-3 in this process left torch patched (DeepSpeed's
    partitioned linear), and the memory planner's measurements later in the same worker
    counted other saved tensors."""
    from train_helpers import copy_run, rewind_run, run_train, step_losses, tiny_config

    from evaluation.cli import main_eval
    from evaluation.generate_cli import main_generate
    from train.checkpoint import find_latest, load_rank_payload
    config = tiny_config(tmp_path, "straight", max_steps=5, save_every=3,
                         model={"mechanism": "titans", "n_layer": 1, "d_model": 16,
                                "d_inner": 32, "tgt_len": 4, "mem_len": 0, "pre_lnorm": True,
                                "titans": {"d_mem": 8, "chunk_size": 2}},
                         bptt={"depth": 1, "checkpoint_segments": True},
                         deepspeed={"zero_stage": 3, "precision": "bf16"},
                         data={"global_batch": 2}, eval={"max_segments": 2})
    run_train(config, launcher="single")
    straight = tmp_path / "runs" / "straight"
    stopped_cfg = copy_run(straight, tmp_path, "stopped")
    stopped = tmp_path / "runs" / "stopped"
    rewind_run(stopped, 3)
    memory = load_rank_payload(find_latest(stopped / "checkpoints"), 0)["memory"]
    assert memory["kind"] == "titans" and memory["weights"][0].dtype == torch.float32
    assert memory["weights"][0].abs().sum() > 0 and not memory["fresh"].any()
    run_train(stopped_cfg, launcher="single")
    losses = step_losses(straight)
    assert sorted(losses) == [1, 2, 3, 4, 5] and all(map(math.isfinite, losses.values()))
    assert step_losses(stopped) == losses
    assert main_eval(["--run-dir", str(straight), "--no-track"]) == 0
    capsys.readouterr()
    assert main_generate(["--checkpoint", str(straight / "model.safetensors"), "--data",
                          str(tmp_path / "data"), "--prompt-ids", "1 2 3 4 5 6",
                          "--max-new-tokens", "6", "--seed", "0"]) == 0
    assert len(capsys.readouterr().out.split()) >= 6


def test_titans_is_planned_with_its_state_stated(capsys):
    from planner.plan import main_plan
    assert main_plan(["--config", "quickstart", "--gpu", "a100-80gb",
                      "model.mechanism=titans", "model.mem_len=0"]) == 0
    assert "Titans M and S: 2 layers x 2 matrices [32, 64] + [64, 32]" in capsys.readouterr().out
    # around a pretrained GPT-2 (a shape-only config.json): the same state, stated rows
    assert main_plan(["--config", "copy-gpt2-hf-cpu", "--gpu", "a100-80gb",
                      "model.mechanism=titans", "model.titans.d_mem=16"]) == 0
    out = capsys.readouterr().out
    assert "Titans M and S: 2 layers x 2 matrices [16, 32] + [32, 16] per row" in out
    assert "the neural memory's reads and update" in out


@pytest.mark.parametrize("conv_size", [0, 4])
def test_the_plan_of_a_titans_window_is_within_15_percent_of_the_measured_peak(conv_size):
    """One window of 2 segments on the CPU: the planner's peak from the shapes
    `TitansCore.segment_shapes` states, against the allocator's (measured 2026-11-27: 0.886
    of it without convolutions, 0.870 with them; the deep memory's backward intermediates
    undercounted)."""
    from planner.window import predict_window
    from train.memory_probe import measure
    cfg = ModelConfig(mechanism="titans", vocab_size=50, n_layer=2, d_model=32, n_head=2,
                      d_inner=64, tgt_len=16, mem_len=0, pre_lnorm=True,
                      titans={"d_mem": 8, "chunk_size": 8, "conv_size": conv_size})
    got, want = measure(cfg, 2, 1, False), predict_window(cfg, 2, 1, False)
    assert want["peak"] == pytest.approx(got["peak"], rel=0.15)


@pytest.mark.parametrize("arch,conv_size", [("gpt2", 0), ("llama", 0), ("gpt2", 3)])
def test_titans_runs_around_a_pretrained_model_causally_and_carries_its_memory(
        arch, conv_size, tmp_path):
    from pretrained_helpers import TINY
    cfg = ModelConfig(mechanism="titans", backbone="hf", tgt_len=L, mem_len=0,
                      titans={"d_mem": 8, "chunk_size": 2, "num_persistent": 2,
                              "conv_size": conv_size},
                      hf={"path": str(TINY[arch](tmp_path / arch))})
    torch.manual_seed(0)
    lm = build_model(cfg)
    with torch.no_grad():
        for gate in lm.memory_gate:
            gate.proj.weight.normal_(0.0, 0.5)
    x = torch.randint(0, cfg.vocab_size, (2, 2 * L), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[:, 2] = (y[:, 2] + 1) % cfg.vocab_size
    a1 = lm(x[:, :L], None, return_log_probs=True)
    with torch.no_grad():
        b1 = lm(y[:, :L], None, return_log_probs=True)
        fresh = lm(x[:, L:], None, return_log_probs=True).log_probs
    assert torch.equal(a1.log_probs[:, :2], b1.log_probs[:, :2])        # no peeking ahead
    assert (a1.log_probs[:, 2:] - b1.log_probs[:, 2:]).abs().max() > 1e-6
    second = lm(x[:, L:], a1.state, targets=x[:, L:], return_log_probs=True)
    assert isinstance(second.state, NeuralMemoryState)
    assert (second.log_probs - fresh).abs().max() > 1e-5                 # the memory carries
    second.loss.backward()
    assert lm.memory[0].k_proj.weight.grad.abs().sum() > 0   # through the first segment's update


@pytest.mark.parametrize("arch, deepspeed", [
    ("gpt2", {"zero_stage": 2}), ("llama", {"zero_stage": 3, "precision": "bf16"})])
def test_memtrain_train_runs_titans_around_a_pretrained_model_and_resumes_exactly(
        arch, deepspeed, tmp_path, monkeypatch):
    """Through the whole engine around a frozen pretrained model (GPT-2 in fp32 at ZeRO-2,
    Llama in bf16 at ZeRO-3, its frozen base partitioned too, which the checkpointed
    segments' re-run must meet gathered; model/segment_lm.py): a copy task stopped by
    SIGTERM at step 2 and resumed (the neural memory's carried weights and momentum in the
    checkpoint, segments checkpointed) repeats the uninterrupted run's losses, and they
    move."""
    from pretrained_helpers import (
        COPY_STEPS,
        COPY_STOP,
        TINY,
        make_copy_task,
        train_copy_task,
    )
    from train_helpers import step_losses
    path = TINY[arch](tmp_path / arch)
    copy = make_copy_task(tmp_path / "copy4-s2")
    # Llama's with §4.4's convolutions: their tails (bf16) are saved and resumed too
    model = {"mechanism": "titans", "backbone": "hf", "tgt_len": 6, "mem_len": 0,
             "titans": {"d_mem": 8, "chunk_size": 2, "num_persistent": 2,
                        "conv_size": 3 if arch == "llama" else 0},
             "hf": {"path": str(path), "finetune": "frozen"}}
    whole = step_losses(train_copy_task(tmp_path, copy, model, "whole", monkeypatch,
                                        deepspeed=deepspeed))
    train_copy_task(tmp_path, copy, model, "stopped", monkeypatch, stop_at=COPY_STOP,
                    deepspeed=deepspeed, checkpoint_segments=True)
    run_dir = train_copy_task(tmp_path, copy, model, "stopped", monkeypatch,
                              deepspeed=deepspeed, checkpoint_segments=True)
    resumed = step_losses(run_dir)
    assert sorted(whole) == list(range(1, COPY_STEPS + 1)) and whole[COPY_STEPS] != whole[1]
    assert resumed == pytest.approx(whole, rel=1e-5)
