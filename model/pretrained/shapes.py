"""One training segment of a pretrained decoder with memory tokens, stated tensor by tensor
for the GPU-memory planner (model/shapes.py `StatedLayer`; planner/ turns it into bytes).

PretrainedMemoryLM (wrapper.py) runs the base model's own decoder over Q = 2m + L rows
[read | tokens | write] (Bulatov et al. 2022, §3) with a [1, 1, Q, Q] boolean mask, then the
vocabulary head over the L token rows and an fp32 cross-entropy. What autograd keeps was
read off the transformers modules (5.24) and checked by listing the saved tensors of a
tiny model (benchmarks/bench_memory_plan.py measures them); B rows, d, H query heads of
d_head, intermediate size I, vocabulary V:

- Llama family (llama, mistral, qwen2): RMSNorm upcasts its input to fp32 and keeps that
  copy (in an fp32 model: the input itself) and the fp32 rsqrt [B, Q, 1], and the
  normalised rows when its gain trains; q/k/v's input; RoPE's cos and sin [B, Q, d_head]
  (computed once per segment); the rotated q and k and v, keys and values repeated to H
  heads when grouped-query attention has fewer (a copy); SwiGLU keeps the gate's output,
  the SiLU's output and up's output [B, Q, I], and down's input when down trains.
- GPT-2: LayerNorm keeps its input, mean and rstd; c_attn's output [B, Q, 3d] (q, k, v are
  views of it); the tanh-approximated GELU keeps its input when it runs fused (the
  default, `model.hf.fused_gelu`, activations.py), written out in Python (`gelu_new`) four
  [B, Q, 4d] tensors (its input, tanh, 0.5·x, 1 + tanh); dropout masks after c_proj, the
  MLP and the embeddings when the config's dropout is on.
- A linear layer keeps its input only when its weight trains: a frozen base keeps no
  projection inputs, and LoRA (Hu et al. 2021, peft) keeps the adapter's input (the
  layer's input itself without lora_dropout; with it the dropped copy and its mask) and
  lora_A's output [B, Q, r].
- Embedding: the token ids when the embedding trains (GPT-2: the position ids too); the
  head: the final norm, the head's input rows [B·L, d] (the loss runs over chunks of rows
  recomputed in backward, model/loss.py: no [B·L, V] log-softmax is kept), the targets.
- SDPA (one call per layer, keys = queries = Q): the planner adds what the kernel keeps
  (its output, which o_proj reads as its input, the log-sum-exp, the mask in the model
  dtype), since that depends on the device.
The state: the write rows' copy [B, m, d].

A mixture of experts' layer: moe_shapes.py.

ARMT (`mechanism: armt`, Rodkin et al. 2024; wrapper.py, model/mechanisms/armt/pretrained.py): Q = L
+ m rows [tokens | memory] under the base model's causal mask, no read block; before each layer an
associative block (model/mechanisms/armt/pretrained.py `associative_shapes`: its read and write, and
the layer's A and z), and the state A, z per layer in float32. Under `checkpoint_layers` the hooks
checkpoint the read and write too: a layer keeps the read's input and output, 2Q rows.

Which parameters train is read from the model itself, built on the meta device from the
checkpoint's config (no weights): the same `apply_finetune` (full, frozen, LoRA on peft's
or the configured targets) that training runs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

from ..loss import chunk_rows
from ..shapes import SdpaShape, SegmentShapes, StatedBlock, StatedLayer, TensorShape
from ..typed import ConfigError
from .activations import effective_activation
from .architectures import GPT2, MOE_LAYOUTS, Layout, layout_of, planned
from .checkpoint_config import SHAPE_FIELDS, hf_config, require_shape
from .layer_tensors import (
    ACTIVATION_SAVES,
    Linear,
    dropout_draws,
    dropout_masks,
    linear_inputs,
    linear_of,
    matmul_outputs,
    norm_backward,
    norm_saves,
    trained_elements,
    weight_grads,
)
from .moe_shapes import MoeFacts, moe_blocks, moe_facts
from .traits import config_traits


@dataclass(frozen=True)
class Base:
    """The meta model's facts the shapes need (read once per checkpoint and finetune mode)."""

    model_type: str
    kv_heads: int
    activation: str
    dropout: float         # residual dropout (GPT-2), 0 when the family has none
    embd_dropout: float
    rotary: bool
    linears: dict          # layer-relative module name -> Linear
    norm_trains: dict      # layer-relative norm name (and the final norm) -> bool
    embedding_trains: tuple[bool, ...]   # per `Layout.embeddings`
    head: Linear
    tied: bool             # lm_head's weight is the input embedding's
    trained: dict          # block name -> trained parameter elements it uses
    total: int             # all parameters (the memory's included)
    trained_total: int
    largest: int           # the largest single tensor
    positions: int         # rows of a learned position table (0: none)
    moe: MoeFacts | None = None


