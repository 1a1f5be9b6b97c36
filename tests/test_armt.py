"""ARMT on the native stack (model/mechanisms/armt/core.py) as specifications.

The reference below runs a segment as the equations of model/mechanisms/armt/core.py and
model/mechanisms/armt/associative.py state it: [tokens ∘ memory tokens] under a causal mask built
here, each layer's read (tests/test_associative_core.py `ref_retrieve`, loops over rows and
positions in float64) added to the layer's input, the layer itself, then the delta-rule
write from the memory rows of the layer's output (`ref_write`, loops over memory tokens).
The decoder layers are the backbone's own (their attention is pinned elsewhere, in
tests/reference.py); everything ARMT adds is recomputed here without the model's code.
"""

from __future__ import annotations

import copy

import pytest
import torch
from bptt_reach import CUTS, random_segments, segments_reached
from test_associative_core import ref_retrieve, ref_write

from model import AssociativeMemory, ModelConfig, build_model
from model.backbone import Lengths
from model.positional import sinusoid

V, L, M = 19, 4, 3


def armt_model(seed=0, dtype=torch.float64, sharpen=True, **overrides) -> torch.nn.Module:
    cfg = dict(mechanism="armt", vocab_size=V, n_layer=2, d_model=16, n_head=2, d_inner=32,
               dropout=0.0, tgt_len=L, mem_len=0, pre_lnorm=True,
               rmt={"num_mem_tokens": M, "memory_norm": "none"}, armt={"d_key": 4})
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = build_model(ModelConfig(**cfg)).to(dtype)
    if sharpen:   # W_v starts at zero: give every weight a value so the memory matters
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "layer_norm" not in name:
                    p.normal_(0.0, 0.3 if p.dim() >= 2 else 0.1)
    return model.eval()


def ref_segment(model, tokens, A, z, carried=None):
    """(token hidden [B, L, d], A', z', write outputs) of one segment, from the equations."""
    core = model.core
    h0 = model.embedding(tokens).double()
    bsz, n_tok, _ = h0.shape
    mem = core.memory_init.value.double()[None].expand(bsz, -1, -1)
    if carried is not None:
        mem = carried
    x = torch.cat([h0, mem], dim=1)
    n_q = x.shape[1]
    allowed = torch.ones(n_q, n_q, dtype=torch.bool).tril()[None]       # causal, no cache
    r = sinusoid(torch.arange(n_q - 1, -1, -1), core.cfg.d_model).double()
    A_out, z_out = [], []
    for i, (layer, block) in enumerate(zip(core.layers, core.associative, strict=True)):
        x = x + ref_retrieve(block, A[:, i], z[:, i], x)
        x = layer(x, None, r, core.rel_u.value, core.rel_v.value, allowed)
        A_i, z_i = ref_write(block, A[:, i], z[:, i], x[:, n_tok:])
        A_out.append(A_i)
        z_out.append(z_i)
    return x[:, :n_tok], torch.stack(A_out, 1), torch.stack(z_out, 1), x[:, n_tok:]


