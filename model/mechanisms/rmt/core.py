"""Recurrent Memory Transformer (Bulatov et al. 2022), decoder-only variant.

The same m memory vectors are placed before and after the segment (paper §3, Eq. for H̃^0):

    H̃^0_τ = [H^mem_τ ∘ H^0_τ ∘ H^mem_τ]      (read block | tokens | write block)
    [H^read ∘ H^N ∘ H^write] = Transformer(H̃^0_τ)
    H^mem_{τ+1} := H^write_τ

Memory rows see their blocks in full; causality applies only among sequence tokens (the
mask rule of RMT §3, written out as a table in tests/test_rmt.py). The memory is NOT
detached here: gradients flow into earlier segments until the caller detaches the state,
which is how it sets the BPTT depth k.
With mem_len > 0 an XL cache of all positions' layer inputs is kept as well (Tr-XL + RMT,
§3.4), and `read_mem_from_cache` lets memory rows read it.
"""

from __future__ import annotations

import torch
from torch import nn

from ...attention import AttnLayout
from ...backbone import Lengths, RelativeBackbone
from ...config import ModelConfig
from ...memory import RMTMemory
from ...memory_tokens import memory_token_parameters, side_cache, write_rows
from ...positional import distance_list
from ...shapes import AttentionShape, LayerShape, SegmentShapes, TensorShape, xl_cache


def rmt_allowed(n_mem: int, n_tok: int, cache_len: int, cache_valid: torch.Tensor | None,
                read_mem_from_cache: bool, device) -> torch.Tensor:
    """bool [B|1, 2m+L, cache+2m+L]: rows [read | tokens | write], columns [cache | read |
    tokens | write], True = may attend (RMT §3; the table in tests/test_rmt.py)."""
    m, n_q = n_mem, 2 * n_mem + n_tok
    allowed = torch.zeros(n_q, cache_len + n_q, dtype=torch.bool, device=device)
    read, tok, write = slice(0, m), slice(m, m + n_tok), slice(m + n_tok, n_q)
    col = cache_len
    allowed[:, col:col + m] = True                                   # everyone reads memory
    allowed[tok, col + m:col + m + n_tok] = torch.ones(
        n_tok, n_tok, dtype=torch.bool, device=device).tril()        # causal among tokens
    allowed[write, col + m:] = True                                  # write sees all
    if cache_len:
        allowed[tok, :cache_len] = True
        if read_mem_from_cache:
            allowed[read, :cache_len] = True
            allowed[write, :cache_len] = True
    allowed = allowed[None]
    if cache_len and cache_valid is not None:
        key_valid = torch.ones(cache_valid.shape[0], cache_len + n_q, dtype=torch.bool,
                               device=device)
        key_valid[:, :cache_len] = (torch.arange(cache_len, device=device)[None]
                                    >= (cache_len - cache_valid.to(device))[:, None])
        allowed = allowed & key_valid[:, None, :]
    return allowed


def initial_memory(batch_size: int, m: int, d: int, device=None) -> RMTMemory:
    """RMT's initial state, on either backbone: every row `fresh` (its first segment reads
    the learned initial memory); the token slots are zeros until written. No XL cache yet:
    whether there is one is decided in forward by the run-time lengths (evaluation may
    switch it on or off), the one source of mem_len."""
    return RMTMemory(tokens=torch.zeros(batch_size, m, d, device=device),
                     fresh=torch.ones(batch_size, dtype=torch.bool, device=device))


def memory_inputs(init_memory: torch.Tensor, state: RMTMemory, bsz: int, dtype
                  ) -> torch.Tensor:
    """RMT's read (and write) block inputs [B, m, d], on either backbone: the carried
    memory, the learned initial one in the rows that start a document (`fresh`)."""
    init = init_memory.to(dtype)[None].expand(bsz, -1, -1)
    return torch.where(state.fresh[:, None, None], init, state.tokens.to(dtype))


