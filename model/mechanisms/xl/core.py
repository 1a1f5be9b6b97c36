"""Transformer-XL (Dai et al. 2019): segment-level recurrence with a per-layer cache.

For layer n (paper §3.2 and §3.3):
    h̃^{n-1} = [SG(m^{n-1}) ∘ h^{n-1}]
    q = h^{n-1} W_q,  k, v = h̃^{n-1} W_{k,E}, h̃^{n-1} W_v
    h^n = FF(LN(h^{n-1} + W_o softmax(A^rel) v))
Queries come only from the current segment; keys and values from [memory ∘ segment].
mem_len = 0 is the no-recurrence baseline ("Transformer + RPE").
"""

from __future__ import annotations

import torch

from ...backbone import Lengths, RelativeBackbone, causal_allowed
from ...config import ModelConfig
from ...memory import XLMemory
from ...positional import distance_list
from ...shapes import AttentionShape, LayerShape, SegmentShapes, xl_cache


class TransformerXL(RelativeBackbone):
    @classmethod
    def segment_shapes(cls, cfg: ModelConfig, rows: int, mem_len: int) -> SegmentShapes:
        """Each layer: Q = L queries over K = M + L keys, distances M+L-1 .. 0 (one list for
        all layers); W_o and the FFN over the L rows. The cache holds the layer inputs; when
        L = M the new cache IS those inputs (model/memory.py `_last` copies nothing)."""
        n, k = cfg.tgt_len, mem_len + cfg.tgt_len
        attn = AttentionShape(n, k, k, q_input=n, kv_input=k, mask_per_row=mem_len > 0)
        layer = LayerShape((attn,), out_rows=n, input_rows=n, input_saved=True)
        state, text = xl_cache(cfg, rows, mem_len)
        return SegmentShapes((layer,) * cfg.n_layer, distances=k, output_rows=n, state=state,
                             state_text=text or "none (mem_len 0)",
                             state_aliases_inputs=n == mem_len)

    def empty_state(self, batch_size: int, device=None) -> XLMemory:
        return XLMemory(hids=[], length=torch.zeros(batch_size, dtype=torch.long, device=device))

    def forward(self, h0: torch.Tensor, state: XLMemory | None, lengths: Lengths):
        """h0 [B, L, d] (embedded, dropped out) -> (hidden [B, L, d], new XLMemory)."""
        bsz, n_q, _ = h0.shape
        if state is None:
            state = self.empty_state(bsz, h0.device)
        m_now = state.mem_len_now
        allowed = causal_allowed(n_q, m_now, state.length, lengths, h0.device)
        # Keys never lie right of a query, so the distance list M+L-1 .. 0 suffices.
        dist = distance_list(m_now, n_q, 0, m_now + n_q, n_dist=m_now + n_q, device=h0.device)
        r_emb = self.r_emb(dist, lengths, dtype=h0.dtype)

        layer_inputs, h = [], h0
        bias = self.bias_tensors()
        for i, layer in enumerate(self.layers):
            layer_inputs.append(h)
            mem = state.hids[i] if m_now else None
            u, v = self.biases(i, bias)
            h = self.run_layer(layer, h, mem, r_emb, u, v, allowed)
        if lengths.mem_len > 0:
            new_state = state.appended(layer_inputs, lengths.mem_len)
        else:
            new_state = self.empty_state(bsz, h0.device)
        return self.drop(h), new_state
