"""The loss without the logits tensor (model/loss.py): the head and the cross-entropy run
over chunks of supervised rows, each recomputed in backward, and give the loss and the
gradients of the plain path, written here straight from the definition (the whole [N, V]
logits, a float32 log-softmax, the NLL of the target), natively and around pretrained
models, for every mechanism; what backward keeps holds no [N, V] buffer."""

import pytest
import torch
import torch.nn.functional as F
from pretrained_helpers import TINY, V, hf_model_section

import model.loss as loss_mod
from model import ModelConfig, build_model
from model.loss import SupervisedRows, chunked_nll, logits_nll, segment_nll
from model.pretrained.logits import lm_logits
from train.segment_checkpoint import SegmentCheckpoint

L, B = 6, 3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) if a.numel() else 0.0


def _head(d=16, v=37, dtype=torch.float32, bias=True, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(d, v, bias=bias).to(dtype)


def _rows_nll(head):
    return lambda h, t: logits_nll(head(h), t)


@pytest.mark.parametrize("rows", [1, 5, 7, 64])
def test_chunked_nll_and_its_gradients_equal_the_whole_logits_path_in_float32(rows):
    head = _head()
    h = torch.randn(23, 16, requires_grad=True)
    t = torch.randint(0, 37, (23,))
    weights = torch.rand(23)   # a non-uniform upstream gradient per row
    ref = F.cross_entropy(head(h).float(), t, reduction="none")
    ref_grads = torch.autograd.grad((ref * weights).sum(), [h, head.weight, head.bias])
    ours = chunked_nll(_rows_nll(head), h, t, rows)
    grads = torch.autograd.grad((ours * weights).sum(), [h, head.weight, head.bias])
    assert _rel(ours, ref) <= 1e-6
    for g, r in zip(grads, ref_grads, strict=True):
        assert _rel(g, r) <= 1e-6


def test_chunked_nll_in_bf16_is_the_plain_path_within_the_rounding_of_one_chunk():
    """Per row the same bf16 head and float32 log-softmax: the NLL and the hidden rows'
    gradient are the plain path's bit for bit; the weight's gradient is a sum over chunks of
    bf16 products, so it differs by at most one bf16 rounding per chunk."""
    head = _head(dtype=torch.bfloat16)
    h = torch.randn(40, 16, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 37, (40,))
    ref = logits_nll(head(h), t)
    ref_grads = torch.autograd.grad(ref.sum(), [h, head.weight])
    rows = 8
    ours = chunked_nll(_rows_nll(head), h, t, rows)
    grads = torch.autograd.grad(ours.sum(), [h, head.weight])
    assert ours.dtype == torch.float32
    assert torch.equal(ours, ref)
    assert torch.equal(grads[0], ref_grads[0])
    n_chunks = 40 // rows
    bound = n_chunks * 2.0**-8 * float(ref_grads[1].float().abs().max())
    assert float((grads[1].float() - ref_grads[1].float()).abs().max()) <= bound


def test_backward_keeps_no_rows_by_vocabulary_buffer():
    """What autograd saves for backward: the input rows and the targets, never a [rows, V]
    tensor (the plain path saves the float32 log-softmax of all rows)."""
    head = _head(d=8, v=1000)
    h = torch.randn(64, 8, requires_grad=True)
    t = torch.randint(0, 1000, (64,))
    saved = []

    def pack(x):
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        chunked_nll(_rows_nll(head), h, t, rows=16).sum()
    assert saved and max(saved) < 16 * 1000
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        logits_nll(head(h), t).sum()
    assert max(saved) >= 64 * 1000   # the plain path, for contrast: the check can fail


def test_only_supervised_rows_reach_the_head_and_the_rest_score_zero():
    head = _head()
    seen = []
    rows_nll = _rows_nll(head)

    def counting(h, t):
        seen.append(h.shape[0])
        return rows_nll(h, t)

    hidden = torch.randn(B, L, 16)
    targets = torch.randint(0, 37, (B, L))
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[0, 2] = mask[2, 4] = mask[2, 5] = True
    picked = SupervisedRows(mask, hidden.device)
    assert picked.device.tolist() == [2, 16, 17]
    assert picked.host.tolist() == [2, 16, 17]   # a host mask is read on the host
    with torch.no_grad():
        nll = segment_nll(counting, hidden, targets, mask, rows=100)
        ref = logits_nll(head(hidden).flatten(0, 1), targets.flatten()).view(B, L)
    assert seen == [3]
    torch.testing.assert_close(nll[mask], ref[mask], rtol=1e-6, atol=0)
    assert torch.count_nonzero(nll[~mask]) == 0


def test_a_segment_with_no_supervised_row_still_gives_every_head_weight_a_gradient():
    head = _head()
    hidden = torch.randn(B, L, 16, requires_grad=True)
    nll = segment_nll(_rows_nll(head), hidden, torch.zeros(B, L, dtype=torch.long),
                      torch.zeros(B, L, dtype=torch.bool), rows=4)
    nll.sum().backward()
    assert head.weight.grad is not None and torch.count_nonzero(head.weight.grad) == 0


# ---- whole models: the engine's forward against the plain path on `decode`'s output ------

NATIVE = {"xl": dict(mem_len=4), "lamemo": dict(mem_len=4), "rmt": dict(mem_len=0),
          "armt": dict(mem_len=0, armt={"d_key": 8}),
          "titans": dict(mem_len=0, pre_lnorm=True, titans={"d_mem": 8, "chunk_size": 3})}


def _native(mechanism, cutoffs=()):
    torch.manual_seed(0)
    cfg = ModelConfig(mechanism=mechanism, vocab_size=41, n_layer=2, d_model=16, n_head=2,
                      d_inner=32, dropout=0.0, tgt_len=L, rmt={"num_mem_tokens": 2},
                      cutoffs=list(cutoffs), **NATIVE[mechanism])
    return build_model(cfg)


def _reference(model, tokens, state, targets, mask):
    """The plain path: every row's logits at once, float32 log-softmax, masked mean."""
    hidden, _ = model.decode(tokens, state)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if hasattr(model, "softmax"):
        logp = model.softmax(flat)   # the adaptive softmax's full log-distribution
        nll = -logp.gather(1, targets.reshape(-1, 1)).squeeze(1)
    else:
        nll = F.cross_entropy(lm_logits(model.base, flat).float(), targets.reshape(-1),
                              reduction="none")
    nll = nll.view(targets.shape) * mask
    return nll.sum() / mask.sum()


def _loss_and_grads(fn, model):
    model.zero_grad()
    loss = fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _check_against_reference(model, vocab, monkeypatch, mask_where, ckpt):
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", vocab * 4)   # 4 rows a chunk
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (B, 2 * L + 1), generator=g)
    mask = torch.rand(B, L, generator=g) < 0.5 if mask_where else torch.ones(B, L, dtype=bool)
    mask[0, 0] = True
    first = model(x[:, :L], None, targets=x[:, 1:L + 1]).state.detach()
    tokens, targets = x[:, L:2 * L], x[:, L + 1:]
    given = None if mask_where is None else mask
    ref, ref_g = _loss_and_grads(lambda: _reference(model, tokens, first, targets, mask), model)
    run = SegmentCheckpoint() if ckpt else None
    ours, g = _loss_and_grads(lambda: model(tokens, first, targets=targets, loss_mask=given,
                                            run_decode=run).loss, model)
    assert _rel(ours, ref) <= 1e-6
    assert g.keys() == ref_g.keys()
    for name in ref_g:
        assert _rel(g[name], ref_g[name]) <= 1e-6, name