class RMT(RelativeBackbone):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.opts = cfg.rmt
        self.memory_init, self.memory_layer_norm = memory_token_parameters(
            cfg, cfg.rmt.memory_norm)

    @classmethod
    def segment_shapes(cls, cfg: ModelConfig, rows: int, mem_len: int) -> SegmentShapes:
        """Q = 2m + L rows [read | tokens | write] in every layer, K = M + Q keys (the XL
        cache of §3.4 when mem_len > 0), signed distances D = Q + K - 1 (memory rows look
        right inside their blocks). The state: a copy of the write rows [B, m, d] (or the
        memory LayerNorm's output, which reads them as a view of the output) and the cache."""
        m, n = cfg.mech.num_mem_tokens(cfg), cfg.tgt_len
        q = 2 * m + n
        k = mem_len + q
        attn = AttentionShape(q, k, q + k - 1, q_input=q, kv_input=k, mask_per_row=mem_len > 0)
        layer = LayerShape((attn,), out_rows=q, input_rows=q, input_saved=True)
        tokens = TensorShape((rows, m, cfg.d_model))
        cache, cache_text = xl_cache(cfg, rows, mem_len)
        text = f"RMT memory [{rows}, {m}, {cfg.d_model}]" + (f", {cache_text}" if cache else "")
        norm = cfg.pre_lnorm and cfg.rmt.memory_norm != "none"
        return SegmentShapes((layer,) * cfg.n_layer, distances=q + k - 1, output_rows=q,
                             state=(tokens, *cache), state_text=text,
                             memory_norm_rows=m if norm else 0,
                             aux_targets=m if cfg.rmt.mem_loss_weight > 0 else 0,
                             mem_len_adds=None if mem_len else
                             "an XL cache beside the memory tokens")

    @property
    def init_memory(self) -> nn.Parameter:
        return self.memory_init.value

    def empty_state(self, batch_size: int, device=None) -> RMTMemory:
        m, d = self.init_memory.shape
        return initial_memory(batch_size, m, d, device)

    def forward(self, h0: torch.Tensor, state: RMTMemory | None, lengths: Lengths):
        """h0 [B, L, d] -> (token hidden [B, L, d], RMTMemory with the write outputs)."""
        bsz, n_tok, _ = h0.shape
        if state is None:
            state = self.empty_state(bsz, h0.device)
        init_memory = self.memory_init()
        m = init_memory.shape[0]
        mem_in = memory_inputs(init_memory, state, bsz, h0.dtype)
        x = torch.cat([mem_in, h0, mem_in], dim=1)
        n_q = x.shape[1]

        cache = side_cache(state, lengths, bsz, h0.device)
        c_now = cache.mem_len_now if cache is not None else 0
        allowed = rmt_allowed(m, n_tok, c_now, cache.length if cache is not None else None,
                              self.opts.read_mem_from_cache, h0.device)
        # Memory rows attend to the right inside their block, so distances are signed.
        dist = distance_list(c_now, n_q, 0, c_now + n_q, device=h0.device)
        r_emb = self.r_emb(dist, lengths, dtype=h0.dtype)
        # Names the rows and columns when attention is recorded (RMT Fig. 6 maps).
        layout = AttnLayout((("cache", c_now), ("read", m), ("segment", n_tok), ("write", m)),
                            c_now, 0)

        layer_inputs, h = [], x
        bias = self.bias_tensors()
        for i, layer in enumerate(self.layers):
            layer_inputs.append(h)
            u, v = self.biases(i, bias)
            h = self.run_layer(layer, h, cache.hids[i] if c_now else None, r_emb, u, v, allowed,
                               layout)
        h = self.drop(h)  # write outputs are taken after the final dropout (RMT code)
        new_cache = cache.appended(layer_inputs, lengths.mem_len) if cache is not None else None
        new_state = RMTMemory(tokens=write_rows(h, m + n_tok, self.memory_layer_norm),
                              fresh=torch.zeros_like(state.fresh), cache=new_cache)
        return h[:, m:m + n_tok], new_state
