"""The load-balancing loss of a mixture-of-experts base model, as its own forward adds it.

A transformers MoE causal LM (Mixtral, Qwen2/3-MoE, OLMoE, ...; transformers 5.24,
models/<type>/modeling_<type>.py) records each layer's router logits with a forward hook
on its router module (its `_can_record_outputs["router_logits"]`, an OutputRecorder naming
the router class and which of its outputs are the logits) and, when its config says
`output_router_logits`, its `*ForCausalLM.forward` adds

    loss += router_aux_loss_coef * load_balancing_loss_func(router_logits, E, top_k)

(Switch Transformer's auxiliary loss, Fedus et al. 2021, Eqs. 4-6) over every row it ran,
no padding mask. The wrapper runs the decoder itself (wrapper.py), so it records the same
router outputs the same way for one segment's decoder run (`routed`): every row the
mechanism puts through the decoder, memory rows included, as the base model's forward on
those rows would, and computes the loss with the model's own module function
(`balance_loss`). probe.py checks the result against the model's own loss once at load.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

_COEF_ATTRS = ("router_aux_loss_coef", "aux_loss_coef")


@dataclass
class Router:
    """Where a loaded MoE model's router logits come from and how its forward weighs them."""

    modules: list[nn.Module]
    index: int            # which output of a router module holds the logits
    experts: int
    top_k: int
    coef: float
    loss_fn: object       # the modeling module's load_balancing_loss_func

    @contextmanager
    def routed(self) -> Iterator[list[torch.Tensor]]:
        """For the body of a with-block: yields the list the router logits of every run of
        the routers are appended to, in call order."""
        seen: list[torch.Tensor] = []

        def hook(_module, _args, output):
            seen.append(output[self.index] if isinstance(output, (tuple, list)) else output)
        handles = [m.register_forward_hook(hook) for m in self.modules]
        try:
            yield seen
        finally:
            for h in handles:
                h.remove()

    def balance_loss(self, logits: list[torch.Tensor]) -> torch.Tensor:
        """The unweighted load-balancing loss of the recorded router logits."""
        return self.loss_fn(tuple(logits), self.experts, self.top_k, None)


def find_router(base, moe) -> Router | None:
    """The router of `base` (a loaded AutoModelForCausalLM) when its config asks the forward
    to add the load-balancing loss (`moe.aux`, traits.py) and the model records router
    logits and defines the loss; else None (a dense model, or an MoE model trained without
    it, as its own forward would)."""
    if moe is None or not moe.aux:
        return None
    spec = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
    loss_fn = getattr(sys.modules[type(base).__module__], "load_balancing_loss_func", None)
    if spec is None or loss_fn is None:
        return None
    if isinstance(spec, type):
        target, index, layer_name, class_name = spec, 0, None, None
    else:
        target, index = spec.target_class, spec.index
        layer_name, class_name = spec.layer_name, spec.class_name
    modules = [m for name, m in base.base_model.named_modules()
               if ((target is not None and isinstance(m, target))
                   or (class_name and type(m).__name__.endswith(class_name)))
               and (layer_name is None or layer_name in name)]
    if not modules:
        return None
    coef = next((float(getattr(base, a)) for a in _COEF_ATTRS
                 if getattr(base, a, None) is not None), moe.coef)
    return Router(modules, index, int(getattr(base, "num_experts", None) or moe.experts),
                  int(getattr(base, "num_experts_per_tok", None) or moe.top_k), coef, loss_fn)
