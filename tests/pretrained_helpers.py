"""Tiny random pretrained checkpoints for the tests: built from configs, written with
`save_pretrained`, loaded back through `model.hf.path` (never a download). The builders are
model/pretrained/tiny.py's, which also rehearses the documented commands."""

from __future__ import annotations

from pathlib import Path

from model.pretrained.tiny import TINY, V, tiny_gpt2, tiny_llama

__all__ = ["TINY", "V", "hf_model_section", "tiny_gpt2", "tiny_llama"]


def hf_model_section(path: Path, m: int = 4, tgt_len: int = 8, **hf) -> dict:
    """The `model:` section of a run config around the checkpoint at `path`."""
    return {"mechanism": "rmt", "backbone": "hf", "tgt_len": tgt_len, "mem_len": 0,
            "rmt": {"num_mem_tokens": m}, "hf": {"path": str(path), **hf}}
