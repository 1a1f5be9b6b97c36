"""The native stack (`backbone: native`): the memory mechanisms on the relative-position
decoder of model/backbone.py, every weight its own."""

from __future__ import annotations

from typing import ClassVar

import torch
from safetensors.torch import load_model as _load_into
from safetensors.torch import save_model as _save_from

from ..lm import MemoryLM, core_class
from .base import Backbone, FlopCounts


class NativeBackbone(Backbone):
    name: ClassVar[str] = "native"
    records_analysis: ClassVar[bool] = True

    def build(self, cfg, **kwargs):
        if kwargs:
            raise TypeError(f"the native stack takes no build arguments, got {sorted(kwargs)}")
        return MemoryLM(cfg)

    def shape_class(self, cfg):
        return core_class(cfg)

    def write_weights(self, model, filename: str, metadata: dict[str, str]) -> None:
        # Every weight; tied input/output weights once (safetensors' save_model
        # de-duplicates shared tensors).
        _save_from(model.float(), filename, metadata=metadata)

    def load_weights(self, model, path: str, device) -> None:
        _load_into(model, path, strict=True, device=str(device))

    def load_state(self, model, state: dict, source: str) -> None:
        # Tied weights may be stored under one name only; anything else missing is an error.
        tied = {n for n, p in model.named_parameters(remove_duplicate=False)} - \
            {n for n, p in model.named_parameters()}
        own = model.state_dict()
        missing = [n for n in own if n not in state and n not in tied]
        unexpected = [n for n in state if n not in own]
        shapes = [f"{n}: checkpoint {tuple(state[n].shape)}, model {tuple(own[n].shape)}"
                  for n in own if n in state and state[n].shape != own[n].shape]
        if missing or unexpected or shapes:
            raise ValueError(f"{source} does not match the model code: missing "
                             f"{missing[:5]}, unexpected {unexpected[:5]}, shapes {shapes[:5]}")
        model.load_state_dict(state, strict=False)

    def flop_counts(self, cfg) -> FlopCounts:
        # Built on the meta device; a mechanism's init may draw random numbers even there,
        # and counting must not move the stream a run's dropout and exact resume rely on.
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = MemoryLM(type(cfg).from_dict(cfg.to_dict()))   # a copy: built apart
        body = sum(p.numel() for p in model.core.parameters())
        if cfg.cutoffs:   # the head cluster: shortlist + one logit per tail (adaptive.py)
            head = (cfg.cutoffs[0] + len(cfg.cutoffs)) * cfg.d_model
            head += cfg.d_model ** 2 if cfg.div_val > 1 else 0    # its projection
        else:
            head = cfg.vocab_size * cfg.d_model
        return FlopCounts(body, head, 1.0)
