"""Sampling with the memory carried from segment to segment.

The stream is processed exactly as in training and evaluation: the memory advances only at
segment boundaries (every `seg_len` tokens). Inside the open segment, each new token's
distribution is that of the open segment's last position read on the committed memory
(the model's `open_segment`, model/open_segment.py: the native stack re-runs the open
segment, a pretrained backbone extends a KV cache of it by the new token); once the segment
is full it is committed and its new state becomes the memory. So the text a model generates
conditions on the same context it would see when scoring that text.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .memory import MemoryState
from .open_segment import open_segment


def filter_logits(log_probs: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> torch.Tensor:
    """[B, V] log-probabilities -> logits for sampling with temperature, top-k and nucleus
    (top-p, Holtzman et al. 2020) filtering; removed entries become -inf."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = log_probs.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(log_probs: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, V] log-probabilities -> [B, 1] ids drawn after `filter_logits`. top_k = 1 is
    greedy: the most likely id, taken without a draw unless several ids tie for it (then
    one of those is drawn, as the filtered distribution says); a draw over the whole
    vocabulary costs more than the rest of a small model's step."""
    if top_k == 1:
        best = log_probs.argmax(-1, keepdim=True)
        if not bool(((log_probs == log_probs.gather(-1, best)).sum(-1) > 1).any()):
            return best
    logits = filter_logits(log_probs, temperature, top_k, top_p)
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


@torch.no_grad()
def stream_generate(model, prompt: torch.Tensor, max_new_tokens: int, *,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    seg_len: int | None = None, state: MemoryState | None = None,
                    generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
    """Yield sampled tokens [B] one at a time after reading prompt [B, T] (T >= 1)."""
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be [batch, length >= 1], got {tuple(prompt.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if max_new_tokens <= 0:
        return
    seg_len = seg_len or model.cfg.tgt_len
    bsz = prompt.shape[0]
    state = state if state is not None else model.initial_state(bsz, prompt.device)
    # Commit whole segments of the prompt; keep the remainder (>= 1 token) open.
    n_full = (prompt.shape[1] - 1) // seg_len
    for s in range(n_full):
        seg = open_segment(model, state)
        seg.read(prompt[:, s * seg_len:(s + 1) * seg_len])
        state = seg.commit().detach()
    seg = open_segment(model, state)
    log_probs = seg.predict(prompt[:, n_full * seg_len:])
    n_open = prompt.shape[1] - n_full * seg_len
    for i in range(max_new_tokens):
        nxt = sample(log_probs, temperature, top_k, top_p, generator)
        yield nxt[:, 0]
        if i + 1 == max_new_tokens:
            return
        if n_open == seg_len:   # the segment is full: commit it; the new token opens the next
            seg, n_open = open_segment(model, seg.commit().detach()), 0
        log_probs = seg.predict(nxt)
        n_open += 1


def generate(model, prompt: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """prompt [B, T] -> [B, T + max_new_tokens] (prompt followed by the samples)."""
    new = list(stream_generate(model, prompt, max_new_tokens, **kwargs))
    if not new:
        return prompt
    return torch.cat([prompt, torch.stack(new, dim=1)], dim=1)
