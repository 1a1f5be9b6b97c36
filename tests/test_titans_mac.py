"""MAC's read and write options (model/mechanisms/titans/mechanism.py: `read_as`, `update_input`,
`output_gate`, `read_init_std`, the gate biases) on the native stack: each keeps causality,
carries the memory and trains every parameter; each does what it names; each is refused
where it does not apply; and `memtrain train` says when the write can get no gradient.
docs/titans.md, "Why it did not learn, by difference"."""

from __future__ import annotations

import pytest
import torch
from titans_helpers import L, V, naive_memory, titans_model, token_4_changed

from model import ConfigError, ModelConfig, build_model


def test_the_mac_read_and_write_options_are_refused_for_mag_mal_and_a_pretrained_decoder():
    """`update_input`, `read_as` and `output_gate` choose among MAC's (§4.1) read, write
    and gate; MAG and MAL already read and write the layer's input, and MAG's output is
    the gate. Around a pretrained decoder only the paper's MAC runs."""
    for field, value in (("update_input", "input"), ("read_as", "residual"),
                         ("output_gate", False), ("read_init_std", 0.1)):
        for variant in ("mag", "mal") if field != "read_init_std" else ("mag",):
            with pytest.raises(ConfigError) as err:
                ModelConfig(mechanism="titans", mem_len=0,
                            titans={"variant": variant, field: value})
            assert err.value.field == f"model.titans.{field}"
        with pytest.raises(ConfigError) as err:
            ModelConfig(mechanism="titans", backbone="hf", mem_len=0, titans={field: value},
                        hf={"path": "unused"})
        assert err.value.field == f"model.titans.{field}"


# MAC's read on the residual stream and its write with the layer input (alone, together,
# without Eq. 25's gate, with the convolutions): the same properties as the paper's MAC.
MAC_OPTIONS = [{"read_as": "residual"}, {"update_input": "input"},
               {"read_as": "residual", "update_input": "input", "output_gate": False},
               {"read_as": "residual", "update_input": "input", "conv_size": 3}]
MAC_IDS = ["residual", "input", "residual-input-nogate", "residual-input-conv"]


@pytest.mark.parametrize("options", MAC_OPTIONS, ids=MAC_IDS)
def test_mac_options_keep_causality_carry_and_train_every_parameter(options):
    """Each of MAC's read/write options: changing token 4 leaves tokens 0-3 exactly as
    they were and changes the next segment (causal reads of the chunks before); the state
    carries into the next segment and a reset row reads M_0; every parameter gets a
    gradient over two segments."""
    model = titans_model(**options)
    x = torch.randint(0, V, (2, 2 * L), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a1, b1, a2, b2 = token_4_changed(model, x)
        fresh = model(x[:, L:], None, return_log_probs=True).log_probs
        reset = model(x[:, L:], a1.state.reset_rows(torch.tensor([True, False])),
                      return_log_probs=True).log_probs
    assert torch.equal(a1.log_probs[:, :4], b1.log_probs[:, :4])
    assert (a1.log_probs[:, 4:] - b1.log_probs[:, 4:]).abs().max() > 1e-5
    assert (a2.log_probs - b2.log_probs).abs().max() > 1e-5
    assert (a2.log_probs - fresh).abs().max() > 1e-4
    assert torch.equal(reset[0], fresh[0]) and torch.equal(reset[1], a2.log_probs[1])
    model = titans_model(sharpen=False, **options).train()
    z = torch.randint(0, V, (2, 2 * L + 1), generator=torch.Generator().manual_seed(6))
    first = model(z[:, :L], None, targets=z[:, 1:L + 1])
    second = model(z[:, L:2 * L], first.state, targets=z[:, L + 1:])
    (first.loss + second.loss).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


@pytest.mark.parametrize("update_input", ["output", "input"])
def test_update_input_chooses_the_stream_the_memory_is_written_with(update_input):
    """`update_input: input` writes layer 0's memory with the layer's input (the scaled
    embeddings): its state after a segment is exactly NeuralMemory.update of M_0 with
    them; the paper's `output` (Eq. 24, the attention's output y) writes something else."""
    model = titans_model(update_input=update_input, conv_size=0)
    x = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(3))
    mem = model.core.memory[0]
    with torch.no_grad():
        h0 = model.embedding(x)
        state = model(x, None).state
        m0 = [w[None].expand(2, -1, -1) for w in mem.initial_weights()]
        want, _, _ = mem.update(m0, [torch.zeros_like(w) for w in m0], h0)
    same = all(torch.allclose(s[:, 0], w, rtol=1e-6, atol=1e-7)
               for s, w in zip(state.weights, want, strict=True))
    assert same == (update_input == "input")


