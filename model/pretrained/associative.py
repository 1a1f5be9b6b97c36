"""ARMT's associative memory around a pretrained decoder's own layers (Rodkin et al. 2024;
the equations are model/associative.py's, the native forward model/armt.py's).

For each decoder layer l of the base model, during one segment:

    h^{l-1} <- h^{l-1} + read_l(A_l, z_l; h^{l-1})      every row, the state BEFORE the segment
    h^l = Layer_l(h^{l-1})                               the base model's layer, untouched
    (A_l', z_l') = write_l(A_l, z_l; h^l[memory rows])   for the next segment

The base model's forward loop is not ours, so the read is a forward pre-hook and the write
a forward hook on each layer of its decoder list. The hooks live only for one `decode`
call (`associative_pass`): they close over that call's incoming state and collect its
writes, and are removed when the call ends, so no module holds memory between calls (the
state goes in and comes out of `forward`, as everywhere in memtrain) and a re-run of the
whole segment (segment checkpointing recomputes `_forward`) installs its own.

Under HF gradient checkpointing (`model.checkpoint_layers`) transformers checkpoints a
layer's `forward`, not its `__call__` (modeling_layers.py `GradientCheckpointingLayer`),
so the hooks run once, outside the recomputed region: the read's output is the
checkpointed layer's input and the write reads the layer's output, as without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ..associative import AssociativeLayer, AssociativeMemory
from ..typed import ConfigError


def decoder_layers_name(base) -> str:
    """The name, inside `base.base_model`, of the decoder's list of layers: the one
    nn.ModuleList of `config.num_hidden_layers` entries (Llama's `layers`, GPT-2's `h`)."""
    n = base.config.num_hidden_layers
    found = [name for name, mod in base.base_model.named_modules()
             if isinstance(mod, nn.ModuleList) and len(mod) == n]
    if len(found) != 1:
        raise ConfigError("model.hf.path", f"ARMT hooks the decoder's layers: expected one "
                          f"list of {n} modules in {type(base.base_model).__name__}, found "
                          f"{found or 'none'}")
    return found[0]


@dataclass
class SegmentWrites:
    """What one segment's hooks wrote: (A_l', z_l') per layer, in layer order."""

    A: list = field(default_factory=list)
    z: list = field(default_factory=list)

    def state(self, before: AssociativeMemory, tokens=None) -> AssociativeMemory:
        if any(a is None for a in self.A):
            missing = [i for i, a in enumerate(self.A) if a is None]
            raise RuntimeError(f"decoder layers {missing} did not run: no associative write")
        return before.written(self.A, self.z, tokens=tokens)


def _hidden(output):
    """A decoder layer's hidden states: transformers 5 layers return the tensor, older ones
    and some families a tuple whose first entry it is."""
    return output[0] if isinstance(output, tuple) else output


@contextmanager
def associative_pass(layers: nn.ModuleList, blocks: nn.ModuleList, state: AssociativeMemory,
                     n_tok: int) -> Iterator[SegmentWrites]:
    """For the body of a with-block (one run of the base model over [tokens ∘ memory]):
    layer i's input gets block i's read of the incoming state, and block i writes the
    memory rows (those after the first `n_tok`) of layer i's output. Yields the writes."""
    writes = SegmentWrites(A=[None] * len(layers), z=[None] * len(layers))

    def read_hook(i: int, block: AssociativeLayer):
        def hook(module, args, kwargs):
            A, z = state.layer(i)
            if args:   # the hidden states come first, positionally or by name
                return (block.read(A, z, args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": block.read(A, z, kwargs["hidden_states"])}
        return hook

    def write_hook(i: int, block: AssociativeLayer):
        def hook(module, args, output):
            A, z = state.layer(i)
            writes.A[i], writes.z[i] = block.write(A, z, _hidden(output)[:, n_tok:])
        return hook

    handles = []
    try:
        for i, (layer, block) in enumerate(zip(layers, blocks, strict=True)):
            handles.append(layer.register_forward_pre_hook(read_hook(i, block),
                                                           with_kwargs=True))
            handles.append(layer.register_forward_hook(write_hook(i, block)))
        yield writes
    finally:
        for h in handles:
            h.remove()


def armt_inputs(tokens_emb: torch.Tensor, memory_init: torch.Tensor,
                state: AssociativeMemory, carry_tokens: bool) -> torch.Tensor:
    """[E(x) ∘ M] [B, L + m, d]: M the learned memory tokens, or with `carry_tokens` the
    previous segment's write outputs in the rows that have been written (writes > 0)."""
    bsz = tokens_emb.shape[0]
    init = memory_init.to(tokens_emb.dtype)[None].expand(bsz, -1, -1)
    mem = init
    if carry_tokens and state.tokens is not None:
        fresh = (state.writes == 0)[:, None, None]
        mem = torch.where(fresh, init, state.tokens.to(tokens_emb.dtype))
    return torch.cat([tokens_emb, mem], dim=1)
