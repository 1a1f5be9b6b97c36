"""Titans (Behrouz, Zhong, Mirrokni 2025, arXiv 2501.00663) as a registered mechanism: its
options (`model.titans`) and their bounds, its traits, and its segment around a pretrained
decoder. The neural memory is model/mechanisms/titans/neural_memory.py, the native forward (memory
as a context, §4.1) model/mechanisms/titans/core.py, the hooks around a pretrained model's layers
model/mechanisms/titans/pretrained.py. docs/titans.md has the equations and the choices made.

The bounds are those of the failures users of other implementations report (NaN after a
few or a few thousand steps): the inner learning rate theta_t, the momentum eta_t and the
memory's depth. With l2-normalised keys (|k| = 1) one inner step of the linear memory on
Eq. 12 multiplies the error along k by 1 - 2 theta: theta <= 1 keeps it in [-1, 1), so an
update never grows the error it corrects; eta < 1 makes the surprise S a decaying sum, not
a growing one; a deeper MLP multiplies the gradient by every matrix's norm, and the paper
measures deep memories of 1 to 4 layers (§5.5). Within those bounds the memory still
overflows when the gates saturate unless each token's gradient is clipped (`max_grad_norm`,
not in the paper): tests/test_neural_memory.py runs every bound at once with and without
the clip.
"""

from __future__ import annotations

from ...registry import Mechanism, register
from ...typed import ConfigError, check_choice
from .neural_memory import NeuralMemoryState
from .options import (
    MAX_DEPTH,
    QK_NORMS,
    READ_AS,
    SURPRISE_AT,
    UPDATE_INPUTS,
    VARIANTS,
    TitansOptions,
)