def test_read_as_residual_drops_the_read_rows_from_the_attention():
    """`read_as: residual` adds h_i to token i's row instead of entering it as L context
    rows (Eq. 22): the layer attends over P + L keys, not P + 2L (segment_shapes)."""
    from model.mechanisms.titans.core import TitansCore
    cfg = ModelConfig(mechanism="titans", vocab_size=V, n_layer=2, d_model=16, n_head=2,
                      d_inner=32, tgt_len=L, mem_len=0,
                      titans={"d_mem": 8, "num_persistent": 2})
    res = ModelConfig(mechanism="titans", vocab_size=V, n_layer=2, d_model=16, n_head=2,
                      d_inner=32, tgt_len=L, mem_len=0,
                      titans={"d_mem": 8, "num_persistent": 2, "read_as": "residual"})
    assert TitansCore.segment_shapes(cfg, 2, 0).distances == 2 + 2 * L
    assert TitansCore.segment_shapes(res, 2, 0).distances == 2 + L


def test_read_init_std_draws_w_h_at_that_std_and_no_other_parameter_moves():
    """`read_init_std` is W_H's initial std (null: `model.init_std`); W_H is drawn from a
    fork of the generator, so the same seed gives every other parameter the same values
    whatever the std. MAG has no W_H and refuses it."""
    cfg = dict(mechanism="titans", vocab_size=V, n_layer=2, d_model=64, n_head=2,
               d_inner=32, tgt_len=L, mem_len=0, dropout=0.0)
    torch.manual_seed(0)
    default = build_model(ModelConfig(**cfg, titans={"d_mem": 64}))
    torch.manual_seed(0)
    wide = build_model(ModelConfig(**cfg, titans={"d_mem": 64, "read_init_std": 0.125}))
    for a, b in zip(default.core.memory_out, wide.core.memory_out, strict=True):
        assert float(a.weight.std()) == pytest.approx(0.02, rel=0.05)
        assert float(b.weight.std()) == pytest.approx(0.125, rel=0.05)
    other = {k: v for k, v in wide.state_dict().items() if ".memory_out." not in k}
    for k, v in default.state_dict().items():
        if ".memory_out." not in k:
            assert torch.equal(v, other[k]), k
    with pytest.raises(ConfigError) as err:
        ModelConfig(mechanism="titans", mem_len=0,
                    titans={"variant": "mag", "read_init_std": 0.1})
    assert err.value.field == "model.titans.read_init_std"


