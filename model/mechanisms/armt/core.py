"""Associative Recurrent Memory Transformer (Rodkin, Kuratov, Bulatov, Burtsev 2024) on the
native relative-position stack.

ARMT is RMT whose memory tokens write, in every layer, into an associative matrix that
every position of the next segment reads (model/mechanisms/armt/associative.py has the read and the
delta-rule write, with their equations). Per segment, as the authors' code runs it
(modeling_amt/language_modeling.py of RodkinIvan/associative-recurrent-memory-transformer):

    x^0 = [E(x_τ) ∘ M]                       the segment's tokens, then m memory tokens
    for each layer l:
        x^{l-1} <- x^{l-1} + read_l(A_l, z_l; x^{l-1})     every row, the state before τ
        x^l = Layer_l(x^{l-1})                             causal over [cache ∘ tokens ∘ M]
        (A_l, z_l) <- write_l(A_l, z_l; x^l[M rows])       for the next segment
    logits from the token rows of the top layer

M are the same learned vectors in every segment (the authors': only A and z cross the
boundary); `armt.carry_tokens` instead carries the write outputs as the next segment's M
(RMT's recurrence on top, through `armt.memory_norm`). There is no read block: what the
tokens know of earlier segments comes from the associative reads. The memory rows sit
after the tokens under the causal mask, so they see the whole segment and nothing of
theirs leaks into the tokens' predictions. With mem_len > 0 the layers also attend to an
XL cache of the previous token rows (the authors' sliding-window mode).

The state (A, z per layer, float32) is NOT detached here: gradients flow into earlier
segments until the caller detaches it, which sets the BPTT depth, as for RMT.
"""

from __future__ import annotations

import torch
from torch import nn

from ...backbone import Lengths, RelativeBackbone, causal_allowed
from ...config import ModelConfig
from ...memory_tokens import memory_token_parameters, side_cache, write_rows
from ...positional import distance_list
from ...shapes import AttentionShape, LayerShape, SegmentShapes, TensorShape, xl_cache
from .associative import AssociativeLayer, AssociativeMemory, checkpoint_first_run


def associative_layer(cfg: ModelConfig) -> AssociativeLayer:
    """One layer's associative block as `model.armt` configures it (values of width
    d_model, added to the hidden states as in the authors' code)."""
    o = cfg.armt
    return AssociativeLayer(cfg.d_model, o.d_key, feature_map=o.feature_map, nu=o.nu,
                            use_gate=o.gate, correction=o.correction,
                            authors_gamma=o.authors_gamma, read_precision=o.read_precision,
                            denominator_floor=o.denominator_floor)


def memory_token_inputs(memory_init: torch.Tensor, state: AssociativeMemory, bsz: int,
                        carry_tokens: bool, dtype) -> torch.Tensor:
    """The m memory-token inputs [B, m, d] of a segment (this stack and a pretrained one):
    the learned ones, or with `carry_tokens` the previous write outputs in the rows that
    have been written (writes > 0)."""
    init = memory_init.to(dtype)[None].expand(bsz, -1, -1)
    if not carry_tokens or state.tokens is None:
        return init
    fresh = (state.writes == 0)[:, None, None]
    return torch.where(fresh, init, state.tokens.to(dtype))


def initial_state(blocks: nn.ModuleList, batch_size: int, device=None) -> AssociativeMemory:
    """ARMT's initial state, on either backbone: A = 0, z = 0 in every layer, which IS a
    fresh document (model/mechanisms/armt/associative.py). No XL cache yet: whether there is one is
    decided in forward by the run-time lengths (evaluation may switch it on or off), as for RMT."""
    b = blocks[0]
    return AssociativeMemory.zeros(batch_size, len(blocks), b.d_phi, b.d_value, device=device)


