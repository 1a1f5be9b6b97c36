"""Recurrent Memory Transformer (Bulatov et al. 2022) as a registered mechanism: its options
(`model.rmt`) and their validation, its traits and auxiliary loss (§3.4), and its segment
around a pretrained decoder. The native forward and the pieces both backbones share (the
mask of §3, the memory inputs, the write rows, the initial state) are model/mechanisms/rmt/core.py;
the positions and pattern around a pretrained model are model/pretrained/positions.py.

Around a pretrained decoder (the base model's own layers):

    H̃_τ = [H^mem_τ ∘ E(x_τ) ∘ H^mem_τ]          read block | token embeddings | write block
    [· ∘ H_τ ∘ H^write_τ] = Decoder(H̃_τ);  H^mem_{τ+1} := H^write_τ

H^mem_1 is a learned [m, d] matrix drawn at the scale of the pretrained embeddings. With
m = 0 the decoder gets exactly what the base model's own forward gives it (no mask, default
positions): the plain base model, the baseline without memory.
"""

from __future__ import annotations

import torch

from ...memory import RMTMemory
from ...memory_tokens import pretrained_memory_init
from ...registry import AuthorsCheckpoint, Mechanism, register
from ...typed import ConfigError
from .options import MEMORY_NORMS, RMT_PATTERNS, RMTOptions


def check_memory_tokens(cfg, m: int, field: str) -> None:
    """The memory-token count of RMT or ARMT (`field` names where it was read)."""
    if m < 0:
        raise ConfigError(field, f"must be >= 0, got {m}")


def check_memory_norm(cfg) -> None:
    """`model.rmt.memory_norm` (ARMT's carried tokens pass it too)."""
    o = cfg.rmt
    if o.memory_norm not in MEMORY_NORMS:
        raise ConfigError("model.rmt.memory_norm", f"unknown {o.memory_norm!r}; choose "
                          f"{', '.join(MEMORY_NORMS)}")


