"""`model.rmt.pattern: causal` is the RMT authors' Hugging Face wrapper (MemoryCell /
RecurrentWrapper of booydar/recurrent-memory-transformer) exactly: each segment is the base
model's own forward on `inputs_embeds = [mem; E(x); mem]` with its causal mask and default
positions 0..2m+L-1, the logits are the token rows, and the next memory is the last hidden
state (after the final norm) of the write rows. The reference below is written from that
description, not from the wrapper, and runs the base model alone (tests/pretrained_helpers.py
`authors_reference`)."""

import pytest
import torch
from pretrained_helpers import TINY, V, authors_reference, hf_model_section

from model import ConfigError, ModelConfig, build_model

ARCHS = ("gpt2", "llama")
M = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: TINY[arch](root / arch) for arch in ARCHS}


def _model(path, pattern="causal", attn="sdpa"):
    torch.manual_seed(0)
    section = hf_model_section(path, M, 8, attn_implementation=attn)
    section["rmt"]["pattern"] = pattern
    return build_model(ModelConfig.from_dict(section))


def reference(base, memory_init, segments):
    return authors_reference(base, memory_init, segments)


def _segments():
    g = torch.Generator().manual_seed(1)
    # The last segment is shorter than the trained length (8): the write block moves with L.
    return [torch.randint(0, V, (2, n), generator=g) for n in (8, 8, 5)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_causal_pattern_log_probs_and_memory_equal_the_base_model_on_mem_tokens_mem(
        ckpt, arch, attn):
    model = _model(ckpt[arch], attn=attn).eval()
    segs = _segments()
    with torch.no_grad():
        ref = reference(model.base, model.memory_init(), segs)
        state = None
        for (ref_lp, ref_mem), seg in zip(ref, segs, strict=True):
            out = model(seg, state, return_log_probs=True)
            state = out.state
            torch.testing.assert_close(out.log_probs, ref_lp, atol=1e-5, rtol=0)
            torch.testing.assert_close(state.tokens, ref_mem, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_causal_pattern_gradients_equal_the_reference_through_three_segments(ckpt, arch):
    model = _model(ckpt[arch]).train()
    segs = _segments()
    targets = [torch.roll(s, -1, dims=1) for s in segs]
    state, loss = None, 0.0
    for seg, tgt in zip(segs, targets, strict=True):
        out = model(seg, state, targets=tgt)
        state, loss = out.state, loss + out.nll.sum()
    loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref_loss = sum(-lp.gather(-1, t[..., None]).sum()
                   for (lp, _), t in zip(reference(model.base, model.memory_init(), segs),
                                         targets, strict=True))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-6)
    assert "memory_init.weight" in ours or any("memory_init" in n for n in ours)
    for name, p in model.named_parameters():
        if name in ours:
            torch.testing.assert_close(ours[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_paper_pattern_is_not_the_authors_wrapper(ckpt, arch):
    """The two options differ on the same weights (what makes an imported checkpoint need
    `pattern: causal`)."""
    model = _model(ckpt[arch], pattern="paper").eval()
    seg = _segments()[0]
    with torch.no_grad():
        (ref_lp, _), = reference(model.base, model.memory_init(), [seg])
        ours = model(seg, return_log_probs=True).log_probs
    assert (ours - ref_lp).abs().max() > 1e-3


def test_causal_pattern_is_refused_where_it_has_no_meaning(ckpt):
    with pytest.raises(ConfigError, match="model.rmt.pattern"):
        ModelConfig(mechanism="rmt", rmt={"pattern": "causal"})
    section = hf_model_section(ckpt["llama"], M, 8)
    section.update(mechanism="armt")
    section["rmt"]["pattern"] = "causal"
    with pytest.raises(ConfigError, match="model.rmt.pattern"):
        ModelConfig.from_dict(section)
    with pytest.raises(ConfigError, match="model.rmt.pattern"):
        ModelConfig(mechanism="rmt", rmt={"pattern": "bidirectional"})
