"""ARMT around a pretrained Hugging Face decoder (`model: {mechanism: armt, backbone: hf}`,
model/mechanisms/armt/pretrained.py): the wrapper computes what a naive layer-by-layer run of
the equations of model/mechanisms/armt/associative.py computes, its memory is inert until trained,
the associative state carries gradient exactly as far as it is not detached, segment and layer
checkpointing change nothing, and `memtrain train` trains and resumes it exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pretrained_helpers import (
    COPY_STEPS,
    COPY_STOP,
    V,
    hf_model_section,
    make_copy_task,
    tiny_gpt2,
    tiny_llama,
    train_copy_task,
)
from train_helpers import step_losses

from data_pipeline.streams import SegmentBatch
from model import ConfigError, ModelConfig, build_model
from model.pretrained.positions import armt_position_ids
from planner.activations import Dims, count_params
from planner.plan import main_plan
from planner.window import window_memory
from train.bptt import run_window
from train.memory_probe import measure

ARCHS = {"gpt2": tiny_gpt2, "llama": tiny_llama}
EPS = 1e-5
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    # GPT-2 untied: a tied head would give every embedding row the last segment's gradient.
    return {arch: make(root / arch, tied=False) for arch, make in ARCHS.items()}


def _section(path, m=3, tgt_len=8, armt=None, **model):
    sec = hf_model_section(path, m, tgt_len)
    return {**sec, "mechanism": "armt", "armt": {"d_key": 8, **(armt or {})}, **model}


def _model(path, excite=True, **kw):
    """The wrapper; `excite` draws W_v (zero at initialisation, which makes every read 0)
    so that the memory does something."""
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_dict(_section(path, **kw)))
    if excite:
        with torch.no_grad():
            for block in model.associative:
                block.v_proj.weight.normal_(0, 0.3)
    return model


def test_armt_without_memory_tokens_is_refused_by_name(ckpt):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(_section(ckpt["llama"], m=0))
    assert err.value.field == "model.rmt.num_mem_tokens"


# ---------------------------------------------------------------- the naive reference
def _dpfp(x, nu=3):
    r = torch.cat([F.relu(x), F.relu(-x)], -1)
    return torch.cat([r * r.roll(j, -1) for j in range(1, nu + 1)], -1)


def _read(block, A, z, h):
    f = _dpfp(h @ block.q_proj.weight.T)
    return h + (f @ A) / ((f * z[:, None]).sum(-1, keepdim=True) + EPS)


def _write(block, A, z, mem):
    f = _dpfp(mem @ block.k_proj.weight.T)
    v = mem @ block.v_proj.weight.T
    beta = torch.sigmoid(mem @ block.gate.weight.T + block.gate.bias)           # [B, m, 1]
    den = (f * z[:, None]).sum(-1, keepdim=True)
    vbar = (f @ A) / (den + EPS)
    gamma = (1 - den / ((f * f).sum(-1, keepdim=True) + EPS)).clamp(0, 1)
    return A + (beta * f).transpose(1, 2) @ (v - vbar), z + (gamma * f).sum(1)


def _reference_segment(model, tokens, A, z, carried):
    """One segment of the tiny Llama run by hand, layer by layer, from the equations:
    [E(x) ∘ M], positions 0..L-1 and T..T+m-1, a causal mask, read before and write after
    every decoder layer. Returns (token logits, A', z', memory rows of the output)."""
    inner, m, n = model.base.model, model.num_mem_tokens, tokens.shape[1]
    mem = model.memory_init.value[None].expand(tokens.shape[0], -1, -1)
    x = torch.cat([inner.embed_tokens(tokens), carried if carried is not None else mem], 1)
    pos = armt_position_ids(m, n, model.cfg.tgt_len)
    assert pos.tolist() == [list(range(n)) + list(range(8, 8 + m))]
    rope = inner.rotary_emb(x, pos)
    causal = torch.ones(n + m, n + m, dtype=torch.bool).tril()[None, None]
    A_new, z_new = [], []
    for i, (layer, block) in enumerate(zip(inner.layers, model.associative, strict=True)):
        x = _read(block, A[:, i], z[:, i], x)
        x = layer(x, attention_mask=causal, position_ids=pos, position_embeddings=rope)
        x = x[0] if isinstance(x, tuple) else x
        a, b = _write(block, A[:, i], z[:, i], x[:, n:])
        A_new.append(a)
        z_new.append(b)
    x = inner.norm(x)
    return model.base.lm_head(x[:, :n]), torch.stack(A_new, 1), torch.stack(z_new, 1), x[:, n:]


@pytest.mark.parametrize("carry", [False, True])
def test_the_wrapper_computes_the_naive_layer_by_layer_equations_over_three_segments(
        ckpt, carry):
    """The last segment is shorter than tgt_len: its memory positions jump past the
    tokens' and the memory must still see every token."""
    model = _model(ckpt["llama"], armt={"carry_tokens": carry}).eval()
    tokens = torch.randint(0, V, (2, 21), generator=torch.Generator().manual_seed(1))
    state = model.initial_state(2)
    A, z, carried = state.A.clone(), state.z.clone(), None
    with torch.no_grad():
        for seg in (tokens[:, :8], tokens[:, 8:16], tokens[:, 16:]):
            out = model(seg, state, return_log_probs=True)
            logits, A, z, rows = _reference_segment(model, seg, A, z, carried)
            carried = rows if carry else None
            torch.testing.assert_close(out.log_probs, torch.log_softmax(logits, -1),
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out.state.A, A, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out.state.z, z, rtol=1e-5, atol=1e-5)
            state = out.state
    assert state.writes.tolist() == [3, 3] and bool(A.abs().sum() > 0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_at_initialisation_the_memory_is_inert_the_token_logits_are_the_base_models(
        ckpt, arch):
    """W_v = 0: every read returns 0 and A stays 0, so over any number of segments the
    tokens' logits are the base model's on [tokens ∘ memory tokens] at the stated
    positions."""
    model = _model(ckpt[arch], excite=False).eval()
    tokens = torch.randint(0, V, (2, 8))
    state = None
    with torch.no_grad():
        for _ in range(3):
            out = model(tokens, state, return_log_probs=True)
            state = out.state
        emb = model.base.get_input_embeddings()(tokens)
        x = torch.cat([emb, model.memory_init.value[None].expand(2, -1, -1)], 1)
        base = model.base(inputs_embeds=x, position_ids=armt_position_ids(3, 8, 8)).logits
    assert torch.equal(state.A, torch.zeros_like(state.A)) and bool(state.z.sum() > 0)
    torch.testing.assert_close(out.log_probs, torch.log_softmax(base[:, :8].float(), -1),
                               rtol=0, atol=1e-6)


def _segments(n, rows=2):
    """Segment j uses only the token ids {2j, 2j+1}: the embedding rows that get gradient
    say which segments the loss reached."""
    g = torch.Generator().manual_seed(0)
    return [SegmentBatch(2 * j + torch.randint(0, 2, (rows, 9), generator=g),
                         torch.zeros(rows, dtype=torch.bool), None, 0, j) for j in range(n)]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gradient_reaches_the_first_segment_through_the_state_until_it_is_detached(ckpt, arch):
    """Only the last of 3 segments is scored; its write never reaches its own loss, so the
    write-side parameters (k, v, gate) get gradient only through the state from earlier
    segments."""
    model = _model(ckpt[arch])
    emb = model.base.get_input_embeddings().weight
    write_side = [p for b in model.associative for p in (b.k_proj.weight, b.v_proj.weight,
                                                          b.gate.weight)]
    for cut, expect in ((set(), [True] * 3), ({1}, [False, True, True]),
                        ({2}, [False, False, True])):
        model.zero_grad()
        res = run_window(model, None, _segments(3), torch.device("cpu"),
                         counted=[False, False, True], detach_before=cut)
        res.loss.backward()
        assert [bool(emb.grad[2 * j:2 * j + 2].abs().sum() > 0) for j in range(3)] == expect
        reached = [p.grad is not None and bool(p.grad.abs().sum() > 0) for p in write_side]
        assert all(reached) == (cut != {2}) and any(reached) == (cut != {2})


@pytest.mark.parametrize("arch", list(ARCHS))
def test_segment_and_layer_checkpointing_give_the_same_loss_and_gradients(ckpt, arch):
    runs = []
    for segments, layers in ((False, False), (True, False), (False, True), (True, True)):
        model = _model(ckpt[arch], checkpoint_layers=layers).train()
        res = run_window(model, None, _segments(3), torch.device("cpu"),
                         checkpoint_segments=segments)
        res.loss.backward()
        runs.append((res.loss.detach(), [p.grad.clone() for p in model.parameters()]))
    for loss, grads in runs[1:]:
        assert torch.equal(loss, runs[0][0])
        for a, b in zip(grads, runs[0][1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["frozen", "lora"])
def test_finetune_modes_keep_the_associative_blocks_trained_and_exported(ckpt, mode):
    model = _model(ckpt["llama"], hf={"path": str(ckpt["llama"]), "finetune": mode})
    names = model.trained_parameter_names()
    blocks = [f"associative.{n}" for n, _ in model.associative.named_parameters()]
    assert set(blocks) <= set(names) and "memory_init.value" in names
    assert all(n in blocks or n == "memory_init.value" or "lora_" in n for n in names)


# ---------------------------------------------------------------- memtrain plan
@pytest.mark.parametrize("arch,finetune,carry", [("llama", "frozen", False),
                                                 ("llama", "lora", False),
                                                 ("gpt2", "full", True)])
def test_a_planned_segment_is_what_autograd_keeps_from_the_second_segment_on(
        ckpt, arch, finetune, carry):
    """One window of 2 segments less one of 1 (train/memory_probe.py measures the
    saved storages): the second segment, whose incoming state requires grad, within 0.3% of
    the stated segment (the first one is stated the same, an overcount of one state)."""
    cfg = ModelConfig.from_dict(_section(ckpt[arch], m=4, hf={"path": str(ckpt[arch]),
                                                              "finetune": finetune},
                                         armt={"carry_tokens": carry}))
    second = measure(cfg, 3, 1, False)["saved"] - measure(cfg, 3, 0, False)["saved"]
    planned = window_memory(Dims(cfg, 3, 0, "fp32", kernel="cpu"), count_params(cfg), 2,
                            False).per_segment
    assert sum(planned.values()) == pytest.approx(second, rel=0.003)


def test_memtrain_plan_states_the_associative_memory_and_counts_its_parameters(
        ckpt, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    # No data there: planned as a token stream, whose state is carried between windows.
    assert main_plan(["--config", "copy-llama-hf-cpu", "--gpu", "a100-80gb",
                      "model.mechanism=armt", "model.armt.d_key=16",
                      f"data.path={tmp_path / 'stream'}"]) == 0
    out = capsys.readouterr().out
    # d_phi = 2 nu d_key = 96 (DPFP); 32 rows per rank; fp32 whatever the precision.
    assert "ARMT A [32, 2, 96, 64] + z [32, 2, 96] fp32" in out
    assert "one segment: the associative read and write" in out
    # The associative blocks (always trained) are counted on the meta device as built.
    model = _model(ckpt["llama"], armt={"d_key": 16}, hf={"path": str(ckpt["llama"]),
                                                          "finetune": "lora"})
    p = count_params(model.cfg)
    assert p.total == model.num_params()
    assert p.trained_total == sum(q.numel() for q in model.parameters() if q.requires_grad)


# ---------------------------------------------------------------- memtrain train
def test_memtrain_train_runs_armt_on_a_frozen_llama_and_resumes_exactly(
        ckpt, tmp_path, monkeypatch):
    """A copy task, stopped by SIGTERM at step 2 and resumed with its segments checkpointed:
    the same loss at every step as the uninterrupted run, and the memory trains."""
    copy = make_copy_task(tmp_path / "copy4-s2")
    model = _section(ckpt["llama"], m=2, tgt_len=6, hf={"path": str(ckpt["llama"]),
                                                         "finetune": "frozen"})
    whole = step_losses(train_copy_task(tmp_path, copy, model, "whole", monkeypatch))
    train_copy_task(tmp_path, copy, model, "stopped", monkeypatch, stop_at=COPY_STOP,
                    checkpoint_segments=True)
    run_dir = train_copy_task(tmp_path, copy, model, "stopped", monkeypatch,
                              checkpoint_segments=True)
    resumed = step_losses(run_dir)
    assert sorted(whole) == list(range(1, COPY_STEPS + 1)) and whole[COPY_STEPS] != whole[1]
    assert resumed == pytest.approx(whole, rel=1e-5)
