"""Naive references written straight from the papers' equations, for the tests to compare
the fast paths against. Loops over positions on purpose: clarity over speed."""

from __future__ import annotations

import math

import torch

from model import ModelConfig, build_model


def tiny_config(mechanism: str = "xl", **overrides) -> ModelConfig:
    base = dict(mechanism=mechanism, vocab_size=23, n_layer=2, d_model=16, n_head=2,
                d_inner=32, dropout=0.0, dropatt=0.0, tgt_len=4, mem_len=6,
                rmt={"num_mem_tokens": 2})
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(mechanism: str = "xl", seed: int = 0, **overrides):
    """d_model 16, 2 heads, segment 4, memory 6, dropout 0, with sharpened parameters: at the
    default init (std 0.02, u = v = 0) attention is near-uniform and a wrong memory moves the
    loss by ~1e-7, so equivalence tests could not fail. LayerNorm gains stay ~1."""
    torch.manual_seed(seed)
    model = build_model(tiny_config(mechanism, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" not in name:
                p.normal_(0.0, 0.3 if p.dim() >= 2 else 0.1)
    return model.eval()


def sharpened_model(mechanism: str, mem_len: int, *, vocab: int, seg: int, seed: int = 0,
                    sharpen: bool = True):
    """A small model (d 32) whose outputs depend visibly on context and memory.

    The default init (std 0.02, zero biases and u/v) gives near-uniform attention and outputs,
    under which a wrong memory barely changes the NLL or the greedy choice; larger random
    parameters everywhere (LayerNorm gains stay ~1) make the memory matter.
    """
    cfg = ModelConfig(mechanism=mechanism, vocab_size=vocab, n_layer=2, d_model=32, n_head=4,
                      d_inner=64, dropout=0.0, dropatt=0.0, tgt_len=seg, mem_len=mem_len,
                      rmt={"num_mem_tokens": 3})
    torch.manual_seed(seed)
    model = build_model(cfg)
    if sharpen:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "layer_norm" not in name:
                    p.normal_(0.0, 0.2 if p.dim() >= 2 else 0.1)
    return model.eval()


def run_segments(model, tokens, targets, seg: int, state=None):
    """Run `tokens` [B, T] segment by segment (length `seg`), carrying the memory; return
    (per-segment nll list, final state)."""
    nlls = []
    for s in range(0, tokens.shape[1], seg):
        out = model(tokens[:, s:s + seg], state, targets=targets[:, s:s + seg])
        nlls.append(out.nll)
        state = out.state
    return nlls, state


def sinusoid_row(delta: float, d_model: int) -> torch.Tensor:
    """R_Δ = [sin(Δ f_0) .. sin(Δ f_{d/2-1}), cos(Δ f_0) ..], f_k = 10000^(-2k/d)."""
    freqs = [10000 ** (-2 * k / d_model) for k in range(d_model // 2)]
    return torch.tensor([math.sin(delta * f) for f in freqs] + [math.cos(delta * f)
                                                                 for f in freqs])


def rel_score(q_i, k_j, u, v, w_r, delta, d_model):
    """A^rel_ij per head (XL §3.3): (a) q·k + (b) q·W_R R + (c) u·k + (d) v·W_R R, scaled.

    q_i, k_j [H, dh]; u, v [H, dh]; w_r [H*dh, d]; delta the distance fed to R.
    """
    n_head, d_head = q_i.shape
    r = (w_r @ sinusoid_row(delta, d_model).to(w_r.dtype)).view(n_head, d_head)
    a = (q_i * k_j).sum(-1)
    b = (q_i * r).sum(-1)
    c = (u * k_j).sum(-1)
    d = (v * r).sum(-1)
    return (a + b + c + d) / math.sqrt(d_head)


def softmax_attend(scores: list[torch.Tensor], values: list[torch.Tensor]):
    """scores: per key [H]; values: per key [H, dh] -> (Σ β v [H, dh], logsumexp [H])."""
    s = torch.stack(scores)  # [K, H]
    lse = torch.logsumexp(s, dim=0)
    beta = torch.exp(s - lse)
    return (beta[..., None] * torch.stack(values)).sum(0), lse


def rmt_paper_pattern(m: int, n: int) -> torch.Tensor:
    """RMT's "paper" attention pattern (Bulatov et al. 2022, §3) over rows [read (m) |
    tokens (n) | write (m)], cell by cell: bool [2m+n, 2m+n], True = may attend."""
    rows = 2 * m + n
    kind = ["read"] * m + ["token"] * n + ["write"] * m
    allowed = torch.zeros(rows, rows, dtype=torch.bool)
    for i in range(rows):
        for j in range(rows):
            if kind[j] == "read":
                allowed[i, j] = True                  # everyone reads the read block
            elif kind[i] == "token" and kind[j] == "token":
                allowed[i, j] = j <= i                # causal among the tokens
            elif kind[i] == "write":
                allowed[i, j] = True                  # write sees every token and write row
    return allowed
