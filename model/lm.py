"""MemoryLM: embeddings, one memory mechanism, and the (adaptive) softmax.

    out = model(tokens, state, targets=..., loss_mask=...)
    out.loss, out.nll, out.state          # carry out.state into the next segment

It is a `SegmentLM` (model/segment_lm.py), what the engine sees of any model, this one or
a pretrained backbone (model/pretrained/). It is mechanism-agnostic above the backbone: the
registered mechanism (model/mechanisms/) names the core that runs it and its auxiliary loss;
it takes (tokens, state) and returns (loss/logits, new state), so training, checkpointing
and evaluation never branch on the mechanism.
"""

from __future__ import annotations

import math

from torch import nn

from .adaptive import AdaptiveEmbedding, AdaptiveSoftmax, tie_embeddings
from .backbone import RelativeBackbone
from .config import ModelConfig
from .fused_loss import fused_rows, softmax_head
from .loss import chunk_rows, segment_nll
from .memory import MemoryState
from .segment_lm import LMOutput, SegmentLM, add_lm_loss


def core_class(cfg: ModelConfig) -> type[RelativeBackbone]:
    """The class that runs `cfg.mechanism` on the native stack, as its mechanism module
    (model/mechanisms/) names it; its `segment_shapes` states a segment's shapes
    (model/shapes.py)."""
    return cfg.mech.core_class(cfg)


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
        """XL code init: N(0, init_std) weights, zero biases, LayerNorm gain N(1, init_std);
        the parameters the mechanism initialises itself (`Mechanism.own_init`) are left."""
        own = self.cfg.mech.own_init
        for name, p in self.core.named_parameters():
            if own and name.startswith(own):
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
        hidden, new_state = self.decode(tokens, state)
        return self.softmax(hidden[:, -1]), new_state

    def decode(self, tokens, state):
        # Embeddings are scaled by sqrt(d_model) inside AdaptiveEmbedding (XL code).
        return self.core(self.drop(self.embedding(tokens)), state, self.lengths)

    def score(self, hidden, state, targets, loss_mask, return_log_probs) -> LMOutput:
        out = LMOutput(state=state)
        if return_log_probs:
            out.log_probs = self.softmax(hidden.reshape(-1, hidden.shape[-1])
                                         ).view(*hidden.shape[:2], -1)
        if targets is None:
            return out
        # The softmax module is called per chunk, so a sharding wrapper's hooks gather its
        # weights at the chunk's re-run in backward too; its clusters route from host targets.
        # `model.loss_backend`: on CUDA a fused library where the softmax is one linear head.
        fused = fused_rows(self.cfg.loss_backend, softmax_head(self.softmax), hidden)
        nll = segment_nll(self.softmax, hidden, targets, loss_mask,
                          chunk_rows(self.softmax.head_width), fused)
        add_lm_loss(out, nll, loss_mask)
        # The mechanism's weighted auxiliary loss (RMT §3.4), apart from the LM loss: the
        # training step adds it for backward (train/bptt.py).
        out.aux_loss = self.cfg.mech.aux_loss(self.cfg, self.softmax, state)
        return out


def bits_per_token(nll_nats: float) -> float:
    return nll_nats / math.log(2)