def test_without_the_output_gate_the_model_is_the_gated_one_at_initialisation():
    """`output_gate: false` builds no Eq. 25 gate (o = y); given the gated model's other
    parameters it computes exactly what the gated model computes at W_G = 0 (2 sigmoid(0)
    = 1), in every segment."""
    gated = titans_model(sharpen=False)
    plain = titans_model(sharpen=False, output_gate=False)
    assert plain.core.memory_gate is None
    missing = plain.load_state_dict(gated.state_dict(), strict=False)
    assert missing.missing_keys == [] and all(k.startswith("core.memory_gate.")
                                              for k in missing.unexpected_keys)
    x = torch.randint(0, V, (2, 2 * L), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a = gated(x[:, :L], None, return_log_probs=True)
        b = plain(x[:, :L], None, return_log_probs=True)
        a2 = gated(x[:, L:], a.state, return_log_probs=True).log_probs
        b2 = plain(x[:, L:], b.state, return_log_probs=True).log_probs
    assert torch.equal(a.log_probs, b.log_probs) and torch.equal(a2, b2)


def test_train_says_when_the_write_can_get_no_gradient():
    """One chunk per segment and bptt.depth 0: every read is of memory the segments before
    wrote, and no gradient crosses a segment, so the write's parameters get exactly zero
    gradient; `memtrain train` says so (Mechanism.training_notes). With a smaller chunk
    or BPTT they get one, and nothing is said."""
    one_chunk = titans_model(chunk_size=L).train()
    note = one_chunk.cfg.mech.training_notes
    [line] = note(one_chunk.cfg, 0)
    assert "bptt.depth 0" in line and "W_K, W_V" in line
    assert note(one_chunk.cfg, 1) == []
    assert note(titans_model(chunk_size=L // 2).cfg, 0) == []

    def write_grads(model):
        model.zero_grad()
        x = torch.randint(0, V, (2, L + 1), generator=torch.Generator().manual_seed(3))
        first = model(x[:, :L], None, targets=x[:, 1:])
        model(x[:, :L], first.state.detach(), targets=x[:, 1:]).loss.backward()   # depth 0
        return [p.grad for n, p in model.named_parameters()
                if ".k_proj" in n or ".v_proj" in n]
    assert all(g is None or not g.any() for g in write_grads(one_chunk))
    two_chunks = titans_model(chunk_size=L // 2).train()
    assert any(g is not None and g.any() for g in write_grads(two_chunks))


def _memory64(**kw):
    """A float64 NeuralMemory, its input [2, 7, 12] and perturbed start weights/momentum."""
    from model.mechanisms.titans.neural_memory import NeuralMemory
    torch.manual_seed(0)
    mem = NeuralMemory(12, 6, depth=2, max_lr=0.7, max_forget=0.5, forget_bias=-1.0,
                       max_grad_norm=None, **kw).double()
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    m0 = [w.detach()[None].repeat(2, 1, 1) for w in mem.initial_weights()]
    start = [w + 0.1 * torch.randn_like(w) for w in m0]
    return mem, x, m0, start, [0.05 * torch.randn_like(w) for w in start]


@pytest.mark.parametrize("chunk", [1, 3])
def test_surprise_at_initial_takes_every_gradient_at_m0(chunk):
    """`surprise_at: initial` takes Eq. 12's gradient of every token at the learned M_0,
    not at its chunk's start (§3.2), whatever the weights the segment starts from: equal
    to a float64 token loop with every gradient at M_0, at any chunk size; the default
    equals the loop with the chunk-start gradients, and the two differ."""
    mem, x, m0, start, mom = _memory64(chunk_size=chunk, surprise_at="initial")
    got_w, got_s, _ = mem.update(start, mom, x)
    want_w, want_s = naive_memory(mem, x, start, mom, at=m0)
    for a, b in zip(got_w + got_s, want_w + want_s, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    mem.surprise_at = "chunk"
    at_chunks, _, _ = mem.update(start, mom, x)
    loop, _ = naive_memory(mem, x, start, mom)
    torch.testing.assert_close(at_chunks[0], loop[0], rtol=1e-9, atol=1e-11)
    assert (at_chunks[0] - got_w[0]).abs().max() > 1e-4


def test_memory_residual_is_x_plus_the_layer_norm_of_the_mlp():
    """`memory_residual`: M(x) = x + LayerNorm(MLP(x)) (TTT's memory, titans-pytorch's
    default): the update equals the float64 token loop of that memory (the layer norm's
    backward written out in surprise_factors, autograd in the loop), the read is
    q + LayerNorm(MLP(q)), and without it both are the plain MLP's."""
    import torch.nn.functional as F

    from model.mechanisms.titans.neural_memory import mlp
    mem, x, _, start, mom = _memory64(chunk_size=3, residual_norm=True)
    got_w, got_s, read = mem.update(start, mom, x, read=x)
    want_w, want_s = naive_memory(mem, x, start, mom)
    for a, b in zip(got_w + got_s, want_w + want_s, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    q = mem.query(x[:, :3], torch.float64)
    plain = mlp(start, q)
    torch.testing.assert_close(read[:, :3], q + F.layer_norm(plain, (6,), eps=1e-5))
    mem.residual_norm = False
    plain_w, _, plain_read = mem.update(start, mom, x, read=x)
    torch.testing.assert_close(plain_read[:, :3], plain)
    assert (plain_w[0] - got_w[0]).abs().max() > 1e-4


def test_qk_norm_rms_input_normalises_the_memory_input_and_adds_only_its_scale():
    """`qk_norm: rms_input` RMS-normalises the memory's input before W_Q, W_K, W_V and the
    gates and leaves q and k unnormalised (titans-pytorch's NeuralMemory): the write is
    unchanged by the input's scale (with l2 only k and q are: v grows with it), and the
    model's only new parameters are the norms' scales, every other one as drawn before."""
    mem, x, _, start, mom = _memory64(chunk_size=3, qk_norm="rms_input")
    a, _, _ = mem.update(start, mom, x)
    b, _, _ = mem.update(start, mom, 3 * x)
    torch.testing.assert_close(a[0], b[0])
    k = mem.k_proj(x * torch.rsqrt(x.square().mean(-1, keepdim=True) + torch.finfo(x.dtype).eps))
    torch.testing.assert_close(mem.project("k", x, None)[0], k)
    mem.in_norm = None
    a, _, _ = mem.update(start, mom, x)
    b, _, _ = mem.update(start, mom, 3 * x)
    assert (a[0] - b[0]).abs().max() > 1e-3
    plain, rms = titans_model(), titans_model(qk_norm="rms_input")
    extra = set(rms.state_dict()) - set(plain.state_dict())
    assert extra == {f"core.memory.{i}.in_norm.weight" for i in range(2)}
    for k, v in plain.state_dict().items():
        assert torch.equal(v, rms.state_dict()[k]), k


@pytest.mark.parametrize("field,value", [("surprise_at", "end"), ("qk_norm", "rms")])
def test_the_new_memory_choices_are_refused_by_their_field(field, value):
    with pytest.raises(ConfigError) as err:
        ModelConfig(mechanism="titans", mem_len=0, titans={field: value})
    assert err.value.field == f"model.titans.{field}"


def test_segment_positions_add_the_fixed_sinusoid_to_the_input_and_nothing_else():
    """`segment_positions` adds model/mechanisms/titans/core.py's sinusoid of each row's position in
    its segment (sin 0 = 0 and cos 0 = 1 at row 0) to the stack's input: the model equals the
    default one with the table added to its embeddings, in every segment (the same rows
    0..L-1 each), with the same parameters drawn; refused around a pretrained decoder."""
    from model.mechanisms.titans.core import segment_positions
    table = segment_positions(L, 16, torch.float32)
    assert torch.equal(table[0], torch.cat([torch.zeros(8), torch.ones(8)]))
    assert table.shape == (L, 16) and (table[1] - table[2]).abs().max() > 0.1
    plain, placed = titans_model(), titans_model(segment_positions=True)
    assert all(torch.equal(v, placed.state_dict()[k]) for k, v in plain.state_dict().items())
    x = torch.randint(0, V, (2, 2 * L), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a = placed(x[:, :L], None, return_log_probs=True)
        a2 = placed(x[:, L:], a.state, return_log_probs=True).log_probs
        plain.embedding.register_forward_hook(lambda mod, inp, out: out + table)
        b = plain(x[:, :L], None, return_log_probs=True)
        b2 = plain(x[:, L:], b.state, return_log_probs=True).log_probs
        c = titans_model()(x[:, :L], None, return_log_probs=True).log_probs
    assert torch.equal(a.log_probs, b.log_probs) and torch.equal(a2, b2)
    assert (a.log_probs - c).abs().max() > 1e-3
    with pytest.raises(ConfigError) as err:
        ModelConfig(mechanism="titans", backbone="hf", mem_len=0, hf={"path": "unused"},
                    titans={"segment_positions": True})
    assert err.value.field == "model.titans.segment_positions"
