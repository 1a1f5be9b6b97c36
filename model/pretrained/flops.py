"""The FLOP estimate's terms (train/throughput.py) for a pretrained decoder outside the
planner's dense layer layouts (model/pretrained/architectures.py `LAYOUTS`): an architecture
it has no layout for, or a mixture of experts.

The estimate needs far less than the planner: the parameters every row passes through, the
head's, the trained share, the rows through each layer and the attention calls' Q x K. All
of it is read without a layout: the parameters from the model built on the meta device
(memory, LoRA and all, as the run builds it), the rows and calls from what the mechanism
states it adds (`Mechanism.pretrained_rows`), the heads from the config. So every
architecture memtrain runs reports its model FLOPs and MFU; a planned one keeps the
planner's stated shapes (the same numbers where both apply:
tests/test_throughput.py).

A mixture of experts' expert weights are counted at the share a row passes through: top-k
of E experts (traits.py `moe`).
"""

from __future__ import annotations

import functools
import json


def _key(cfg) -> str:
    import dataclasses
    return json.dumps({"mechanism": cfg.mechanism, "backbone": "hf", "mem_len": 0,
                       "tgt_len": 1, "hf": dataclasses.asdict(cfg.hf),
                       **{n: dataclasses.asdict(o) for n, o in cfg.mechanism_sections().items()}},
                      sort_keys=True)


@functools.lru_cache(maxsize=8)
def _meta_counts(key: str) -> tuple[int, int, float]:
    from ..config import ModelConfig
    from .checkpoint_config import hf_config
    from .traits import config_traits
    from .wrapper import meta_model
    cfg = ModelConfig.from_dict(json.loads(key))
    hf = hf_config(cfg.hf)
    traits = config_traits(hf)
    base, lm = meta_model(cfg, hf)
    named = list(lm.named_parameters())
    total = sum(p.numel() for _, p in named)
    trained = sum(p.numel() for _, p in named if p.requires_grad)
    head = base.get_output_embeddings().weight
    embedding = base.get_input_embeddings().weight
    tables = embedding.numel() + (0 if head is embedding else head.numel())
    tables += traits.table * embedding.shape[1]
    body = total - tables
    if traits.moe is not None:
        experts = sum(p.numel() for n, p in named if ".experts." in n)
        body -= experts * (1 - traits.moe.top_k / traits.moe.experts)
    return int(body), head.numel(), trained / total


def unplanned_counts(cfg) -> tuple[int, int, float]:
    """(N_body, N_head, the trained share) of `cfg` (backbone hf, shape read), from the
    meta model: the backbone's `FlopCounts` (model/backbones/pretrained.py)."""
    return _meta_counts(_key(cfg))


def unplanned_terms(cfg, seg_len: int) -> tuple[float, float, int]:
    """(rows through each layer, sum over a layer's attention calls of d_attn x Q x K times
    the layers, extra scored rows) of one segment of `seg_len` tokens, one batch row."""
    import dataclasses
    c = dataclasses.replace(cfg, tgt_len=seg_len)
    mem = c.mech.pretrained_rows(c, 1, 0)
    calls = mem.sdpa_calls or ()
    per_layer = (sum(a.queries * a.keys * a.heads * a.head_dim for a in calls) if calls
                 else mem.rows * mem.rows * c.n_head * c.d_head)
    per_layer += sum(a.queries * a.keys * a.heads * a.head_dim
                     for blk in mem.blocks for a in blk.attention)
    return float(mem.input_rows), float(per_layer * c.n_layer), 0