@register
class RMT(Mechanism):
    name = "rmt"
    section = "rmt"
    options = RMTOptions
    state = RMTMemory
    same_length = False
    memory_tokens = True
    memory_blocks = 2               # [read | tokens | write]
    analyses = ("blocks",)          # RMT Fig. 6: attention between the blocks
    own_init = ("memory_init", "memory_layer_norm")
    identity_fields = ("pattern",)
    authors_format = "rmt-authors"
    pretrained = True

    def num_mem_tokens(self, cfg) -> int:
        return cfg.rmt.num_mem_tokens

    def validate(self, cfg) -> None:
        o = cfg.rmt
        check_memory_norm(cfg)
        check_memory_tokens(cfg, o.num_mem_tokens, "model.rmt.num_mem_tokens")
        if o.num_mem_tokens == 0 and not cfg.backbone_traits.base_without_memory:
            # A pretrained backbone with 0 memory tokens is its plain base model (the
            # no-memory baseline); the native stack has mechanism 'xl' for that.
            raise ConfigError("model.rmt.num_mem_tokens", "must be > 0 (use mechanism 'xl' "
                              "with mem_len 0 for no memory)")
        check_pattern(cfg, causal=cfg.backbone_traits.position_ids)
        if o.mem_loss_weight < 0:
            raise ConfigError("model.rmt.mem_loss_weight", "must be >= 0")
        if not 0 <= o.mem_loss_token < cfg.vocab_size:
            raise ConfigError("model.rmt.mem_loss_token", f"must be a token id in "
                              f"[0, {cfg.vocab_size}), got {o.mem_loss_token}")
        if o.mem_loss_weight and not cfg.backbone_traits.own_softmax:
            raise ConfigError("model.rmt.mem_loss_weight", "the auxiliary memory loss is "
                              "defined for the native stack only")

    def core_class(self, cfg) -> type:
        from .core import RMT as Core
        return Core

    def aux_loss(self, cfg, softmax, state):
        o = cfg.rmt
        if o.mem_loss_weight <= 0:
            return None
        # RMT §3.4: each write output predicts a fixed reserved token, weight 0.01 in the
        # paper; which outputs are predicted is unspecified (our choice: every write row).
        write = state.tokens.reshape(-1, state.tokens.shape[-1])
        # On the host: the adaptive softmax routes host targets without a device sync.
        target = torch.full((write.shape[0],), o.mem_loss_token)
        return o.mem_loss_weight * softmax(write, target).mean()

    # -- around a pretrained decoder -------------------------------------------------------
    def pretrained_parameters(self, cfg, base, memory_scale):
        return {"memory_init": pretrained_memory_init(cfg, base, cfg.rmt.num_mem_tokens,
                                                      memory_scale)}

    def pretrained_initial_state(self, lm, batch_size, device=None):
        from .core import initial_memory
        return initial_memory(batch_size, self.num_mem_tokens(lm.cfg), lm.cfg.d_model, device)

    def pretrained_decode(self, lm, emb, state):
        from ...memory_tokens import write_rows
        from ...pretrained.paper_attention import paper_attention, splits
        from ...pretrained.positions import causal_attention, memory_position_ids
        from .core import memory_inputs
        bsz, n_tok, _ = emb.shape
        m, base = self.num_mem_tokens(lm.cfg), lm.base
        if m == 0:
            hidden = base.base_model(inputs_embeds=emb, use_cache=False)[0]
            return hidden, RMTMemory(tokens=state.tokens, fresh=torch.zeros_like(state.fresh))
        mem_in = memory_inputs(lm.memory_init(), state, bsz, emb.dtype)
        x = torch.cat([mem_in, emb, mem_in], dim=1)
        pattern = lm.cfg.rmt.pattern
        positions = memory_position_ids(m, n_tok, lm.cfg.tgt_len, emb.device, pattern)
        # "paper": its mask, or three maskless calls that skip the masked tiles
        # (paper_attention.py); "causal": the base model's own mask, built with no host
        # read (positions.py).
        split = splits(base, lm.cfg.hf.paper_attention, lm.cfg.checkpoint_layers)
        with (paper_attention(base, m, n_tok, emb.dtype, emb.device, split)
              if pattern == "paper" else
              causal_attention(base, x.shape[1], x.dtype, x.device)) as mask:
            h = base.base_model(inputs_embeds=x, attention_mask=mask,
                                position_ids=positions.expand(bsz, -1), use_cache=False)[0]
        return h[:, m:m + n_tok], RMTMemory(tokens=write_rows(h, m + n_tok),
                                            fresh=torch.zeros_like(state.fresh))

    def pretrained_open_segment(self, lm, state):
        from ...pretrained.incremental import CachedSegment
        from ...pretrained.positions import memory_attention_mask
        from .core import memory_inputs
        m = self.num_mem_tokens(lm.cfg)

        def read_block(bsz: int, dtype):
            # The m read rows at positions 0 .. m-1 with the read block's own mask for the
            # pattern (the top-left m x m of the segment's; "causal": the base model's own).
            x = memory_inputs(lm.memory_init(), state, bsz, dtype)
            mask = memory_attention_mask(m, 0, dtype, lm.base.config._attn_implementation,
                                         x.device, lm.cfg.rmt.pattern)
            return x, None if mask is None else mask[..., :m, :m]
        return CachedSegment(lm, state, offset=m, read_block=read_block if m else None)

    def pretrained_rows(self, cfg, rows, trained_params):
        from ...shapes import MemoryRows, SdpaShape, TensorShape
        m, n, d = cfg.rmt.num_mem_tokens, cfg.tgt_len, cfg.d_model
        q = 2 * m + n
        # The "paper" pattern's split (pretrained/paper_attention.py `splits`: the checkpoint's
        # own attention functions, a planned architecture's): the tokens' causal call over
        # [read; tokens], the read rows over the read block, the write rows over all.
        split = (cfg.rmt.pattern == "paper" and m > 0 and cfg.hf.paper_attention == "split"
                 and cfg.hf.attn_implementation == "sdpa" and not cfg.checkpoint_layers)
        h, dh = cfg.n_head, cfg.d_head
        calls = (SdpaShape(m + n, m + n, h, dh, masked=False),
                 SdpaShape(m, m, h, dh, masked=False),
                 SdpaShape(m, q, h, dh, masked=False)) if split else ()
        return MemoryRows(
            rows=q, own_mask=cfg.rmt.pattern == "causal", input_rows=q, sdpa_calls=calls,
            state=(TensorShape((rows, m, d)),), state_text=f"RMT memory [{rows}, {m}, {d}]",
            # where(fresh, init, memory)
            embedding_saved=(TensorShape((rows, 1, 1), "bool"),) if m else (),
            saved_label="the memory rows' fresh flags (torch.where)")

    def authors_split(self, state):
        from ...pretrained.authors_format import split_authors_state
        return AuthorsCheckpoint(*split_authors_state(state))

    def authors_section(self, m, segment_size, **facts) -> dict:
        # Their MemoryCell: [mem; E(x); mem] under the base model's causal mask.
        return {"mechanism": self.name, "rmt": {"num_mem_tokens": m, "pattern": "causal"}}

    def authors_state(self, model) -> dict:
        from ...pretrained.authors_format import to_authors_state
        return to_authors_state(model)


def check_pattern(cfg, causal: bool) -> None:
    """`model.rmt.pattern`: 'causal' only where `causal` is allowed (RMT around a pretrained
    model)."""
    o = cfg.rmt
    if o.pattern not in RMT_PATTERNS:
        raise ConfigError("model.rmt.pattern", f"unknown {o.pattern!r}; choose one of "
                          f"{', '.join(RMT_PATTERNS)}")
    if o.pattern == "causal" and not causal:
        raise ConfigError("model.rmt.pattern", "'causal' is the RMT authors' Hugging Face "
                          "wrapper's pattern: it needs mechanism 'rmt' with backbone 'hf' "
                          "(the native RMT follows RMT §3, 'paper'; ARMT is causal by "
                          "construction)")
