"""`model.compile` around a pretrained model (model/pretrained/regional.py): each decoder
layer's forward compiled on its own, the mechanisms' hooks eager around it.

Traced on the `aot_eager` backend (Dynamo, then AOT autograd's forward/backward split, on
eager kernels: no C++ built, docs/testing.md "The cold cache and torch.compile"), where the
compiled losses must be eager's bit for bit, dropout included; one Inductor case, at one
shape. Tiny random checkpoints of 3 layers built from configs (never downloaded), dropout on,
so that the graph counts show the layers sharing their graph and the losses show dropout
drawn in eager order.
"""

from __future__ import annotations

import pytest
import torch
from compile_helpers import graph_limit

from model import ConfigError, ModelConfig, build_model, resolve_shape
from model.compiled import compile_core, compiled_graphs, graph_breaks
from model.pretrained.regional import decoder_layers
from train.segment_checkpoint import SegmentCheckpoint

pytestmark = pytest.mark.slow

V, TGT, ROWS = 32, 8, 2
# The segment lengths of the training steps: a short segment (a sample's last) at step 3
# is a second shape, which torch compiles with a dynamic length.
LENGTHS = (TGT, TGT, 5, TGT)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=3, n_head=4,
                               resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                               bos_token_id=0, eos_token_id=0)).save_pretrained(root / "gpt2")
    LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=256,
                                 attention_dropout=0.1, bos_token_id=0, eos_token_id=0)
                     ).save_pretrained(root / "llama")
    return {"gpt2": root / "gpt2", "llama": root / "llama"}


def _model(path, mechanism: str, compiled: bool, backend: str = "aot_eager", **extra):
    section = {"mechanism": mechanism, "backbone": "hf", "tgt_len": TGT, "mem_len": 0,
               "hf": {"path": str(path)}, **extra}
    if mechanism in ("rmt", "armt"):
        section["rmt"] = {"num_mem_tokens": 2}
    if mechanism == "armt":
        section["armt"] = {"d_key": 8}
    if mechanism == "titans":
        section["titans"] = {"d_mem": 16, "chunk_size": 4, "num_persistent": 2}
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_dict(section)).train()
    if mechanism == "armt":   # W_v is zero at initialisation: every read would be 0
        with torch.no_grad():
            for block in model.associative:
                block.v_proj.weight.normal_(0, 0.3)
    if compiled:
        compile_core(model, backend)
    return model


def _train(path, mechanism: str, compiled: bool, lengths=LENGTHS, window: int = 1,
           **extra):
    """Adam steps over BPTT windows of `window` segments (each checkpointed when window >
    1, as `bptt.checkpoint_segments` does): (losses, graphs built by the end of each step,
    graph breaks, model)."""
    if compiled:
        # Count this run's graphs only: the layers of every model built here share their
        # code, whose earlier graphs (and shapes already seen dynamic) would be reused.
        torch._dynamo.reset()
    model = _model(path, mechanism, compiled, **extra)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    data = torch.Generator().manual_seed(3)
    state, losses, graphs = None, [], []
    graphs0, breaks0 = compiled_graphs(), graph_breaks()
    for n in lengths:
        loss = 0.0
        for _ in range(window):
            x = torch.randint(0, V, (ROWS, n + 1), generator=data)
            out = model(x[:, :-1], state, targets=x[:, 1:],
                        run_decode=SegmentCheckpoint() if window > 1 else None)
            state, loss = out.state, loss + out.loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        state = state.detach()
        losses.append(loss.item())
        graphs.append(compiled_graphs() - graphs0)
    return losses, graphs, graph_breaks() - breaks0, model


CASES = [("gpt2", "rmt"), ("gpt2", "armt"), ("llama", "rmt"), ("llama", "armt")]


@pytest.fixture(scope="module")
def runs(ckpt):
    """Each case trained eager and compiled (aot_eager), the compiled run under a graph limit
    of 1 per function: {case: (eager losses, compiled losses, graphs per step, breaks)}."""
    out = {}
    for arch, mechanism in CASES:
        eager, *_ = _train(ckpt[arch], mechanism, False)
        with graph_limit(1):
            losses, graphs, breaks, _ = _train(ckpt[arch], mechanism, True)
        out[arch, mechanism] = (eager, losses, graphs, breaks)
    return out


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_compiled_layers_give_the_eager_losses_bit_for_bit_on_aot_eager(runs, case):
    eager, compiled, _, _ = runs[case]
    assert compiled == eager
    assert len(set(eager)) == len(LENGTHS)     # training moves, dropout differs per step


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_the_layers_share_one_graph_per_segment_shape_with_no_graph_break(runs, case):
    # 3 layers of one class: one graph for the full segment, one (dynamic) for the short
    # one, then none. A graph per layer would make 3 and 6. The run's limit was 1 graph per
    # function: without the limit raised (regional.py), the short segment would run eager
    # ([1, 1, 1, 1], with eager's losses: only this count sees it).
    _, _, graphs, breaks = runs[case]
    assert graphs == [1, 1, 2, 2]
    assert breaks == 0


