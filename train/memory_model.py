"""A memtrain model as a drop-in nn.Module for any trainer (a plain torch loop, HF Trainer,
accelerate, Lightning): one call takes a whole multi-segment sequence.

    from train.memory_model import MemoryModel
    model = MemoryModel.from_pretrained("runs/copy-rmt", bptt_depth=2,
                                        checkpoint_segments=True)
    out = model(input_ids, labels=input_ids)          # transformers' CausalLMOutput
    out.loss.backward()

The sequence is cut into segments of `segment_length` tokens (the trained `model.tgt_len`),
the memory starts fresh for every row and is threaded through the segments, and gradient
reaches `bptt_depth` segments back (None: all of them), cut exactly where `memtrain train`
cuts a task sample (train/bptt.py `episode_cuts`: windows aligned to the sequence's end).
The loss is memtrain's: the token-weighted mean NLL of every counted target. So one call
computes what one `memtrain train` micro-step on the same sample computes, gradients
included (tests/test_memory_model.py). Labels follow transformers: `labels` are the input
ids (the shift happens inside), -100 is not counted; `attention_mask` 0 marks right padding,
which is never counted (a padded token only precedes other padding, so nothing counted sees
it). The returned `logits` are the log-probabilities (normalised logits: the same softmax,
the same argmax); `memory` is the state after the last segment, for a caller that carries it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

from model.io import load_model
from model.segment_lm import SegmentLM

from .bptt import episode_cuts
from .segment_checkpoint import SegmentCheckpoint

IGNORE = -100   # transformers' label for "not counted"


@dataclass
class MemoryLMOutput(CausalLMOutput):
    memory: Any = None


class MemoryModel(nn.Module):
    def __init__(self, model: SegmentLM, *, segment_length: int | None = None,
                 bptt_depth: int | None = None, checkpoint_segments: bool = False,
                 recompute: str = "full"):
        super().__init__()
        self.model = model
        self.cfg = model.cfg
        self.segment_length = segment_length or model.cfg.tgt_len
        if self.segment_length <= 0:
            raise ValueError(f"segment_length must be > 0, got {segment_length}")
        if bptt_depth is not None and bptt_depth < 0:
            raise ValueError(f"bptt_depth must be >= 0 or None (all segments), got "
                             f"{bptt_depth}")
        self.bptt_depth, self.checkpoint_segments = bptt_depth, checkpoint_segments
        self.recompute = recompute
        self.checkpointed = SegmentCheckpoint(recompute)

    @classmethod
    def from_pretrained(cls, source: str | Path, checkpoint: str | None = None,
                        **kwargs) -> MemoryModel:
        """`source`: a memtrain model file (.safetensors, from `memtrain export` or `memtrain
        import`), a model directory `memtrain import` wrote, or a run directory (its latest
        complete checkpoint, or `checkpoint`, in fp32)."""
        source = Path(source)
        if source.is_dir() and (source / "model.safetensors").is_file() and not (
                source / "config.yaml").is_file():
            source = source / "model.safetensors"
        if source.suffix == ".safetensors":
            return cls(load_model(source), **kwargs)
        from .export import load_weights
        from .run_access import load_run_config, pick_checkpoint
        cfg = load_run_config(str(source), [])
        info = pick_checkpoint(cfg, checkpoint)
        if info is None:
            raise FileNotFoundError(f"no complete checkpoint in {source}")
        return cls(load_weights(info, cfg.model), **kwargs)

    def segments(self, n_tokens: int) -> list[slice]:
        length = self.segment_length
        return [slice(s, min(s + length, n_tokens)) for s in range(0, n_tokens, length)]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, memory=None,
                return_logits: bool = True, **unused) -> MemoryLMOutput:
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, length >= 1], got "
                             f"{tuple(input_ids.shape)}")
        targets = mask = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels {tuple(labels.shape)} must have the shape of "
                                 f"input_ids {tuple(input_ids.shape)}")
            # Position t predicts labels[t + 1]; the last position predicts nothing.
            pad = torch.full_like(labels[:, :1], IGNORE)
            targets = torch.cat([labels[:, 1:], pad], dim=1)
            mask = targets != IGNORE
            if attention_mask is not None:
                _check_right_padding(attention_mask)
                mask &= torch.cat([attention_mask[:, 1:], pad.new_zeros(pad.shape)], 1).bool()
            targets = targets.masked_fill(~mask, 0)
        n = input_ids.shape[1]
        # The segments memtrain cuts a sample of n tokens into: inputs 0 .. n-2 (the last
        # token is only a target). With logits asked for, the last token runs too, as a
        # segment of its own when the others are full (it carries no loss, so the cuts and
        # the gradients are those of the n-1 inputs).
        parts = self.segments(n - 1 if labels is not None and n > 1 else n)
        if labels is not None and return_logits and parts and parts[-1].stop < n:
            if parts[-1].stop - parts[-1].start < self.segment_length:
                parts[-1] = slice(parts[-1].start, n)
            else:
                parts.append(slice(parts[-1].stop, n))
            n_counted = len(self.segments(n - 1))
        else:
            n_counted = len(parts)
        # Gradient through at most bptt_depth segments back, aligned to the sample's end.
        cuts = (episode_cuts(n_counted, self.bptt_depth) if self.bptt_depth is not None
                and self.training else frozenset())
        n_ckpt = len(parts) if self.checkpoint_segments and self.training else 0
        state, logits, nll, counted = memory, [], None, None
        for i, part in enumerate(parts):
            if state is not None and i in cuts:
                state = state.detach()
            out = self.model(input_ids[:, part], state,
                             targets=None if targets is None else targets[:, part],
                             loss_mask=None if mask is None else mask[:, part],
                             return_log_probs=return_logits,
                             run_decode=self.checkpointed if i < n_ckpt else None)
            state = out.state
            if return_logits:
                logits.append(out.log_probs)
            if targets is not None and i < n_counted:
                nll = out.nll.sum() if nll is None else nll + out.nll.sum()
                counted = out.n_tokens if counted is None else counted + out.n_tokens
        loss = None if nll is None else nll / counted.clamp(min=1)
        return MemoryLMOutput(loss=loss, logits=torch.cat(logits, 1) if logits else None,
                              memory=state)


def _check_right_padding(attention_mask: torch.Tensor) -> None:
    """Padding must close a row: a padded position inside the text would be read by the
    tokens after it (and by the memory)."""
    keep = attention_mask.bool()
    if (keep[:, 1:] & ~keep[:, :-1]).any():
        raise ValueError("attention_mask: padding must be on the right (a 0 followed by a 1 "
                         "in a row); pad on the right or drop the padding")
