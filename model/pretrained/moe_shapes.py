"""A mixture-of-experts layer of a pretrained decoder, stated tensor by tensor for the
planner (shapes.py puts it into the segment).

Mixture of experts (Mixtral, Qwen2-MoE; architectures.py `Experts`; Shazeer et al. 2017,
§2.1, top-k gating): every expert's fused tensors, gate_up [E, 2I, d] and down [E, d, I],
are parameters of the layer, all E resident: their gradients and optimizer states are
counted under each ZeRO stage as the dense weights are. transformers 5.24 runs them through
`config._experts_implementation`; from_config and from_pretrained choose "grouped_mm"
(integrations/moe.py: `torch.nn.functional.grouped_mm` over the rows sorted by expert, on
the CPU too with this torch), which memtrain runs and the planner counts. Over N = B·Q rows
and S = k·N routed rows it keeps: the router's input (when its weight trains), its fp32
softmax [N, E] and top-k indices [N, k]; where the top-k probabilities are renormalised
(Mixtral always, Qwen2-MoE per `norm_topk_prob`) the fp32 quotient [N, k] and sum [N, 1];
the load-balancing loss's softmax [N, E] and top-k indices (router.py); the permutations of
the gather by expert, of the weights' gather and back to token order ([S] int64 each) and
the int32 group offsets [E]; the gathered rows [S, d] when gate_up trains or is adapted;
gate_up's output [S, 2I] (SiLU reads its gate half); SiLU's output [S, I] unless recomputed;
down's input [S, I] when down trains or is adapted; down's output [S, d] and the routing
weights [S, 1] (float32 in Mixtral) for the weighted sum. LoRA on a fused tensor (peft's
`target_parameters`) folds W + scaling·B·A into a new [E, ., .] tensor that the grouped
matmul keeps: one per adapted tensor, layer and segment. Qwen2-MoE's shared expert is a
dense SwiGLU over the N rows, with its sigmoid gate [N, 1] and output [N, d]. None of this
depends on how the S rows split among the experts. The other implementations are not
counted: "eager" (a loop over the experts hit) keeps the same rows plus one more [S, d]
and, instead of the three permutations, [S, 2] int64 of indices, also split-independent;
"batched_mm" gathers every routed row's expert weights, keeping [S, 2I, d] and [S, d, I].
Without a grouped_mm kernel (a GPU before compute capability 8.0, or compiled outside bf16)
transformers falls back to its own op, which keeps each grouped matmul's input even when
the expert weights are frozen: [S, d] + [S, I] per layer more than planned.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..shapes import StatedBlock, TensorShape
from .architectures import Layout
from .layer_tensors import (
    Linear,
    linear_inputs,
    norm_backward,
    norm_saves,
    trained_elements,
)
from .traits import config_traits


@dataclass(frozen=True)
class Fused:
    """One fused [E, ., .] expert tensor (or the router's weight) of the meta model."""

    trains: bool           # the tensor itself gets a gradient
    adapted: bool          # peft's ParamWrapper (`target_parameters`) adapts it: the
    #                        forward reads W + scaling·B·A, a new tensor of W's shape


@dataclass(frozen=True)
class MoeFacts:
    """A mixture-of-experts layer's facts (architectures.py `Experts`, the config, the meta
    model)."""

    experts: int           # E
    top_k: int             # k
    size: int              # an expert's intermediate size I
    renormalise: bool
    fp32_weights: bool
    router: Fused
    gate_up: Fused
    down: Fused
    balance: bool          # the forward adds the load-balancing loss (router.py)
    shared_size: int = 0   # the shared expert's intermediate size (0: none)


def fused_of(module, name: str) -> tuple[Fused, int]:
    """The fused tensor `name` of `module` (the experts, or the router's `weight`) through
    the chain of peft ParamWrappers around it, and the trained elements it adds (its own, and
    those of its adapter's lora_A and lora_B)."""
    adapted, elems = False, 0
    while hasattr(module, "base_layer"):
        if getattr(module, "parameter_name", None) == name:
            adapted = True
            elems += sum(p.numel() for n, p in module.named_parameters()
                         if p.requires_grad and n.startswith(("lora_A.", "lora_B.")))
        module = module.base_layer
    p = getattr(module, name)
    return Fused(p.requires_grad, adapted), elems + (p.numel() if p.requires_grad else 0)


def moe_facts(hf, lay: Layout, layer, router) -> tuple[MoeFacts, int, int]:
    """The layer's MoE facts, and the trained elements of its "ffn" block (router, the
    experts' gate_up, the shared expert's gate and up, its gate) and "ffn-out" (down)."""
    ex = lay.moe
    traits = config_traits(hf).moe
    rt, rt_n = fused_of(layer.get_submodule(ex.router), "weight")
    experts = layer.get_submodule(ex.experts)
    gu, gu_n = fused_of(experts, "gate_up_proj")
    dn, dn_n = fused_of(experts, "down_proj")
    renorm = ex.renormalise if isinstance(ex.renormalise, bool) else \
        bool(getattr(hf, ex.renormalise))
    facts = MoeFacts(traits.experts, traits.top_k, int(getattr(hf, ex.size_field)), renorm,
                     ex.fp32_weights, rt, gu, dn, router is not None,
                     int(getattr(hf, ex.shared_field)) if ex.shared else 0)
    shared_in = (*ex.shared[:2], ex.shared_gate) if ex.shared else ()
    return (facts, rt_n + gu_n + trained_elements(layer, shared_in) if shared_in else rt_n + gu_n,
            dn_n + (trained_elements(layer, ex.shared[2:]) if ex.shared else 0))


def moe_blocks(f, lay: Layout, b: int, q: int, d: int, recompute: bool, mm
                ) -> tuple[StatedBlock, ...]:
    """The "ffn", "experts" and "ffn-out" blocks of a mixture-of-experts layer (module
    docstring) over N = B·Q rows, S = k·N routed rows, as the `grouped_mm` experts
    implementation runs them."""
    m, t, lin, ex = f.moe, TensorShape, f.linears, lay.moe
    n, k, e, i, si = b * q, f.moe.top_k, f.moe.experts, f.moe.size, f.moe.shared_size
    s = k * n
    shared = [lin[x] for x in ex.shared]
    gate = [lin[ex.shared_gate]] if si else []
    router = Linear(m.router.trains or m.router.adapted)
    up_reads = m.gate_up.trains or m.gate_up.adapted
    down_reads = m.down.trains or m.down.adapted
    f32 = lambda shape: t(shape, "fp32", category="ffn")  # noqa: E731
    saved = [*norm_saves(lay, b, q, d, f.norm_trains[lay.ffn_norm]),
             *linear_inputs([router, *shared[:2], *gate], b, q, d, "ffn"),
             *([t((e, d), category="ffn")] if m.router.adapted else []),
             f32((n, e)),                                     # the router's softmax
             t((n, k), "int64", category="ffn"),              # top-k's indices
             *([f32((n, k)), f32((n, 1))] if m.renormalise else []),
             # the load-balancing loss (router.py) redoes the softmax and the top-k (whose
             # saved indices are freed with it at once: its values are not used; counted)
             *([t((n, e), category="ffn"), t((n, k), "int64", category="ffn")]
               if m.balance else []),
             # the gather by expert, the weights' gather, the inverse permutation
             t((s,), "int64", count=3, category="ffn"),
             f32((e,)),                                       # int32 offsets, 4 B each
             *([t((s, d), category="ffn")] if up_reads else []),
             *([t((e, 2 * i, d), category="ffn")] if m.gate_up.adapted else [])]
    if si:   # the shared expert: a dense SwiGLU over all N rows
        saved.append(t((n, si), count=2 if recompute else 3, category="ffn"))
    ffn = StatedBlock(
        "ffn", saved=tuple(saved), alive=(t((b, q, d)),),
        # gate_up's grouped matmul backward: its output's gradient, its input's and its
        # weight's; the gather's scatter back to N rows; the norm's
        phases=((t((s, 2 * i)), t((s, d)), t((b, q, d)),
                 *([t((e, 2 * i, d))] if up_reads else [])),
                norm_backward(lay, b, q, d)),
        trained_params=f.trained["ffn"],
        ops=tuple(mm([router, *shared[:2], *gate], [e, *([si, si, 1] if si else [])], d)))
    # The routed rows' gate and up outputs (one [S, 2I] storage: the SiLU reads a view of
    # it) and the SiLU's output unless recomputed; freed once their backward has run, before
    # gate_up's.
    experts = StatedBlock(
        "experts", saved=(t((s, 2 * i), category="ffn"),
                          *([] if recompute else [t((s, i), category="ffn")])),
        alive=(t((b, q, d)),),
        # the product's gradient, SiLU(gate) (recomputed or kept) and the two operands'
        # gradients; then SiLU's gradient beside up's and their [S, 2I] concatenation
        phases=((t((s, i), count=4 if recompute else 3),), (t((s, i), count=2),
                                                             t((s, 2 * i)))))
    ffn_out = StatedBlock(
        "ffn-out",
        saved=(*([t((s, i), category="ffn")] if down_reads else []),
               *([t((e, d, i), category="ffn")] if m.down.adapted else []),
               t((s, d), category="ffn"),                     # the experts' output rows
               t((s, 1), "fp32" if m.fp32_weights else "model", category="ffn"),
               *(linear_inputs(shared[2:], b, q, si, "ffn") if si else []),
               *([t((n, 1), category="ffn"), t((n, d), category="ffn")] if si else [])),
        alive=(t((b, q, d)),),
        phases=((t((s, d), "fp32" if m.fp32_weights else "model"), t((s, d)), t((s, i)),
                 *([t((e, d, i))] if down_reads else [])),),
        trained_params=f.trained["ffn-out"],
        ops=tuple(mm(shared[2:], [d], si)) if si else (),
        # the gathered rows (a local of the experts' forward, kept or not), the weighted
        # rows and their copy back in token order, in the routing weights' dtype
        forward=(*([] if up_reads else [t((s, d))]),
                 t((s, d), "fp32" if m.fp32_weights else "model", count=2)))
    return ffn, experts, ffn_out
