"""A pretrained Hugging Face causal LM with memory tokens (`backbone: hf`, model/pretrained/).

Its shape is its checkpoint's (read in a step of its own: `resolve_shape`); its export holds
only what the run trained (`exported_names`: every base weight with `finetune: full`, the
memory parameters with `frozen`, the memory and the LoRA adapters with `lora`), the rest
being the checkpoint itself, which loading reads again from `model.hf` (path, revision, GGUF
file; so a frozen export of a 7B model is a few kilobytes, and the base must still be at
that path). Its vocabulary is its tokenizer's: the data must be tokenized with it, or be
task ids it learns as new symbols. transformers is imported only when a model is built.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from safetensors.torch import load_file as _read_tensors
from safetensors.torch import save_file as _save_tensors

from ..config import ConfigError
from ..pretrained import checkpoint_config
from .base import Backbone, FlopCounts

# The pretrained base an export's weights go with (also inside its model config; here for
# anyone reading the file's metadata without memtrain).
BASE_KEYS = {"memtrain_base_path": "path", "memtrain_base_revision": "revision",
             "memtrain_base_gguf_file": "gguf_file", "memtrain_finetune": "finetune"}


class PretrainedBackbone(Backbone):
    name: ClassVar[str] = "hf"
    loads_checkpoint: ClassVar[bool] = True

    # ------------------------------------------------------------------ the config
    def resolve_shape(self, cfg):
        return checkpoint_config.resolve_shape(cfg)

    def require_shape(self, cfg, what: str) -> None:
        checkpoint_config.require_shape(cfg, what)

    def label(self, cfg) -> str:
        return f"{cfg.hf.path} + {cfg.mechanism.upper()}"

    def finetune(self, cfg) -> str:
        return cfg.hf.finetune

    def checkpoint_source(self, cfg) -> tuple[str, str] | None:
        return "model.hf.path", cfg.hf.path

    # ------------------------------------------------------------------ the model
    def build(self, cfg, **kwargs):
        """`kwargs`: PretrainedMemoryLM's (an already loaded base, the memory's scale)."""
        self.require_shape(cfg, "a model")
        from ..pretrained.wrapper import PretrainedMemoryLM
        return PretrainedMemoryLM(cfg, **kwargs)

    def shape_class(self, cfg):
        from ..pretrained.shapes import PretrainedShapes
        return PretrainedShapes

    # ------------------------------------------------------------------ the weights
    def exported_names(self, model) -> list[str]:
        return model.trained_parameter_names()

    def export_metadata(self, cfg) -> dict[str, str]:
        return {key: str(getattr(cfg.hf, field)) for key, field in BASE_KEYS.items()}

    def write_weights(self, model, filename: str, metadata: dict[str, str]) -> None:
        _save_tensors(self.trained_state(model), filename, metadata=metadata)

    def load_weights(self, model, path: str, device) -> None:
        self.load_trained(model, _read_tensors(path), path)

    def load_state(self, model, state: dict, source: str) -> None:
        """Only the trained names: the frozen rest of a checkpoint's state (whatever
        DeepSpeed kept of it at its stage) is the base, loaded again from `model.hf`."""
        own = model.state_dict()
        strays = [n for n in state if n not in own]
        if strays:
            raise ValueError(f"{source} does not match the model code: unexpected "
                             f"{strays[:5]}")
        trained = set(self.exported_names(model))
        self.load_trained(model, {n: t for n, t in state.items() if n in trained}, source)

    def trained_state(self, model) -> dict[str, torch.Tensor]:
        """{name: fp32 copy} of the parameters an export holds."""
        params = dict(model.named_parameters())
        return {name: params[name].detach().float().cpu().contiguous().clone()
                for name in self.exported_names(model)}

    def load_trained(self, model, state: dict[str, torch.Tensor], source: str) -> None:
        """Copy the trained parameters from `state` into `model`, strictly: exactly the
        names `model` trains, each of its shape (the frozen rest is the base)."""
        names = self.exported_names(model)
        params = dict(model.named_parameters())
        missing = sorted(set(names) - set(state))
        unexpected = sorted(set(state) - set(names))
        shapes = [f"{n}: file {tuple(state[n].shape)}, model {tuple(params[n].shape)}"
                  for n in names if n in state and state[n].shape != params[n].shape]
        if missing or unexpected or shapes:
            raise ValueError(
                f"{source} does not hold what this model trains (model.hf.finetune "
                f"{model.cfg.hf.finetune!r}): missing {missing[:8]}, unexpected "
                f"{unexpected[:8]}, shapes {shapes[:8]}")
        with torch.no_grad():
            for name in names:
                params[name].copy_(state[name])

    # ------------------------------------------------------------------ the data
    def fits_vocabulary(self, cfg, n_ids: int) -> bool:
        """Its embedding may have more rows than the data have ids (padded past its
        tokenizer, or a small task alphabet): the ids must fit."""
        return n_ids <= cfg.vocab_size

    def check_training_data(self, cfg, manifest, data_path: str, announce: bool) -> None:
        """A pretrained model reads every id as its own token, so data from another
        tokenizer would train it on garbage without an error (docs/pretrained_data_notes.md):
        "hf" data must carry the fingerprint of model.hf.path's tokenizer; task and synthetic
        data, whose ids name no text, are taken as new symbols; text in memtrain's own
        vocabularies is refused. Ids past the embedding's rows are refused whatever the
        kind."""
        hf, kind = cfg.hf, manifest.vocab.get("kind")
        data = f"the data at {data_path}"
        redo = f"prepare them with `--tokenizer hf:{hf.path}`"
        if kind == "hf":
            from data_pipeline.hf_tokenizer import HFVocab
            try:
                own = HFVocab.load(hf.path, hf.revision, hf.gguf_file)
            except ValueError as err:
                raise ConfigError("model.hf.path", f"{err} (needed to check that {data} "
                                  "were tokenized with it)") from None
            if manifest.vocab_fingerprint != own.fingerprint():
                raise ConfigError("data.path", f"{data} were tokenized with "
                                  f"{manifest.vocab.get('name')} ({manifest.vocab_size} ids, "
                                  f"{manifest.vocab_fingerprint[:12]}), not with the tokenizer "
                                  f"of model.hf.path ({own.describe()}); {redo}")
            top = int(manifest.extra.get("max_id", manifest.vocab_size - 1))
        elif kind in ("task", "synthetic"):
            top = manifest.vocab_size - 1
            if announce:
                print(f"memtrain: {data} are {kind} ids, not text of the model's tokenizer: "
                      f"the pretrained model learns them as new symbols", flush=True)
        else:
            raise ConfigError("data.path", f"{data} were tokenized with memtrain's {kind!r} "
                              f"vocabulary ({manifest.vocab_size} ids), which model.hf.path "
                              f"{hf.path} would read as other tokens; {redo}")
        if top >= cfg.vocab_size:
            raise ConfigError("data.path", f"{data} hold ids up to {top}; the embedding of "
                              f"model.hf.path {hf.path} has {cfg.vocab_size} rows")

    # ------------------------------------------------------------------ positions
    def check_segment_positions(self, cfg, seg_len: int, option: str) -> None:
        """A learned position table (GPT-2) ends: 2m + L rows must fit in it
        (checkpoint_config.py)."""
        checkpoint_config.check_segment_positions(cfg, seg_len, option)

    def flop_counts(self, cfg) -> FlopCounts:
        # The meta model's facts (model/pretrained/shapes.py); the embedding tables are
        # lookups, not matmuls, and a tied head is counted as the head. Outside the
        # planner's dense layouts (an architecture it has no layout for, or a mixture of
        # experts, whose experts count at the top-k share a row passes through): read from
        # the meta model and the mechanism's rows (model/pretrained/flops.py).
        from ..pretrained.architectures import LAYOUTS
        from ..pretrained.shapes import base_facts
        if cfg.hf.model_type not in LAYOUTS:
            from ..pretrained.flops import unplanned_counts
            return FlopCounts(*unplanned_counts(cfg))
        f = base_facts(cfg)
        tables = cfg.vocab_size * cfg.d_model * (1 if f.tied else 2) + f.positions * cfg.d_model
        return FlopCounts(f.total - tables, cfg.vocab_size * cfg.d_model,
                          f.trained_total / f.total)

    def flop_terms(self, cfg, seg_len: int) -> tuple[float, float, int]:
        from ..pretrained.architectures import LAYOUTS
        if cfg.hf.model_type not in LAYOUTS:
            from ..pretrained.flops import unplanned_terms
            return unplanned_terms(cfg, seg_len)
        return super().flop_terms(cfg, seg_len)
