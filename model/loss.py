"""The language-model loss without the logits tensor.

A segment of B x L tokens over a vocabulary of V makes [B*L, V] logits; the plain loss keeps
three float32 tensors of that size alive (the up-cast logits, the log-softmax saved for
backward, and its gradient): at GPT-2's V = 50,257 and 32 x 1,024 tokens, 6.6 GB each, more
than half of a training step's peak. Here the head and the cross-entropy run over chunks of
rows, each chunk under non-reentrant activation checkpointing: its forward keeps only its
input rows, and backward recomputes that chunk's logits, so at most one chunk's [rows, V]
float32 buffers exist at any time. The numerics per row are the plain path's: the head in the
model's dtype, the log-softmax in float32 (or wider), the same backward; only the sum of the
head's weight gradient over chunks is accumulated in another order.

Only supervised rows reach the head: where a loss mask is given (episodic tasks and BABILong
supervise the answer only), the rows are selected before the head, from the host copy of the
mask when the caller passes one, so choosing them never makes the host wait for a device.

The head is called as a function of (hidden rows, target rows), so it runs through the
modules themselves: hooks of a sharding wrapper gather their parameters at the re-run too.

On CUDA a fused library's head + cross-entropy may take the chunks' place (`segment_nll`'s
`fused`, chosen by `model.loss_backend` in model/fused_loss.py); this module stays PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Rows per chunk are chosen so that one chunk's float32 logits hold about this many elements
# (2**25 elements = 128 MiB): at V = 50,257, 667 rows, a head GEMM of 667 x 768 x 50,257 that
# still fills a GPU, with each of the chunk's float32 [rows, V] buffers at 128 MiB.
CHUNK_ELEMENTS = 2**25

RowsNLL = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def chunk_rows(vocab_size: int) -> int:
    """Rows per chunk for a head over `vocab_size` outputs (CHUNK_ELEMENTS, read at the
    call, so a test can make chunks small)."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
    return max(1, CHUNK_ELEMENTS // vocab_size)


def logits_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [N, V] in any dtype, targets [N] -> per-row NLL [N], the log-softmax in float32
    or wider whatever the model's dtype (bf16 logits lose the NLL's low bits)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets.to(logits.device, non_blocking=True),
                           reduction="none")


def chunked_nll(rows_nll: RowsNLL, hidden: torch.Tensor, targets: torch.Tensor,
                rows: int) -> torch.Tensor:
    """hidden [N, d], targets [N] (on any device) -> NLL [N]: `rows_nll` (hidden rows,
    target rows -> their NLL) over chunks of `rows` rows. With gradients, each chunk runs
    under non-reentrant checkpointing (one backward per step, as ZeRO-2/3 require): it keeps
    its inputs and recomputes in backward. The head draws no random numbers, so the RNG state
    is not saved; the recomputed metadata is not compared, because a sharding wrapper may
    hold a frozen head's weight released between the forward and its re-run
    (model/segment_lm.py says when)."""
    n = hidden.shape[0]
    grad = torch.is_grad_enabled()
    parts = []
    for start in range(0, max(n, 1), rows):  # no rows: one empty chunk, zero gradients
        h, t = hidden[start:start + rows], targets[start:start + rows]
        if grad:
            parts.append(checkpoint(rows_nll, h, t, use_reentrant=False,
                                    preserve_rng_state=False, determinism_check="none"))
        else:
            parts.append(rows_nll(h, t))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def padded_head(head: torch.nn.Module, multiple: int):
    """(weight, bias) of a linear `head` [V, d] padded with zero rows to a multiple of
    `multiple`, for a head GEMM over aligned tiles; None where padding does not apply (off,
    V already a multiple, or the head not a plain materialised nn.Linear: a LoRA-wrapped
    head, a ZeRO-3 shard). Made once per segment (a [V, d] copy, small beside the GEMMs
    over every chunk); the logits of the padding are cut off before the softmax
    (`cut_logits`), so the loss and every gradient of the real rows are the unpadded ones."""
    if multiple <= 0 or type(head) is not torch.nn.Linear:
        return None
    weight = head.weight
    vocab = head.out_features
    pad = -vocab % multiple
    if pad == 0 or weight.is_meta or weight.numel() != vocab * head.in_features:
        return None
    bias = None if head.bias is None else F.pad(head.bias, (0, pad))
    return F.pad(weight, (0, 0, 0, pad)), bias


