"""The weight layouts of the RMT authors' Hugging Face wrapper, and of peft adapters, mapped
to and from PretrainedMemoryLM's parameters. Facts about the authors' layout
(booydar/recurrent-memory-transformer, modeling_rmt/language_modeling.py):

    MemoryCell(base_model, num_mem_tokens)
        .model    the base AutoModelForCausalLM, its own parameter names below `model.`
        .memory   nn.Parameter [m, d]: the initial memory, read and written as
                  [memory; E(x); memory] under the base model's causal mask at default
                  positions (memtrain's `model.rmt.pattern: causal`)
    RecurrentWrapper(memory_cell, segment_size=L, ...)
        .memory_cell  the MemoryCell: every key above under `memory_cell.`

so a `RecurrentWrapper.state_dict()` holds `memory_cell.memory` [m, d] and
`memory_cell.model.<the base model's keys>`; a bare MemoryCell's the same without the
`memory_cell.` prefix. The segment length is not in the weights (a wrapper argument).

memtrain's names: `memory_init.value` [m, d] and `base.<the base model's keys>` (LoRA
adapters, when the run trained them, as peft injects them: `...q_proj.lora_A.default.weight`).
A peft adapter directory (`PeftModel.save_pretrained`) names the same adapters
`base_model.model.<module path>.lora_A.weight`.
"""

from __future__ import annotations

import torch

BASE = "base."
ADAPTER = ".default"           # the adapter name peft's injection gives (one adapter)
PEFT_PREFIX = "base_model.model."


def split_authors_state(state: dict[str, torch.Tensor]):
    """An RMT authors' state dict -> (base model state dict, initial memory [m, d]).
    Accepts a RecurrentWrapper's or a bare MemoryCell's keys; anything else is refused by
    name, so a checkpoint of another model is not half-loaded."""
    prefix = "memory_cell." if "memory_cell.memory" in state else ""
    if prefix + "memory" not in state:
        raise ValueError("not an RMT authors' checkpoint: no 'memory_cell.memory' (a "
                         "RecurrentWrapper) or 'memory' (a MemoryCell) key; keys start "
                         f"{sorted(state)[:5]}")
    memory = state[prefix + "memory"]
    if memory.dim() != 2:
        raise ValueError(f"the authors' memory must be [m, d], got {tuple(memory.shape)}")
    base, other = {}, []
    for key, value in state.items():
        if key == prefix + "memory":
            continue
        if key.startswith(prefix + "model."):
            base[key[len(prefix + "model."):]] = value
        else:
            other.append(key)
    if other:
        raise ValueError(f"keys outside the authors' layout: {other[:8]}")
    return base, memory


def merged_base_state(model) -> dict[str, torch.Tensor]:
    """The base model's state dict with LoRA adapters (if any) merged into the weights they
    adapt (W + B A * alpha / r, peft's merge), under the base model's own names: what the
    authors' layout and a plain checkpoint directory hold."""
    base = model.base
    lora = {n: m for n, m in base.named_modules() if hasattr(m, "lora_A") and
            ADAPTER[1:] in getattr(m, "lora_A", {})}
    if not lora:
        return {k: v.detach().clone() for k, v in base.state_dict().items()}
    import copy
    merged = copy.deepcopy(base)
    for name, module in merged.named_modules():
        if name in lora:
            module.merge(adapter_names=[ADAPTER[1:]])
    state = {}
    for key, value in merged.state_dict().items():
        if "lora_" in key:
            continue
        # peft keeps the adapted layer's own weight under `base_layer.`
        state[key.replace(".base_layer.", ".")] = value.detach().clone()
    return state


def to_authors_state(model) -> dict[str, torch.Tensor]:
    """PretrainedMemoryLM (RMT, `pattern: causal`) -> a RecurrentWrapper state dict."""
    if model.cfg.rmt.pattern != "causal":
        raise ValueError(f"the RMT authors' wrapper runs RMT with its causal pattern; this "
                         f"model has pattern {model.cfg.rmt.pattern!r} (model.rmt.pattern), "
                         "whose outputs their code would not reproduce")
    if model.memory_init is None:
        raise ValueError("the model has no memory tokens (model.rmt.num_mem_tokens 0)")
    state = {"memory_cell.memory": model.memory_init().detach().float().clone()}
    for key, value in merged_base_state(model).items():
        state["memory_cell.model." + key] = value
    return state


