"""`model.hf.fused_gelu` (model/pretrained/activations.py): a checkpoint whose activation is
`gelu_new` runs it as the fused `gelu_pytorch_tanh`, with the original's logits to float
rounding and a fraction of its elementwise ops; any architecture naming `gelu_new` gets it,
others are untouched, and false keeps the original. Tiny random checkpoints built from
configs, never downloaded."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from benchmarks.bench_pretrained_fused import PointwiseOps
from model import ModelConfig, resolve_shape
from model.pretrained.activations import effective_activation, fuse_gelu
from model.pretrained.loading import load_base

V = 32


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny GPT-2 whose weights are drawn wide (std 0.3, not 0.02), so the MLP's
    pre-activations spread over [-3, 3], where the tanh approximation and the exact GELU
    differ by up to ~1e-3: at GPT-2's own init the inputs sit near 0, where every GELU is
    x/2 and no activation could be told from another."""
    from transformers import GPT2Config, GPT2LMHeadModel
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               initializer_range=0.3, bos_token_id=0, eos_token_id=0)
                    ).save_pretrained(path)
    return path


def _base(path, fused: bool):
    # The activation's own ops, without the recompute of its output in backward
    # (model.hf.recompute_activation, counted in tests/test_activation_recompute.py).
    cfg = ModelConfig.from_dict({"mechanism": "rmt", "backbone": "hf", "tgt_len": 8,
                                 "mem_len": 0, "rmt": {"num_mem_tokens": 0},
                                 "hf": {"path": str(path), "fused_gelu": fused,
                                        "recompute_activation": False}})
    return load_base(resolve_shape(cfg)).eval()


def test_fused_gelu_gives_the_original_logits_to_1e5_relative_in_fp32(gpt2, capsys):
    from transformers.activations import GELUTanh, NewGELUActivation
    original, fused = _base(gpt2, False), _base(gpt2, True)
    assert "runs as the fused gelu_pytorch_tanh (the same tanh approximation, one kernel; " \
           "2 modules)" in capsys.readouterr().out
    assert {type(m.mlp.act) for m in original.transformer.h} == {NewGELUActivation}
    assert {type(m.mlp.act) for m in fused.transformer.h} == {GELUTanh}
    x = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = original(x).logits, fused(x).logits
        pre = original.transformer.h[0].mlp.c_fc(original.transformer.h[0].ln_2(
            original.transformer.wte(x) + original.transformer.wpe(torch.arange(24))))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    # The test can tell activations apart: the inputs are wide, and the exact GELU moves
    # the logits by far more than the tolerance.
    assert pre.abs().max() > 2
    for block in original.transformer.h:
        block.mlp.act = torch.nn.GELU()
    with torch.no_grad():
        exact = original(x).logits
    assert not torch.allclose(exact, want, rtol=1e-5, atol=1e-6)




def mlp_pointwise_ops(base) -> Counter:
    """The pointwise ops of one GPT-2 MLP's forward and backward, on [2, 16, d] inputs."""
    mlp = base.transformer.h[0].mlp.train()
    x = torch.randn(2, 16, base.config.n_embd, requires_grad=True)
    grad = torch.randn(2, 16, base.config.n_embd)
    with PointwiseOps() as count:
        mlp(x).backward(grad)
    return count.ops


def test_fused_gelu_cuts_the_mlps_elementwise_ops_from_19_to_2(gpt2):
    # c_fc and c_proj are addmm (not pointwise); dropout is off. The Python tanh GELU is 8
    # ops forward (pow, mul, add, mul, tanh, add, mul, mul) and 11 backward; the fused one
    # is gelu and gelu_backward (BENCHMARKS.md, "Pretrained backbone: fused activation and
    # regional compile").
    original, fused = mlp_pointwise_ops(_base(gpt2, False)), mlp_pointwise_ops(_base(gpt2, True))
    assert sum(original.values()) == 19
    assert original["tanh"] == 1 and original["tanh_backward"] == 1
    assert fused == Counter({"gelu": 1, "gelu_backward": 1})


@pytest.mark.parametrize("model_type,field", [("gpt2", "activation_function"),
                                              ("gpt_neo", "activation_function"),
                                              ("gpt_bigcode", "activation_function")])
def test_every_architecture_naming_gelu_new_gets_the_fused_kernel(model_type, field):
    # (gpt2 and gpt_neo name gelu_new by default; gpt_bigcode's default is already fused,
    # some of its checkpoints name gelu_new.)
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.activations import NewGELUActivation
    hf = AutoConfig.for_model(model_type, vocab_size=V, hidden_size=32, n_embd=32,
                              num_layers=2, n_layer=2, num_heads=2, n_head=2,
                              attention_types=[[["global"], 2]], max_position_embeddings=64,
                              n_positions=64, **{field: "gelu_new"})
    base = AutoModelForCausalLM.from_config(hf)
    before = sum(type(m) is NewGELUActivation for m in base.modules())
    assert before == 2
    on, off = _options(True), _options(False)
    assert fuse_gelu(base, off) == 0
    assert sum(type(m) is NewGELUActivation for m in base.modules()) == 2
    assert fuse_gelu(base, on) == 2
    assert not any(type(m) is NewGELUActivation for m in base.modules())
    # The checkpoint's config still names its own activation; the planner counts what runs.
    assert getattr(base.config, field) == "gelu_new"
    assert effective_activation(base.config, field, on) == "gelu_pytorch_tanh"
    assert effective_activation(base.config, field, off) == "gelu_new"


def test_an_architecture_with_another_activation_is_left_as_it_is(capsys):
    from transformers import LlamaConfig, LlamaForCausalLM
    base = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2))
    acts = [type(layer.mlp.act_fn) for layer in base.model.layers]
    assert fuse_gelu(base, _options(True)) == 0
    assert [type(layer.mlp.act_fn) for layer in base.model.layers] == acts
    assert capsys.readouterr().out == ""


def _options(fused: bool):
    from model.config import PretrainedOptions
    return PretrainedOptions(fused_gelu=fused)
