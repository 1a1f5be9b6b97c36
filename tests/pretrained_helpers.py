"""Tiny random pretrained checkpoints for the tests: built from configs, written with
`save_pretrained`, loaded back through `model.hf.path` (never a download)."""

from __future__ import annotations

from pathlib import Path

import torch

V = 32   # vocabulary of the tiny checkpoints (the copy tasks' symbols fit in it)


def tiny_gpt2(path: Path, *, d: int = 64, layers: int = 2, tied: bool = True,
              n_positions: int = 64, seed: int = 0) -> Path:
    """GPT-2 family: learned absolute positions, Conv1D projections, tied head."""
    from transformers import GPT2Config, GPT2LMHeadModel
    if not (path / "config.json").exists():
        torch.manual_seed(seed)
        GPT2LMHeadModel(GPT2Config(
            vocab_size=V, n_positions=n_positions, n_embd=d, n_layer=layers, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            tie_word_embeddings=tied)).save_pretrained(path)
    return path


def tiny_llama(path: Path, *, d: int = 64, layers: int = 2, tied: bool = False,
               seed: int = 0) -> Path:
    """Llama family: RoPE, grouped-query attention (4 query heads over 2 KV heads),
    RMSNorm, SwiGLU."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if not (path / "config.json").exists():
        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(
            vocab_size=V, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied)).save_pretrained(path)
    return path


TINY = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def hf_model_section(path: Path, m: int = 4, tgt_len: int = 8, **hf) -> dict:
    """The `model:` section of a run config around the checkpoint at `path`."""
    return {"mechanism": "rmt", "backbone": "hf", "tgt_len": tgt_len, "mem_len": 0,
            "rmt": {"num_mem_tokens": m}, "hf": {"path": str(path), **hf}}
