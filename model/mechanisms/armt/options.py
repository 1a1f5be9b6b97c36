"""ARMT's options, `model.armt` (a field of model/config.py `ModelConfig`): the dataclass
alone, so that the config can declare it without importing the mechanism."""

from __future__ import annotations

from dataclasses import dataclass

FEATURE_MAPS = ("dpfp", "elu", "identity")
ARMT_MEMORY_POSITIONS = ("fixed", "follow", "table_end")



@dataclass
class ARMTOptions:
    """Associative Recurrent Memory Transformer (Rodkin et al. 2024) options;
    model/mechanisms/armt/core.py has the equations. Its m memory tokens are placed after the
    segment's tokens, and their outputs write every layer's association matrix. The defaults are the
    authors' code."""

    # m. null only in configs written before this field: their count was
    # `model.rmt.num_mem_tokens`, which it is then set to when the config is built (a
    # FutureWarning says so where that count is not the default; mechanism.py `upgrade`).
    num_mem_tokens: int | None = None
    # The LayerNorm the carried write outputs pass (`carry_tokens`; pre-LN): "unit",
    # "embedding" or "none", as RMT's `memory_norm`. null only in configs written before
    # this field: then `model.rmt.memory_norm`, as for the count.
    memory_norm: str | None = None
    # Width of q and k before the feature map (the authors' d_mem; 64 in their scripts).
    d_key: int = 64
    # phi: "dpfp" (deterministic parameter-free projection, the authors'), "elu" (elu + 1)
    # or "identity" (the alternative left in their code; its normaliser can be <= 0).
    feature_map: str = "dpfp"
    # DPFP's nu: phi has 2 * nu * d_key entries (3 in the authors' code).
    nu: int = 3
    # beta = sigmoid(w_b . m + b), the importance of each memory token's write; false: 1.
    gate: bool = True
    # gamma, the normaliser's correction for a key already stored (the authors'
    # --no_correction turns it off); false: every write adds phi(k) to z.
    correction: bool = True
    # gamma as the authors' code computes it (eps also in its numerator, 1 on a row's first
    # write); the default drops that eps so a zero state is a fresh one with no flag
    # (model/mechanisms/armt/associative.py). `memtrain import --format armt-authors` sets it.
    authors_gamma: bool = False
    # false (the authors'): every segment's memory tokens start from the same learned
    # vectors and only the association matrices cross the boundary; true: the write
    # outputs are also carried as the next segment's memory tokens (RMT's recurrence on
    # top of the associative memory), through `memory_norm`.
    carry_tokens: bool = False
    # Position ids of the memory tokens around a pretrained model (backbone hf; the native
    # stack's positions are relative). "fixed": T .. T+m-1, T = max(L, tgt_len), the same
    # rows whatever the segment's length; "follow": L .. L+m-1, right after the segment
    # (the authors' code without wrap_pos: the base model's default positions); "table_end":
    # the last m rows of a learned position table (the authors' wrap_pos, which appends m
    # rows to GPT-2's table for the memory). model/pretrained/positions.py.
    memory_positions: str = "fixed"
    # The operands of the associative read: "fp32" (exact, the default) or "bf16" (phi(q),
    # A and z rounded to bf16 for one tensor-core matmul; the state and the write stay
    # float32). Its drift against fp32 over 512 segments is measured and bounded in
    # tests/test_armt_costs.py; docs/armt-costs.md, "The read in bf16".
    read_precision: str = "fp32"
    # Under segment checkpointing, move each segment's incoming A and z to host memory
    # after its forward and back for its re-run in backward (model/mechanisms/armt/associative.py
    # `AssociativeMemory.offload`): the device then holds O(1) states instead of one per
    # segment of the window, at the price of two copies of |A| per segment. Exact.
    offload_state: bool = False
    # A floor under the read's and the write's denominator, phi^T z >= floor * |phi|^2
    # (model/mechanisms/armt/associative.py; docs/armt.md, "Loss spikes"): 0, the default, is the
    # authors' read exactly; 1 bounds the read of a query on features that gamma kept out of z.
    denominator_floor: float = 0.0
