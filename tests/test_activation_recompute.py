"""The MLP's activation output recomputed in backward, not kept
(model/pretrained/activation_recompute.py, `model.hf.recompute_activation`): the same
gradients bit for bit, one [B, Q, I] tensor fewer saved per layer, one more activation
kernel in backward, composed with every checkpointing that sits below it."""

import pytest
import torch
from pretrained_helpers import TINY, V, hf_model_section
from torch.utils.checkpoint import checkpoint

from benchmarks.bench_pretrained_fused import PointwiseOps
from model import ModelConfig, build_model
from model.pretrained.activation_recompute import (
    is_activation,
    recompute_activations,
    remove_recompute,
)
from model.pretrained.loading import training_activations
from train.segment_checkpoint import SegmentCheckpoint

L, B = 6, 3


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: TINY[arch](root / arch) for arch in ("gpt2", "llama")}


def _model(ckpts, arch, recompute, mechanism="rmt", **model):
    section = hf_model_section(ckpts[arch], 2, L, recompute_activation=recompute)
    section.update(mechanism=mechanism, **model)
    if mechanism == "armt":
        section["armt"] = {"d_key": 8}
    torch.manual_seed(0)
    return build_model(ModelConfig.from_dict(section)).train()


def _saved_storages(fn):
    """Run `fn` under an outermost pair of hooks; the distinct storages autograd saved.
    Each is held until the end, so no address is reused by a later storage (a graph that is
    dropped during the forward frees what it saved)."""
    seen, held = {}, []

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, seen


def _grads(model, x, ckpt_segment=False):
    model.zero_grad()
    ckpt = SegmentCheckpoint() if ckpt_segment else None
    out, saved = _saved_storages(lambda: model(x[:, :L], None, targets=x[:, 1:L + 1],
                                               run_decode=ckpt).loss)
    out.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, \
        sum(saved.values())


def _inner(model) -> int:
    cfg = model.base.config
    return getattr(cfg, "n_inner", None) or getattr(cfg, "intermediate_size", None) \
        or 4 * cfg.hidden_size


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("mechanism", ["rmt", "armt"])
def test_gradients_are_bitwise_those_of_the_kept_output_and_one_activation_less_is_saved(
        ckpts, arch, mechanism):
    """GPT-2 (c_proj reads GELU's output) and Llama (the product reads SiLU's output):
    every gradient bit for bit, and autograd's saved storages smaller by exactly one
    [B, Q, I] float32 tensor per layer."""
    x = torch.randint(0, V, (B, L + 1), generator=torch.Generator().manual_seed(1))
    kept, recomputed = _model(ckpts, arch, False, mechanism), _model(ckpts, arch, True, mechanism)
    g0, saved0 = _grads(kept, x)
    g1, saved1 = _grads(recomputed, x)
    assert g0.keys() == g1.keys()
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
    rows = 2 * 2 + L if mechanism == "rmt" else L + 2     # [read | tokens | write] / [tokens | mem]
    layers = kept.base.config.num_hidden_layers
    assert saved0 - saved1 == layers * B * rows * _inner(kept) * 4


@pytest.mark.parametrize("how", ["segment", "layers"])
def test_it_composes_with_the_checkpointing_below_it(ckpts, how):
    """Segment checkpointing (memtrain's) and per-layer checkpointing (transformers',
    `model.checkpoint_layers`) keep seeing the same tensors in the first forward and the
    re-run: gradients equal to the kept output's bit for bit."""
    x = torch.randint(0, V, (B, L + 1), generator=torch.Generator().manual_seed(2))
    extra = {"checkpoint_layers": True} if how == "layers" else {}
    runs = [_grads(_model(ckpts, "gpt2", r, **extra), x, ckpt_segment=how == "segment")[0]
            for r in (False, True)]
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name


def test_nothing_outlives_the_forward_under_a_checkpoint(ckpts):
    """Under a checkpoint whose hooks store nothing, the recompute's hooks must hand every
    tensor down, not keep the activation's input or output themselves: the only storage
    autograd keeps is the checkpoint's input."""
    model = _model(ckpts, "gpt2", True)
    mlp = model.base.transformer.h[0].mlp
    h = torch.randn(2, 5, 64, requires_grad=True)
    out, saved = _saved_storages(lambda: checkpoint(mlp, h, use_reentrant=False))
    assert saved == {} or set(saved) <= {h.untyped_storage().data_ptr()}
    out.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


def test_the_cost_is_one_activation_kernel_in_backward(ckpts):
    model = _model(ckpts, "gpt2", True)
    mlp = model.base.transformer.h[0].mlp
    x = torch.randn(2, 5, 64, requires_grad=True)
    with PointwiseOps() as count:
        mlp(x).sum().backward()
    assert count.ops["gelu"] == 2 and count.ops["gelu_backward"] == 1


def test_only_one_kernel_activations_are_recomputed_and_the_option_turns_it_off(ckpts):
    from transformers.activations import GELUActivation, GELUTanh, NewGELUActivation
    assert is_activation(GELUTanh()) and is_activation(torch.nn.SiLU())
    assert is_activation(GELUActivation())
    # transformers' Python activations: several kernels each, recomputing them costs as much
    assert not is_activation(NewGELUActivation())
    assert not is_activation(GELUActivation(use_gelu_python=True))
    assert not is_activation(torch.nn.PReLU())      # it has a weight
    for arch in ("gpt2", "llama"):
        off = _model(ckpts, arch, False)
        assert not any("forward" in m.__dict__ for m in off.base.modules())


def test_removing_it_gives_every_module_its_class_forward_back(ckpts):
    """What `model.compile` does before compiling the decoder layers (regional.py)."""
    model = _model(ckpts, "llama", True)
    wrapped = [m for m in model.base.modules() if "forward" in m.__dict__]
    assert len(wrapped) == 2 * model.base.config.num_hidden_layers   # each MLP and its SiLU
    assert remove_recompute(model.base) == len(wrapped)
    assert not any("forward" in m.__dict__ for m in model.base.modules())
    assert recompute_activations(model.base, model.cfg.hf) == 2


def test_the_memory_probe_runs_the_activations_training_runs(ckpts):
    """train/memory_probe.py builds its random-weight base through the same step as the
    load (`training_activations`), so the planner is checked against what trains."""
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(ckpts["gpt2"])
    training_activations(base, _model(ckpts, "gpt2", True).cfg.hf)
    assert sum("forward" in m.__dict__ for m in base.modules()) == 4


def test_a_model_without_one_list_of_decoder_layers_runs_as_loaded(ckpts):
    """Finding the MLPs needs the decoder's one list of layers; without it the recompute
    steps aside (whether memory can be placed is the mechanism's question, not this one's)."""
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(ckpts["gpt2"])
    base.config.num_hidden_layers = 99          # no ModuleList of 99 layers anywhere
    assert recompute_activations(base, _model(ckpts, "gpt2", True).cfg.hf) == 0
    assert not any("forward" in m.__dict__ for m in base.modules())
