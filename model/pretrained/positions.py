"""Where the memory tokens sit in a pretrained model: positions and attention pattern.

Order in the sequence, as RMT places them (Bulatov et al. 2022, §3): [read | tokens | write],
m + L + m rows. Position ids (one rule for every supported architecture):

    read   0 .. m-1
    tokens m .. m+L-1
    write  m+T .. m+T+m-1,   T = max(L, tgt_len)

so the write tokens' positions do not move when a segment is shorter than the trained
length (the last segment of a sample, an evaluation at a shorter length): with learned
absolute positions (GPT-2) the write rows always get the same position embeddings, and with
rotary positions (Llama, Qwen, Mistral, SmolLM) they sit after the text at the distances a
causal LM reads its recent context at. The read tokens are always at 0 .. m-1, the tokens
keep the positions a pretrained model saw (0-based after the memory). The authors' code
gives the memory default positions 0 .. 2m+L-1, which moves the write block with L.

Attention pattern, `model.rmt.pattern`:
- "paper": the native RMT table (model/mechanisms/rmt/core.py `rmt_allowed`, written out in
  tests/test_rmt.py): every row reads the read block; tokens are causal among themselves;
  the write rows see the read block, every token and the whole write block. Positions by
  the rule above.
- "causal": the RMT authors' Hugging Face wrapper (MemoryCell): the base model's own causal
  mask over the whole [read | tokens | write] row, at its default positions 0 .. 2m+L-1
  (so a read row sees only the read rows before it, and the write block moves with L).
  The decoder gets no mask and plain positions: exactly the base model's forward on
  `inputs_embeds = [mem; E(x); mem]`.

ARMT (Rodkin et al. 2024; model/mechanisms/armt/core.py) has no read block: [tokens | memory], L + m
rows, under the base model's own causal mask (the memory rows, last, see every token), with

    tokens 0 .. L-1
    memory T .. T+m-1,       T = max(L, tgt_len)

the same rule for the write block (`model.armt.memory_positions: fixed`; "follow" puts
the memory at L .. L+m-1 and "table_end" in the last m rows of a learned position table,
the two placements of the ARMT authors' code). When L < tgt_len the positions jump from L-1 to T;
transformers reads such a jump in position ids given WITHOUT an attention mask as the start
of another packed sequence and would cut the memory off from the tokens
(masking_utils `find_packed_sequence_indices`). An all-ones 2-D padding mask avoids that,
but costs a host sync per forward: transformers decides whether SDPA may run with
`is_causal` instead of a mask by reading the mask's values (masking_utils
`_ignore_causal_mask_sdpa`), and with no mask it reads the position ids (a sync too).
`causal_attention` gives the base model its plain causal attention with neither read
(docs/armt-costs.md, "Host syncs"): for SDPA the same kernel call with `is_causal` that the
all-ones mask leads to, for the eager kernel the additive causal mask transformers would
build from it, given as a 4-D mask that it uses as is. ARMT, Titans and RMT's "causal"
pattern run the base model under it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..mechanisms.rmt.core import rmt_allowed
from .traits import refuse_sequence_positions, traits_of


def check_accepts_positions(decoder) -> None:
    """Refuse a decoder whose forward takes no position ids (Bloom: ALiBi biases built from
    the padding mask; recurrent models: the row order itself), naming the property."""
    if "position_ids" not in inspect.signature(decoder.forward).parameters:
        raise refuse_sequence_positions(
            decoder.config.model_type,
            f"{type(decoder).__name__}.forward takes no position_ids")


def memory_position_ids(m: int, n_tok: int, tgt_len: int, device=None,
                        pattern: str = "paper") -> torch.Tensor:
    """Position ids [1, 2m + L] of [read | tokens | write] (the module docstring's rule for
    `pattern`)."""
    t = max(n_tok, tgt_len) if pattern == "paper" else n_tok
    return torch.cat([torch.arange(0, m + n_tok, device=device),
                      torch.arange(m + t, 2 * m + t, device=device)])[None]


def armt_position_ids(m: int, n_tok: int, tgt_len: int, device=None, placement: str = "fixed",
                      table: int = 0) -> torch.Tensor:
    """Position ids [1, L + m] of ARMT's [tokens | memory]: the module docstring's rule
    ("fixed"), right after the segment ("follow"), or the last m rows of a learned table of
    `table` rows ("table_end"); `model.armt.memory_positions`."""
    t = {"fixed": max(n_tok, tgt_len), "follow": n_tok, "table_end": table - m}[placement]
    return torch.cat([torch.arange(0, n_tok, device=device),
                      torch.arange(t, t + m, device=device)])[None]


def memory_attention_mask(m: int, n_tok: int, dtype: torch.dtype, attn_implementation: str,
                          device=None, pattern: str = "paper") -> torch.Tensor | None:
    """The 4-D mask [1, 1, 2m+L, 2m+L] transformers uses as given: bool (True = attend) for
    SDPA, additive (0 / dtype min) for the eager kernel, which adds it to the scores. None
    for the "causal" pattern: the base model builds its own causal mask."""
    if pattern == "causal":
        return None
    allowed = rmt_allowed(m, n_tok, 0, None, False, device)[:, None]
    if attn_implementation == "sdpa":
        return allowed
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=device), blocked)


# An attention implementation that is transformers' own SDPA function under a name with no
# mask function registered: masking_utils `_preprocess_mask_arguments` then returns no mask
# before it reads the padding mask or the position ids, and the SDPA call with no mask runs
# `is_causal`, exactly what the all-ones padding mask leads to after its read.
SDPA_CAUSAL = "memtrain_sdpa_causal"


def _register_sdpa_causal() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if AttentionInterface._global_mapping.get(SDPA_CAUSAL) is not sdpa_attention_forward:
        AttentionInterface.register(SDPA_CAUSAL, sdpa_attention_forward)


@contextmanager
def causal_attention(base, n_rows: int, dtype: torch.dtype, device=None
                     ) -> Iterator[torch.Tensor | None]:
    """For one forward of `base` (no KV cache) over n_rows rows under its own causal mask:
    yields the `attention_mask` to pass (module docstring). SDPA: None, with the config's
    attention implementation set to SDPA_CAUSAL for the body of the with-block; a layer
    re-run later (gradient checkpointing) under "sdpa" with the same None mask runs the
    same call. Eager: the 4-D additive causal mask [1, 1, n, n] (0 / dtype min). A model
    whose attention does not go through transformers' attention functions (Falcon and
    StableLM compare the implementation's name themselves; traits.py `attention`, checked
    at load by probe.py): the boolean 4-D causal mask under its own "sdpa"."""
    config = base.config
    impl = config._attn_implementation
    if impl == "eager":
        allowed = torch.ones(n_rows, n_rows, dtype=torch.bool, device=device).tril()
        blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)
        yield torch.where(allowed, torch.zeros((), dtype=dtype, device=device),
                          blocked)[None, None]
        return
    if impl != "sdpa":
        raise ValueError(f"attention implementation {impl!r}: 'sdpa' or 'eager' "
                         "(model.hf.attn_implementation)")
    if traits_of(base).attention == "mask":
        yield torch.ones(n_rows, n_rows, dtype=torch.bool, device=device).tril()[None, None]
        return
    _register_sdpa_causal()
    config._attn_implementation = SDPA_CAUSAL
    try:
        yield None
    finally:
        config._attn_implementation = impl
