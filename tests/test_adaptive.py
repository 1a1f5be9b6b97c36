"""Adaptive input / projected adaptive softmax: distributions, factorisation, tying, counts."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from model.adaptive import AdaptiveEmbedding, AdaptiveSoftmax, tie_embeddings

VOCAB = 2000
CUTOFFS = [200, 1000]
ENDS = [0, 200, 1000, 2000]

# (cutoffs, div_val, d_embed, d_proj): plain softmax, one matrix split into clusters,
# per-cluster widths, and one matrix with per-cluster projections (d_proj != d_embed).
SETTINGS = {
    "no_cutoffs": ([], 1, 64, 64),
    "div1": (CUTOFFS, 1, 64, 64),
    "div2": (CUTOFFS, 2, 64, 64),
    "div1_proj": (CUTOFFS, 1, 64, 48),
    "div2_proj": (CUTOFFS, 2, 64, 48),
}


def assert_close(actual, expected, atol=1e-5, rtol=1e-5):
    # torch.testing.assert_close would do, but its first call imports torch.distributed.tensor
    # (~1.5 s), which alone would eat most of this file's time budget.
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    err = (actual - expected).abs().max().item()
    assert torch.allclose(actual, expected, atol=atol, rtol=rtol), f"max abs error {err:.3g}"


def make_softmax(setting: str, seed: int = 0) -> AdaptiveSoftmax:
    cutoffs, div_val, d_embed, d_proj = SETTINGS[setting]
    torch.manual_seed(seed)
    sm = AdaptiveSoftmax(VOCAB, d_embed, d_proj, cutoffs, div_val=div_val)
    # The default init (tiny weights, zero biases) gives a near-uniform distribution that can
    # hide bugs; random parameters everywhere make every term of the factorisation matter.
    with torch.no_grad():
        for p in sm.parameters():
            p.normal_(0.0, 0.3)
    return sm


def targets_in_every_cluster(n_per_cluster: int = 5) -> torch.Tensor:
    bounds = zip(ENDS[:-1], ENDS[1:], strict=True)
    picks = [torch.randint(lo, hi, (n_per_cluster,)) for lo, hi in bounds]
    picks.append(torch.tensor([0, 199, 200, 999, 1000, VOCAB - 1]))  # cluster edges
    return torch.cat(picks)


@pytest.mark.parametrize("setting", SETTINGS)
def test_log_probs_rows_sum_to_one(setting):
    sm = make_softmax(setting)
    hidden = torch.randn(7, sm.d_proj)
    logp = sm.log_probs(hidden)
    assert logp.shape == (7, VOCAB)
    assert_close(logp.exp().sum(-1), torch.ones(7), atol=1e-5, rtol=0)


@pytest.mark.parametrize("setting", SETTINGS)
def test_nll_equals_minus_log_probs_at_target(setting):
    sm = make_softmax(setting)
    target = targets_in_every_cluster()
    hidden = torch.randn(len(target), sm.d_proj)
    nll = sm.nll(hidden, target)
    ref = -sm.log_probs(hidden).gather(1, target[:, None]).squeeze(1)
    assert nll.shape == target.shape
    assert_close(nll, ref, atol=1e-5, rtol=1e-5)
    # Leading dimensions are allowed as long as they match.
    assert_close(sm.nll(hidden.view(3, -1, sm.d_proj), target.view(3, -1)),
                               nll.view(3, -1))


@pytest.mark.parametrize("setting", ["div1", "div2", "div1_proj", "div2_proj"])
def test_tail_token_probability_factorises_into_head_times_within_cluster(setting):
    sm = make_softmax(setting).double()
    hidden = torch.randn(4, sm.d_proj, dtype=torch.float64)
    p = sm.log_probs(hidden).exp()

    def cluster_params(i):
        lo, hi = ENDS[i], ENDS[i + 1]
        if sm.div_val == 1:
            w, b = sm.out_weights[0][lo:hi], sm.out_biases[0][lo:hi]
        else:
            w, b = sm.out_weights[i], sm.out_biases[i]
        h = hidden @ sm.out_projs[i] if len(sm.out_projs) else hidden
        return h, w, b

    h0, w0, b0 = cluster_params(0)
    head_logits = torch.cat([h0 @ w0.T + b0, h0 @ sm.cluster_weight.T + sm.cluster_bias], -1)
    p_head = torch.softmax(head_logits, -1)
    assert_close(p[:, :200], p_head[:, :200])
    for i, token in [(1, 200), (1, 777), (2, 1000), (2, 1999)]:
        hi_, wi, bi = cluster_params(i)
        p_within = torch.softmax(hi_ @ wi.T + bi, -1)[:, token - ENDS[i]]
        p_cluster = p_head[:, 200 + i - 1]
        assert_close(p[:, token], p_cluster * p_within)


def _naive_nll(sm: AdaptiveSoftmax, hidden, target):
    """-log p(target) from the definition: head softmax over shortlist + cluster logits,
    p(tail token) = p(cluster) p(token | cluster), each cluster's weights sliced by hand."""
    def logits(i, h):
        lo, hi = ENDS[i], ENDS[i + 1]
        w, b = sm.out_weights[0][lo:hi], sm.out_biases[0][lo:hi]
        h = h @ sm.out_projs[i] if len(sm.out_projs) else h
        if i == 0:
            w, b = torch.cat([w, sm.cluster_weight]), torch.cat([b, sm.cluster_bias])
        return h @ w.T + b
    out = []
    for h, t in zip(hidden, target.tolist(), strict=True):
        head = F.log_softmax(logits(0, h[None]), -1)[0]
        i = next(i for i in range(3) if t < ENDS[i + 1])
        lp = head[t] if i == 0 else head[200 + i - 1] + F.log_softmax(
            logits(i, h[None]), -1)[0, t - ENDS[i]]
        out.append(-lp)
    return torch.stack(out)