class _PaddedHead(torch.autograd.Function):
    """hidden [N, d] @ padded weight [V', d]^T, the first `vocab` columns. The forward GEMM
    runs over the padded rows (aligned tiles); backward reads only the real rows, so the
    gradients are the unpadded head's whatever order a BLAS sums a longer reduction in."""

    @staticmethod
    def forward(ctx, hidden, weight, vocab):
        ctx.save_for_backward(hidden, weight)
        ctx.vocab = vocab
        return F.linear(hidden, weight)[..., :vocab]

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        vocab, pad = ctx.vocab, weight.shape[0] - ctx.vocab
        grad = grad.contiguous()
        grad_hidden = grad @ weight[:vocab]
        grad_weight = F.pad(grad.reshape(-1, vocab).T @ hidden.reshape(-1, hidden.shape[-1]),
                            (0, 0, 0, pad))
        return grad_hidden, grad_weight, None


def cut_logits(hidden: torch.Tensor, padded: tuple, vocab: int) -> torch.Tensor:
    """The head's logits [N, vocab] through the padded GEMM [N, V'] (`padded_head`)."""
    weight, bias = padded
    logits = _PaddedHead.apply(hidden, weight, vocab)
    return logits if bias is None else logits + bias[:vocab]


class SupervisedRows:
    """The flat positions where a loss mask [B, L] holds, on the host (numpy, from a host
    mask) and on the device the hidden states live on. From a host mask the device copy does
    not block; from a device mask, `nonzero` makes the host wait once (callers outside the
    training step, which hands the host copy over: train/bptt.py)."""

    def __init__(self, loss_mask: torch.Tensor, device: torch.device):
        flat = loss_mask.detach().reshape(-1)
        if flat.device.type == "cpu":
            self.host = torch.from_numpy(np.flatnonzero(flat.numpy()))
            self.device = self.host.to(device, non_blocking=True)
        else:
            self.device = flat.nonzero().squeeze(1)
            self.host = None

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, ...] -> its supervised rows, read where x lives."""
        if x.device.type == "cpu" and self.host is not None:
            return x.index_select(0, self.host)
        return x.index_select(0, self.device.to(x.device, non_blocking=True))


def segment_nll(rows_nll: RowsNLL, hidden: torch.Tensor, targets: torch.Tensor,
                loss_mask: torch.Tensor | None, rows: int,
                fused: RowsNLL | None = None) -> torch.Tensor:
    """hidden [B, L, d], targets [B, L] (host or device), loss_mask [B, L] bool or None ->
    NLL [B, L], 0 where the mask is False: the head reads only supervised rows, in chunks
    (`chunked_nll`), or, where `fused` is given, all of them in one call of it (a fused
    library's head + cross-entropy, model/fused_loss.py: the same float32 NLL per row). No
    supervised rows always take the chunks, which give every head parameter a zero
    gradient."""
    bsz, seg = targets.shape
    flat_h = hidden.reshape(bsz * seg, hidden.shape[-1])
    flat_t = targets.reshape(-1)

    def nll_of(h, t):
        if fused is not None and h.shape[0]:
            return fused(h, t)
        return chunked_nll(rows_nll, h, t, rows)

    if loss_mask is None:
        return nll_of(flat_h, flat_t).view(bsz, seg)
    picked = SupervisedRows(loss_mask, flat_h.device)
    nll = nll_of(picked.take(flat_h), picked.take(flat_t))
    full = nll.new_zeros(bsz * seg)
    return full.index_copy(0, picked.device, nll).view(bsz, seg)
