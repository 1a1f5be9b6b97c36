"""Access to a pretrained decoder's layers that every mechanism hooking them shares (ARMT's
associative blocks, Titans' neural memory, the activation recompute, regional compilation):
where the list of layers is, and what a layer returns.
"""

from __future__ import annotations

from torch import nn

from ..typed import ConfigError


def decoder_layers_name(base) -> str:
    """The name, inside `base.base_model`, of the decoder's list of layers: the one
    nn.ModuleList of `config.num_hidden_layers` entries (Llama's `layers`, GPT-2's `h`)."""
    n = base.config.num_hidden_layers
    found = [name for name, mod in base.base_model.named_modules()
             if isinstance(mod, nn.ModuleList) and len(mod) == n]
    if len(found) != 1:
        raise ConfigError("model.hf.path", f"memtrain hooks the decoder's layers: expected "
                          "one "
                          f"list of {n} modules in {type(base.base_model).__name__}, found "
                          f"{found or 'none'}")
    return found[0]


def layer_hidden(output):
    """A decoder layer's hidden states: transformers 5 layers return the tensor, older ones
    and some families a tuple whose first entry it is."""
    return output[0] if isinstance(output, tuple) else output
