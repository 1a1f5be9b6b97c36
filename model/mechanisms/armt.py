"""Associative Recurrent Memory Transformer (Rodkin et al. 2024) as a registered mechanism:
its options (`model.armt`) and their validation, its traits, and its segment around a
pretrained decoder. The native forward is model/armt.py, the associative read and write
model/associative.py, the hooks around a pretrained model's layers
model/pretrained/associative.py.

Around a pretrained decoder:

    x^0 = [E(x_τ) ∘ M]                                   tokens, then m memory tokens
    per decoder layer l: x^{l-1} += read_l(A_l, z_l; x^{l-1});  x^l = Layer_l(x^{l-1});
                         (A_l, z_l) <- write_l(A_l, z_l; x^l[M rows])
    logits_τ = LMHead(x^top[tokens])

under the base model's own causal mask, positions by positions.py `armt_position_ids`. The
state is `AssociativeMemory` (A, z per layer, float32), not detached here: the caller's
BPTT windows cut it.

The memory-token count is `model.armt.num_mem_tokens`. Configs and checkpoints written
before ARMT had its own count set `model.rmt.num_mem_tokens` only: with
`model.armt.num_mem_tokens` unset (null), the count is read from there (and errors name
that field). A config that sets both to different counts is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..associative import READ_PRECISIONS, AssociativeMemory
from ..memory_tokens import pretrained_memory_init
from ..typed import ConfigError
from .registry import AuthorsCheckpoint, Mechanism, register
from .rmt import (
    RMTOptions,
    check_memory_norm,
    check_memory_tokens,
    check_pattern,
)

FEATURE_MAPS = ("dpfp", "elu", "identity")
ARMT_MEMORY_POSITIONS = ("fixed", "follow", "table_end")


@dataclass
class ARMTOptions:
    """Associative Recurrent Memory Transformer (Rodkin et al. 2024) options; model/armt.py
    has the equations. Its m memory tokens are placed after the segment's tokens, and
    their outputs write every layer's association matrix. The defaults are the authors'
    code."""

    # m; null: `model.rmt.num_mem_tokens` (what configs written before this field set).
    num_mem_tokens: int | None = None
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
    # (model/associative.py). `memtrain import --format armt-authors` sets it.
    authors_gamma: bool = False
    # false (the authors'): every segment's memory tokens start from the same learned
    # vectors and only the association matrices cross the boundary; true: the write
    # outputs are also carried as the next segment's memory tokens (RMT's recurrence on
    # top of the associative memory), through `model.rmt.memory_norm`.
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
    # after its forward and back for its re-run in backward (model/associative.py
    # `AssociativeMemory.offload`): the device then holds O(1) states instead of one per
    # segment of the window, at the price of two copies of |A| per segment. Exact.
    offload_state: bool = False
    # A floor under the read's and the write's denominator, phi^T z >= floor * |phi|^2
    # (model/associative.py; docs/armt.md, "Loss spikes"): 0, the default, is the authors'
    # read exactly; 1 bounds the read of a query on features that gamma kept out of z.
    denominator_floor: float = 0.0


def token_field(cfg) -> str:
    """The field ARMT's memory-token count is read from (module docstring)."""
    return "model.rmt.num_mem_tokens" if cfg.armt.num_mem_tokens is None else \
        "model.armt.num_mem_tokens"


