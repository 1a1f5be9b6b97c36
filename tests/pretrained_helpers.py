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
