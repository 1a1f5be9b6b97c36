"""The memory FIFO (model/memory.py `_fifo`, `_last`; Transformer-XL §3.2): the memory grows
per segment up to mem_len, holds the last mem_len inputs of every layer, owns exactly its
rows, and is empty without a memory. States come from running the models of
test_memory_protocol.py."""

import pytest
import torch
from reference import sharpened_model
from test_memory_protocol import (
    BATCH,
    MEM,
    SEG,
    SETUPS,
    VOCAB,
    make_model,
    random_tokens,
    tensors,
)

from model import build_model


def test_xl_memory_grows_per_segment_and_is_capped_at_mem_len():
    model = make_model("xl")
    tokens, targets = random_tokens(2, 4, seed=8)
    state, seen = None, []
    with torch.no_grad():
        for s in range(4):
            state = model(tokens[:, s * SEG:(s + 1) * SEG], state).state
            seen.append(state.mem_len_now)
            assert state.length.tolist() == [min((s + 1) * SEG, MEM)] * 2
            assert all(h.shape == (2, state.mem_len_now, 32) for h in state.hids)
    assert seen == [SEG, MEM, MEM, MEM]


def test_xl_fifo_holds_the_last_mem_len_inputs_of_every_layer():
    model = make_model("xl")
    captured: dict[int, list[torch.Tensor]] = {i: [] for i in range(3)}
    hooks = [model.embedding.register_forward_hook(
        lambda _m, _a, out: captured[0].append(out.detach()))]
    # Inputs of layers 1.. (layer 0's input is the embedding output: dropout is 0).
    hooks.append(model.core.layers[1].register_forward_pre_hook(
        lambda _m, args: captured[1].append(args[0].detach())))
    tokens, _ = random_tokens(2, 3, seed=9)
    state = None
    try:
        with torch.no_grad():
            for s in range(3):
                state = model(tokens[:, s * SEG:(s + 1) * SEG], state).state
                for layer in range(2):
                    stream = torch.cat(captured[layer], dim=1)
                    keep = min(stream.shape[1], MEM)
                    assert torch.equal(state.hids[layer], stream[:, -keep:]), (s, layer)
    finally:
        for h in hooks:
            h.remove()
    assert len(captured[0]) == 3 and len(captured[1]) == 3


@pytest.mark.parametrize("setup", ["xl", "lamemo", "rmt+cache"])
@pytest.mark.parametrize("mem_len", [2, SEG, MEM])    # shorter than, as long as, longer than
def test_a_carried_state_holds_only_its_own_rows(setup, mem_len):
    """Each tensor of the state owns a storage of exactly its size: the memory of the last
    M rows is not a view of [old ∘ new] (or of the layer output), which would keep M+L rows
    alive for as long as the memory lives, in every layer (and in checkpoint files)."""
    mechanism, _ = SETUPS[setup]
    model = sharpened_model(mechanism, mem_len, vocab=VOCAB, seg=SEG).train()
    tokens, targets = random_tokens(BATCH, 3, seed=4)
    state = None
    for s in range(3):   # the first segment (no memory yet), then a full memory
        out = model(tokens[:, s * SEG:(s + 1) * SEG], state,
                    targets=targets[:, s * SEG:(s + 1) * SEG])
        out.loss.backward()
        state = out.state.detach()
        for name, t in tensors(state).items():
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (s, name)
            assert t.is_contiguous(), (s, name)


def test_xl_without_memory_carries_nothing():
    cfg = dict(mechanism="xl", vocab_size=VOCAB, n_layer=2, d_model=32, n_head=4,
               d_inner=64, dropout=0.0, tgt_len=SEG, mem_len=0)
    model = build_model(cfg).eval()
    tokens, _ = random_tokens(2, 2, seed=10)
    state = model(tokens[:, :SEG]).state
    assert state.mem_len_now == 0 and state.length.tolist() == [0, 0]
