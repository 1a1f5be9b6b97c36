"""MemoryLM: embeddings, one memory mechanism, and the (adaptive) softmax.

`SegmentLM` is what the engine sees of any model, this one or a pretrained backbone with
memory tokens (model/pretrained/):

    out = model(tokens, state, targets=..., loss_mask=...)
    out.loss, out.nll, out.state          # carry out.state into the next segment

The model is mechanism-agnostic above the backbone: it takes (tokens, state) and returns
(loss/logits, new state), so training, checkpointing and evaluation never branch on the
mechanism.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .adaptive import AdaptiveEmbedding, AdaptiveSoftmax, tie_embeddings
from .backbone import Lengths, RelativeBackbone
from .config import ModelConfig
from .lamemo import LaMemo
from .memory import MemoryState
from .recompute import context_fn
from .rmt import RMT
from .transformer_xl import TransformerXL

# The mechanism registry: `ModelConfig.mechanism` -> its class (see `core_class`).
_CORES = {"xl": TransformerXL, "lamemo": LaMemo, "rmt": RMT}


def core_class(cfg: ModelConfig) -> type[RelativeBackbone]:
    """The class that runs `cfg.mechanism`; its `segment_shapes` states a segment's shapes
    (model/shapes.py)."""
    if cfg.mechanism == "lamemo" and not cfg.lamemo.look_ahead:
        # LaMemo Table 3 "w/o look-ahead": only C→, which is exactly Transformer-XL.
        return TransformerXL
    return _CORES[cfg.mechanism]


@dataclass
class LMOutput:
    state: MemoryState
    # Per-token negative log-likelihood [B, L] in nats, 0 where loss_mask is False.
    nll: torch.Tensor | None = None
    # Number of tokens counted in `nll` (sum of loss_mask), for exact per-token means.
    n_tokens: torch.Tensor | None = None
    # Mean NLL over counted tokens, plus the weighted auxiliary loss if any: what to minimise.
    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    # Log-probabilities [B, L, V], only when asked for (costly with a 267k vocabulary).
    log_probs: torch.Tensor | None = None


class SegmentLM(nn.Module):
    """What every model the engine trains shares: (tokens, memory) -> LMOutput, run-time
    lengths, and segment checkpointing. Subclasses build their layers and `_forward`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.lengths = Lengths.from_config(cfg)

    def initial_state(self, batch_size: int, device=None) -> MemoryState:
        raise NotImplementedError

    def set_lengths(self, mem_len: int | None = None, clamp_len: int | None = None,
                    same_length: bool | None = None) -> None:
        """Change the evaluation memory settings (segment length is the input's length)."""
        lengths = Lengths(self.lengths.mem_len if mem_len is None else mem_len,
                          self.lengths.clamp_len if clamp_len is None else clamp_len,
                          self.lengths.same_length if same_length is None else same_length)
        self.cfg.check_lengths(lengths.mem_len, lengths.clamp_len, lengths.same_length)
        self.lengths = lengths

    @contextmanager
    def using_lengths(self, mem_len: int | None = None, clamp_len: int | None = None,
                      same_length: bool | None = None) -> Iterator[Lengths]:
        """`set_lengths` for the body of a with-block; the previous lengths come back after
        it, also on an error (evaluation protocols, RECL, the speed comparison)."""
        saved = self.lengths
        self.set_lengths(mem_len, clamp_len, same_length)
        try:
            yield self.lengths
        finally:
            self.lengths = saved

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor, state: MemoryState | None = None,
                targets: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                return_log_probs: bool = False, checkpoint_segment: bool = False,
                recompute: str = "full") -> LMOutput:
        """tokens [B, L] -> LMOutput. targets [B, L] are the next tokens, on the device or
        on the host (the training step passes the host copy: the adaptive softmax routes its
        clusters there without a device sync); loss_mask [B, L] (bool) limits the loss to
        some positions (e.g. a task's answer).

        checkpoint_segment: keep none of this segment's activations for backward, only its
        inputs (tokens and the incoming memory), and recompute the segment during backward.
        Across a BPTT window this leaves only the memory passed between segments alive, so
        peak memory hardly grows with the depth k. Non-reentrant checkpointing: one backward
        per step (what ZeRO-2/3 require); the RNG state is restored so dropout recomputes
        identically.

        recompute: what a checkpointed segment keeps besides its inputs, so that its re-run
        skips those ops ("full": nothing; "save-masks", "save-ffn-out", "save-linear",
        "save-matmul" and "save-masks+..." in model/recompute.py). Every policy is exact.
        Ignored without checkpoint_segment."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tuple(tokens.shape)}")
        if state is not None and state.batch_size != tokens.shape[0]:
            raise ValueError(f"memory state has {state.batch_size} rows but tokens have "
                             f"{tokens.shape[0]}")
        if checkpoint_segment and torch.is_grad_enabled():
            ctx = context_fn(recompute, self.cfg.d_inner)
            extra = {} if ctx is None else {"context_fn": ctx}
            return checkpoint(self._forward, tokens, state, targets, loss_mask,
                              return_log_probs, use_reentrant=False, **extra)
        return self._forward(tokens, state, targets, loss_mask, return_log_probs)

    def _forward(self, tokens, state, targets, loss_mask, return_log_probs) -> LMOutput:
        raise NotImplementedError


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


def build_model(cfg: ModelConfig | dict, **pretrained) -> SegmentLM:
    """Build a model from a ModelConfig or a plain dict (validated either way): the native
    stack, or a pretrained backbone with memory tokens (`backbone: hf`; `pretrained` are
    `PretrainedMemoryLM`'s keyword arguments, e.g. an already loaded base model)."""
    if isinstance(cfg, dict):
        cfg = ModelConfig.from_dict(cfg)
    if cfg.backbone == "hf":
        from .pretrained import PretrainedMemoryLM
        return PretrainedMemoryLM(cfg, **pretrained)
    return MemoryLM(cfg)


def bits_per_token(nll_nats: float) -> float:
    return nll_nats / math.log(2)
