"""Associative Recurrent Memory Transformer (Rodkin et al. 2024) as a registered mechanism:
its options (`model.armt`) and their validation, its traits, and its segment around a
pretrained decoder. The native forward is model/mechanisms/armt/core.py, the associative read and
write model/mechanisms/armt/associative.py, the hooks around a pretrained model's layers
model/mechanisms/armt/pretrained.py.

Around a pretrained decoder:

    x^0 = [E(x_τ) ∘ M]                                   tokens, then m memory tokens
    per decoder layer l: x^{l-1} += read_l(A_l, z_l; x^{l-1});  x^l = Layer_l(x^{l-1});
                         (A_l, z_l) <- write_l(A_l, z_l; x^l[M rows])
    logits_τ = LMHead(x^top[tokens])

under the base model's own causal mask, positions by positions.py `armt_position_ids`. The
state is `AssociativeMemory` (A, z per layer, float32), not detached here: the caller's
BPTT windows cut it.

The memory-token count is `model.armt.num_mem_tokens` and the carried tokens' LayerNorm
`model.armt.memory_norm`. Configs and checkpoints written before ARMT had them set RMT's,
`model.rmt.num_mem_tokens` and `model.rmt.memory_norm`: where ARMT's are unset (null), they
are set from those once, when the config is built (`ARMT.upgrade`, with a FutureWarning
where RMT's is not its default; errors then name the field the value came from), and
nothing reads RMT's section for ARMT afterwards. A config that sets both counts to
different values is refused.
"""

from __future__ import annotations

import math
import warnings

import torch

from ...memory_tokens import pretrained_memory_init
from ...registry import AuthorsCheckpoint, Mechanism, register
from ...typed import ConfigError, check_choice
from ..rmt.mechanism import check_memory_tokens, check_pattern
from ..rmt.options import MEMORY_NORMS, RMTOptions
from .associative import READ_PRECISIONS, AssociativeMemory
from .options import ARMT_MEMORY_POSITIONS, FEATURE_MAPS, ARMTOptions


def token_field(cfg) -> str:
    """The field ARMT's memory-token count came from, for errors: `model.rmt.
    num_mem_tokens` in a config written before ARMT had its own (`ARMT.upgrade`)."""
    return ("model.rmt.num_mem_tokens" if "num_mem_tokens" in upgraded_fields(cfg.armt)
            else "model.armt.num_mem_tokens")


def upgraded_fields(o: ARMTOptions) -> set[str]:
    """The fields of this section that `ARMT.upgrade` filled from `model.rmt`."""
    return o.__dict__.setdefault("_from_rmt", set())


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
    # W_v = 0 (model/mechanisms/armt/associative.py); N(0, init_std) keys would make phi(k)^T z of
    # the order of the denominators' eps.
    own_init = ("memory_init", "memory_layer_norm", "associative.")
    pretrained = True
    authors_format = "armt-authors"

    def upgrade(self, cfg) -> None:
        # Configs and checkpoints written before ARMT had its own memory-token count and
        # memory norm set RMT's (module docstring): those are what they meant.
        o, moved = cfg.armt, upgraded_fields(cfg.armt)
        for name in ("num_mem_tokens", "memory_norm"):
            if getattr(o, name) is not None:
                continue
            value = getattr(cfg.rmt, name)
            setattr(o, name, value)
            moved.add(name)
            if value != getattr(RMTOptions, name):
                warnings.warn(f"memtrain: model.rmt.{name} ({value!r}) sets ARMT's {name} "
                              f"only in configs written before model.armt.{name}; write "
                              f"model.armt.{name}: {value!r} instead", FutureWarning,
                              stacklevel=2)

    def num_mem_tokens(self, cfg) -> int:
        return cfg.armt.num_mem_tokens

    def validate(self, cfg) -> None:
        o, m, field = cfg.armt, self.num_mem_tokens(cfg), token_field(cfg)
        legacy = cfg.rmt.num_mem_tokens
        if field == "model.armt.num_mem_tokens" and legacy not in (RMTOptions.num_mem_tokens,
                                                                     m):
            raise ConfigError("model.armt.num_mem_tokens", f"is {m} but model.rmt."
                              f"num_mem_tokens is {legacy}: ARMT's count is model.armt."
                              "num_mem_tokens; remove the other")
        check_choice("model.armt.memory_norm" if "memory_norm" not in upgraded_fields(o)
                     else "model.rmt.memory_norm", o.memory_norm, MEMORY_NORMS)
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
        check_choice("model.armt.read_precision", o.read_precision, READ_PRECISIONS)
        check_choice("model.armt.memory_positions", o.memory_positions, ARMT_MEMORY_POSITIONS)
        if o.memory_positions != "fixed" and not cfg.backbone_traits.position_ids:
            raise ConfigError("model.armt.memory_positions", "places memory tokens in a "
                              "pretrained model's positions (backbone 'hf'); the native "
                              "stack's positions are relative")

    def core_class(self, cfg) -> type:
        from .core import ARMT as Core
        return Core

    # -- around a pretrained decoder -------------------------------------------------------
    def pretrained_parameters(self, cfg, base, memory_scale):
        from torch import nn

        from ...pretrained.layers import decoder_layers_name
        from .core import associative_layer
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
        from .core import initial_state
        return initial_state(lm.associative, batch_size, device)

    def pretrained_decode(self, lm, emb, state):
        from ...memory_tokens import write_rows
        from ...pretrained.positions import armt_position_ids, causal_attention
        from .associative import checkpoint_first_run
        from .core import memory_token_inputs
        from .pretrained import associative_pass
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
        from ...pretrained.incremental import CachedSegment
        from .pretrained import associative_pass
        layers = lm.base.base_model.get_submodule(lm.layers_name)

        def reads(n_tok: int):
            # The token rows come first and read the committed state; no writes until the
            # segment is committed (incremental.py).
            return associative_pass(layers, lm.associative, state, n_tok, write=False)
        return CachedSegment(lm, state, offset=0, reads=reads)

    def pretrained_rows(self, cfg, rows, trained_params):
        from ...shapes import MemoryRows, TensorShape
        from .pretrained import associative_shapes
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
        from ...pretrained.authors_format import split_armt_authors_state
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
        from ...pretrained.authors_format import to_armt_authors_state
        layers = model.base.base_model.get_submodule(model.layers_name)
        path = next(n for n, mod in model.base.named_modules() if mod is layers)
        return to_armt_authors_state(model, path)