def lora_state(model) -> dict[str, torch.Tensor]:
    """The trained LoRA adapters under peft's adapter-file names."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name and name.startswith(BASE):
            key = PEFT_PREFIX + name[len(BASE):].replace(ADAPTER + ".", ".")
            out[key] = p.detach().float().cpu().contiguous().clone()
    return out


# ---------------------------------------------------------------------------------- ARMT
# The ARMT authors' layout (RodkinIvan/associative-recurrent-memory-transformer,
# modeling_amt/language_modeling.py): AssociativeMemoryCell(base, m, d_mem, layers_attr,
# wrap_pos) replaces every decoder layer `<layers_attr>.i` of the base by a wrapper that
# holds the layer as `.layer` and the associative block's projections beside it:
#     model.<layers_attr>.i.W_mq.weight [d_mem, d]    q before phi   (memtrain q_proj)
#     model.<layers_attr>.i.W_mk.weight [d_mem, d]    k before phi   (k_proj)
#     model.<layers_attr>.i.W_mv.weight [d, d]        values         (v_proj)
#     model.<layers_attr>.i.W_mb.weight [1, d], .bias [1]  the write gate beta  (gate)
#     model.<layers_attr>.i.layer.<the layer's own keys>
#     memory [m, d]                                   the memory tokens (memtrain memory_init)
# under `memory_cell.` in an AssociativeRecurrentWrapper. The cell also keeps the layer list
# as its attribute `layers`, so every wrapped layer's keys appear a second time as
# `layers.i.*` (the same tensors). A and z are plain attributes,
# not in the state dict. wrap_pos (GPT-2) appends m rows to `transformer.wpe` for the
# memory: the table then has n_positions + m rows (memtrain `memory_positions: table_end`).
ARMT_NAMES = {"W_mq.weight": "q_proj.weight", "W_mk.weight": "k_proj.weight",
              "W_mv.weight": "v_proj.weight", "W_mb.weight": "gate.weight",
              "W_mb.bias": "gate.bias"}


def split_armt_authors_state(state: dict[str, torch.Tensor]):
    """An ARMT authors' state dict -> (base state dict, memory [m, d], memtrain's
    `associative.*` state dict, the layers' path in the base, d_mem)."""
    import re
    prefix = "memory_cell." if "memory_cell.memory" in state else ""
    if prefix + "memory" not in state:
        raise ValueError("not an ARMT authors' checkpoint: no 'memory_cell.memory' or "
                         f"'memory' key; keys start {sorted(state)[:5]}")
    wrapped = [re.fullmatch(re.escape(prefix) + r"model\.(.+)\.(\d+)\.W_mq\.weight", k)
               for k in state]
    layers = {(m_.group(1), int(m_.group(2))) for m_ in wrapped if m_}
    paths = {path for path, _ in layers}
    if len(paths) != 1:
        raise ValueError(f"not an ARMT authors' checkpoint: expected the W_mq of every layer "
                         f"under one path, found {sorted(paths) or 'none'}")
    path = paths.pop()
    base, assoc, other = {}, {}, []
    layer_re = re.compile(re.escape(f"{prefix}model.{path}.") + r"(\d+)\.(.+)")
    for key, value in state.items():
        if key == prefix + "memory":
            continue
        if key.startswith(prefix + "layers."):   # the cell's alias of the wrapped layers
            twin = f"{prefix}model.{path}.{key[len(prefix + 'layers.'):]}"
            if twin not in state or not torch.equal(state[twin], value):
                other.append(key)
            continue
        hit = layer_re.fullmatch(key)
        if hit and hit.group(2) in ARMT_NAMES:
            assoc[f"associative.{hit.group(1)}.{ARMT_NAMES[hit.group(2)]}"] = value
        elif hit and hit.group(2).startswith("layer."):
            base[f"{path}.{hit.group(1)}.{hit.group(2)[len('layer.'):]}"] = value
        elif key.startswith(prefix + "model.") and not hit:
            base[key[len(prefix + "model."):]] = value
        else:
            other.append(key)
    if other:
        raise ValueError(f"keys outside the ARMT authors' layout: {other[:8]}")
    d_mem = state[f"{prefix}model.{path}.0.W_mq.weight"].shape[0]
    return base, state[prefix + "memory"], assoc, path, d_mem


def to_armt_authors_state(model, layers_path: str) -> dict[str, torch.Tensor]:
    """PretrainedMemoryLM (ARMT) -> an AssociativeRecurrentWrapper state dict, the decoder
    layers at `layers_path` (e.g. 'transformer.h' for GPT-2, 'model.layers' for Llama)."""
    cfg = model.cfg
    if cfg.armt.memory_positions == "fixed":
        raise ValueError("the ARMT authors' code places the memory right after the segment "
                         "or in the last rows of GPT-2's table: export an ARMT model with "
                         "model.armt.memory_positions 'follow' or 'table_end' (this one: "
                         f"{cfg.armt.memory_positions!r})")
    o = cfg.armt
    if o.correction and not o.authors_gamma:
        import warnings
        warnings.warn("model.armt.authors_gamma is false: the authors' code computes the "
                      "correction gamma with eps also in its numerator, so their outputs "
                      "differ from this model's where |phi(k)|^2 is near eps", stacklevel=2)
    if (o.feature_map, o.nu, o.gate, o.carry_tokens) != ("dpfp", 3, True, False):
        raise ValueError("the ARMT authors' code is DPFP with nu 3, the write gate and no "
                         "carried tokens (model.armt.feature_map/nu/gate/carry_tokens)")
    back = {v: k for k, v in ARMT_NAMES.items()}
    state = {"memory_cell.memory": model.memory_init().detach().float().clone()}
    for key, value in merged_base_state(model).items():
        if key.startswith(layers_path + "."):
            i, rest = key[len(layers_path) + 1:].split(".", 1)
            key = f"{layers_path}.{i}.layer.{rest}"
        state["memory_cell.model." + key] = value
    for name, p in model.associative.named_parameters():
        i, rest = name.split(".", 1)
        state[f"memory_cell.model.{layers_path}.{i}.{back[rest]}"] = p.detach().float().clone()
    inside = f"memory_cell.model.{layers_path}."
    for key in [k for k in state if k.startswith(inside)]:
        state["memory_cell.layers." + key[len(inside):]] = state[key]
    return state