class ARMT(RelativeBackbone):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.memory_init, norm = memory_token_parameters(cfg, cfg.armt.memory_norm)
        # The memory LayerNorm only where write outputs become the next memory tokens.
        self.memory_layer_norm = norm if cfg.armt.carry_tokens else None
        self.associative = nn.ModuleList(associative_layer(cfg) for _ in range(cfg.n_layer))

    @classmethod
    def segment_shapes(cls, cfg: ModelConfig, rows: int, mem_len: int) -> SegmentShapes:
        """Q = L + m rows [tokens | memory] per layer, causal over K = M + Q keys (one
        distance list, as XL's). Besides the layer, each associative block saves its
        projections and features (DPFP keeps its two factors and product), the retrieved
        values, and its backward reads that layer's A and z; the state is A, z per layer
        in float32 (the carried tokens and the cache where configured)."""
        m, n, d = cfg.mech.num_mem_tokens(cfg), cfg.tgt_len, cfg.d_model
        q = n + m
        k = mem_len + q
        block = associative_layer(cfg)
        d_key, d_phi = block.d_key, block.d_phi
        attn = AttentionShape(q, k, k, q_input=q, kv_input=k, mask_per_row=mem_len > 0)
        saved = (TensorShape((rows, q, d)),                        # read: its input (W_q's)
                 TensorShape((rows, q, d_key), "fp32", count=2),   # relu(+-W_q h)
                 TensorShape((rows, q, d_phi), "fp32", count=3),   # DPFP's 2 factors, phi
                 TensorShape((rows, q, d), "fp32"),                # phi^T A
                 TensorShape((rows, q), "fp32"),                   # phi^T z + eps
                 TensorShape((rows, m, d_key), "fp32", count=2),   # write: relu(+-W_k m)
                 TensorShape((rows, m, d_phi), "fp32", count=3),   # factors, phi (as bmm's)
                 TensorShape((rows, m, d), "fp32", count=2),       # phi^T A, v - vbar
                 TensorShape((rows, m), "fp32", count=6))          # beta, dens, gamma
        state_read = (TensorShape((rows, d_phi, d), "fp32"), TensorShape((rows, d_phi), "fp32"))
        layer = LayerShape((attn,), out_rows=q, input_rows=q, input_saved=True, saved=saved,
                           state_read=state_read)
        A = TensorShape((rows, cfg.n_layer, d_phi, d), "fp32")
        z = TensorShape((rows, cfg.n_layer, d_phi), "fp32")
        state = [A, z]
        text = (f"ARMT A [{rows}, {cfg.n_layer}, {d_phi}, {d}] + z [{rows}, {cfg.n_layer}, "
                f"{d_phi}] fp32")
        if cfg.armt.carry_tokens:
            state.append(TensorShape((rows, m, d)))
            text += f", memory tokens [{rows}, {m}, {d}]"
        cache, cache_text = xl_cache(cfg, rows, mem_len)
        if cache:
            state.extend(cache)
            text += f", {cache_text}"
        norm = cfg.armt.carry_tokens and cfg.pre_lnorm and cfg.armt.memory_norm != "none"
        return SegmentShapes((layer,) * cfg.n_layer, distances=k, output_rows=q,
                             state=tuple(state), state_text=text,
                             memory_norm_rows=m if norm else 0,
                             saved_label="the associative read and write",
                             mem_len_adds=None if mem_len else
                             "an XL cache beside the associative memory")

    def empty_state(self, batch_size: int, device=None) -> AssociativeMemory:
        return initial_state(self.associative, batch_size, device)

    def forward(self, h0: torch.Tensor, state: AssociativeMemory | None, lengths: Lengths):
        """h0 [B, L, d] -> (token hidden [B, L, d], AssociativeMemory after the writes)."""
        bsz, n_tok, _ = h0.shape
        if state is None:
            state = self.empty_state(bsz, h0.device)
        state.resident()          # after `offload`: this is a checkpointed segment's re-run
        mem_in = memory_token_inputs(self.memory_init(), state, bsz,
                                     self.cfg.armt.carry_tokens, h0.dtype)
        x = torch.cat([h0, mem_in], dim=1)
        n_q = x.shape[1]

        cache = side_cache(state, lengths, bsz, h0.device)
        c_now = cache.mem_len_now if cache is not None else 0
        allowed = causal_allowed(n_q, c_now, cache.length if cache is not None else None,
                                 lengths, h0.device)
        dist = distance_list(c_now, n_q, 0, c_now + n_q, n_dist=c_now + n_q, device=h0.device)
        r_emb = self.r_emb(dist, lengths, dtype=h0.dtype)

        token_inputs, A_new, z_new, h = [], [], [], x
        bias = self.bias_tensors()
        A_in, z_in, grad_A = state.layers()
        for i, (layer, block) in enumerate(zip(self.layers, self.associative, strict=True)):
            z_i = z_in[i]
            h, A_i = block.read_passing(A_in[i], z_i, h, grad_A, i)
            token_inputs.append(h[:, :n_tok])
            u, v = self.biases(i, bias)
            h = self.run_layer(layer, h, cache.hids[i] if c_now else None, r_emb, u, v,
                               allowed)
            A_i, z_i = block.write(A_i, z_i, h[:, n_tok:])
            A_new.append(A_i)
            z_new.append(z_i)
        h = self.drop(h)
        new_cache = cache.appended(token_inputs, lengths.mem_len) if cache is not None else None
        tokens = None
        if self.cfg.armt.carry_tokens:
            tokens = write_rows(h, n_tok, self.memory_layer_norm)
        new_state = state.written(A_new, z_new, cache=new_cache, tokens=tokens)
        if self.cfg.armt.offload_state and checkpoint_first_run():
            state.offload()       # the checkpoint keeps this object for the re-run
        return h[:, :n_tok], new_state
