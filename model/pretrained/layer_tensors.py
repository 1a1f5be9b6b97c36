"""What the pieces of a pretrained decoder layer keep for backward, stated tensor by tensor
for the planner (shapes.py composes them into a segment; moe_shapes.py into a mixture of
experts' layer): norms, linear layers with their LoRA adapters, dropout, the activations, and
the matmul outputs the selective recompute policies name (train/recompute.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..shapes import TensorShape
from .architectures import Layout

# [B, Q, I] tensors an activation keeps: its input (SiLU, exact and tanh GELU kernels), or
# the four of transformers' Python tanh GELU (shapes.py's docstring).
ACTIVATION_SAVES = {"silu": 1, "swish": 1, "gelu": 1, "gelu_pytorch_tanh": 1, "relu": 1,
                    "gelu_new": 4}


@dataclass(frozen=True)
class Linear:
    """What one (possibly adapted) linear layer of the meta model says about training."""

    trains: bool           # its own weight gets a gradient
    lora_r: int = 0        # LoRA rank (0: no adapter)
    lora_dropout: float = 0.0

    @property
    def keeps_input(self) -> bool:   # its input tensor itself is saved
        return self.trains or (self.lora_r > 0 and self.lora_dropout == 0)


def linear_of(module) -> Linear:
    base = getattr(module, "base_layer", module)
    lora = getattr(module, "lora_A", None)
    if not lora:
        return Linear(base.weight.requires_grad)
    name = next(iter(lora))
    drop = module.lora_dropout[name]
    return Linear(base.weight.requires_grad, module.r[name], float(getattr(drop, "p", 0.0)))


def trained_elements(module, prefixes) -> int:
    return sum(p.numel() for n, p in module.named_parameters()
               if p.requires_grad and n.startswith(prefixes))


def norm_saves(lay: Layout, rows: int, q: int, d: int, trains: bool) -> list[TensorShape]:
    """What a norm over [rows, q, d] keeps (shapes.py's docstring)."""
    if lay.norm == "rms":
        out = [TensorShape((rows, q, d), "fp32", category="layernorm"),
               TensorShape((rows, q, 1), "fp32", category="layernorm")]
        return out + ([TensorShape((rows, q, d), category="layernorm")] if trains else [])
    return [TensorShape((rows, q, d), category="layernorm"),
            TensorShape((rows, q, 1), "stat", 2, category="layernorm")]


def norm_backward(lay: Layout, rows: int, q: int, d: int) -> tuple[TensorShape, ...]:
    """A norm's backward: the gradient reaching it, and RMSNorm's three fp32 [rows, q, d]
    (it differentiates in fp32: the gain's product, x·rsqrt, x²) or LayerNorm's input
    gradient."""
    g = TensorShape((rows, q, d))
    return (g, TensorShape((rows, q, d), "fp32", 3)) if lay.norm == "rms" else (g, g)


def linear_inputs(linears: list[Linear], rows: int, q: int, width: int, category: str,
            input_counted: bool = False) -> list[TensorShape]:
    """What linear layers reading one input of `width` keep: that input once, if any of them
    keeps it (and it is not `input_counted` elsewhere); each adapter's dropped copy and mask
    (lora_dropout > 0) and lora_A's output."""
    out = []
    if any(x.keeps_input for x in linears) and not input_counted:
        out.append(TensorShape((rows, q, width), category=category))
    for x in linears:
        if x.lora_r and x.lora_dropout > 0:
            out += [TensorShape((rows, q, width), "mask", category="dropout"),
                    TensorShape((rows, q, width), category=category)]
        if x.lora_r:
            out.append(TensorShape((rows, q, x.lora_r), category=category))
    return out


def weight_grads(linears: list[Linear], fan_in: int, fan_out: int) -> list[TensorShape]:
    """The weight gradients a backward allocates (before adding them to `.grad`)."""
    return [TensorShape((fan_in, fan_out)) for x in linears if x.trains]


def dropout_masks(p: float, shape: tuple[int, ...]) -> list[TensorShape]:
    return [TensorShape(shape, "mask", category="dropout")] if p > 0 else []


def dropout_draws(p: float, shape: tuple[int, ...]) -> list[TensorShape]:
    return [TensorShape(shape, "bool", category="draws")] if p > 0 else []


def matmul_outputs(linears: list[Linear], widths: list[int], rows: int, q: int, fan_in: int,
             inner: int) -> list[TensorShape]:
    """The mm / addmm outputs of linear layers of `fan_in` inputs and `widths` outputs, with
    their adapters' (lora_A, lora_B) and lora_dropout's draws, for train/recompute.py: a
    matmul reducing over d_inner (`inner`) is its "ffn-out"."""
    kind = lambda k: "ffn-out" if k == inner else "linear"  # noqa: E731
    out = []
    for x, w in zip(linears, widths, strict=True):
        out.append(TensorShape((rows, q, w), category=kind(fan_in)))
        if x.lora_r:
            out += [TensorShape((rows, q, x.lora_r), category=kind(fan_in)),
                    TensorShape((rows, q, w), category=kind(x.lora_r)),
                    *dropout_draws(x.lora_dropout, (rows, q, fan_in))]
    return out