@pytest.mark.parametrize("setting", ["div1", "div1_proj"])
def test_one_matrix_clusters_give_the_naive_gradient_and_one_vocab_sized_buffer(setting):
    """div_val 1: the clusters are row blocks of one [vocab, d] matrix. Their gradient is
    the per-cluster slices' (naive reference), written into ONE new [vocab, d] tensor, not
    one zero-filled [vocab, d] tensor per cluster (4 x 440 MB per step at WikiText-103)."""
    sm = make_softmax(setting).double()
    target = targets_in_every_cluster()
    hidden = torch.randn(len(target), sm.d_proj, dtype=torch.float64)
    _naive_nll(sm, hidden, target).sum().backward()
    naive = [p.grad.clone() for p in sm.parameters()]
    sm.zero_grad(set_to_none=True)
    loss = sm.nll(hidden, target).sum()
    weight = sm.out_weights[0]
    made = _ShapeCount(tuple(weight.shape))
    with made:
        loss.backward()
    assert made.n == 1, made.n
    for got, want in zip([p.grad for p in sm.parameters()], naive, strict=True):
        assert_close(got, want, atol=1e-12, rtol=1e-12)


class _ShapeCount(TorchDispatchMode):
    """How many op outputs have `shape` (the new tensors an op makes, views excepted)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.n = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape \
                and torch.Tag.view_copy not in func.tags and not func.is_view:
            self.n += 1
        return out


def test_calling_the_module_dispatches_to_nll_or_log_probs():
    sm = make_softmax("div2_proj")
    target = targets_in_every_cluster()
    hidden = torch.randn(len(target), sm.d_proj)
    assert torch.equal(sm(hidden, target), sm.nll(hidden, target))
    assert torch.equal(sm(hidden), sm.log_probs(hidden))


def build_tied(div_val: int, tie_projs: list[bool], d_embed: int = 64, d_proj: int = 48):
    torch.manual_seed(0)
    emb = AdaptiveEmbedding(VOCAB, d_embed, d_proj, CUTOFFS, div_val=div_val)
    sm = AdaptiveSoftmax(VOCAB, d_embed, d_proj, CUTOFFS, div_val=div_val)
    tie_embeddings(emb, sm, tie_weight=True, tie_projs=tie_projs)
    return nn.ModuleList([emb, sm]), emb, sm


def test_gradients_flow_and_tied_parameters_are_shared_objects():
    model, emb, sm = build_tied(div_val=2, tie_projs=[False, True, True])
    for i in range(3):
        assert sm.out_weights[i] is emb.emb_layers[i].weight
    assert sm.out_projs[0] is not emb.emb_projs[0]
    assert sm.out_projs[1] is emb.emb_projs[1] and sm.out_projs[2] is emb.emb_projs[2]

    # Tied parameters appear once in a module holding both.
    params = list(model.parameters())
    assert len({id(p) for p in params}) == len(params)
    untied = [p for p in sm.parameters() if all(p is not q for q in emb.parameters())]
    assert sum(p.numel() for p in params) == (sum(p.numel() for p in emb.parameters())
                                             + sum(p.numel() for p in untied))
    assert len(untied) == 3 + 1 + 2  # biases, head projection, cluster weight/bias

    tokens = targets_in_every_cluster()
    sm.nll(emb(tokens), tokens.roll(1)).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_div_val_1_ties_every_tail_projection_to_the_single_input_projection():
    model, emb, sm = build_tied(div_val=1, tie_projs=[False, True, True])
    assert len(emb.emb_projs) == 1 and len(sm.out_projs) == 3
    assert sm.out_weights[0] is emb.emb_layers[0].weight
    assert sm.out_projs[1] is emb.emb_projs[0] and sm.out_projs[2] is emb.emb_projs[0]
    assert sm.out_projs[0] is not emb.emb_projs[0]
    tokens = targets_in_every_cluster()
    sm.nll(emb(tokens), tokens.roll(1)).mean().backward()
    assert emb.emb_projs[0].grad.abs().sum() > 0 and sm.cluster_weight.grad.abs().sum() > 0


def test_clusters_without_targets_still_get_zero_gradients():
    # Keeps every parameter in the graph, so DDP needs no find_unused_parameters.
    model, emb, sm = build_tied(div_val=2, tie_projs=[])
    tokens = torch.randint(0, 200, (16,))  # shortlist only
    sm.nll(emb(tokens), tokens).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
    assert sm.out_biases[2].grad.abs().sum() == 0


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("div_val", [1, 4])
def test_parameter_counts_of_tied_wikitext103_models(div_val, monkeypatch):
    # Counts only: build on the meta device (no 100M-float allocation) and skip the random
    # init, whose meta implementation imports torch._dynamo on first use (~1 s).
    monkeypatch.setattr(nn.init, "normal_", lambda tensor, *args, **kwargs: tensor)
    vocab, cutoffs, tie_projs = 267735, [20000, 40000, 200000], [False, True, True, True]
    d = 410 if div_val == 1 else 1024
    with torch.device("meta"):
        emb = AdaptiveEmbedding(vocab, d, d, cutoffs, div_val=div_val)
        sm = AdaptiveSoftmax(vocab, d, d, cutoffs, div_val=div_val)
    tie_embeddings(emb, sm, tie_weight=True, tie_projs=tie_projs)
    if div_val == 1:
        # shared weight + softmax bias + head's cluster weight/bias; no projections (d == d).
        expected = vocab * d + vocab + 3 * d + 3
    else:
        sizes = [20000, 20000, 160000, 67735]
        dims = [1024, 256, 64, 16]
        tables = sum(n * d_i for n, d_i in zip(sizes, dims, strict=True))  # shared with the softmax
        in_projs = sum(d * d_i for d_i in dims)
        head_proj = d * dims[0]  # tie_projs[0] is False: the softmax keeps its own
        expected = tables + in_projs + head_proj + vocab + 3 * d + 3
    assert count(nn.ModuleList([emb, sm])) == expected


def test_embedding_is_scaled_and_tail_tokens_use_their_cluster_projection():
    torch.manual_seed(0)
    emb = AdaptiveEmbedding(VOCAB, 64, 64, CUTOFFS, div_val=1)
    tokens = torch.tensor([[3, 250], [1500, 1999]])
    out = emb(tokens)
    assert out.shape == (2, 2, 64)
    assert_close(out, emb.emb_layers[0].weight[tokens] * 8.0)

    emb = AdaptiveEmbedding(VOCAB, 64, 48, CUTOFFS, div_val=2)
    out = emb(tokens)
    assert out.shape == (2, 2, 48)
    for pos, token in [((0, 0), 3), ((0, 1), 250), ((1, 0), 1500), ((1, 1), 1999)]:
        i = next(i for i in range(3) if ENDS[i] <= token < ENDS[i + 1])
        assert emb.emb_layers[i].weight.shape[1] == 64 // 2**i
        ref = emb.emb_projs[i] @ emb.emb_layers[i].weight[token - ENDS[i]] * math.sqrt(48)
        assert_close(out[pos], ref)


@pytest.mark.parametrize("kwargs, name", [
    (dict(cutoffs=[1000, 200]), "cutoffs"),
    (dict(cutoffs=[200, 200]), "cutoffs"),
    (dict(cutoffs=[200, VOCAB]), "cutoffs"),
    (dict(div_val=0), "div_val"),
    (dict(d_embed=8, div_val=4), "d_embed"),  # 8 // 4**2 == 0
])
@pytest.mark.parametrize("cls", [AdaptiveEmbedding, AdaptiveSoftmax])
def test_bad_arguments_raise_value_error_naming_the_argument(cls, kwargs, name):
    args = dict(vocab_size=VOCAB, d_embed=64, d_proj=64, cutoffs=CUTOFFS) | kwargs
    with pytest.raises(ValueError, match=name):
        cls(**args)


def test_bad_tie_projs_length_raises_value_error():
    emb = AdaptiveEmbedding(VOCAB, 64, 48, CUTOFFS, div_val=2)
    sm = AdaptiveSoftmax(VOCAB, 64, 48, CUTOFFS, div_val=2)
    with pytest.raises(ValueError, match="tie_projs"):
        tie_embeddings(emb, sm, tie_weight=True, tie_projs=[True, True])
    other = AdaptiveSoftmax(VOCAB, 64, 48, CUTOFFS, div_val=1)
    with pytest.raises(ValueError, match="div_val"):
        tie_embeddings(emb, other, tie_weight=True, tie_projs=[])


@pytest.mark.parametrize("setting", ["no_cutoffs", "div2_proj"])
def test_bf16_autocast_nll_is_finite_float32_and_close_to_fp32(setting):
    sm = make_softmax(setting)
    target = targets_in_every_cluster()
    hidden = torch.randn(len(target), sm.d_proj)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        nll = sm.nll(hidden, target)
        logp = sm.log_probs(hidden)
    assert nll.dtype == torch.float32 and logp.dtype == torch.float32
    assert torch.isfinite(nll).all() and torch.isfinite(logp).all()
    # bf16 logits carry ~3 significant digits; the loss must stay close to the fp32 one.
    assert_close(nll, sm.nll(hidden, target), atol=0.1, rtol=0.02)


def test_out_of_range_target_raises_instead_of_being_silently_dropped():
    sm = make_softmax("div2")
    emb = AdaptiveEmbedding(VOCAB, 64, 64, CUTOFFS, div_val=2)
    for bad in (-1, VOCAB):
        with pytest.raises((IndexError, RuntimeError)):
            sm.nll(torch.randn(2, 64), torch.tensor([5, bad]))
        with pytest.raises((IndexError, RuntimeError)):
            emb(torch.tensor([5, bad]))


def test_log_softmax_tail_precision_matches_reference_full_softmax():
    # With no cutoffs the module is exactly a (projected) full softmax.
    sm = make_softmax("no_cutoffs")
    hidden = torch.randn(5, 64)
    ref = F.log_softmax(hidden @ sm.out_weights[0].T + sm.out_biases[0], -1)
    assert_close(sm.log_probs(hidden), ref)
