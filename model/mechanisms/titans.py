"""Titans (Behrouz, Zhong, Mirrokni 2025, arXiv 2501.00663) as a registered mechanism: its
options (`model.titans`) and their bounds, its traits, and its segment around a pretrained
decoder. The neural memory is model/neural_memory.py, the native forward (memory as a
context, §4.1) model/titans.py, the hooks around a pretrained model's layers
model/pretrained/titans.py. docs/titans.md has the equations and the choices made.

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

from dataclasses import dataclass

from ..neural_memory import NeuralMemoryState
from ..registry import Mechanism, register
from ..typed import ConfigError, check_choice

VARIANTS = ("mac", "mag", "mal")
UPDATE_INPUTS = ("output", "input")
READ_AS = ("context", "residual")
SURPRISE_AT = ("chunk", "initial")
QK_NORMS = ("l2", "rms_input")
MAX_DEPTH = 4


@dataclass
class TitansOptions:
    """Titans' neural memory (§3) and its memory-as-a-context architecture (§4.1)."""

    # "mac": memory as a context (§4.1); "mag": as a gate (§4.2); "mal": as a layer (§4.3).
    # MAG and MAL on the native stack only.
    variant: str = "mac"
    # Width of q, k, v and of the memory's input and output (d_in of M).
    d_mem: int = 32
    # L_M, the MLP's number of matrices (1: the linear memory M(k) = k W; §3.1, §5.5).
    memory_depth: int = 2
    # Width of the MLP's hidden layers; null: 2 * d_mem.
    memory_hidden: int | None = None
    # b, the chunk of the parallel update (§3.2): gradients inside a chunk are taken at the
    # weights of its start. 1: the exact token recurrence (one chunk per token).
    chunk_size: int = 16
    # N_p, the persistent memory tokens (Eq. 19), per layer (model/titans.py).
    num_persistent: int = 4
    # Bounds of the data-dependent gates: theta_t in (0, max_lr], eta_t in (0, max_momentum],
    # alpha_t in (0, max_forget] (each the bound times a sigmoid).
    max_lr: float = 0.5
    max_momentum: float = 0.9
    max_forget: float = 1.0
    # Each token's gradient of each memory matrix clipped to this Frobenius norm (not in
    # the paper; without it the memory overflows at the gates' bounds, model/neural_memory.py).
    max_grad_norm: float = 1.0
    # c, the kernel of the causal depthwise convolution after each of W_Q, W_K, W_V (§4.4),
    # run across segment boundaries (the last c - 1 rows carried in the state). 0: none
    # (the runs measured in docs/titans.md had none); the paper's architecture has them,
    # with a kernel the text does not state (4 is the short convolution of the linear
    # recurrent models it follows).
    conv_size: int = 0
    # Training runs the chunk loop's step (a chunk's reads and update, §3.2) as one compiled
    # graph by `model.compile_backend`, compiled once and reused by every full chunk of every
    # layer (model/compiled.py `compiled_chunk_step`; docs/titans.md, "The compiled chunk").
    # Off: eager. Independent of `model.compile`, which compiles the decoder stack.
    compiled_chunks: bool = False
    # MAC (§4.1) only. The stream the memory is written with (Eq. 24): "output", the
    # attention's output y as the paper writes it; "input", the layer's input x (what MAG,
    # MAL and titans-pytorch's MAC write). Eq. 25's gate reads the stream the memory is
    # written with: M*(y), or M*(x) with "input" (read and write share one stream and, with
    # convolutions, one tail).
    update_input: str = "output"
    # MAC only. Where the read h = W_H M*(q) enters (Eq. 22): "context", as rows the
    # segment's tokens attend to; "residual", added to each token's row x_i + h_i before
    # the attention (a choice outside the paper: it gives the read a direct path to the
    # output at initialisation).
    read_as: str = "context"
    # Eq. 25's gate o = y * 2 sigmoid(W_G M*(y)) (MAC, MAG); off: o = y.
    output_gate: bool = True
    # Initial biases of the data-dependent gates (pre-sigmoid, §3.1): theta_t = max_lr
    # sigmoid(lr_bias + ...), eta_t = max_momentum sigmoid(momentum_bias + ...), alpha_t =
    # max_forget sigmoid(forget_bias + ...). -4: alpha ~ 0.018 per token.
    lr_bias: float = 0.0
    momentum_bias: float = 0.0
    forget_bias: float = -4.0
    # Std of W_H's initial weights (the read's projection to the model's width, MAC and
    # MAL); null: `model.init_std` (0.02, the rest of the stack's). On the side-by-side
    # stream the read on the residual stream learns with 1 / sqrt(d_mem) and barely with
    # 0.02 (docs/titans.md, "Why it did not learn, by difference").
    read_init_std: float | None = None
    # Where the memory's gradient (Eq. 12) is taken: "chunk", at the weights of each
    # chunk's start (§3.2, Eq. 16); "initial", at the learned initial weights M_0 for every
    # token (titans-pytorch's NeuralMemory with its `batch_size` unset: every gradient of a
    # sequence at the weights it started with). The reads use the current weights in both.
    surprise_at: str = "chunk"
    # The memory M(x) = x + LayerNorm(MLP(x)) (TTT's form, titans-pytorch's default memory;
    # the layer norm without a learned scale) instead of the paper's plain MLP (§3.1).
    memory_residual: bool = False
    # "l2": q and k l2-normalised (§4.4); "rms_input": the memory's input RMS-normalised (a
    # learned scale) before W_Q, W_K, W_V and the gates, q and k not (titans-pytorch's
    # NeuralMemory defaults).
    qk_norm: str = "l2"
    # Native only. Add a fixed sinusoid of each row's position in its segment to the
    # stack's input (model/titans.py `segment_positions`): titans-pytorch's MAC gives its
    # inputs absolute positions, this stack's attention only relative ones. With the
    # segment as the memory's chunk, the memory can then key what it writes by position.
    segment_positions: bool = False


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
    # M_0 ~ N(0, 1/d_in) and the zero gate of Eq. 25 (model/neural_memory.py, titans.py);
    # the XL init's N(0, 0.02) would make a deep memory's reads vanish.
    # W_H (`memory_out.`) at `read_init_std` (model/titans.py).
    own_init = ("memory.", "memory_out.", "memory_gate.", "persistent")
    identity_fields = ("variant", "conv_size")
    pretrained = True
    # Around a pretrained decoder: the persistent rows, then [h_i x_i] pairs sharing a
    # position (model/pretrained/titans.py), so a segment uses P + L positions.
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
        from ..titans import TitansCore
        return TitansCore

    # -- around a pretrained decoder -------------------------------------------------------
    def pretrained_parameters(self, cfg, base, memory_scale):
        from ..pretrained.titans import parameters
        return parameters(cfg, base, memory_scale)

    def pretrained_initial_state(self, lm, batch_size, device=None):
        from ..titans import initial_state
        return initial_state(lm.cfg, lm.memory, batch_size, device)

    def pretrained_decode(self, lm, emb, state):
        from ..pretrained.titans import decode
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
        from ..pretrained.titans import memory_rows
        return memory_rows(cfg, rows, trained_params)
