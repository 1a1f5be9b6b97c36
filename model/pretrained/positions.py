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
- "paper": the native RMT table (model/rmt.py `rmt_allowed`, written out in
  tests/test_rmt.py): every row reads the read block; tokens are causal among themselves;
  the write rows see the read block, every token and the whole write block. Positions by
  the rule above.
- "causal": the RMT authors' Hugging Face wrapper (MemoryCell): the base model's own causal
  mask over the whole [read | tokens | write] row, at its default positions 0 .. 2m+L-1
  (so a read row sees only the read rows before it, and the write block moves with L).
  The decoder gets no mask and plain positions: exactly the base model's forward on
  `inputs_embeds = [mem; E(x); mem]`.

ARMT (Rodkin et al. 2024; model/armt.py) has no read block: [tokens | memory], L + m rows,
under the base model's own causal mask (the memory rows, last, see every token), with

    tokens 0 .. L-1
    memory T .. T+m-1,       T = max(L, tgt_len)

the same rule for the write block (`model.armt.memory_positions: fixed`; "follow" puts
the memory at L .. L+m-1 and "table_end" in the last m rows of a learned position table,
the two placements of the ARMT authors' code). When L < tgt_len the positions jump from L-1 to T;
transformers reads such a jump in position ids given WITHOUT an attention mask as the start
of another packed sequence and would cut the memory off from the tokens
(masking_utils `find_packed_sequence_indices`), so the wrapper passes an all-ones 2-D
padding mask, from which the model builds its plain causal mask.
"""

from __future__ import annotations

import inspect

import torch

from ..rmt import rmt_allowed
from ..typed import ConfigError


def check_accepts_positions(decoder) -> None:
    if "position_ids" not in inspect.signature(decoder.forward).parameters:
        raise ConfigError("model.hf.path", f"{type(decoder).__name__}.forward takes no "
                          "position_ids, so memory positions cannot be placed")


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