def layout(hf) -> Layout:
    """The planner's layout of the checkpoint's architecture (architectures.py), or a
    ConfigError naming the architectures it has one for, or what of a planned one's config
    it does not count."""
    lay = layout_of(hf.model_type)
    if lay is None:
        raise ConfigError("model.hf.path", f"`memtrain plan` has no segment shapes for "
                          f"{hf.model_type!r} (model/pretrained/shapes.py); planned mixtures "
                          f"of experts: {', '.join(sorted(MOE_LAYOUTS))}; planned "
                          f"architectures: {', '.join(planned())}")
    act = getattr(hf, lay.act_field)
    if act not in ACTIVATION_SAVES:
        raise ConfigError("model.hf.path", f"`memtrain plan` does not count the activation "
                          f"{act!r} ({lay.act_field}); counted: {', '.join(ACTIVATION_SAVES)}")
    if lay.moe is not None:
        # Every layer is stated alike: a dense layer among the sparse ones, or the routers'
        # multiplicative jitter on their input, is not.
        uneven = {"mlp_only_layers": bool(getattr(hf, "mlp_only_layers", None)),
                  "decoder_sparse_step": getattr(hf, "decoder_sparse_step", 1) != 1,
                  "router_jitter_noise": bool(getattr(hf, "router_jitter_noise", 0.0))}
        for field, on in uneven.items():
            if on:
                raise ConfigError("model.hf.path", f"`memtrain plan` states every layer of "
                                  f"{hf.model_type!r} as one sparse mixture-of-experts layer "
                                  f"without router jitter; its config's {field} "
                                  f"({getattr(hf, field)!r}) is not counted")
    return lay


@functools.lru_cache(maxsize=4)
def _base(key: str) -> Base:
    from ..config import ModelConfig
    from .wrapper import meta_model
    cfg = ModelConfig.from_dict(json.loads(key))
    hf = hf_config(cfg.hf)
    lay = layout(hf)
    base, lm = meta_model(cfg, hf)
    top = base.base_model
    layer = getattr(top, lay.layers)[0]
    names = (*lay.qkv, lay.out, *lay.ffn_in, *([lay.ffn_out] if lay.ffn_out else []),
             *((*lay.moe.shared, lay.moe.shared_gate) if lay.moe and lay.moe.shared else ()))
    moe, moe_in, moe_out = moe_facts(hf, lay, layer, lm._router) if lay.moe else (None, 0, 0)
    ffn_in = lay.ffn_in if not lay.moe else ()
    norm = lambda mod: all(p.requires_grad for p in mod.parameters())  # noqa: E731
    params = list(lm.parameters())
    head = base.get_output_embeddings()
    return Base(
        model_type=hf.model_type,
        kv_heads=getattr(hf, "num_key_value_heads", None) or cfg.n_head,
        activation=effective_activation(hf, lay.act_field, cfg.hf),
        dropout=float(getattr(hf, lay.dropouts[0], 0.0) or 0.0) if lay.dropouts[0] else 0.0,
        embd_dropout=float(getattr(hf, lay.dropouts[1], 0.0) or 0.0) if lay.dropouts[1]
        else 0.0,
        rotary=config_traits(hf).positions == "rotary",
        linears={n: linear_of(layer.get_submodule(n)) for n in names},
        norm_trains={lay.attn_norm: norm(layer.get_submodule(lay.attn_norm)),
                     lay.ffn_norm: norm(layer.get_submodule(lay.ffn_norm)),
                     "final": norm(top.get_submodule(lay.final_norm))},
        embedding_trains=tuple(top.get_submodule(e).weight.requires_grad
                               for e in lay.embeddings),
        head=linear_of(head),
        tied=head.weight is base.get_input_embeddings().weight,
        trained={"attention": trained_elements(layer, (lay.attn_norm, *lay.qkv)),
                 "attention-out": trained_elements(layer, (lay.out,)),
                 "ffn": trained_elements(layer, (lay.ffn_norm, *ffn_in)) + moe_in,
                 "ffn-out": (trained_elements(layer, (lay.ffn_out,)) if lay.ffn_out else 0)
                 + moe_out,
                 "embedding": trained_elements(top, lay.embeddings)
                 + trained_elements(lm, ("memory_init",)),
                 "associative": trained_elements(lm, ("associative.0.",)),
                 "head": trained_elements(top, (lay.final_norm,))
                 + (0 if head.weight is base.get_input_embeddings().weight
                    else trained_elements(head, ("",)))},
        total=sum(p.numel() for p in params),
        trained_total=sum(p.numel() for p in params if p.requires_grad),
        largest=max(p.numel() for p in params),
        positions=getattr(hf, "n_positions", 0) if lay is GPT2 else 0, moe=moe)


