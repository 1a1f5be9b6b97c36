"""`model.compile` around a pretrained model: each decoder layer's forward compiled on its
own (regional compilation, as torchtitan's `apply_compile` does, Liang et al. 2024: one
transformer block at a time, not the whole model).

Why per layer, not the whole base model:
- The layers are instances of one class: Dynamo traces a layer's `forward` once and the
  others reuse the graph, their parameters its inputs (`inline_inbuilt_nn_modules`), so a
  model compiles once per layer kind, whatever its depth (tests/test_pretrained_compile.py
  counts the graphs: one per layer kind and segment shape).
- Only `forward` is swapped on the instance, not the module's call: the forward hooks of
  ARMT and Titans (model/mechanisms/armt/pretrained.py, titans.py: the memory's read before a layer,
  its write after) run eager around the compiled layer, and so do ZeRO-3's gathers and HF's
  gradient checkpointing (`model.checkpoint_layers`), which wraps the layer's call. The
  embedding, the rotary table, the masks and the head stay eager too.
- Inside a layer the compiler fuses what sits between the matmuls: LayerNorm or RMSNorm
  (RMSNorm's fp32 upcast included), the residual adds, GPT-2's activation, SwiGLU's SiLU
  and product, dropout, and peft's LoRA adapters' adds. (Liger Kernel's hand-written norms
  are not used: the compiled layer already fuses them, on any device.)

As for the native stack (model/compiled.py): only calls with gradients enabled go through
the compiled code (evaluation and generation, with the KV cache, stay eager), parameter
names and state_dict keys do not change, dropout draws from torch's generator in eager
order (`fallback_random`), so the losses are eager's to float tolerance, and
`model.compile_backend` picks Inductor or aot_eager.
"""

from __future__ import annotations

import torch
from torch import nn

from .activation_recompute import remove_recompute
from .layers import decoder_layers_name


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The base model's list of decoder layers (PretrainedMemoryLM's `base`)."""
    base = model.base
    return base.base_model.get_submodule(decoder_layers_name(base))


def compile_decoder_layers(model: nn.Module, backend: str, compile_fn) -> int:
    """Swap each decoder layer's `forward` for a compiled one (module docstring), in place;
    `compile_fn(fn, backend)` is model/compiled.py's torch.compile. Returns the number of
    layers."""
    layers = decoder_layers(model)
    # The compiler's partitioner picks what to recompute among the elementwise ops it fuses
    # (the activation included); saved-tensor hooks inside a traced layer would only get in
    # its way (activation_recompute.py).
    remove_recompute(model.base)
    kinds = {type(layer) for layer in layers}
    # A graph per kind of layer and per shape of segment (the full one, then a short last
    # segment, compiled with a dynamic length), with room for inputs that guard otherwise
    # (e.g. with or without gradient): past torch's per-function limit a layer would
    # silently run eager, so raise it (process-wide, only ever raised).
    needed = 4 * len(kinds) + 4
    if torch._dynamo.config.recompile_limit < needed:
        torch._dynamo.config.recompile_limit = needed
    for layer in layers:
        eager = layer.forward
        compiled = compile_fn(eager, backend)

        def forward(*args, _eager=eager, _compiled=compiled, **kwargs):
            if not torch.is_grad_enabled():
                return _eager(*args, **kwargs)
            return _compiled(*args, **kwargs)

        layer.forward = forward
    return len(layers)
