"""The feed-forward activation's output recomputed in backward from its input, not kept.

In a transformer layer's MLP, `W_2 · act(W_1 x)` (or Llama's `W_d (act(W_g x) * W_u x)`),
autograd keeps the activation's input (the activation's own backward needs it) and its
output (the next matmul's input, or the product's operand): two [B, Q, I] tensors, I = 4d
for GPT-2, where the output is a pure elementwise function of the input. It is the largest
tensor of a GPT-2 layer: 6,144 of its 26,688 bytes per token in bf16 (BENCHMARKS.md, "The
step at the shapes users run"). Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", §4) recompute in backward exactly the parts of a
layer whose memory is large and whose FLOPs are small; an elementwise activation is the
extreme case: one read of I per token, no matmul.

How, without changing any module: while an MLP's forward runs, a pair of saved-tensor hooks
sits on top of the hooks already there (segment checkpointing's, HF's gradient
checkpointing's, or none). Every tensor saved for backward passes through `pack`; one that
is an activation's output (the same storage) is stored as the activation's input plus the
function, and `unpack` evaluates the function again when backward asks for it. Any other
tensor is handed on to the hooks below unchanged, so checkpointing sees the same tensors in
the same order in its first forward and in its re-run. The recomputed values are the same
kernel on the same input: gradients are bitwise those of the kept output
(tests/test_activation_recompute.py).

`model.hf.recompute_activation` (default true) installs it at load; a compiled layer
(`model.compile`) has it removed, since the compiler's partitioner already chooses what to
recompute among the elementwise ops it fuses.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..typed import ConfigError
from .layers import decoder_layers_name

# Activations that run as one kernel: recomputing them costs one read of the input. (The
# Python ones, e.g. `gelu_new` with `model.hf.fused_gelu: false`, keep several tensors of
# their own anyway and would cost a kernel per op again.)
_ONE_KERNEL = (nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.Hardswish,
               nn.LeakyReLU, nn.ReLU6)
_HF_ONE_KERNEL = ("SiLUActivation",)
_HF_KERNEL_OR_PYTHON = ("GELUActivation", "GELUTanh")   # `act`: torch's kernel or a method


def is_activation(module: nn.Module) -> bool:
    """A one-kernel elementwise activation: torch's, or transformers' own that call one."""
    if isinstance(module, _ONE_KERNEL):
        return True
    if type(module).__module__ != "transformers.activations":
        return False
    name = type(module).__name__
    return name in _HF_ONE_KERNEL or (name in _HF_KERNEL_OR_PYTHON
                                      and not inspect.ismethod(getattr(module, "act", None)))


class _Recomputed:
    """A saved activation output, stored as what recomputes it."""

    __slots__ = ("fn", "offset", "packed", "size", "stride")

    def __init__(self, packed, fn, size, stride, offset):
        self.packed, self.fn = packed, fn
        self.size, self.stride, self.offset = size, stride, offset


class _Scope:
    """The hooks of one MLP forward: the activations' (output, input, function) it ran."""

    def __init__(self):
        self.outputs: list[tuple[torch.Tensor, torch.Tensor, object]] = []
        # The hooks below ours, captured on entry (None: none), so pack and unpack compose.
        below = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.below_pack, self.below_unpack = below if below else (None, None)

    def pack(self, t: torch.Tensor):
        for out, inp, fn in self.outputs:
            if (t.dtype == out.dtype and t.device == out.device
                    and t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()):
                kept = inp if self.below_pack is None else self.below_pack(inp)
                return _Recomputed(kept, fn, t.size(), t.stride(),
                                   t.storage_offset() - out.storage_offset())
        return t if self.below_pack is None else self.below_pack(t)

    def unpack(self, packed):
        if isinstance(packed, _Recomputed):
            inp = packed.packed if self.below_unpack is None else self.below_unpack(
                packed.packed)
            with torch.no_grad():
                out = packed.fn(inp)
            return out.as_strided(packed.size, packed.stride, packed.offset)
        return packed if self.below_unpack is None else self.below_unpack(packed)


def _wrap_mlp(mlp: nn.Module, acts: list[nn.Module]) -> None:
    scopes: list[_Scope] = []    # the MLP forward running now (nested calls: innermost last)
    mlp_forward = mlp.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return mlp_forward(*args, **kwargs)
        scope = _Scope()
        scopes.append(scope)
        try:
            with torch.autograd.graph.saved_tensors_hooks(scope.pack, scope.unpack):
                return mlp_forward(*args, **kwargs)
        finally:
            # Every saved tensor's unpack holds the scope: drop its references to the
            # outputs, or they would live until backward after all.
            scopes.pop().outputs.clear()

    for act in acts:
        act_forward = act.forward

        def recorded(x, _fn=act_forward):
            out = _fn(x)
            if scopes and isinstance(x, torch.Tensor) and out.requires_grad:
                scopes[-1].outputs.append((out, x, _fn))
            return out

        _swap_forward(act, recorded)
    _swap_forward(mlp, forward)


def _swap_forward(module: nn.Module, forward) -> None:
    # What `remove_recompute` restores: the instance's own forward, if it had one.
    module._memtrain_eager_forward = module.__dict__.get("forward")
    module.forward = forward


def recompute_activations(base: nn.Module, opts) -> int:
    """Install the recompute (module docstring) in every decoder layer's MLP of the loaded
    `base` if `opts.recompute_activation`; returns the number of activation modules."""
    if not opts.recompute_activation:
        return 0
    try:
        layers = base.base_model.get_submodule(decoder_layers_name(base))
    except ConfigError:
        # No single list of decoder layers to find the MLPs in: that is the memory
        # mechanism's business to refuse (or not), not this optimisation's; run as loaded.
        return 0
    count = 0
    for layer in layers:
        parents: dict[nn.Module, list[nn.Module]] = {}
        for parent in layer.modules():
            for child in parent.children():
                if is_activation(child):
                    parents.setdefault(parent, []).append(child)
        for parent, acts in parents.items():
            if not hasattr(parent, "_memtrain_eager_forward"):
                _wrap_mlp(parent, acts)
                count += len(acts)
    return count


def remove_recompute(base: nn.Module) -> int:
    """Undo `recompute_activations` (before compiling the layers); returns how many modules
    got their own forward back."""
    undone = 0
    for module in base.modules():
        if "_memtrain_eager_forward" in module.__dict__:
            own = module.__dict__.pop("_memtrain_eager_forward")
            if own is None:
                del module.forward       # the class's forward again
            else:
                module.forward = own
            undone += 1
    return undone
