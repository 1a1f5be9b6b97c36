"""RMT's options, `model.rmt` (a field of model/config.py `ModelConfig`): the dataclass
alone, so that the config can declare it without importing the mechanism."""

from __future__ import annotations

from dataclasses import dataclass

MEMORY_NORMS = ("unit", "embedding", "none")
RMT_PATTERNS = ("paper", "causal")



@dataclass
class RMTOptions:
    """Recurrent Memory Transformer (Bulatov et al. 2022) options."""

    # m: memory tokens placed as a read block before and a write block after the segment.
    num_mem_tokens: int = 10
    # Let memory rows attend to the XL cache (RMT §3; the table is in tests/test_rmt.py); off
    # in the LM code.
    read_mem_from_cache: bool = False
    # Auxiliary loss of §3.4 (Tr-XL + RMT): each write output predicts `mem_loss_token`.
    mem_loss_weight: float = 0.0
    mem_loss_token: int = 0
    # Pre-LN only (post-LN outputs are already normalised): a LayerNorm on the write outputs
    # before they become the next memory, or the memory's norm grows with every segment of
    # a stream. "unit": gain 1 (the streams, quickstart and smoke were measured with it);
    # "embedding": gain init_std * sqrt(d_model), the scale of the initial memory and the
    # embeddings (the copy config); "none": no LayerNorm (the reverse and AR configs).
    memory_norm: str = "unit"
    # The attention pattern over [read | tokens | write]. "paper": RMT §3's rule (memory rows
    # see their whole block, tokens are causal; the native stack and the LM code); "causal":
    # the base model's own causal mask over the whole row at default positions 0..2m+L-1, as
    # the RMT authors' Hugging Face wrapper (MemoryCell) runs it; pretrained backbones only.
    # "paper" is the default for every backbone: as good on the mean and steadier on a
    # pretrained model (docs/coming-from-authors.md), and what earlier runs computed.
    pattern: str = "paper"