@pytest.mark.parametrize("mechanism", sorted(NATIVE))
@pytest.mark.parametrize("mask_where,ckpt", [(None, False), ("host", True)])
def test_native_loss_and_gradients_equal_the_plain_path(mechanism, mask_where, ckpt,
                                                        monkeypatch):
    _check_against_reference(_native(mechanism), 41, monkeypatch, mask_where, ckpt)


def test_adaptive_softmax_clusters_chunked_equal_its_full_log_distribution(monkeypatch):
    _check_against_reference(_native("xl", cutoffs=(10, 25)), 41, monkeypatch, "host", True)


@pytest.fixture(scope="module")
def hf_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: TINY[arch](root / arch) for arch in ("gpt2", "llama")}


@pytest.mark.parametrize("arch,mechanism", [("gpt2", "rmt"), ("llama", "rmt"),
                                            ("gpt2", "armt"), ("llama", "titans")])
@pytest.mark.parametrize("mask_where,ckpt", [(None, True), ("host", False)])
def test_pretrained_loss_and_gradients_equal_the_plain_path(arch, mechanism, mask_where, ckpt,
                                                            hf_ckpts, monkeypatch):
    section = hf_model_section(hf_ckpts[arch], 2, L)
    section["mechanism"] = mechanism
    if mechanism == "armt":
        section["armt"] = {"d_key": 8}
    if mechanism == "titans":
        section["titans"] = {"d_mem": 8, "chunk_size": 3}
    torch.manual_seed(0)
    _check_against_reference(build_model(ModelConfig.from_dict(section)), V, monkeypatch,
                             mask_where, ckpt)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("rows", [1000, 4])
def test_a_vocabulary_padded_for_the_head_gemm_leaves_loss_and_gradients_equal(
        arch, rows, hf_ckpts, monkeypatch):
    """model.hf.vocab_multiple: the head GEMM over V = 32 padded with zero rows to 128, the
    padding's logits cut off before the softmax. On the CPU the loss is the unpadded run's
    bit for bit; so is every gradient when the rows are one chunk, and within 1e-6 relative
    over several chunks (their contributions reach the weight through the padded copy, summed
    in another order)."""
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", V * rows)
    x = torch.randint(0, V, (B, L + 1), generator=torch.Generator().manual_seed(2))
    mask = torch.rand(B, L, generator=torch.Generator().manual_seed(3)) < 0.7
    runs = []
    for multiple in (0, 128):
        section = hf_model_section(hf_ckpts[arch], 2, L)
        section["hf"]["vocab_multiple"] = multiple
        torch.manual_seed(0)
        model = build_model(ModelConfig.from_dict(section))
        assert (loss_mod.padded_head(model.base.get_output_embeddings(), multiple)
                is None) == (multiple == 0)
        runs.append(_loss_and_grads(lambda m=model: m(x[:, :-1], None, targets=x[:, 1:],
                                                      loss_mask=mask).loss, model))
    (loss0, grads0), (loss1, grads1) = runs
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        if rows >= B * L:
            assert torch.equal(grads0[name], grads1[name]), name
        else:
            assert _rel(grads1[name], grads0[name]) <= 1e-6, name


def test_a_negative_vocab_multiple_is_refused_by_its_field():
    from model.typed import ConfigError
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({"mechanism": "rmt", "backbone": "hf", "mem_len": 0,
                               "hf": {"path": "x", "vocab_multiple": -1}})
    assert err.value.field == "model.hf.vocab_multiple"