@pytest.mark.parametrize("carry_tokens", [False, True])
def test_hidden_states_and_next_state_match_the_equations_over_three_segments(carry_tokens):
    model = armt_model(armt={"d_key": 4, "carry_tokens": carry_tokens})
    tokens = torch.randint(0, V, (2, 3 * L), generator=torch.Generator().manual_seed(1))
    state = model.initial_state(2)
    A, z, carried = state.A.double(), state.z.double(), None
    with torch.no_grad():
        for s in range(3):
            seg = tokens[:, s * L:(s + 1) * L]
            hidden, state = model.core(model.embedding(seg), state, Lengths(0))
            want, A, z, write = ref_segment(model, seg, A, z, carried)
            carried = write if carry_tokens else None
            torch.testing.assert_close(hidden, want, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(state.A, A, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(state.z, z, rtol=1e-9, atol=1e-9)
            assert state.writes.tolist() == [s + 1, s + 1]
            assert (state.tokens is not None) == carry_tokens
    assert A.abs().sum() > 0 and z.abs().sum() > 0


def test_carried_tokens_shape_the_segment_after_next_and_learned_ones_do_not_depend_on_them():
    # Memory rows come after the tokens under the causal mask, so a segment's own tokens
    # never see its memory tokens: carried tokens act through what they write for the
    # segment after. With learned tokens (the authors') the carried ones are ignored.
    tokens = torch.randint(0, V, (2, 3 * L), generator=torch.Generator().manual_seed(2))
    outs = {}
    for carry in (False, True):
        model = armt_model(armt={"d_key": 4, "carry_tokens": carry})
        with torch.no_grad():
            first = model(tokens[:, :L], None).state
            other = model(tokens[:, :L].flip(0), None).state    # another document's tokens
            mixed = AssociativeMemory(A=first.A, z=first.z, writes=first.writes,
                                      tokens=other.tokens)
            outs[carry] = []
            for state in (first, mixed):
                second = model(tokens[:, L:2 * L], state).state
                outs[carry].append(model(tokens[:, 2 * L:], second,
                                         return_log_probs=True).log_probs)
    assert torch.equal(*outs[False])
    assert (outs[True][0] - outs[True][1]).abs().max() > 1e-6


def test_at_initialisation_the_memory_is_inert():
    # W_v = 0 (the authors' init): every read returns 0, so a carried state changes nothing
    # until training gives the values a direction; z grows all the same.
    model = armt_model(dtype=torch.float32, sharpen=False)
    tokens = torch.randint(0, V, (2, 2 * L), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        first = model(tokens[:, :L], None)
        carried = model(tokens[:, L:], first.state, return_log_probs=True).log_probs
        fresh = model(tokens[:, L:], None, return_log_probs=True).log_probs
    assert torch.equal(carried, fresh)
    assert first.state.A.abs().sum() == 0 and first.state.z.sum() > 0


@pytest.mark.parametrize("checkpoint_segments", [False, True])
@pytest.mark.parametrize(("detach_before", "reached"), CUTS)
def test_gradient_reaches_exactly_the_segments_after_the_last_cut(detach_before, reached,
                                                                  checkpoint_segments):
    # Only the last of 4 segments has a loss; it reaches earlier segments only through A
    # and z (no read block, no carried tokens).
    model = armt_model(dtype=torch.float32).train()
    assert segments_reached(model, random_segments(4, V, L, seed=4), detach_before,
                            checkpoint_segments) == reached


def test_bf16_model_keeps_a_float32_state_and_tracks_float32_over_sixteen_segments():
    # The state's precision itself is pinned in tests/test_associative_core.py (a bf16 state
    # drifts, a float32 one does not); here the whole bf16 model runs with it. Measured:
    # A and z within 1-10% of the float32 model's after 16 segments (the keys come from
    # bf16 hidden states), output probabilities within 5e-4.
    tokens = torch.randint(0, V, (2, 16 * L), generator=torch.Generator().manual_seed(5))
    # The backbone at its init (a sharpened one is chaotic: bf16 rounding alone sends its
    # trajectories apart), the associative blocks with values.
    f32 = armt_model(dtype=torch.float32, sharpen=False)
    with torch.no_grad():
        for p in f32.core.associative.parameters():
            p.normal_(0.0, 0.3)
    bf16 = copy.deepcopy(f32).to(torch.bfloat16)
    states, probs = {}, {}
    with torch.no_grad():
        for name, model in (("f32", f32), ("bf16", bf16)):
            state = None
            for s in range(16):
                out = model(tokens[:, s * L:(s + 1) * L], state, return_log_probs=True)
                state = out.state
            states[name], probs[name] = state, out.log_probs.float().exp()
    got, want = states["bf16"], states["f32"]
    assert got.A.dtype == got.z.dtype == torch.float32
    assert torch.isfinite(got.A).all() and torch.isfinite(got.z).all()
    assert (got.z - want.z).norm() / want.z.norm() < 0.2
    assert (got.A - want.A).norm() / want.A.norm() < 0.2
    assert (probs["bf16"] - probs["f32"]).abs().max() < 0.01


def test_state_dtype_and_shape_survive_a_save_and_a_move_to_bf16(tmp_path):
    model = armt_model(dtype=torch.float32, armt={"d_key": 4, "carry_tokens": True})
    with torch.no_grad():
        state = model(torch.randint(0, V, (2, L)), None).state
    torch.save(state.state_dict(), tmp_path / "memory.pt")
    back = AssociativeMemory.from_state_dict(torch.load(tmp_path / "memory.pt",
                                                        weights_only=True))
    moved = back.to(dtype=torch.bfloat16)
    assert moved.A.shape == state.A.shape == (2, 2, 2 * 3 * 4, 16)
    assert moved.A.dtype == moved.z.dtype == torch.float32      # fp32 whatever the model's
    assert moved.tokens.dtype == torch.bfloat16 and moved.writes.dtype == torch.long
    assert torch.equal(moved.A, state.A) and torch.equal(moved.z, state.z)


def test_config_refuses_what_armt_cannot_run():
    from model import ConfigError
    base = dict(mechanism="armt", vocab_size=V, tgt_len=L, mem_len=0)
    for bad, field in [({"rmt": {"num_mem_tokens": 0}}, "model.rmt.num_mem_tokens"),
                       ({"armt": {"d_key": 0}}, "model.armt.d_key"),
                       ({"armt": {"feature_map": "relu"}}, "model.armt.feature_map"),
                       ({"armt": {"nu": 0}}, "model.armt.nu"),
                       ({"rmt": {"mem_loss_weight": 0.1}}, "model.rmt.mem_loss_weight"),
                       ({"mem_len": 4, "same_length": True}, "model.same_length")]:
        with pytest.raises(ConfigError) as info:
            ModelConfig(**{**base, **bad})
        assert info.value.field == field, bad


def test_armt_counts_its_own_memory_tokens_and_reads_older_configs_model_rmt_count():
    from model import ConfigError
    base = dict(mechanism="armt", vocab_size=V, tgt_len=L, mem_len=0)
    own = ModelConfig(**base, armt={"num_mem_tokens": 5})
    older = ModelConfig.from_dict({**base, "rmt": {"num_mem_tokens": 3}})   # before the field
    assert own.mech.num_mem_tokens(own) == 5 and older.mech.num_mem_tokens(older) == 3
    assert build_model(own).core.memory_init.value.shape[0] == 5
    for cfg in (own, older):
        back = ModelConfig.from_dict(cfg.to_dict())
        assert back == cfg and back.mech.num_mem_tokens(back) == cfg.mech.num_mem_tokens(cfg)
    with pytest.raises(ConfigError) as info:
        ModelConfig(**base, armt={"num_mem_tokens": 5}, rmt={"num_mem_tokens": 3})
    assert info.value.field == "model.armt.num_mem_tokens"
    with pytest.raises(ConfigError) as info:
        ModelConfig(**base, armt={"num_mem_tokens": 0})
    assert info.value.field == "model.armt.num_mem_tokens"
