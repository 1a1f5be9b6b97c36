"""The shape every torch.compile test compiles (tests/test_compile.py,
tests/test_compile_bf16_zero3.py; docs/testing.md, "The cold cache and torch.compile"): one
shape, so that the Inductor cache a cold machine fills is filled once."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from train_helpers import V

from model import ModelConfig, build_model
from model.compiled import compile_core

# The shape of tests/train_helpers.py tiny_config: the memory reaches its full length at the
# second step, so STEPS = 4 shows a graph per length (0, 8) and then two steps with none.
TGT, MEM, STEPS, BATCH = 8, 8, 4, 4
SHAPE = dict(vocab_size=V, n_layer=2, d_model=32, n_head=2, d_inner=64, dropout=0.1,
             dropatt=0.1, tgt_len=TGT, rmt={"num_mem_tokens": 2})
# The same shape for the `memtrain train` runs (dropatt on, as in the in-process runs).
RUN_MODEL = {"dropatt": 0.1, "rmt": {"num_mem_tokens": 2}}


@contextmanager
def graph_limit(limit: int):
    """torch.compile's per-function graph limit set to `limit` for the block: below what
    the models here need, so that only compile_core raising it lets every length compile
    (past the limit torch runs the function eager and only logs a warning)."""
    config = torch._dynamo.config
    saved = config.recompile_limit
    config.recompile_limit = limit
    try:
        yield
    finally:
        config.recompile_limit = saved


def tiny(mechanism: str, mem_len: int, compiled: bool, device: str = "cpu",
         backend: str = "inductor", **extra):
    """A tiny model from seed 0 with dropout, its Adam and a seeded data generator;
    `backend`: model/compiled.py `_compile`."""
    torch.manual_seed(0)
    cfg = ModelConfig(**{**SHAPE, "mechanism": mechanism, "mem_len": mem_len, **extra})
    model = build_model(cfg).to(device)   # torch.manual_seed seeded the GPUs' generators too
    if compiled:
        compile_core(model, backend)
    return model, torch.optim.Adam(model.parameters(), 1e-3), torch.Generator().manual_seed(3)


def batch(data: torch.Generator, device: str = "cpu"):
    return torch.randint(0, V, (2, BATCH, TGT), generator=data).to(device)
