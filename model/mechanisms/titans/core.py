"""Titans (Behrouz, Zhong, Mirrokni 2025) on the native relative-position stack: memory as
a context (MAC, §4.1), and as a gate or a layer (MAG, MAL; below). The neural memory and
its update are model/mechanisms/titans/neural_memory.py.

Per segment S (the paper's chunk of the sequence) and layer l, in the paper's order
(retrieve, attend, update):

    h   = M_{l, tau-1}*(q),  q = x W_Q                      (Eq. 21: retrieve, no update)
    S~  = [p_l | W_H h | x]                                  (Eq. 22: persistent, memory, input)
    y   = Layer_l(x; context [p_l | W_H h])                  (Eq. 23: attend)
    M_{l, tau} = update of M_{l, tau-1} with the tokens y    (Eq. 24: chunked, §3.2)
    o   = y ⊗ M*(y)                                          (Eq. 25)

and o is the next layer's input. Choices where the paper is silent or where it would break a
causal language model (docs/titans.md lists them):

- Causality. h_i is read with the query of token i, so token j may attend to h_i only for
  i <= j; the persistent rows p_l to all; the tokens causally. The queries are the segment's
  tokens only: the context rows are keys and values, as Transformer-XL's cache is, which is
  what this stack's layer takes as its `mem` argument (their distances are those of a
  cache of P + L rows before the segment).
- Eq. 25 reads M with the weights of each token's chunk start (the chunks of the segment
  before its own; model/mechanisms/titans/neural_memory.py), not the memory after the whole segment,
  whose weights hold the segment's later tokens. ⊗ is a gate o = y * 2 sigmoid(W_G M*(y)), W_G = 0
  at initialisation, so the block starts as the backbone (as ARMT's W_v = 0 does).
- Persistent memory (Eq. 19) prepends learned tokens to the input. They are independent of
  the input and come first under the causal mask, so their hidden states are the same
  constants in every segment; here every layer has its own learned rows p_l [P, d], which
  can express those constants (and more).
- One neural memory per layer, as ARMT has one association matrix per layer.

MAC's read, write and gate have options outside the paper's defaults (measured on the
side-by-side stream, docs/titans.md "Why it did not learn, by difference"): `read_as:
residual` adds h_i = W_H M*(q_i) to token i's row before the attention instead of
entering it as a context row (token i then need not find its own read among the L rows
by position); `update_input: input` writes the memory with the layer's input x instead of
y (with the read on the residual stream, y contains the read: the memory would be written
with itself); `output_gate: false` drops Eq. 25's gate (o = y); `read_init_std` sets
W_H's initial scale (at the stack's 0.02 the read is a few percent of a token's row and
every gradient into the memory is scaled by it).

`model.titans.variant` "mag" (memory as a gate, §4.2) and "mal" (as a layer, §4.3) use the
same memory and state: MAG attends over [p_l | x] and gates its output with the memory's
read of x, o = y ⊗ M*(x); MAL adds the memory's read W_H M*(x) to x (a residual branch: a
choice, the paper feeds M's output alone) and attends over [p_l | that]. In both the
memory is updated with the layer's input x, and each token reads the weights of its
chunk's start.

The state (NeuralMemoryState: every layer's MLP weights and momentum, float32) is NOT
detached here: gradients flow through the inner updates into earlier segments until the
caller detaches it, which sets the BPTT depth, as for RMT and ARMT.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...backbone import Learned, Lengths, RelativeBackbone
from ...config import ModelConfig
from ...positional import distance_list
from ...shapes import AttentionShape, LayerShape, SegmentShapes, TensorShape
from .neural_memory import NeuralMemory, NeuralMemoryState


def neural_memory(cfg: ModelConfig) -> NeuralMemory:
    """One layer's neural memory as `model.titans` configures it."""
    o = cfg.titans
    return NeuralMemory(cfg.d_model, o.d_mem, depth=o.memory_depth, hidden=o.memory_hidden,
                        chunk_size=o.chunk_size, max_lr=o.max_lr, max_momentum=o.max_momentum,
                        max_forget=o.max_forget, max_grad_norm=o.max_grad_norm,
                        conv_size=o.conv_size, lr_bias=o.lr_bias,
                        momentum_bias=o.momentum_bias, forget_bias=o.forget_bias,
                        surprise_at=o.surprise_at, residual_norm=o.memory_residual,
                        qk_norm=o.qk_norm,
                        compile_backend=cfg.compile_backend if o.compiled_chunks else None)


def segment_positions(n: int, d: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """[n, d]: each row's position in its segment as a sinusoid (sin | cos at d / 2
    frequencies from 1 down to 1/100), `model.titans.segment_positions`: the absolute
    position that titans-pytorch's MAC gives its inputs (an axial positional embedding over
    the segment) and this relative-position stack does not. Fixed, no parameters."""
    pos = torch.arange(n, dtype=torch.float32, device=device)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, device=device) * (-math.log(100.0) / d))
    return torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=-1)[:, :d].to(dtype)


