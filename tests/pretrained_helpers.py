"""Tiny random pretrained checkpoints for the tests: built from configs, written with
`save_pretrained`, loaded back through `model.hf.path` (never a download). The builders are
model/pretrained/tiny.py's, which also rehearses the documented commands."""

from __future__ import annotations

from pathlib import Path

from model.pretrained.tiny import TINY, V, tiny_gpt2, tiny_llama

__all__ = ["TINY", "V", "hf_model_section", "tiny_gpt2", "tiny_llama", "train_copy_task",
           "COPY_STEPS", "COPY_STOP", "make_copy_task"]


def hf_model_section(path: Path, m: int = 4, tgt_len: int = 8, **hf) -> dict:
    """The `model:` section of a run config around the checkpoint at `path`."""
    return {"mechanism": "rmt", "backbone": "hf", "tgt_len": tgt_len, "mem_len": 0,
            "rmt": {"num_mem_tokens": m}, "hf": {"path": str(path), **hf}}


# `memtrain train` around a tiny checkpoint, in this process: a copy task (4 symbols, 2
# segments of 6 positions; make_copy_task), COPY_STEPS steps, stopped
# by SIGTERM after step COPY_STOP - 1's engine step when asked.
COPY_STEPS, COPY_STOP = 4, 2


def train_copy_task(tmp: Path, copy: Path, model: dict, name: str, monkeypatch,
                    stop_at: int | None = None, deepspeed: dict | None = None,
                    **bptt) -> Path:
    """Train (or resume) the run `name` of the model section `model` on the copy task at
    `copy` (ZeRO-0 in fp32 unless `deepspeed` says otherwise); returns its run directory."""
    import os
    import signal

    import yaml
    from train_helpers import train_in_process

    from train import trainer
    from train.config import load_config
    from train.loop import TrainingLoop

    cfg = {"name": name, "run_dir": str(tmp / "runs" / name), "max_steps": COPY_STEPS,
           "log_every": 1, "threads": 1, "seed": 0, "model": model,
           "data": {"path": str(copy), "global_batch": 4},
           "bptt": {"depth": 1, **bptt}, "deepspeed": deepspeed or {"zero_stage": 0},
           "optim": {"lr": 1e-2, "schedule": "constant"},
           "eval": {"max_segments": 2}, "tracking": {"enabled": False}}
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    cfg = load_config(tmp / f"{name}.yaml")

    class Stopping(TrainingLoop):
        def _engine_step(self, step):
            super()._engine_step(step)
            if stop_at is not None and step == stop_at - 1:
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(trainer, "TrainingLoop", Stopping)
    train_in_process(cfg, monkeypatch)
    return cfg.resolved_run_dir


def make_copy_task(out: Path) -> Path:
    """The copy task train_copy_task trains on: 4 symbols, 2 segments."""
    from data_pipeline.prepare import main_tasks
    assert main_tasks(["copy", "--src-len", "4", "--n-segments", "2", "--train-size", "64",
                       "--valid-size", "8", "--test-size", "8", "--out", str(out)]) == 0
    return out


def authors_reference(base, memory, segments):
    """The RMT authors' HF wrapper loop written from its description (docs/
    coming-from-authors.md), on the base model alone: per segment the base model's forward
    on inputs_embeds [mem; E(x); mem] with its own causal mask and default positions; the
    token rows' log-probs, and the write rows' last hidden state as the next memory.
    Returns [(log_probs [B, L, V], memory after the segment [B, m, d])]."""
    import torch
    m = memory.shape[0]
    mem = memory[None].expand(segments[0].shape[0], -1, -1)
    out = []
    for seg in segments:
        x = torch.cat([mem, base.get_input_embeddings()(seg), mem], dim=1)
        res = base(inputs_embeds=x, output_hidden_states=True)
        mem = res.hidden_states[-1][:, -m:]
        out.append((torch.log_softmax(res.logits[:, m:-m].float(), -1), mem))
    return out
