"""A tiny native Titans model and the token-4 change over two segments, shared by
tests/test_titans.py and tests/test_titans_mac.py."""

from __future__ import annotations

import torch

from model import ModelConfig, build_model

V, L = 13, 6


def titans_model(seed: int = 0, sharpen: bool = True, **titans) -> torch.nn.Module:
    """A 2-layer float32 model; `titans` updates the section (e.g. variant="mag")."""
    opts = {"d_mem": 8, "chunk_size": 4, "num_persistent": 2, **titans}
    torch.manual_seed(seed)
    model = build_model(ModelConfig(mechanism="titans", vocab_size=V, n_layer=2, d_model=16,
                                    n_head=2, d_inner=32, dropout=0.0, tgt_len=L, mem_len=0,
                                    pre_lnorm=True, titans=opts))
    if sharpen:   # Eq. 25's gate starts at W_G = 0: give it values so the memory matters
        with torch.no_grad():
            for gate in model.core.memory_gate or ():
                gate.proj.weight.normal_(0.0, 0.5)
    return model.eval()


def token_4_changed(model, x):
    """(a1, b1, a2, b2): the first segment of x and of x with token 4 changed, and the
    second segment of x read on each one's state."""
    y = x.clone()
    y[:, 4] = (y[:, 4] + 1) % V
    a1, b1 = model(x[:, :L], None, return_log_probs=True), model(y[:, :L], None,
                                                                 return_log_probs=True)
    a2 = model(x[:, L:], a1.state, return_log_probs=True)
    b2 = model(x[:, L:], b1.state, return_log_probs=True)
    return a1, b1, a2, b2


def naive_memory(mem, x, weights, momentum, at=None):
    """`mem.update` of x [B, n, d_model] (float64) one token at a time, written from the
    paper's Eq. 12-14 (§3.1) with the gradient by autograd: at the weights of the token's
    chunk start (§3.2), or at `at` for every token (`surprise_at: initial`); the memory
    x + LayerNorm(MLP(x)) when `mem.residual_norm`. No clip."""
    import torch.nn.functional as F

    from model.mechanisms.titans.neural_memory import mlp
    k, v = mem.project("kv", x, None)
    k = mem._qk(k)
    theta, log_eta, log_keep = mem.gate_values(x, torch.float64)
    eta, keep = log_eta.exp(), log_keep.exp()
    weights, momentum = [w.clone() for w in weights], [s.clone() for s in momentum]
    for t in range(x.shape[1]):
        if at is None and t % mem.chunk_size == 0:
            start = [w.detach().clone() for w in weights]
        point = [w.detach().clone().requires_grad_(True) for w in (start if at is None else at)]
        with torch.enable_grad():
            pred = mlp(point, k[:, t:t + 1])               # the plain MLP (§3.1)
            if mem.residual_norm:   # written out here, not through mlp's flag
                pred = k[:, t:t + 1] + F.layer_norm(pred, pred.shape[-1:], eps=1e-5)
            grads = torch.autograd.grad((pred - v[:, t:t + 1]).square().sum(), point)
        for i, g in enumerate(grads):
            momentum[i] = eta[:, t, None, None] * momentum[i] - theta[:, t, None, None] * g
            weights[i] = keep[:, t, None, None] * weights[i] + momentum[i]
    return weights, momentum