def mac_allowed(n_persistent: int, n_tok: int, device) -> torch.Tensor:
    """bool [1, L, P + 2L]: token j (row) may see every persistent row, the retrieved row
    h_i for i <= j, and token i for i <= j (keys [p | h | tokens])."""
    causal = torch.ones(n_tok, n_tok, dtype=torch.bool, device=device).tril()
    persistent = torch.ones(n_tok, n_persistent, dtype=torch.bool, device=device)
    return torch.cat([persistent, causal, causal], dim=1)[None]


class MemoryGate(nn.Module):
    """Eq. 25's ⊗: o = y * 2 sigmoid(W_G r), r = M*(y) [B, n, d_mem]; W_G = 0 at init."""

    def __init__(self, d_mem: int, d_model: int):
        super().__init__()
        self.proj = nn.Linear(d_mem, d_model)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return y * (2 * torch.sigmoid(self.proj(r.to(y.dtype))))


def initial_state(cfg: ModelConfig, memories: nn.ModuleList, batch_size: int,
                  device=None) -> NeuralMemoryState:
    """Every row fresh: its first segment reads the learned initial weights M_0, S = 0, and
    the convolutions (if any) see zeros before it."""
    rows = max(cfg.titans.conv_size - 1, 0)
    return NeuralMemoryState.empty(batch_size, len(memories), memories[0].shapes, device,
                                   tails=(streams(cfg.titans.variant), rows, cfg.d_model))


def streams(variant: str) -> int:
    """The memory's input streams: the update's (and its reads'), and MAC's retrieval."""
    return 2 if variant == "mac" else 1