def base_facts(cfg) -> Base:
    """The meta model's facts for `cfg` (a ModelConfig with `backbone: hf` whose shape was
    read); independent of the segment length, so one build serves every length the planner
    tries."""
    require_shape(cfg, "the planner's segment shapes")
    key = {"mechanism": cfg.mechanism, "backbone": "hf", "mem_len": 0, "tgt_len": 1,
           **{name: dataclasses.asdict(o) for name, o in cfg.mechanism_sections().items()},
           "hf": dataclasses.asdict(cfg.hf),
           **{name: getattr(cfg, name) for name in SHAPE_FIELDS}}
    return _base(json.dumps(key, sort_keys=True))


def segment_shapes(cfg, rows: int, mem_len: int) -> SegmentShapes:
    """One training segment of `rows` batch rows (module docstring); mem_len is always 0
    (a pretrained backbone keeps no XL cache). The backward phases were read off the
    allocator's events of each backward node (benchmarks/bench_memory_plan.py)."""
    f = base_facts(cfg)
    lay = layout_of(f.model_type)
    b, n = rows, cfg.tgt_len
    # The mechanism's rows: RMT's [read | tokens | write], ARMT's [tokens | memory], ...
    mem = cfg.mech.pretrained_rows(cfg, b, f.trained["associative"])
    # No mask: the base model's own causal one, or the mechanism's own maskless calls.
    q, no_mask = mem.rows, mem.own_mask or bool(mem.sdpa_calls)
    d, h, dh, inner = cfg.d_model, cfg.n_head, cfg.d_head, cfg.d_inner
    vocab, lin, t = cfg.vocab_size, f.linears, TensorShape
    g, gi = t((b, q, d)), t((b, q, inner))      # a gradient of the residual stream / the FFN
    qkv, ffn_in = [lin[x] for x in lay.qkv], [lin[x] for x in lay.ffn_in]
    kv = f.kv_heads * dh
    qkv_widths = [h * dh, kv, kv] if len(qkv) == 3 else [h * dh + 2 * kv]
    mm = lambda xs, widths, fan_in: matmul_outputs(xs, widths, b, q, fan_in, inner)  # noqa: E731
    attention = StatedBlock(
        "attention",
        saved=(*norm_saves(lay, b, q, d, f.norm_trains[lay.attn_norm]),
               *linear_inputs(qkv, b, q, d, "qkv"),
               t((b, h, q, dh), category="qkv"),                 # q, k, v as SDPA reads them:
               # ARMT and RMT's "causal" pattern pass no mask, so transformers lets SDPA
               # read grouped keys and values (enable_gqa) instead of copies repeated to H
               t((b, f.kv_heads if no_mask else h, q, dh), count=2, category="qkv")),
        alive=(g,),
        phases=((t((b, q, 3 * h * dh)), g, *weight_grads(qkv, d, h * dh)),   # the projections
                norm_backward(lay, b, q, d)),
        trained_params=f.trained["attention"],
        attention=mem.sdpa_calls or (SdpaShape(q, q, h, dh),),
        ops=tuple(mm(qkv, qkv_widths, d)))
    # o_proj reads SDPA's output (counted with the call): only an adapter adds to it. The
    # mechanism's own calls concatenate their outputs: o_proj keeps that copy.
    attention_out = StatedBlock(
        "attention-out",
        saved=(*linear_inputs([lin[lay.out]], b, q, h * dh, "qkv",
                        input_counted=not mem.sdpa_calls),
               *dropout_masks(f.dropout, (b, q, d))),
        alive=(g,), phases=((g, g, *weight_grads([lin[lay.out]], h * dh, d)),),
        trained_params=f.trained["attention-out"],
        ops=(*mm([lin[lay.out]], [d], h * dh), *dropout_draws(f.dropout, (b, q, d))))
    # The activation's backward beside the gradient reaching it: two more [B, Q, I] (the
    # product's two operand gradients; the Python GELU's products), one for a single op.
    acts, act_grads = ACTIVATION_SAVES[f.activation], 3
    # A one-kernel activation's output is recomputed in backward, not kept
    # (`model.hf.recompute_activation`, activation_recompute.py; not under model.compile).
    recompute = (cfg.hf.recompute_activation and not cfg.compile
                 and ACTIVATION_SAVES[f.activation] == 1)
    if lay.gated:
        acts += 1 if recompute else 2                  # up (and SiLU(gate) unless recomputed)
        act_grads += recompute                         # SiLU(gate) again, for up's gradient
    elif ACTIVATION_SAVES[f.activation] == 1:
        act_grads = 2
    again = [t((b, q, inner))] if recompute else []   # the activation's output, recomputed
    if f.moe is not None:
        ffn_blocks = moe_blocks(f, lay, b, q, d, recompute, mm)
    else:
        ffn = StatedBlock(
            "ffn",
            saved=(*norm_saves(lay, b, q, d, f.norm_trains[lay.ffn_norm]),
                   *linear_inputs(ffn_in, b, q, d, "ffn"),
                   t((b, q, inner), count=acts, category="ffn")),
            alive=(g,),
            phases=((t((b, q, inner), count=act_grads),),
                    (gi, g, *weight_grads(ffn_in, d, inner)),
                    norm_backward(lay, b, q, d)),
            trained_params=f.trained["ffn"], ops=tuple(mm(ffn_in, [inner] * len(ffn_in), d)))
        ffn_out = StatedBlock(
            "ffn-out",
            # (non-gated: the projection's input is the activation's output, recomputed)
            saved=(*linear_inputs([lin[lay.ffn_out]], b, q, inner, "ffn",
                            input_counted=recompute and not lay.gated),
                   *dropout_masks(f.dropout, (b, q, d))),
            alive=(g,), phases=((gi, *weight_grads([lin[lay.ffn_out]], inner, d),
                                 *(again if not lay.gated else [])),),
            trained_params=f.trained["ffn-out"],
            ops=(*mm([lin[lay.ffn_out]], [d], inner), *dropout_draws(f.dropout, (b, q, d))),
            # the activation's output while the projection reads it (unless kept as its
            # input), and the projection's output
            forward=(*([] if lin[lay.ffn_out].keeps_input and not (recompute and not lay.gated)
                       else [t((b, q, inner))]),
                     t((b, q, d))))
        ffn_blocks = (ffn, ffn_out)
    blocks = (*mem.blocks, attention, attention_out, *ffn_blocks)
    if mem.state_read:
        # Through a segment's backward the gradient of its incoming state stays alive
        # (each layer's slice adds into it); the planner walks a window's last segment,
        # whose outgoing state has none (the earlier ones hold that one too, with less
        # else alive).
        blocks = tuple(dataclasses.replace(blk, alive=blk.alive + mem.state_read)
                       for blk in blocks)
    layer = StatedLayer(blocks, input_rows=mem.input_rows)
    ids = [t((b, n), "int64", category="head")] if f.embedding_trains[0] else []
    tables = [t((vocab, d))] if f.embedding_trains[0] else []    # the dense [V, d] gradient
    if len(f.embedding_trains) > 1 and f.embedding_trains[1]:      # GPT-2's position table
        ids.append(t((1, q), "int64", category="head"))
        tables.append(t((f.positions, d)))
    embedding = StatedBlock(
        "embedding",
        saved=(*ids, *mem.embedding_saved,        # e.g. where(fresh, init, memory); A, z
               *dropout_masks(f.embd_dropout, (b, q, d)),
               *([t((b, q, dh), count=2, category="rotary")] if f.rotary else [])),
        alive=(g,), phases=(tuple(tables),),
        trained_params=f.trained["embedding"], ops=tuple(dropout_draws(f.embd_dropout, (b, q, d))),
        # held through the decoder's forward by the callers' frames: E(x), the rows the
        # decoder reads and, with a learned position table, its rows
        forward=(t((b, n, d)), t((b, q, d)), *([t((b, q, d))] if f.positions else [])))
    nv = b * n
    rows = min(nv, chunk_rows(vocab))
    multiple = cfg.hf.vocab_multiple
    pad = -vocab % multiple if multiple > 0 else 0
    head = StatedBlock(
        "head",
        saved=(*norm_saves(lay, b, q, d, f.norm_trains["final"]),
               # the head's input rows, kept by the loss's chunks (model/loss.py) whether
               # lm_head trains or not; no [B·L, V] log-softmax: backward recomputes it
               t((nv, d), category="head"),
               # model.hf.vocab_multiple: the head's weight padded once per segment
               *([t((vocab + pad, d), category="head")] if pad else []),
               t((nv,), "int64", category="head"), t((b, n), "bool", category="head"),
               # the load-balancing loss's per-expert fractions of routed rows (router.py)
               *([t((f.moe.experts,), "fp32", category="head")] if f.moe and f.moe.balance
                 else [])),
        # one chunk's re-run: its logits, their fp32 log-softmax, its gradient and the
        # logits'; lm_head's backward: its input's gradient and its weight's; the final norm's
        phases=((t((rows, vocab), "fp32", 3), t((rows, vocab), "cast"), t((nv, d)),
                 *weight_grads([f.head], vocab, d)),
                (g, *norm_backward(lay, b, q, d))),
        # no ops a selective recompute policy could keep: the head runs outside the
        # segment's checkpoint (model/segment_lm.py)
        trained_params=f.trained["head"])
    return SegmentShapes((layer,) * cfg.n_layer, distances=0, output_rows=q,
                         state=mem.state, state_text=mem.state_text, embedding=embedding,
                         head=head, saved_label=mem.saved_label)


@dataclass(frozen=True)
class ParameterCounts:
    total: int             # every parameter, the memory's included (tied weights once)
    trained: int           # what `model.hf.finetune` trains (wrapper.py trained_parameter_names)
    tied: int              # elements of a trained weight the head shares with the embedding
    largest: int           # the largest single tensor


class PretrainedShapes:
    """What the planner asks of a pretrained backbone, as it asks a native mechanism's class
    (`model.lm.core_class`): a segment's shapes, and the parameter counts, which the planner
    cannot read off the native layout."""

    @classmethod
    def segment_shapes(cls, cfg, rows: int, mem_len: int) -> SegmentShapes:
        return segment_shapes(cfg, rows, mem_len)

    @classmethod
    def parameter_counts(cls, cfg) -> ParameterCounts:
        f = base_facts(cfg)
        tied = cfg.vocab_size * cfg.d_model if f.tied and f.embedding_trains[0] else 0
        return ParameterCounts(f.total, f.trained_total, tied, f.largest)
