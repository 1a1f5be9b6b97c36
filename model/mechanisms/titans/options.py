"""Titans' options, `model.titans` (a field of model/config.py `ModelConfig`): the
dataclass alone, so that the config can declare it without importing the mechanism."""

from __future__ import annotations

from dataclasses import dataclass

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
    # N_p, the persistent memory tokens (Eq. 19), per layer (model/mechanisms/titans/core.py).
    num_persistent: int = 4
    # Bounds of the data-dependent gates: theta_t in (0, max_lr], eta_t in (0, max_momentum],
    # alpha_t in (0, max_forget] (each the bound times a sigmoid).
    max_lr: float = 0.5
    max_momentum: float = 0.9
    max_forget: float = 1.0
    # Each token's gradient of each memory matrix clipped to this Frobenius norm (not in
    # the paper; without it the memory overflows at the gates' bounds,
    # model/mechanisms/titans/neural_memory.py).
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
    # stack's input (model/mechanisms/titans/core.py `segment_positions`): titans-pytorch's MAC
    # gives its inputs absolute positions, this stack's attention only relative ones. With the
    # segment as the memory's chunk, the memory can then key what it writes by position.
    segment_positions: bool = False