class TitansCore(RelativeBackbone):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        o = cfg.titans
        self.memory = nn.ModuleList(neural_memory(cfg) for _ in range(cfg.n_layer))
        # W_H: the retrieved values (d_mem) as rows of the model's width (MAC's context rows,
        # MAL's residual branch); MAG uses the read only through its gate, MAL has no gate.
        self.memory_out = (nn.ModuleList(nn.Linear(o.d_mem, cfg.d_model, bias=False)
                                         for _ in range(cfg.n_layer))
                           if o.variant != "mag" else None)
        if self.memory_out is not None:
            # N(0, read_init_std), default the stack's N(0, init_std) (`own_init`). Drawn from
            # a fork of the generator, so every other parameter draws what it drew when W_H
            # was the last weight of the stack's init.
            std = cfg.init_std if o.read_init_std is None else o.read_init_std
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                for w in self.memory_out:
                    w.weight.normal_(0.0, std)
        self.memory_gate = (nn.ModuleList(MemoryGate(o.d_mem, cfg.d_model)
                                          for _ in range(cfg.n_layer))
                            if o.variant != "mal" and o.output_gate else None)
        std = cfg.init_std * cfg.d_model ** 0.5        # a scaled token embedding's scale
        self.persistent = (Learned(torch.randn(cfg.n_layer, o.num_persistent, cfg.d_model) * std)
                           if o.num_persistent else None)

    @classmethod
    def segment_shapes(cls, cfg: ModelConfig, rows: int, mem_len: int) -> SegmentShapes:
        """L query rows per layer over K = P + 2L keys [persistent | retrieved | tokens]
        (one distance list, as XL's with a cache of P + L); P + L keys for MAG and MAL.
        Besides the layer, each layer saves the memory's reads (the query, every matrix's
        pre-activation and output, for the retrieval and Eq. 25's read) and its update's
        tensors (keys, values, gates, and per chunk the weights and momentum at its start,
        the MLP's inputs and errors), and with convolutions their inputs; the state is every
        layer's weights and momentum, float32, and the convolutions' tails."""
        o, n, d, n_layer = cfg.titans, cfg.tgt_len, cfg.d_model, cfg.n_layer
        k = o.num_persistent + (2 if o.variant == "mac" and o.read_as == "context" else 1) * n
        mem = neural_memory(cfg)
        widths = [s[1] for s in mem.shapes]
        chunks = -(-n // o.chunk_size)
        params = sum(i * j for i, j in mem.shapes)
        attn = AttentionShape(n, k, k, q_input=n, kv_input=k, mask_per_row=False)
        saved = (TensorShape((rows, n, d)),                              # h = W_H M*(q)
                 TensorShape((rows, n, o.d_mem), "fp32", count=6),       # q, q', k, v, r, r'
                 TensorShape((rows, n, sum(widths)), "fp32", count=4),   # reads: z, silu(z)
                 TensorShape((rows, n, sum(widths)), "fp32", count=2),   # update: a, delta
                 TensorShape((rows, n), "fp32", count=8),                # gates, coefficients
                 TensorShape((rows, params), "fp32", count=2 * chunks),  # M, S per chunk
                 TensorShape((rows, n, d)))                              # y (Eq. 25's gate)
        if o.conv_size:
            # per stream its rows after the tail (the projections' input), and each
            # convolution's input (q, k, v; MAC's retrieval q too)
            wide = n + o.conv_size - 1
            saved += (TensorShape((rows, wide, d), count=streams(o.variant)),
                      TensorShape((rows, wide, o.d_mem), count=2 + streams(o.variant)))
        state_read = (TensorShape((rows, params), "fp32", count=2),)
        layer = LayerShape((attn,), out_rows=n, input_rows=n, input_saved=True, saved=saved,
                           state_read=state_read)
        state = (TensorShape((rows, n_layer, params), "fp32", count=2),)
        text = (f"Titans M and S: {n_layer} layers x {len(mem.shapes)} matrices "
                f"{' + '.join(f'[{i}, {j}]' for i, j in mem.shapes)} per row, fp32, "
                f"[{rows}] rows")
        if o.conv_size:
            # the convolutions' tails: c - 1 rows per stream and layer
            state += (TensorShape((rows, n_layer, o.conv_size - 1, d),
                                  count=streams(o.variant)),)
            text += (f"; the convolutions' last {o.conv_size - 1} rows x "
                     f"{streams(o.variant)} streams")
        return SegmentShapes((layer,) * n_layer, distances=k, output_rows=n,
                             state=state, state_text=text,
                             saved_label="the neural memory's reads and update")

    def empty_state(self, batch_size: int, device=None) -> NeuralMemoryState:
        return initial_state(self.cfg, self.memory, batch_size, device)

    def forward(self, h0: torch.Tensor, state: NeuralMemoryState | None, lengths: Lengths):
        """h0 [B, L, d] -> (hidden [B, L, d], NeuralMemoryState after the segment)."""
        bsz, n_tok, _ = h0.shape
        if state is None:
            state = self.empty_state(bsz, h0.device)
        persistent = self.persistent() if self.persistent is not None else None
        n_p = persistent.shape[1] if persistent is not None else 0
        o = self.cfg.titans
        if o.segment_positions:   # the row's position in the segment, added to its input
            h0 = h0 + segment_positions(n_tok, h0.shape[-1], h0.dtype, h0.device)
        mac = o.variant == "mac"
        rows_read = mac and o.read_as == "context"
        # keys [p | h | x] (MAC, the read as context rows) or [p | x] (MAG, MAL, MAC with
        # the read on the residual stream)
        allowed = mac_allowed(n_p, n_tok, h0.device)
        if not rows_read:
            allowed = allowed[:, :, :n_p + n_tok]
        n_k = allowed.shape[-1]
        dist = distance_list(n_k - n_tok, n_tok, 0, n_k, n_dist=n_k, device=h0.device)
        r_emb = self.r_emb(dist, lengths, dtype=h0.dtype)

        x, new_w, new_s, new_t = h0, [], [], []
        bias = self.bias_tensors()
        for i, (layer, mem) in enumerate(zip(self.layers, self.memory, strict=True)):
            weights, momentum = state.layer(i, mem.initial_weights())
            tail = state.tail(0, i)           # the update stream's last rows (convolutions)
            rows = [] if persistent is None else [
                persistent[i].to(x.dtype)[None].expand(bsz, -1, -1)]
            u, v = self.biases(i, bias)
            if mac:
                x_tail = state.tail(1, i)
                h = self.memory_out[i](mem.retrieve(weights, x, x_tail).to(x.dtype))  # Eq. 21
                if rows_read:
                    context = torch.cat([*rows, h], dim=1)                        # Eq. 22
                    y = self.run_layer(layer, x, context, r_emb, u, v, allowed)     # Eq. 23
                else:   # `read_as: residual`: x_i + h_i, the context the persistent rows
                    context = torch.cat(rows, dim=1) if rows else None
                    y = self.run_layer(layer, x + h, context, r_emb, u, v, allowed)
                # Eq. 24: written with y (the paper) or the layer's input x (`update_input`)
                src = y if o.update_input == "output" else x
                gated = self.memory_gate is not None
                weights, momentum, r = mem.update(weights, momentum, src,
                                                  read=src if gated else None, tail=tail)
                new_t.append([mem.carry(tail, src), mem.carry(x_tail, x)])
                x = self.memory_gate[i](y, r) if gated else y                      # Eq. 25
            else:
                # MAG (§4.2): attention and the memory side by side on the layer's input,
                # combined by the gate. MAL (§4.3): the memory's read (a residual
                # branch, W_H) is the attention's input.
                weights, momentum, r = mem.update(weights, momentum, x, read=x, tail=tail)
                new_t.append([mem.carry(tail, x)])
                context = torch.cat(rows, dim=1) if rows else None
                if self.cfg.titans.variant == "mag":
                    y = self.run_layer(layer, x, context, r_emb, u, v, allowed)
                    x = self.memory_gate[i](y, r)
                else:
                    x = x + self.memory_out[i](r.to(x.dtype))
                    x = self.run_layer(layer, x, context, r_emb, u, v, allowed)
            new_w.append(weights)
            new_s.append(momentum)
        return self.drop(x), state.written(new_w, new_s, new_t)
