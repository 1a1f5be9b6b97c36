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