@register
class ARMT(Mechanism):
    name = "armt"
    section = "armt"
    options = ARMTOptions
    state = AssociativeMemory
    same_length = False
    memory_tokens = True
    memory_blocks = 1               # [tokens | memory]
    # On the repeat-block stream it stays at chance to 1000 steps (docs/armt.md).
    in_smoke = False
    # The blocks keep the authors' init: nn.Linear's default for W_q, W_k and the gate,
    # W_v = 0 (model/associative.py); N(0, init_std) keys would make phi(k)^T z of the
    # order of the denominators' eps.
    own_init = ("memory_init", "memory_layer_norm", "associative.")
    pretrained = True
    authors_format = "armt-authors"

    def num_mem_tokens(self, cfg) -> int:
        o = cfg.armt
        return cfg.rmt.num_mem_tokens if o.num_mem_tokens is None else o.num_mem_tokens

    def validate(self, cfg) -> None:
        o, m, field = cfg.armt, self.num_mem_tokens(cfg), token_field(cfg)
        legacy = cfg.rmt.num_mem_tokens
        if o.num_mem_tokens is not None and legacy not in (RMTOptions.num_mem_tokens, m):
            raise ConfigError("model.armt.num_mem_tokens", f"is {m} but model.rmt."
                              f"num_mem_tokens is {legacy}: ARMT's count is model.armt."
                              "num_mem_tokens; remove the other")
        check_memory_norm(cfg)
        check_memory_tokens(cfg, m, field)
        if m == 0:
            raise ConfigError(field, "ARMT writes its associative memory from the memory "
                              "tokens: must be > 0")
        check_pattern(cfg, causal=False)
        if o.d_key <= 0:
            raise ConfigError("model.armt.d_key", f"must be > 0, got {o.d_key}")
        if o.feature_map not in FEATURE_MAPS:
            raise ConfigError("model.armt.feature_map", f"unknown {o.feature_map!r}; choose "
                              f"one of {', '.join(FEATURE_MAPS)}")
        if o.feature_map == "dpfp" and o.nu < 1:
            raise ConfigError("model.armt.nu", f"must be >= 1, got {o.nu}")
        if cfg.rmt.mem_loss_weight:
            raise ConfigError("model.rmt.mem_loss_weight", "the auxiliary memory loss is "
                              "RMT's (§3.4); ARMT has none")
        if not (o.denominator_floor >= 0 and math.isfinite(o.denominator_floor)):
            raise ConfigError("model.armt.denominator_floor", f"must be a finite number >= 0, "
                              f"got {o.denominator_floor}")
        if o.read_precision not in READ_PRECISIONS:
            raise ConfigError("model.armt.read_precision", f"unknown {o.read_precision!r}; "
                              f"choose one of {', '.join(READ_PRECISIONS)}")
        if o.memory_positions not in ARMT_MEMORY_POSITIONS:
            raise ConfigError("model.armt.memory_positions", f"unknown {o.memory_positions!r}; "
                              f"choose one of {', '.join(ARMT_MEMORY_POSITIONS)}")
        if o.memory_positions != "fixed" and not cfg.backbone_traits.position_ids:
            raise ConfigError("model.armt.memory_positions", "places memory tokens in a "
                              "pretrained model's positions (backbone 'hf'); the native "
                              "stack's positions are relative")

    def core_class(self, cfg) -> type:
        from ..armt import ARMT as Core
        return Core

    # -- around a pretrained decoder -------------------------------------------------------
    def pretrained_parameters(self, cfg, base, memory_scale):
        from torch import nn

        from ..armt import associative_layer
        from ..pretrained.layers import decoder_layers_name
        memory_init = pretrained_memory_init(cfg, base, self.num_mem_tokens(cfg),
                                             memory_scale)
        # A name, not the module list itself: a second reference to the base's layers
        # would put them in the state dict twice. The blocks are not in `base`, so
        # apply_finetune leaves them trainable in every mode (memory parameters, like
        # memory_init); W_v = 0 makes them inert at initialisation.
        return {"memory_init": memory_init, "layers_name": decoder_layers_name(base),
                "associative": nn.ModuleList(associative_layer(cfg)
                                             for _ in range(cfg.n_layer))}

    def pretrained_initial_state(self, lm, batch_size, device=None):
        from ..armt import initial_state
        return initial_state(lm.associative, batch_size, device)

    def pretrained_decode(self, lm, emb, state):
        from ..armt import memory_token_inputs
        from ..associative import checkpoint_first_run
        from ..memory_tokens import write_rows
        from ..pretrained.associative import associative_pass
        from ..pretrained.positions import armt_position_ids, causal_attention
        cfg = lm.cfg
        state = state.resident()
        bsz, n_tok, _ = emb.shape
        mem = memory_token_inputs(lm.memory_init(), state, bsz, cfg.armt.carry_tokens,
                                  emb.dtype)
        x = torch.cat([emb, mem], dim=1)
        positions = armt_position_ids(self.num_mem_tokens(cfg), n_tok, cfg.tgt_len,
                                      emb.device, cfg.armt.memory_positions,
                                      lm.base.config.max_position_embeddings)
        # The model's own causal mask with no host read of a mask or of the positions, and
        # no packed-sequence split at the positions' jump (positions.py).
        layers = lm.base.base_model.get_submodule(lm.layers_name)
        # With the layers checkpointed (HF gradient checkpointing), the hooks' read and
        # write are too (associative.py).
        ckpt = cfg.checkpoint_layers and lm.training and torch.is_grad_enabled()
        with associative_pass(layers, lm.associative, state, n_tok, ckpt) as writes, \
                causal_attention(lm.base, x.shape[1], x.dtype, x.device) as mask:
            h = lm.base.base_model(inputs_embeds=x, attention_mask=mask,
                                   position_ids=positions.expand(bsz, -1), use_cache=False)[0]
        carried = write_rows(h, n_tok) if cfg.armt.carry_tokens else None
        new_state = writes.state(state, tokens=carried)
        if cfg.armt.offload_state and checkpoint_first_run():
            state.offload()
        return h[:, :n_tok], new_state

    def pretrained_open_segment(self, lm, state):
        from ..pretrained.associative import associative_pass
        from ..pretrained.incremental import CachedSegment
        layers = lm.base.base_model.get_submodule(lm.layers_name)

        def reads(n_tok: int):
            # The token rows come first and read the committed state; no writes until the
            # segment is committed (incremental.py).
            return associative_pass(layers, lm.associative, state, n_tok, write=False)
        return CachedSegment(lm, state, offset=0, reads=reads)

    def pretrained_rows(self, cfg, rows, trained_params):
        from ..pretrained.associative import associative_shapes
        from ..shapes import MemoryRows, TensorShape
        m, q = self.num_mem_tokens(cfg), cfg.tgt_len + self.num_mem_tokens(cfg)
        assoc, state, text, state_read = associative_shapes(cfg, rows, q, m, trained_params)
        fresh = (TensorShape((rows, 1, 1), "bool"),) if cfg.armt.carry_tokens else ()
        return MemoryRows(rows=q, own_mask=True, input_rows=2 * q, state=state,
                          state_text=text, state_read=state_read, blocks=(assoc,),
                          embedding_saved=(*fresh, *state_read),
                          saved_label="the associative read and write")

    def check_positions(self, cfg, kind, model_type) -> None:
        if cfg.armt.memory_positions == "table_end" and kind != "absolute":
            raise ConfigError("model.armt.memory_positions", f"'table_end' places the memory "
                              f"in a learned position table; {model_type!r} has {kind} "
                              "positions")

    def authors_split(self, state):
        from ..pretrained.authors_format import split_armt_authors_state
        base, memory, assoc, _, d_mem = split_armt_authors_state(state)
        return AuthorsCheckpoint(base, memory, own=assoc, facts={"d_key": d_mem},
                                 may_widen_positions=True)

    def authors_load(self, model, ckpt) -> None:
        super().authors_load(model, ckpt)
        model.associative.load_state_dict(
            {k[len("associative."):]: v for k, v in ckpt.own.items()}, strict=True)

    def authors_section(self, m, segment_size, *, d_key, correction, placement, **facts
                        ) -> dict:
        # Their AssociativeLayerWrapper: DPFP nu 3, gated writes, eps in gamma's numerator.
        return {"mechanism": self.name, "armt": {
            "num_mem_tokens": m, "d_key": d_key, "feature_map": "dpfp", "nu": 3,
            "gate": True, "correction": correction, "authors_gamma": True,
            "carry_tokens": False, "memory_positions": placement}}

    def authors_state(self, model) -> dict:
        from ..pretrained.authors_format import to_armt_authors_state
        layers = model.base.base_model.get_submodule(model.layers_name)
        path = next(n for n, mod in model.base.named_modules() if mod is layers)
        return to_armt_authors_state(model, path)