@pytest.mark.parametrize("mechanism", ["rmt", "armt"])
def test_checkpointed_segments_recompute_through_the_compiled_layers(ckpt, mechanism):
    # BPTT windows of 2 segments, each checkpointed: the backward re-runs each segment with
    # gradients on and the training shapes, through the compiled layers, with the dropout
    # masks of the forward (RNG state restored), under ARMT's hooks.
    eager, *_ = _train(ckpt["llama"], mechanism, False, lengths=(TGT,) * 3, window=2)
    compiled, _, breaks, _ = _train(ckpt["llama"], mechanism, True, lengths=(TGT,) * 3,
                                    window=2)
    assert compiled == eager
    assert breaks == 0


def test_checkpointed_layers_compose_with_armts_hooks(ckpt):
    # model.checkpoint_layers: HF's gradient checkpointing wraps each layer's call, so the
    # compiled forward runs inside the checkpoint, and so do ARMT's read and write hooks
    # (model/mechanisms/armt/pretrained.py), both at the forward and at the recompute.
    eager, *_ = _train(ckpt["gpt2"], "armt", False, checkpoint_layers=True)
    compiled, graphs, breaks, _ = _train(ckpt["gpt2"], "armt", True, checkpoint_layers=True)
    assert compiled == eager
    assert breaks == 0 and graphs[-1] == 2


def test_titans_hooks_stay_eager_around_the_compiled_layers(ckpt):
    # Titans' pre-hook rewrites the layer's input rows and its hook the output rows
    # (titans.py); only the layer between them is compiled.
    eager, *_ = _train(ckpt["llama"], "titans", False, lengths=(TGT, TGT))
    compiled, graphs, breaks, _ = _train(ckpt["llama"], "titans", True, lengths=(TGT, TGT))
    assert compiled == eager
    assert breaks == 0 and graphs == [1, 1]


def test_evaluation_and_names_stay_eager_and_unchanged(ckpt):
    model = _model(ckpt["llama"], "armt", True)
    eager = _model(ckpt["llama"], "armt", False)
    assert list(model.state_dict()) == list(eager.state_dict())
    model.load_state_dict(eager.state_dict())
    # Only `forward` is swapped on each layer instance: the module's call and hooks are
    # torch's, so ARMT's hooks (registered per segment) run outside the compiled code.
    assert all("forward" in vars(layer) for layer in decoder_layers(model))
    before = compiled_graphs()
    model.eval()
    with torch.no_grad():
        state = None
        for n in (3, 7):   # other lengths than training
            state = model(torch.randint(0, V, (3, n)), state).state
    assert compiled_graphs() == before


def test_inductor_builds_the_compiled_gpt2_layer_with_eager_losses(ckpt):
    # The one Inductor build (the GPT-2 layer at one shape, dropout from torch's generator,
    # `fallback_random`): its kernels round otherwise than eager's, so to float tolerance.
    eager, *_ = _train(ckpt["gpt2"], "rmt", False, lengths=(TGT, TGT))
    compiled, graphs, breaks, _ = _train(ckpt["gpt2"], "rmt", True, lengths=(TGT, TGT),
                                         backend="inductor")
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
    assert graphs == [1, 1] and breaks == 0


def test_the_config_takes_model_compile_around_a_pretrained_model(ckpt):
    # Refused before regional compilation; the backend is checked by name once the
    # checkpoint's shape is read.
    section = {"mechanism": "rmt", "backbone": "hf", "tgt_len": TGT, "mem_len": 0,
               "rmt": {"num_mem_tokens": 2}, "hf": {"path": str(ckpt["gpt2"])},
               "compile": True, "compile_backend": "aot_eager"}
    assert resolve_shape(ModelConfig.from_dict(section)).compile
    with pytest.raises(ConfigError) as err:
        resolve_shape(ModelConfig.from_dict({**section, "compile_backend": "eager"}))
    assert err.value.field == "model.compile_backend"
