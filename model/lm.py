"""MemoryLM: embeddings, one memory mechanism, and the (adaptive) softmax.

    out = model(tokens, state, targets=..., loss_mask=...)
    out.loss, out.nll, out.state          # carry out.state into the next segment

It is a `SegmentLM` (model/segment_lm.py), what the engine sees of any model, this one or
a pretrained backbone with memory tokens (model/pretrained/). It is mechanism-agnostic
above the backbone: it takes (tokens, state) and returns
(loss/logits, new state), so training, checkpointing and evaluation never branch on the
mechanism.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .adaptive import AdaptiveEmbedding, AdaptiveSoftmax, tie_embeddings
from .armt import ARMT
from .backbone import RelativeBackbone
from .config import ModelConfig
from .lamemo import LaMemo
from .memory import MemoryState
from .rmt import RMT
from .segment_lm import LMOutput, SegmentLM
from .transformer_xl import TransformerXL

# The mechanism registry: `ModelConfig.mechanism` -> its class (see `core_class`).
_CORES = {"xl": TransformerXL, "lamemo": LaMemo, "rmt": RMT, "armt": ARMT}


def core_class(cfg: ModelConfig) -> type[RelativeBackbone]:
    """The class that runs `cfg.mechanism`; its `segment_shapes` states a segment's shapes
    (model/shapes.py)."""
    if cfg.mechanism == "lamemo" and not cfg.lamemo.look_ahead:
        # LaMemo Table 3 "w/o look-ahead": only C→, which is exactly Transformer-XL.
        return TransformerXL
    return _CORES[cfg.mechanism]


class MemoryLM(SegmentLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        d = cfg.d_model
        self.embedding = AdaptiveEmbedding(cfg.vocab_size, d, d, list(cfg.cutoffs),
                                           cfg.div_val, cfg.init_std, cfg.proj_init_std)
        self.softmax = AdaptiveSoftmax(cfg.vocab_size, d, d, list(cfg.cutoffs), cfg.div_val,
                                       cfg.init_std, cfg.proj_init_std)
        tie_embeddings(self.embedding, self.softmax, cfg.tie_weight, list(cfg.tie_projs))
        self.drop = nn.Dropout(cfg.dropout)
        self.core = core_class(cfg)(cfg)
        self._init_backbone()

    def _init_backbone(self) -> None:
        """XL code init: N(0, init_std) weights, zero biases, LayerNorm gain N(1, init_std)."""
        for name, p in self.core.named_parameters():
            if "memory_init" in name or "memory_layer_norm" in name:  # the RMT sets them
                continue
            if name.startswith("associative."):
                # ARMT's blocks keep the authors' init: nn.Linear's default for W_q, W_k and
                # the gate, W_v = 0 (model/associative.py). N(0, init_std) keys would make
                # phi(k)^T z of the order of the denominators' eps.
                continue
            if "layer_norm" in name:
                if name.endswith("weight"):
                    nn.init.normal_(p, 1.0, self.cfg.init_std)
                else:
                    nn.init.zeros_(p)
            elif name.endswith("bias") and p.dim() == 1:
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, self.cfg.init_std)

    def initial_state(self, batch_size: int, device=None) -> MemoryState:
        return self.core.empty_state(batch_size, device)

    def next_token_log_probs(self, tokens, state):
        """Only the last position through the (adaptive) softmax: the open segment of a
        generation is re-run per token, and [B, L, V] log-probs would be its largest cost."""
        hidden, new_state = self.core(self.drop(self.embedding(tokens)), state, self.lengths)
        return self.softmax(hidden[:, -1]), new_state

    def _forward(self, tokens, state, targets, loss_mask, return_log_probs) -> LMOutput:
        # Embeddings are scaled by sqrt(d_model) inside AdaptiveEmbedding (XL code).
        h0 = self.drop(self.embedding(tokens))
        hidden, new_state = self.core(h0, state, self.lengths)
        out = LMOutput(state=new_state)
        bsz, seg = tokens.shape
        flat = hidden.reshape(bsz * seg, -1)
        if return_log_probs:
            out.log_probs = self.softmax(flat).view(bsz, seg, -1)
        if targets is None:
            return out
        nll = self.softmax(flat, targets.reshape(-1)).view(bsz, seg)
        if loss_mask is None:
            loss_mask = torch.ones_like(nll, dtype=torch.bool)
        nll = nll * loss_mask
        out.nll = nll
        out.n_tokens = loss_mask.sum()
        out.loss = nll.sum() / out.n_tokens.clamp(min=1)
        opts = self.cfg.rmt
        if self.cfg.mechanism == "rmt" and opts.mem_loss_weight > 0:
            # RMT §3.4: each write output predicts a fixed reserved token, weight 0.01 in
            # the paper; which outputs are predicted is unspecified (our choice: every write row).
            write = new_state.tokens.reshape(-1, hidden.shape[-1])
            # On the host: the adaptive softmax routes host targets without a device sync.
            target = torch.full((write.shape[0],), opts.mem_loss_token)
            out.aux_loss = self.softmax(write, target).mean()
            out.loss = out.loss + opts.mem_loss_weight * out.aux_loss
        return out


def bits_per_token(nll_nats: float) -> float:
    return nll_nats / math.log(2)
