"""A trained model read for sampling or scoring outside training: loaded from a run, a
checkpoint or an export with the vocabulary of its data, and fitted to the data's ids.

`memtrain generate` (generate_cli.py), the lm-eval adapter (lm_eval_model.py) and the
BABILong report (babilong_report.py) read models through it. A backbone may have more output
rows than the data have ids (a pretrained embedding padded past its tokenizer, or a small task
alphabet): the data's ids must fit the model (its backbone says how: model/backbones/
`fits_vocabulary`), and the model then predicts the data's ids only (`DataIds`: the others
never occurred in training and the vocabulary cannot print them).
"""

from __future__ import annotations

from pathlib import Path

import torch

from data_pipeline.shards import load_manifest
from data_pipeline.vocab_by_kind import vocab_from_dict
from model import ConfigError, backbone_of, load_model
from model.open_segment import open_segment
from train.checkpoint import MARKER
from train.export import load_weights
from train.run_access import load_run_config, pick_checkpoint
from train.run_dir import RunDir


def fit_to_data(model, manifest, where: str):
    """`model`, checked against the data's ids (ConfigError on model.vocab_size when they
    do not fit: its backbone's `fits_vocabulary`) and limited to them (`DataIds`) when it
    has more rows. Training accepts data by its own rule (the backbone's
    `check_training_data`)."""
    n_ids, rows = manifest.vocab_size, model.cfg.vocab_size
    if not backbone_of(model.cfg).fits_vocabulary(model.cfg, n_ids):
        raise ConfigError("model.vocab_size", f"the model has {rows} ids but the data at "
                          f"{where} have {n_ids}")
    return DataIds(model, n_ids) if n_ids < rows else model


def load_for_generation(path: Path, data: str | None):
    """(model, vocabulary or None) from a run dir, a checkpoint folder or a .safetensors."""
    if path.suffix == ".safetensors":
        model, data_path = load_model(path), data
    else:
        run_dir, name = path, None
        if (path / MARKER).is_file() and path.parent.name == RunDir.CHECKPOINTS:
            run_dir, name = path.parent.parent, path.name
        cfg = load_run_config(str(run_dir), [])
        info = pick_checkpoint(cfg, name)
        if info is None:
            raise FileNotFoundError(f"no complete checkpoint in {run_dir}")
        model, data_path = load_weights(info, cfg.model), data or cfg.data.path
    vocab = None
    if data_path:
        manifest = load_manifest(data_path)
        model = fit_to_data(model, manifest, data_path)
        try:
            vocab = vocab_from_dict(manifest.vocab)
        except (ValueError, KeyError):
            vocab = None  # e.g. a synthetic stream: ids only
    return model, vocab


class DataIds(torch.nn.Module):
    """`model` sampling only ids below `n_ids`: the others get probability 0 (every other
    call passes through unchanged)."""

    def __init__(self, model, n_ids: int):
        super().__init__()
        self.model, self.n_ids, self.cfg = model, n_ids, model.cfg

    def initial_state(self, batch_size: int, device=None):
        return self.model.initial_state(batch_size, device)

    def set_lengths(self, **lengths) -> None:
        self.model.set_lengths(**lengths)

    def forward(self, tokens, state=None, **kwargs):
        out = self.model(tokens, state, **kwargs)
        if out.log_probs is not None:
            out.log_probs[..., self.n_ids:] = float("-inf")
        return out

    def open_segment(self, state):
        """The model's own open segment of a generation (model/open_segment.py: a
        pretrained backbone's is KV-cached), its predictions limited to the data's ids."""
        return DataIdsSegment(open_segment(self.model, state), self.n_ids)


class DataIdsSegment:
    """An open segment (model/open_segment.py) whose predictions give the ids from `n_ids`
    on probability 0."""

    def __init__(self, segment, n_ids: int):
        self.segment, self.n_ids = segment, n_ids

    def read(self, tokens) -> None:
        self.segment.read(tokens)

    def predict(self, tokens) -> torch.Tensor:
        log_probs = self.segment.predict(tokens)
        log_probs[..., self.n_ids:] = float("-inf")
        return log_probs

    def commit(self):
        return self.segment.commit()


