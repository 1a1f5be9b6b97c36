"""ARMT's associative memory (model/mechanisms/armt/associative.py) as specifications.

The reference below is written straight from the equations in model/mechanisms/armt/associative.py's
docstring: loops over batch rows and memory tokens, float64, no einsum, no DPFP roll.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from model.mechanisms.armt.associative import AssociativeLayer, AssociativeMemory, FeatureMap, dpfp

EPS = 1e-5


# -- the naive reference ---------------------------------------------------------------------
def ref_phi(x: torch.Tensor, kind: str, nu: int) -> torch.Tensor:
    """phi of one vector x [d], entry by entry."""
    x = x.double()
    if kind == "identity":
        return x.clone()
    if kind == "elu":
        return torch.tensor([float(v) + 1 if v > 0 else math.exp(float(v)) for v in x],
                            dtype=torch.float64)
    d = x.shape[0]
    r = [max(float(v), 0.0) for v in x] + [max(-float(v), 0.0) for v in x]   # 2d entries
    out = []
    for j in range(1, nu + 1):          # block j: r_p * r_{(p - j) mod 2d}
        out += [r[p] * r[(p - j) % (2 * d)] for p in range(2 * d)]
    return torch.tensor(out, dtype=torch.float64)


def _w(linear):
    return linear.weight.detach().double()


def ref_write(layer: AssociativeLayer, A, z, mem):
    """(A', z') per row, per memory token, every term written out."""
    A, z = A.double().clone(), z.double().clone()
    A_out, z_out = A.clone(), z.clone()
    kind, nu = layer.phi.kind, layer.phi.nu
    for b in range(mem.shape[0]):
        for i in range(mem.shape[1]):
            h = mem[b, i].double()
            f = ref_phi(_w(layer.k_proj) @ h, kind, nu)
            v = _w(layer.v_proj) @ h
            beta = 1.0
            if layer.gate is not None:
                beta = torch.sigmoid(_w(layer.gate) @ h + layer.gate.bias.detach().double())[0]
            v_old = (f @ A[b]) / (f @ z[b] + EPS)           # the OLD state: one parallel write
            gamma = 1.0
            if layer.correction:
                gamma = min(max(1 - float(f @ z[b]) / (float(f @ f) + EPS), 0.0), 1.0)
            A_out[b] += beta * torch.outer(f, v - v_old)
            z_out[b] += gamma * f
    return A_out, z_out


def ref_retrieve(layer: AssociativeLayer, A, z, hidden):
    out = torch.zeros(*hidden.shape[:2], A.shape[-1], dtype=torch.float64)
    for b in range(hidden.shape[0]):
        for t in range(hidden.shape[1]):
            f = ref_phi(_w(layer.q_proj) @ hidden[b, t].double(), layer.phi.kind, layer.phi.nu)
            out[b, t] = (f @ A[b].double()) / (f @ z[b].double() + EPS)
    return out


def random_layer(seed=0, **kw) -> AssociativeLayer:
    torch.manual_seed(seed)
    kw.setdefault("d_model", 8)
    kw.setdefault("d_key", 4)
    layer = AssociativeLayer(**kw)
    with torch.no_grad():
        for p in layer.parameters():      # W_v starts at zero: give every weight a value
            p.normal_(0, 0.5)
    return layer


# -- feature maps ----------------------------------------------------------------------------
@pytest.mark.parametrize("nu", [1, 2, 3])
def test_dpfp_is_the_definition(nu):
    x = torch.randn(3, 5, dtype=torch.float64)
    got = dpfp(x, nu)
    assert got.shape == (3, 2 * nu * 5) and (got >= 0).all()
    for row in range(3):
        torch.testing.assert_close(got[row], ref_phi(x[row], "dpfp", nu))
    assert FeatureMap("dpfp", nu).out_dim(5) == 2 * nu * 5


def test_other_feature_maps_and_errors():
    x = torch.randn(4, 6, dtype=torch.float64)
    assert torch.equal(FeatureMap("identity")(x), x)
    torch.testing.assert_close(FeatureMap("elu")(x[0]), ref_phi(x[0], "elu", 0))
    assert FeatureMap("elu").out_dim(6) == 6
    with pytest.raises(ValueError):
        FeatureMap("softmax")
    with pytest.raises(ValueError):
        FeatureMap("dpfp", nu=0)


# -- read and write against the reference ----------------------------------------------------
@pytest.mark.parametrize("feature_map,nu,use_gate,correction,d_value", [
    ("dpfp", 3, True, True, None), ("dpfp", 1, False, True, None),
    ("dpfp", 2, True, False, None), ("elu", 3, True, True, None),
    ("identity", 3, True, True, None), ("dpfp", 3, True, True, 5)])
def test_read_write_match_reference(feature_map, nu, use_gate, correction, d_value):
    layer = random_layer(feature_map=feature_map, nu=nu, use_gate=use_gate,
                         correction=correction, d_value=d_value)
    B, m, T = 3, 4, 5
    mem1, mem2 = torch.randn(B, m, 8), torch.randn(B, m, 8)
    hidden = torch.randn(B, T, 8)
    A0, z0 = layer.empty_state(B)
    # Two segments: the second write and the read see a non-empty memory (the delta rule).
    A1r, z1r = ref_write(layer, A0, z0, mem1)
    A2r, z2r = ref_write(layer, A1r, z1r, mem2)
    outr = ref_retrieve(layer, A2r, z2r, hidden)

    lay64 = copy.deepcopy(layer).double()     # the same computation in float64: exact
    A1, z1 = lay64.write(A0.double(), z0.double(), mem1.double())
    A2, z2 = lay64.write(A1, z1, mem2.double())
    out = lay64.retrieve(A2, z2, hidden.double())
    for got, want in [(A1, A1r), (z1, z1r), (A2, A2r), (z2, z2r), (out, outr)]:
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    read = lay64.read(A2, z2, hidden.double())
    proj = outr if layer.out_proj is None else outr @ _w(layer.out_proj).T
    torch.testing.assert_close(read, hidden.double() + proj, rtol=1e-9, atol=1e-9)

    if feature_map != "identity":             # float32 module (phi >= 0: safe normaliser)
        A1, z1 = layer.write(A0, z0, mem1)
        A2, z2 = layer.write(A1, z1, mem2)
        assert A2.dtype == z2.dtype == torch.float32
        torch.testing.assert_close(A2.double(), A2r, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(z2.double(), z2r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.retrieve(A2, z2, hidden).double(), outr,
                                   rtol=1e-4, atol=1e-4)


def test_fresh_layer_reads_nothing():
    """W_v starts at zero (authors' code): at initialisation the block changes nothing."""
    layer = AssociativeLayer(8, 4)
    A, z = layer.write(*layer.empty_state(2), torch.randn(2, 3, 8))
    hidden = torch.randn(2, 5, 8)
    assert torch.equal(layer.read(A, z, hidden), hidden)
    assert (z > 0).any()                        # the keys were counted nevertheless


# -- the delta rule on keys orthogonal under phi ---------------------------------------------
D_MODEL, D_KEY = 12, 6


def probe_layer(use_gate=False, correction=True, beta=None) -> AssociativeLayer:
    """k = q = the first D_KEY entries of h, v = h (identity projections), DPFP nu=3."""
    layer = AssociativeLayer(D_MODEL, D_KEY, use_gate=use_gate or beta is not None,
                             correction=correction)
    with torch.no_grad():
        eye = torch.eye(D_MODEL)
        layer.k_proj.weight.copy_(eye[:D_KEY])
        layer.q_proj.weight.copy_(eye[:D_KEY])
        layer.v_proj.weight.copy_(eye)
        if beta is not None:                   # constant importance beta
            layer.gate.weight.zero_()
            layer.gate.bias.fill_(math.log(beta / (1 - beta)))
    return layer


# Keys whose [relu(k), relu(-k)] have disjoint supports have disjoint DPFP supports (every
# DPFP entry is a product of two entries of one r), hence are orthogonal under phi.
KEYS = torch.tensor([[2., 2., 0., 0., 0., 0.],      # r support {0, 1}
                     [0., 0., 0., 0., 2., 2.],      # r support {4, 5}
                     [0., 0., -2., -2., 0., 0.]])   # r support {8, 9}


def item(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A hidden state whose key part is `key` and value (all of h) carries `value`."""
    return torch.cat([key, value])


def test_probe_keys_are_orthogonal_under_phi():
    f = dpfp(KEYS, 3)
    gram = f @ f.T
    assert torch.equal(gram, torch.diag(torch.diag(gram))) and (torch.diag(gram) > 1).all()


def test_writing_the_same_association_twice_changes_nothing():
    layer = probe_layer()
    vals = torch.randn(3, D_MODEL - D_KEY)
    mem = torch.stack([item(k, v) for k, v in zip(KEYS, vals, strict=True)])[None]
    A1, z1 = layer.write(*layer.empty_state(1), mem)
    A2, z2 = layer.write(A1, z1, mem)
    A3, z3 = layer.write(A2, z2, mem)
    # eps: vbar = v |phi|^2 / (|phi|^2 + eps), so a rewrite adds eps-relative amounts only.
    for a, b in [(A2, A1), (A3, A1), (z2, z1), (z3, z1)]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.retrieve(A3, z3, mem), mem, rtol=1e-5, atol=1e-5)


def test_new_value_for_a_stored_key_replaces_the_old():
    layer = probe_layer()
    old, other, new = torch.randn(3, D_MODEL - D_KEY)
    a, b = item(KEYS[0], old), item(KEYS[1], other)
    A, z = layer.write(*layer.empty_state(1), torch.stack([a, b])[None])
    torch.testing.assert_close(layer.retrieve(A, z, a[None, None])[0, 0], a,
                               rtol=1e-4, atol=1e-4)
    a_new = item(KEYS[0], new)
    A, z = layer.write(A, z, a_new[None, None])
    torch.testing.assert_close(layer.retrieve(A, z, a[None, None])[0, 0], a_new,
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer.retrieve(A, z, b[None, None])[0, 0], b,   # untouched
                               rtol=1e-4, atol=1e-4)


def test_gate_moves_a_fraction_beta_of_the_way():
    """beta < 1: after n writes of (k, v), reading k gives (1 - (1 - beta)^n) v."""
    beta = 0.25
    layer = probe_layer(beta=beta)
    h = item(KEYS[2], torch.randn(D_MODEL - D_KEY))[None, None]
    A, z = layer.empty_state(1)
    for n in range(1, 5):
        A, z = layer.write(A, z, h)
        torch.testing.assert_close(layer.retrieve(A, z, h), (1 - (1 - beta) ** n) * h,
                                   rtol=1e-4, atol=1e-4)


def test_without_correction_rewrites_dilute_the_normaliser():
    """What gamma is for: with gamma = 1, z counts a key each time it is written. Writing
    (k, v) n times gives z = n phi(k) and A = a_n phi(k) v^T with a_1 = 1 and
    a_(n+1) = a_n + 1 - a_n / n (the delta rule), i.e. a_n = n / 2 from n = 2 on: every
    rewrite of the same association reads back v / 2 instead of v."""
    layer = probe_layer(correction=False)
    h = item(KEYS[0], torch.randn(D_MODEL - D_KEY))[None, None]
    A, z = layer.empty_state(1)
    for n in range(1, 6):
        A, z = layer.write(A, z, h)
        want = h if n == 1 else h / 2
        torch.testing.assert_close(layer.retrieve(A, z, h), want, rtol=1e-4, atol=1e-4)
    corrected = probe_layer(correction=True)
    A, z = corrected.empty_state(1)
    for _ in range(5):
        A, z = corrected.write(A, z, h)
    torch.testing.assert_close(corrected.retrieve(A, z, h), h, rtol=1e-4, atol=1e-4)


# -- gradients -------------------------------------------------------------------------------
def test_gradients_flow_through_A_and_z_across_two_writes():
    layer = random_layer(d_model=8, d_key=4)
    mem1 = torch.randn(2, 3, 8, requires_grad=True)
    mem2, query = torch.randn(2, 3, 8), torch.randn(2, 4, 8)
    A1, z1 = layer.write(*layer.empty_state(2), mem1)
    A1.retain_grad()
    z1.retain_grad()
    A2, z2 = layer.write(A1, z1, mem2)
    layer.read(A2, z2, query).square().sum().backward()
    for g in (A1.grad, z1.grad, mem1.grad):
        assert g is not None and g.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())

    # detach() cuts the graph at the segment boundary (the BPTT window's edge).
    state = AssociativeMemory(A=A1[:, None], z=z1[:, None], writes=torch.ones(2, dtype=int))
    cut = state.detach()
    assert not cut.A.requires_grad and not cut.z.requires_grad
    A2, z2 = layer.write(*cut.layer(0), mem2)
    (gm,) = torch.autograd.grad(layer.read(A2, z2, query).sum(), mem1, allow_unused=True)
    assert gm is None


def test_gradient_through_the_state_is_the_derivative():
    """gradcheck of (A, z) -> read(write(A, z, m), q) in float64; gamma = 1 here because
    the authors stop gamma's gradient (with correction on, autograd and finite differences
    legitimately disagree on z)."""
    layer = random_layer(d_model=6, d_key=3, correction=False).double()
    mem, query = torch.randn(2, 3, 6, dtype=torch.float64), torch.randn(2, 4, 6,
                                                                      dtype=torch.float64)
    A0, z0 = layer.write(*(t.double() for t in layer.empty_state(2)), torch.randn(
        2, 3, 6, dtype=torch.float64))
    A0 = A0.detach().requires_grad_()
    z0 = z0.detach().requires_grad_()

    def f(A, z):
        return layer.read(*layer.write(A, z, mem), query)

    assert torch.autograd.gradcheck(f, (A0, z0))


# -- half precision --------------------------------------------------------------------------
def test_bf16_stays_close_to_float32_and_keeps_the_state_float32():
    """Tolerance stated: with bf16 weights and inputs (the projections in bf16, phi and the
    normalised lookups in float32), A, z and the reads stay within 1.5% (relative, in norm)
    of the float32 computation on the same bf16-rounded inputs over 8 segments (measured:
    0.2-0.5% over five seeds)."""
    layer = random_layer(d_model=16, d_key=8)
    lay16 = copy.deepcopy(layer).to(torch.bfloat16)
    with torch.no_grad():                      # the same (bf16-representable) weights
        for p32, p16 in zip(layer.parameters(), lay16.parameters(), strict=True):
            p32.copy_(p16.float())
    B, m = 2, 4
    A, z = layer.empty_state(B)
    A16, z16 = lay16.empty_state(B)
    for _ in range(8):
        mem = torch.randn(B, m, 16).to(torch.bfloat16)
        with torch.no_grad():
            A, z = layer.write(A, z, mem.float())
            A16, z16 = lay16.write(A16, z16, mem)
        assert A16.dtype == z16.dtype == torch.float32
    query = torch.randn(B, 5, 16).to(torch.bfloat16)
    with torch.no_grad():
        out = layer.read(A, z, query.float())
        out16 = lay16.read(A16, z16, query)
    assert out16.dtype == torch.bfloat16 and torch.isfinite(out16).all()

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    assert rel(A16, A) < 1.5e-2 and rel(z16, z) < 1.5e-2
    assert rel(out16 - query, out - query.float()) < 1.5e-2


def test_a_bf16_state_drifts_where_float32_does_not():
    """The same bf16 module over 512 segments, once with A and z kept float32 (what
    AssociativeMemory does) and once rounded to bf16 after every write. With gamma = 1 (z
    grows by a full phi(k) per token) the bf16 state's z is off by ~5% and its reads by
    ~4% (measured, three seeds); the float32 state stays within 0.02% and 0.8%."""
    torch.manual_seed(1)
    layer = random_layer(seed=1, d_model=16, d_key=8, correction=False)
    lay16 = copy.deepcopy(layer).to(torch.bfloat16)
    with torch.no_grad():
        for p32, p16 in zip(layer.parameters(), lay16.parameters(), strict=True):
            p32.copy_(p16.float())
    A, z = layer.empty_state(2)
    A16, z16 = lay16.empty_state(2)
    Ab, zb = A16.clone(), z16.clone()
    with torch.no_grad():
        for _ in range(512):
            mem = torch.randn(2, 4, 16).to(torch.bfloat16)
            A, z = layer.write(A, z, mem.float())
            A16, z16 = lay16.write(A16, z16, mem)
            Ab, zb = (t.to(torch.bfloat16) for t in lay16.write(Ab, zb, mem))
        query = torch.randn(2, 5, 16).to(torch.bfloat16)
        want = layer.read(A, z, query.float()) - query.float()
        out16 = lay16.read(A16, z16, query) - query
        outb = lay16.read(Ab, zb, query) - query

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    assert rel(z16, z) < 2e-3 and rel(out16, want) < 2e-2
    assert rel(zb, z) > 2e-2 and rel(outb, want) > 2 * rel(out16, want)


def test_fp16_module_does_not_overflow_in_phi():
    """DPFP multiplies two key entries: |k| = 300 gives 9e4 > fp16's 65504. The projections
    run in fp16, phi and the state in float32, so the write stays finite and equal to the
    float32 one."""
    layer = probe_layer()
    with torch.no_grad():
        layer.k_proj.weight.mul_(150)          # keys of size 300 from the probe items
    lay16 = copy.deepcopy(layer).half()
    h = item(KEYS[0], torch.randn(D_MODEL - D_KEY))[None, None]
    assert torch.isinf(dpfp(lay16.k_proj(h.half()), 3)).any()      # what would happen
    A16, z16 = lay16.write(*lay16.empty_state(1), h.half())
    A, z = layer.write(*layer.empty_state(1), h.half().float())
    assert torch.isfinite(A16).all() and torch.isfinite(z16).all()
    torch.testing.assert_close(z16, z, rtol=1e-3, atol=0)
    torch.testing.assert_close(A16, A, rtol=2e-3, atol=1e-2)


def test_why_z_is_float32():
    """z is a running sum over a document's segments: in bf16 it stops growing at 256 when
    each segment adds 1, while float32 counts on (what AssociativeMemory.fp32_fields
    avoids)."""
    z16, z32 = torch.zeros((), dtype=torch.bfloat16), torch.zeros(())
    for _ in range(1000):
        z16, z32 = z16 + 1, z32 + 1
    assert float(z32) == 1000 and float(z16) == 256
    state = AssociativeMemory.zeros(2, 3, 24, 16).to(dtype=torch.bfloat16)
    assert state.A.dtype == state.z.dtype == torch.float32


# -- a query on features gamma kept out of z (docs/armt.md, "Loss spikes") ---------------------
def _gamma_kept_out(floor: float = 0.0
                    ) -> tuple:
    """key 1 = [4, 4, 0...] is stored (z = phi(k1): one DPFP feature, r1 r0 = 16); key 2 =
    [2, 2, 1, 0...] holds that feature (4) and two more (r2 r1 = 2, r2 r0 = 2), and since
    phi(k2)^T z = 64 >= |phi(k2)|^2 = 24 its gamma is 0: A takes phi(k2) (v2 - vbar2) on all
    three features, z on none. The query [0, 1, 1, 0...] has only the feature r2 r1: its
    phi^T z is 0 while its phi^T A is 2 (v2 - v1)."""
    layer = probe_layer()
    layer.denominator_floor = floor
    v1, v2 = torch.randn(2, D_MODEL - D_KEY, generator=torch.Generator().manual_seed(0))
    k1, k2 = torch.zeros(2, D_KEY)
    k1[:2], k2[:3] = torch.tensor([4., 4.]), torch.tensor([2., 2., 1.])
    A, z = layer.write(*layer.empty_state(1), item(k1, v1)[None, None])
    A, z = layer.write(A, z, item(k2, v2)[None, None])
    query = item(torch.tensor([0., 1., 1., 0., 0., 0.]), torch.zeros(D_MODEL - D_KEY))
    return layer, A, z, query[None, None], item(k1, v1)[None, None]


def test_the_authors_read_of_features_gamma_kept_out_of_z_is_unbounded():
    """What a loss spike of a trained ARMT is made of: a finite state whose read is five
    orders of magnitude above every value stored (phi^T A / eps)."""
    layer, A, z, query, stored_item = _gamma_kept_out()
    stored = stored_item.abs().max()          # the largest entry of a value written: 4
    assert float(torch.einsum("f,f->", dpfp(torch.tensor([0., 1., 1., 0., 0., 0.]), 3),
                              z[0])) == 0
    assert layer.retrieve(A, z, query).abs().max() > 1e4 * stored
    # the state itself is finite and modest: it is the division that explodes
    assert A.abs().max() < 100 * stored


def test_a_denominator_floor_bounds_that_read_and_leaves_stored_keys_alone():
    layer, A, z, query, stored_item = _gamma_kept_out()
    exact = layer.retrieve(A, z, stored_item)
    layer.denominator_floor = 1.0
    # phi(q)^T z >= |phi(q)|^2: the read is at most phi(q)^T A / |phi(q)|^2, here 2 (v2 - v1)
    assert layer.retrieve(A, z, query).abs().max() <= 2 * A.abs().max()
    # a stored, orthogonal key has phi^T z = |phi|^2 already: read exactly as before
    torch.testing.assert_close(layer.retrieve(A, z, stored_item), exact)
    # the write's gamma reads the raw phi^T z: the same normaliser from the same writes
    # (A differs only where a write's vbar met the floor)
    _, _, z_floored, _, _ = _gamma_kept_out(floor=1.0)
    torch.testing.assert_close(z_floored, z)


def test_training_reads_keep_their_smallest_relative_denominator_for_the_log():
    """`take_read_minimum` (what the training log records per layer as read_den_min/<i>):
    phi(q)^T z / |phi(q)|^2 over the training reads since the last call: 0 for the query
    gamma kept out of z, 1 for a stored orthogonal key; rows with an empty memory do not
    count; evaluation reads are not recorded; taking it starts again."""
    layer, A, z, query, stored_item = _gamma_kept_out()
    layer.train()
    layer.retrieve(A, z, stored_item)
    assert float(layer.take_read_minimum()) == pytest.approx(1.0, rel=1e-4)
    assert layer.take_read_minimum() is None
    layer.retrieve(A, z, stored_item)
    layer.retrieve(A, z, query)
    assert float(layer.take_read_minimum()) == 0.0
    fresh_A, fresh_z = layer.empty_state(1)
    layer.retrieve(fresh_A, fresh_z, query)
    assert float(layer.take_read_minimum()) == float("inf")
    layer.eval()
    layer.retrieve(A, z, query)
    assert layer.take_read_minimum() is None
