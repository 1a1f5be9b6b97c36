"""RMT pinned to the paper, not to itself: a naive forward written from RMT §3.2 (Bulatov et
al. 2022) and Transformer-XL §3.3, compared with model/mechanisms/rmt/core.py on random weights.

The reference builds H̃^0 = [H^mem ∘ H^0 ∘ H^mem] by hand, lets every row attend with the
paper's rule (memory rows see their blocks in full; "the causal attention mask is applied
only to tokens of the input sequence"; the read block cannot see the segment, nothing but
the write block sees the write block), scores each query-key pair with A^rel at the signed
distance between their places in [read | tokens | write], runs the post-LN (or pre-LN)
layers position by position, and takes the last m rows of the output as the next memory.
"""

import pytest
import torch
import torch.nn.functional as F
from reference import rel_score, softmax_attend, tiny_model


def paper_may_attend(i: int, j: int, m: int, n_tok: int) -> bool:
    """RMT §3.2 for rows and columns laid out [read (m) | tokens (n_tok) | write (m)]."""
    def block(p):
        return "read" if p < m else "token" if p < m + n_tok else "write"
    bi, bj = block(i), block(j)
    if bj == "read":
        return True                       # everyone reads the memory
    if bi == "read":
        return False                      # the read block sees only itself
    if bi == "token":
        return bj == "token" and j <= i   # causal among the sequence's tokens only
    return True                           # the write block sees everything


def naive_layer(layer, h: torch.Tensor, u, v, m: int, n_tok: int, pre_lnorm: bool):
    attn, ff = layer.attn, layer.ff
    n_head, d_head = attn.n_head, attn.d_head
    bsz, n, d_model = h.shape
    x = attn.layer_norm(h) if pre_lnorm else h
    q = (x @ attn.q_net.weight.T).view(bsz, n, n_head, d_head)
    k, val = (x @ attn.kv_net.weight.T).chunk(2, dim=-1)
    k, val = k.reshape(bsz, n, n_head, d_head), val.reshape(bsz, n, n_head, d_head)
    out = torch.zeros(bsz, n, n_head * d_head)
    for b in range(bsz):
        for i in range(n):
            keys = [j for j in range(n) if paper_may_attend(i, j, m, n_tok)]
            scores = [rel_score(q[b, i], k[b, j], u, v, attn.r_net.weight, i - j, d_model)
                      for j in keys]
            vec, _ = softmax_attend(scores, [val[b, j] for j in keys])
            out[b, i] = vec.reshape(-1)
    a = out @ attn.o_net.weight.T
    h = h + a if pre_lnorm else attn.layer_norm(h + a)
    w1, w2 = ff.core[0], ff.core[3]
    y = ff.layer_norm(h) if pre_lnorm else h
    y = F.relu(y @ w1.weight.T + w1.bias) @ w2.weight.T + w2.bias
    return h + y if pre_lnorm else ff.layer_norm(h + y)


def naive_rmt_segment(model, tokens: torch.Tensor, memory: torch.Tensor | None):
    """-> (token hidden states [B, L, d], next memory [B, m, d]) for one segment."""
    core = model.core
    h0 = model.embedding(tokens)                       # √d-scaled embeddings (XL code)
    mem = core.init_memory.expand(tokens.shape[0], -1, -1) if memory is None else memory
    m, n_tok = mem.shape[1], tokens.shape[1]
    h = torch.cat([mem, h0, mem], dim=1)               # H̃^0 = [H^mem ∘ H^0 ∘ H^mem]
    for layer in core.layers:
        h = naive_layer(layer, h, core.u_bias, core.v_bias, m, n_tok, model.cfg.pre_lnorm)
    write = h[:, -m:]                                  # [H^read ∘ H^N ∘ H^write]
    if model.cfg.pre_lnorm:  # our pre-LN departure: the next memory is layer-normalised
        write = core.memory_layer_norm(write)
    return h[:, m:m + n_tok], write


@pytest.mark.parametrize("pre_lnorm", [False, True])
def test_rmt_forward_equals_a_naive_forward_from_the_paper(pre_lnorm):
    """Hidden states of every segment and the memory passed on match the naive reference
    over three segments (so the read block of segment 2 and 3 is the previous write)."""
    model = tiny_model("rmt", mem_len=0, pre_lnorm=pre_lnorm, rmt={"num_mem_tokens": 3})
    tokens = torch.randint(0, 23, (2, 12))
    state, ref_mem = None, None
    with torch.no_grad():
        for s in range(3):
            seg = tokens[:, 4 * s:4 * s + 4]
            h0 = model.embedding(seg)
            hidden, state = model.core(h0, state, model.lengths)
            ref_hidden, ref_mem = naive_rmt_segment(model, seg, ref_mem)
            torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(state.tokens, ref_mem, rtol=1e-4, atol=1e-4)

