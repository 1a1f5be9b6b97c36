"""ARMT's associative memory state (model/mechanisms/armt/associative.py AssociativeMemory) under
the memory-state protocol of model/memory.py: built empty, written per segment, saved and
loaded, moved, its rows selected, joined and reset."""

from __future__ import annotations

import io

import pytest
import torch
from test_associative_core import random_layer

from model.mechanisms.armt.associative import AssociativeMemory
from model.memory import MemoryState, XLMemory


def random_state(B=3, n_layer=2, d_phi=6, d_v=4, with_cache=False) -> AssociativeMemory:
    cache = None
    if with_cache:
        cache = XLMemory(hids=[torch.randn(B, 5, d_v) for _ in range(n_layer)],
                         length=torch.tensor([5, 2, 0][:B]))
    return AssociativeMemory(A=torch.randn(B, n_layer, d_phi, d_v),
                             z=torch.rand(B, n_layer, d_phi),
                             writes=torch.arange(1, B + 1), cache=cache)


def test_zeros_layer_written():
    s = AssociativeMemory.zeros(2, 3, 24, 8)
    assert s.A.shape == (2, 3, 24, 8) and s.z.shape == (2, 3, 24)
    assert s.batch_size == 2 and s.n_layer == 3 and s.writes.tolist() == [0, 0]
    assert s.nbytes() == 4 * (2 * 3 * 24 * 8 + 2 * 3 * 24) + 8 * 2
    layers = [random_layer(seed=i, d_model=8, d_key=4) for i in range(3)]
    mems = [torch.randn(2, 2, 8) for _ in range(3)]
    writes = [lay.write(*s.layer(i), mem) for i, (lay, mem) in enumerate(zip(layers, mems,
                                                                            strict=True))]
    new = s.written([w[0] for w in writes], [w[1] for w in writes])
    assert new.A.shape == s.A.shape and new.writes.tolist() == [1, 1]
    for i, (A_i, z_i) in enumerate(writes):
        assert torch.equal(new.layer(i)[0], A_i) and torch.equal(new.layer(i)[1], z_i)
    with pytest.raises(ValueError):
        s.written([s.A[:, 0]], [])


@pytest.mark.parametrize("with_cache", [False, True])
def test_state_dict_round_trip(with_cache):
    s = random_state(with_cache=with_cache)
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    back = MemoryState.from_state_dict(torch.load(buf))
    assert isinstance(back, AssociativeMemory) and back.kind == "armt"
    for name in ("A", "z", "writes"):
        a, b = getattr(s, name), getattr(back, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert (back.cache is None) == (not with_cache)
    if with_cache:
        assert all(torch.equal(a, b) for a, b in zip(s.cache.hids, back.cache.hids,
                                                      strict=True))
    target = random_state(with_cache=with_cache)
    target.load_state_dict(s.state_dict())
    assert torch.equal(target.A, s.A)


def test_to_keeps_A_and_z_float32():
    s = random_state(with_cache=True).to(dtype=torch.bfloat16)
    assert s.A.dtype == s.z.dtype == torch.float32
    assert s.cache.hids[0].dtype == torch.bfloat16 and s.writes.dtype == torch.long


@pytest.mark.parametrize("with_cache", [False, True])
def test_select_and_concat_rows(with_cache):
    s = random_state(with_cache=with_cache)
    sel = s.select_rows(torch.tensor([2, 0]))
    assert torch.equal(sel.A, s.A[[2, 0]]) and torch.equal(sel.z, s.z[[2, 0]])
    assert sel.writes.tolist() == [3, 1]
    joined = MemoryState.concat_rows([s.select_rows([0]), s.select_rows([1, 2])])
    for name in ("A", "z", "writes"):
        assert torch.equal(getattr(joined, name), getattr(s, name))
    if with_cache:
        assert torch.equal(sel.cache.hids[1], s.cache.hids[1][[2, 0]])
        assert torch.equal(joined.cache.length, s.cache.length)


@pytest.mark.parametrize("with_cache", [False, True])
def test_reset_rows_is_a_fresh_document(with_cache):
    s = random_state(with_cache=with_cache)
    s.A[1, 0, 0, 0] = float("nan")              # an overflow in the row that is reset
    mask = torch.tensor([False, True, False])
    r = s.reset_rows(mask)
    assert (r.A[1] == 0).all() and (r.z[1] == 0).all() and r.writes.tolist() == [1, 0, 3]
    assert torch.equal(r.A[[0, 2]], s.A[[0, 2]]) and torch.equal(r.z[[0, 2]], s.z[[0, 2]])
    if with_cache:
        assert r.cache.length.tolist() == [5, 0, 0] and (r.cache.hids[0][1] == 0).all()
    # A zeroed row writes and reads exactly as an empty memory (the authors' first segment).
    layer = random_layer(d_model=4, d_key=1, nu=3)         # d_phi = 6, d_v = 4
    mem, query = torch.randn(3, 2, 4), torch.randn(3, 5, 4)
    A, z = layer.write(*r.layer(0), mem)
    A0, z0 = layer.write(*layer.empty_state(3), mem)
    assert torch.equal(A[1], A0[1]) and torch.equal(z[1], z0[1])
    assert torch.equal(layer.read(*r.layer(0), query)[1], query[1])
    assert torch.isfinite(layer.read(A, z, query)).all()