@register
class Titans(Mechanism):
    name = "titans"
    section = "titans"
    options = TitansOptions
    state = NeuralMemoryState
    same_length = False
    # No memory-token rows: what crosses the boundary is the MLP's weights. Not measured on
    # the smoke stream yet (it runs memory-token mechanisms on windows of 2 and the others
    # with an XL cache, which Titans does not keep).
    in_smoke = False
    analyses = ()
    # M_0 ~ N(0, 1/d_in) and the zero gate of Eq. 25 (model/mechanisms/titans/neural_memory.py,
    # titans.py); the XL init's N(0, 0.02) would make a deep memory's reads vanish.
    # W_H (`memory_out.`) at `read_init_std` (model/mechanisms/titans/core.py).
    own_init = ("memory.", "memory_out.", "memory_gate.", "persistent")
    identity_fields = ("variant", "conv_size")
    pretrained = True
    # Around a pretrained decoder: the persistent rows, then [h_i x_i] pairs sharing a
    # position (model/mechanisms/titans/pretrained.py), so a segment uses P + L positions.
    memory_blocks = 1

    def num_mem_tokens(self, cfg) -> int:
        return cfg.titans.num_persistent

    def warmup_segments(self, cfg, mem_len, tgt_len) -> int:
        return 1    # the memory holds something once one segment has been written

    def validate(self, cfg) -> None:
        o = cfg.titans
        if o.variant not in VARIANTS:
            raise ConfigError("model.titans.variant", f"unknown {o.variant!r}; choose one "
                              f"of {', '.join(VARIANTS)}")
        if o.variant != "mac" and not cfg.backbone_traits.native_core:
            raise ConfigError("model.titans.variant", f"{o.variant!r} runs on the native "
                              "stack only; around a pretrained decoder: 'mac'")
        if o.d_mem <= 0:
            raise ConfigError("model.titans.d_mem", f"must be > 0, got {o.d_mem}")
        if not 1 <= o.memory_depth <= MAX_DEPTH:
            raise ConfigError("model.titans.memory_depth", f"must be in [1, {MAX_DEPTH}] (the "
                              f"depths the paper measures, §5.5), got {o.memory_depth}")
        if o.memory_hidden is not None and o.memory_hidden <= 0:
            raise ConfigError("model.titans.memory_hidden", f"must be > 0 or null, got "
                              f"{o.memory_hidden}")
        if o.chunk_size < 1:
            raise ConfigError("model.titans.chunk_size", f"must be >= 1, got {o.chunk_size}")
        if o.num_persistent < 0:
            raise ConfigError("model.titans.num_persistent", f"must be >= 0, got "
                              f"{o.num_persistent}")
        if not 0 < o.max_lr <= 1:
            raise ConfigError("model.titans.max_lr", f"must be in (0, 1] (with unit keys a "
                              f"step of theta > 1 overshoots the value it writes), got "
                              f"{o.max_lr}")
        if not 0 <= o.max_momentum < 1:
            raise ConfigError("model.titans.max_momentum", f"must be in [0, 1) (eta = 1 "
                              f"makes the surprise grow without bound), got {o.max_momentum}")
        if not (0 < o.max_grad_norm < float("inf")):
            raise ConfigError("model.titans.max_grad_norm", f"must be a finite number > 0 "
                              f"(the clip that keeps the memory finite), got {o.max_grad_norm}")
        if o.conv_size < 0 or o.conv_size == 1:
            raise ConfigError("model.titans.conv_size", f"must be 0 (none) or >= 2 (a "
                              f"kernel over a row and the ones before it), got {o.conv_size}")
        check_choice("model.titans.update_input", o.update_input, UPDATE_INPUTS)
        check_choice("model.titans.read_as", o.read_as, READ_AS)
        check_choice("model.titans.surprise_at", o.surprise_at, SURPRISE_AT)
        check_choice("model.titans.qk_norm", o.qk_norm, QK_NORMS)
        native_only = {"update_input": "output", "read_as": "context", "output_gate": True,
                       "read_init_std": None, "segment_positions": False}
        for name, default in native_only.items():
            if getattr(o, name) != default and not cfg.backbone_traits.native_core:
                raise ConfigError(f"model.titans.{name}", f"{getattr(o, name)!r} runs on the "
                                  f"native stack only; around a pretrained decoder: {default!r}")
        if (o.update_input != "output" or o.read_as != "context") and o.variant != "mac":
            raise ConfigError("model.titans.update_input" if o.update_input != "output"
                              else "model.titans.read_as",
                              "is MAC's (variant 'mac'); MAG and MAL read and write the "
                              "layer's input already")
        if not o.output_gate and o.variant != "mac":
            raise ConfigError("model.titans.output_gate", "MAG's output is the gate (off, "
                              "its memory would be unused); MAL has none: 'mac' only")
        if o.read_init_std is not None and not 0 <= o.read_init_std < float("inf"):
            raise ConfigError("model.titans.read_init_std", f"must be a finite number >= 0 "
                              f"or null, got {o.read_init_std}")
        if o.read_init_std is not None and o.variant == "mag":
            raise ConfigError("model.titans.read_init_std", "MAG has no W_H (its read only "
                              "gates the attention's output)")
        for name in ("lr_bias", "momentum_bias", "forget_bias"):
            if not abs(getattr(o, name)) < float("inf"):
                raise ConfigError(f"model.titans.{name}", f"must be finite, got "
                                  f"{getattr(o, name)}")
        if not 0 <= o.max_forget <= 1:
            raise ConfigError("model.titans.max_forget", f"must be in [0, 1], got "
                              f"{o.max_forget}")

    def check_lengths(self, cfg, mem_len, clamp_len, same_length, section) -> None:
        if mem_len:
            raise ConfigError(f"{section}.mem_len", f"must be 0, got {mem_len}: Titans' "
                              "attention sees its segment, the persistent rows and the "
                              "memory's reads (MAC, §4.1), no XL cache")

    def core_class(self, cfg) -> type:
        from .core import TitansCore
        return TitansCore

    # -- around a pretrained decoder -------------------------------------------------------
    def pretrained_parameters(self, cfg, base, memory_scale):
        from .pretrained import parameters
        return parameters(cfg, base, memory_scale)

    def pretrained_initial_state(self, lm, batch_size, device=None):
        from .core import initial_state
        return initial_state(lm.cfg, lm.memory, batch_size, device)

    def pretrained_decode(self, lm, emb, state):
        from .pretrained import decode
        return decode(lm, emb, state)

    def training_notes(self, cfg, bptt_depth: int) -> list[str]:
        # A read uses the memory as of its chunk's start (Eq. 21-22 per chunk, §3.2): with
        # one chunk per segment every read is of the segments before, whose state a BPTT
        # depth of 0 detaches, so nothing the segment writes reaches its loss.
        o = cfg.titans
        if bptt_depth > 0 or o.chunk_size < cfg.tgt_len:
            return []
        return [f"model.titans.chunk_size {o.chunk_size} >= model.tgt_len {cfg.tgt_len} with "
                "bptt.depth 0: every read of a segment is of the memory the segments before "
                "it wrote, and no gradient crosses a segment, so W_K, W_V, their "
                "convolutions and the gates get none (the memory cannot learn what to "
                "write); set bptt.depth >= 1, or a chunk_size below tgt_len"]

    def pretrained_rows(self, cfg, rows, trained_params):
        from .pretrained import memory_rows
        return memory_rows(cfg, rows, trained_params)
