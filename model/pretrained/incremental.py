"""The open segment of a generation with a pretrained backbone, read through a KV cache.

Generation (model/generate.py, protocol in model/open_segment.py) predicts each new token
from the last position of the open segment read on the committed memory. In a segment of
`PretrainedMemoryLM` (wrapper.py) a token row sees only the rows before it, never a row
after it:

- RMT, [read | tokens | write]: in both `model.rmt.pattern`s (positions.py) a token row
  reads the read block and the earlier tokens, never the write block; the read block reads
  only itself (bidirectionally for "paper", causally for "causal"). Positions: read block
  0 .. m-1, token i at m + i, in both patterns.
- ARMT, [tokens | memory]: the token rows come first under the causal mask, at positions
  0 .. L-1, and each layer's input gets the associative read of the COMMITTED state, which
  is fixed for the whole segment (model/mechanisms/armt/pretrained.py); the writes come from the
  memory rows, which do not exist until the segment is committed.

So the rows of a prefix of the segment are what the full segment's forward computes for
them: the read block is run once (RMT), and every later call runs only the new tokens
against the base model's own KV cache of the rows before them (a transformers DynamicCache),
at the positions above, computing the logits of the last position only (`lm_logits`, the
head and the architecture's post-processing, as in training). Per token this costs one row
through the decoder instead of the whole open segment, and [B, V] logits instead of
[B, L, V] log-probs.

The memory is committed exactly as in training: `commit` runs the wrapper's `decode`, the
forward's own segment pass, over the segment's tokens on the committed state (no head), so
the state after a generated segment is the state the ordinary forward gives for the same
text. The cached rows differ from the forward's only by the kernels' summation order
(tests/test_generate_cached.py: log-probs to 1e-5, the same greedy tokens).
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache

from ..memory import MemoryState
from .logits import lm_logits


def _cache_keyword(decoder) -> str:
    """The name the decoder's forward takes its KV cache by: `cache` since transformers
    renamed it (5.x keeps `past_key_values` as a deprecated alias), `past_key_values`
    before."""
    params = inspect.signature(decoder.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class CachedSegment:
    """`PretrainedMemoryLM`'s open segment (module docstring). `read` only records tokens;
    `predict` brings the KV cache up to every token read and returns the next token's
    log-probabilities [B, V] (float32); `commit` returns the memory after the tokens."""

    def __init__(self, model, state: MemoryState, offset: int = 0, read_block=None,
                 reads=None):
        """The mechanism (model/mechanisms/) says where its token rows sit: `offset` rows
        before them (RMT's read block; ARMT's tokens come first), `read_block(bsz, dtype)`
        -> (those rows' inputs, their mask or None), and `reads(n_tok)`, a context around
        each decoder call over token rows (ARMT's associative reads of the committed
        state)."""
        self.model, self.state = model, state
        self.decoder = model.base.base_model
        self.cache_keyword = _cache_keyword(self.decoder)
        self.offset, self.read_block, self.reads = offset, read_block, reads
        self.tokens: torch.Tensor | None = None
        self.n_cached = 0          # tokens whose rows are in the cache
        self.cache = None          # the decoder's KV cache, made by its first call

    def read(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens if self.tokens is None else torch.cat([self.tokens, tokens], 1)

    def predict(self, tokens: torch.Tensor) -> torch.Tensor:
        self.read(tokens)
        if self.cache is None and self.read_block is not None:
            self._read_block()
        new = self.tokens[:, self.n_cached:]
        hidden = self._run(self.model.base.get_input_embeddings()(new),
                           self.offset + self.n_cached)
        self.n_cached = self.tokens.shape[1]
        return torch.log_softmax(lm_logits(self.model.base, hidden[:, -1]).float(), dim=-1)

    def commit(self) -> MemoryState:
        if self.tokens is None:
            raise RuntimeError("commit of an open segment that has read no tokens")
        return self.model.decode(self.tokens, self.state)[1]

    # -- the decoder calls -----------------------------------------------------------------
    def _call(self, x: torch.Tensor, start: int, mask: torch.Tensor | None) -> torch.Tensor:
        """Rows x [B, n, d] at positions start .. start+n-1 after the cached rows; the
        decoder's last hidden states [B, n, d] (after its final norm)."""
        bsz, n, _ = x.shape
        positions = torch.arange(start, start + n, device=x.device)[None].expand(bsz, -1)
        kwargs = {} if self.cache is None else {self.cache_keyword: self.cache}
        out = self.decoder(inputs_embeds=x, attention_mask=mask, position_ids=positions,
                           use_cache=True, **kwargs)
        if len(out) < 2 or not isinstance(out[1], Cache):
            raise RuntimeError(f"{type(self.decoder).__name__} returned no KV cache")
        self.cache = out[1]
        return out[0]

    def _read_block(self) -> None:
        """The rows before the tokens (RMT's m read rows at positions 0 .. m-1, with the
        read block's own mask for the pattern)."""
        dtype = self.model.base.get_input_embeddings().weight.dtype
        x, mask = self.read_block(self.tokens.shape[0], dtype)
        self._call(x, 0, mask)

    def _run(self, emb: torch.Tensor, start: int) -> torch.Tensor:
        """Token rows after every cached row, under the base model's own causal mask over
        cached + new rows (no mask given: their positions are contiguous, so transformers
        finds no packed-sequence split in them, positions.py)."""
        if self.reads is None:
            return self._call(emb, start, None)
        with self.reads(emb.shape[1]):
            return self._call(emb, start, None)
