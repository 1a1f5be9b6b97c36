"""Titans, memory as a context (§4.1), around a pretrained decoder's own layers; the native
forward and its choices are model/mechanisms/titans/core.py's, the neural memory
model/mechanisms/titans/neural_memory.py's.

The base model's layers take one sequence of rows, so the context rows of Eq. 22 are rows
of it, interleaved with the tokens:

    x^0 = [p_1 .. p_P | h_1 x_1 | h_2 x_2 | ... | h_L x_L]
    per decoder layer l:  h_i <- W_H,l M_l*(q(x_i))              (pre-hook; Eq. 21)
                          x^l = Layer_l(x^{l-1})                  (the base model's own)
                          M_l <- update with the token rows y     (hook; Eq. 24, chunked)
                          x_i <- y_i ⊗ M_l*(y_i)                  (hook; Eq. 25)
    logits from the token rows of the top layer

under the base model's own causal mask: token x_j sees p, and h_i, x_i for i <= j (h_i is
read with token i's query, so it sits right before x_i). The persistent tokens p (Eq. 19)
are learned inputs that pass through the layers, as the paper prepends them. h_i and x_i
share a position id (P + i; the p rows take 0 .. P-1), so the tokens keep the spacing the
model was trained with. As for ARMT (model/mechanisms/armt/pretrained.py), the hooks live for one
`decode` call: they close over its incoming state and collect its updates.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ...pretrained.layers import decoder_layers_name, layer_hidden
from ...pretrained.positions import causal_attention
from ...shapes import MemoryRows, StatedBlock, TensorShape
from .neural_memory import NeuralMemoryState


def parameters(cfg, base, memory_scale) -> dict:
    from ...memory_tokens import pretrained_memory_init
    from .core import MemoryGate, neural_memory
    o, d = cfg.titans, cfg.d_model
    # Eq. 19's tokens at the scale of the pretrained embeddings they sit among (RMT's).
    persistent = pretrained_memory_init(cfg, base, o.num_persistent, memory_scale)
    return {"layers_name": decoder_layers_name(base), "persistent": persistent,
            "memory": nn.ModuleList(neural_memory(cfg) for _ in range(cfg.n_layer)),
            "memory_out": nn.ModuleList(nn.Linear(o.d_mem, d, bias=False)
                                        for _ in range(cfg.n_layer)),
            "memory_gate": nn.ModuleList(MemoryGate(o.d_mem, d) for _ in range(cfg.n_layer))}


def position_ids(n_persistent: int, n_tok: int, device=None) -> torch.Tensor:
    """[1, P + 2L]: 0 .. P-1, then P + i twice (h_i, x_i)."""
    tokens = torch.arange(n_persistent, n_persistent + n_tok, device=device)
    return torch.cat([torch.arange(n_persistent, device=device),
                      tokens.repeat_interleave(2)])[None]


def _interleave(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[h_1 x_1 h_2 x_2 ...] from h, x [B, L, d]."""
    return torch.stack([h, x], dim=2).flatten(1, 2)


@contextmanager
def titans_pass(lm, state: NeuralMemoryState, n_p: int) -> Iterator[tuple[list, list]]:
    """For the body of a with-block (one run of the base model over x^0 above): each
    layer's h rows are its memory's reads, its token rows are updated into the memory and
    gated (Eq. 21, 24, 25). Yields the lists of each layer's (weights, momentum) and of its
    streams' tails (model/mechanisms/titans/neural_memory.py; None without convolutions)."""
    layers = lm.base.base_model.get_submodule(lm.layers_name)
    weights, momentum = [None] * len(layers), [None] * len(layers)
    tails = [[None, None] for _ in layers]     # per layer: update, retrieval stream

    def read_hook(i: int):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            w, _ = state.layer(i, lm.memory[i].initial_weights())
            tokens = x[:, n_p + 1::2]
            x_tail = state.tail(1, i)
            tails[i][1] = lm.memory[i].carry(x_tail, tokens)
            h = lm.memory_out[i](lm.memory[i].retrieve(w, tokens, x_tail).to(x.dtype))
            x = torch.cat([x[:, :n_p], _interleave(h, tokens)], dim=1)
            if args:
                return (x, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": x}
        return hook

    def write_hook(i: int):
        def hook(module, args, output):
            out = layer_hidden(output)
            w, s = state.layer(i, lm.memory[i].initial_weights())
            y = out[:, n_p + 1::2]
            tail = state.tail(0, i)
            tails[i][0] = lm.memory[i].carry(tail, y)
            weights[i], momentum[i], r = lm.memory[i].update(w, s, y, read=y, tail=tail)
            o = lm.memory_gate[i](y, r)
            out = torch.cat([out[:, :n_p], _interleave(out[:, n_p::2], o)], dim=1)
            return (out, *output[1:]) if isinstance(output, tuple) else out
        return hook

    handles = []
    try:
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(read_hook(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(write_hook(i)))
        yield weights, momentum, tails
    finally:
        for h in handles:
            h.remove()


def decode(lm, emb: torch.Tensor, state: NeuralMemoryState):
    """token embeddings [B, L, d] -> (token hidden [B, L, d] after the final norm, state)."""
    bsz, n_tok, _ = emb.shape
    parts = [] if lm.persistent is None else [lm.persistent().to(emb.dtype)[None].expand(
        bsz, -1, -1)]
    n_p = parts[0].shape[1] if parts else 0
    x = torch.cat([*parts, _interleave(torch.zeros_like(emb), emb)], dim=1)
    # The model's own causal mask with no host read of a mask or of the positions, and no
    # packed-sequence split at the repeated positions (positions.py `causal_attention`).
    positions = position_ids(n_p, n_tok, emb.device).expand(bsz, -1)
    with titans_pass(lm, state, n_p) as (weights, momentum, tails), \
            causal_attention(lm.base, x.shape[1], x.dtype, x.device) as mask:
        h = lm.base.base_model(inputs_embeds=x, attention_mask=mask, position_ids=positions,
                               use_cache=False)[0]
    if any(w is None for w in weights):
        raise RuntimeError("a decoder layer did not run: no memory update")
    return h[:, n_p + 1::2], state.written(weights, momentum, tails)


def memory_rows(cfg, rows: int, trained_params: int) -> MemoryRows:
    """P + 2L rows through every layer under the base model's own mask; per layer a stated
    block for the memory's read and update (what model/mechanisms/titans/core.py's segment_shapes
    lists), and the state: every layer's weights and momentum, float32."""
    from .core import TitansCore
    o, n, d = cfg.titans, cfg.tgt_len, cfg.d_model
    q = o.num_persistent + 2 * n
    native = TitansCore.segment_shapes(cfg, rows, 0)
    layer = native.layers[0]
    per_layer = sum(p.numel() for p in _one_layer(cfg).parameters())
    block = StatedBlock("neural memory", saved=layer.saved, alive=(TensorShape((rows, q, d)),),
                        trained_params=per_layer)
    return MemoryRows(rows=q, own_mask=True, input_rows=q, state=native.state,
                      state_text=native.state_text, state_read=layer.state_read,
                      blocks=(block,), saved_label=native.saved_label)


def _one_layer(cfg) -> nn.Module:
    from .core import MemoryGate, neural_memory
    return nn.ModuleList([neural_memory(cfg), nn.Linear(cfg.titans.d_mem, cfg.d_model,
                                                        bias=False),
                          MemoryGate(cfg.titans.d_mem, cfg.d_model)])
