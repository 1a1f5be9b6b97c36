"""ARMT's associative memory around a pretrained decoder's own layers (Rodkin et al. 2024;
the equations are model/mechanisms/armt/associative.py's, the native forward
model/mechanisms/armt/core.py's).

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
so the hooks run outside the recomputed region. They then checkpoint the read and the
write themselves (`checkpoint=True`): per layer only the read's input and output (the
layer's input) and the state stay, as checkpointing a layer promises, and nothing is
computed twice in the forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from ...pretrained.layers import layer_hidden
from ...shapes import StatedBlock, TensorShape
from .associative import AssociativeLayer, AssociativeMemory, FeatureMap


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


@contextmanager
def associative_pass(layers: nn.ModuleList, blocks: nn.ModuleList, state: AssociativeMemory,
                     n_tok: int, checkpoint: bool = False, write: bool = True
                     ) -> Iterator[SegmentWrites]:
    """For the body of a with-block (one run of the base model over [tokens ∘ memory]):
    layer i's input gets block i's read of the incoming state, and block i writes the
    memory rows (those after the first `n_tok`) of layer i's output. Yields the writes.
    `checkpoint`: keep only the inputs of each read and write, recompute them in backward
    (non-reentrant, as the layers' own checkpointing). `write=False`: the reads alone, for
    runs over token rows only (the open segment of a generation, incremental.py), whose
    memory rows come later; the writes stay empty."""
    writes = SegmentWrites(A=[None] * len(layers), z=[None] * len(layers))
    # One unbind for every hook (AssociativeMemory.layers), inside the segment's forward, so
    # a checkpointed segment's re-run makes its own.
    A_in, z_in, grad_A = state.layers()
    # Layer i's A_l as its read hands it on (AssociativeLayer.read_passing): the write takes
    # it, so that backward assembles the gradient of A_l in one place.
    passed = list(A_in)

    def run(fn, *args):
        return _checkpoint(fn, *args, use_reentrant=False) if checkpoint else fn(*args)

    def read_hook(i: int, block: AssociativeLayer):
        def read(A, z, h):
            return block.read_passing(A, z, h, grad_A, i)

        def hook(module, args, kwargs):
            if args:   # the hidden states come first, positionally or by name
                h, passed[i] = run(read, A_in[i], z_in[i], args[0])
                return (h, *args[1:]), kwargs
            h, passed[i] = run(read, A_in[i], z_in[i], kwargs["hidden_states"])
            return args, {**kwargs, "hidden_states": h}
        return hook

    def write_hook(i: int, block: AssociativeLayer):
        def hook(module, args, output):
            writes.A[i], writes.z[i] = run(block.write, passed[i], z_in[i],
                                           layer_hidden(output)[:, n_tok:])
        return hook

    handles = []
    try:
        for i, (layer, block) in enumerate(zip(layers, blocks, strict=True)):
            handles.append(layer.register_forward_pre_hook(read_hook(i, block),
                                                           with_kwargs=True))
            if write:
                handles.append(layer.register_forward_hook(write_hook(i, block)))
        yield writes
    finally:
        for h in handles:
            h.remove()


def associative_shapes(cfg, rows: int, q: int, m: int, trained_params: int
                       ) -> tuple[StatedBlock, tuple[TensorShape, ...], str,
                                  tuple[TensorShape, ...]]:
    """For the planner (shapes.py): one layer's associative read and write as a stated
    block, the state (A, z per layer, float32; the carried tokens where configured) and its
    text. What autograd keeps (model/mechanisms/armt/associative.py; listed off a tiny model's saved
    tensors): the read's input h, the two ReLU outputs of DPFP, its two factors and phi(q)
    (which the einsum keeps when A requires grad: from a window's second segment on), phi^T A
    and phi^T z (the division's operands); the write's inputs (each projection copies the
    strided memory rows), the ReLU outputs, the factors and phi(k), and what the write's
    hand-written backward keeps (model/mechanisms/armt/associative_grad.py): phi(k)^T A, v - vbar,
    beta and phi(k)^T z + eps; the z update keeps gamma. In a window's first segment phi(q) is not
    kept (A does not require grad). Last, the incoming A and z, which every layer reads:
    for the segment's input side (the embedding block, which layer checkpointing leaves alone);
    made inside the window from its second segment on, in its first one they are the
    carried state itself (counted once more)."""
    o, t = cfg.armt, TensorShape
    b, d, dk = rows, cfg.d_model, o.d_key
    d_phi = FeatureMap(o.feature_map, o.nu).out_dim(dk)
    fp32 = lambda *shape, n=1: t(shape, "fp32", count=n, category="extra")  # noqa: E731
    block = StatedBlock(
        "associative",
        saved=(t((b, q, d), category="extra"), fp32(b, q, dk, n=2), fp32(b, q, d_phi, n=3),
               fp32(b, q, d), fp32(b, q, 1),
               t((b, m, d), count=3, category="extra"), fp32(b, m, dk, n=2),
               fp32(b, m, d_phi, n=3), fp32(b, m, d, n=2), fp32(b, m, 1, n=3)),
        alive=(t((b, q, d)),),
        # the features' and the retrieved values' fp32 gradients, A's from read and write
        phases=((t((b, q, d_phi), "fp32", 2), t((b, q, d), "fp32", 2),
                 t((b, d_phi, d), "fp32", 2)),),
        trained_params=trained_params)
    state = [t((b, cfg.n_layer, d_phi, d), "fp32"), t((b, cfg.n_layer, d_phi), "fp32")]
    text = f"ARMT A [{b}, {cfg.n_layer}, {d_phi}, {d}] + z [{b}, {cfg.n_layer}, {d_phi}] fp32"
    if o.carry_tokens:
        state.append(t((b, m, d)))
        text += f", memory tokens [{b}, {m}, {d}]"
    return block, tuple(state), text, tuple(state[:2])
