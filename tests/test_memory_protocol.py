"""The memory-state protocol (model/memory.py), checked for every mechanism.

Everything outside model/ speaks only this protocol, so each property is checked on states
produced by actually running a model for a few segments: detach, select_rows, reset_rows,
to, state_dict round trips, load errors, and batch-first layout (the FIFO: test_memory_fifo.py).
"""

import io

import pytest
import torch
from reference import run_segments, sharpened_model

from model import AssociativeMemory, LaMemoMemory, MemoryState, RMTMemory, XLMemory

VOCAB = 50
SEG = 4  # tgt_len
MEM = 6  # mem_len: not a multiple of SEG, so the FIFO cuts inside a segment
BATCH = 3

# setup id -> (mechanism, mem_len). RMT runs alone (mem_len 0) and with an XL cache beside
# its memory tokens (Tr-XL + RMT).
SETUPS = {
    "xl": ("xl", MEM),
    "lamemo": ("lamemo", MEM),
    "rmt": ("rmt", 0),
    "rmt+cache": ("rmt", MEM),
    "armt": ("armt", 0),
    "armt+cache": ("armt", MEM),
}
STATE_TYPES = {"xl": XLMemory, "lamemo": LaMemoMemory, "rmt": RMTMemory,
               "armt": AssociativeMemory}
# What carries the graph into earlier segments (the BPTT path the caller cuts by detaching):
# RMT's memory tokens, ARMT's association matrices and normalisers.
GRAPH_FIELDS = {"rmt": {"tokens"}, "armt": {"A", "z"}}
# Float fields that stay float32 whatever dtype the state is moved to.
FP32_FIELDS = {"lamemo": ("log_norm",), "armt": ("A", "z")}


def make_model(setup: str, seed: int = 0):
    mechanism, mem_len = SETUPS[setup]
    return sharpened_model(mechanism, mem_len, vocab=VOCAB, seg=SEG, seed=seed)


def random_tokens(batch: int, n_seg: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, n_seg * SEG), generator=g)
    targets = torch.randint(0, VOCAB, (batch, n_seg * SEG), generator=g)
    return tokens, targets


def run(model, tokens, targets, state=None):
    return run_segments(model, tokens, targets, SEG, state)


def state_after(model, n_seg: int = 3, batch: int = BATCH, seed: int = 1):
    tokens, targets = random_tokens(batch, n_seg, seed)
    _, state = run(model, tokens, targets)
    return state


def tensors(state: MemoryState, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a state (nested cache included), by a dotted field path."""
    out = {}
    for name, val in vars(state).items():
        key = f"{prefix}{name}"
        if isinstance(val, torch.Tensor):
            out[key] = val
        elif isinstance(val, list):
            for i, t in enumerate(val):
                out[f"{key}[{i}]"] = t
        elif isinstance(val, MemoryState):
            out.update(tensors(val, f"{key}."))
    return out


def assert_states_equal(a: MemoryState, b: MemoryState) -> None:
    assert type(a) is type(b)
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype, k
        assert torch.equal(ta[k], tb[k]), k


def assert_close(actual, expected, atol=1e-5, rtol=1e-5):
    assert actual.shape == expected.shape
    err = (actual - expected).abs().max().item()
    assert torch.allclose(actual, expected, atol=atol, rtol=rtol), f"max abs error {err:.3g}"


# --------------------------------------------------------------------------- sanity of setup
@pytest.mark.parametrize("setup", SETUPS)
def test_state_has_the_mechanisms_type_and_every_part_is_populated(setup):
    model = make_model(setup)
    state = state_after(model)
    assert type(state) is STATE_TYPES[SETUPS[setup][0]]
    assert state.batch_size == BATCH
    ts = tensors(state)
    if setup in ("rmt", "armt"):
        assert state.cache is None
    if setup in ("rmt+cache", "armt+cache"):
        assert isinstance(state.cache, XLMemory) and len(state.cache.hids) == 2
    if setup in ("xl", "lamemo"):
        assert state.mem_len_now == MEM
    assert all(t.numel() > 0 for t in ts.values())
    if SETUPS[setup][0] == "armt":
        assert state.writes.tolist() == [3] * BATCH and state.A.abs().sum() > 0


# --------------------------------------------------------------------------- batch-first
@pytest.mark.parametrize("setup", SETUPS)
def test_every_state_tensor_is_batch_first(setup):
    model = make_model(setup)
    state = state_after(model, batch=5)
    for name, t in tensors(state).items():
        assert t.dim() >= 1 and t.shape[0] == 5, f"{name}: shape {tuple(t.shape)}"


@pytest.mark.parametrize("setup", SETUPS)
def test_initial_state_tensors_are_batch_first(setup):
    model = make_model(setup)
    state = model.initial_state(5)
    for name, t in tensors(state).items():
        assert t.dim() >= 1 and t.shape[0] == 5, f"{name}: shape {tuple(t.shape)}"


@pytest.mark.parametrize("setup", SETUPS)
def test_select_rows_of_initial_state_gives_same_outputs_as_fresh_run(setup):
    # A training loop starts from initial_state(B) and may drop rows before the first step.
    model = make_model(setup)
    tokens, targets = random_tokens(BATCH, 1, seed=2)
    index = torch.tensor([2, 0])
    state = model.initial_state(BATCH).select_rows(index)
    assert state.batch_size == 2
    with torch.no_grad():
        got = model(tokens[index], state, targets=targets[index]).nll
        want = model(tokens[index], None, targets=targets[index]).nll
    assert_close(got, want)


# --------------------------------------------------------------------------- detach
@pytest.mark.parametrize("setup", SETUPS)
def test_model_output_state_carries_a_graph_only_for_rmt_tokens_and_armt_matrices(setup):
    model = make_model(setup)
    state = state_after(model)  # grad mode on: the forward builds a graph
    graph = GRAPH_FIELDS.get(SETUPS[setup][0], set())
    for name, t in tensors(state).items():
        if name in graph:  # the BPTT path into earlier segments
            assert t.grad_fn is not None and t.requires_grad, name
        else:  # XL cache, LaMemo state, the caches beside them, flags: always stop-gradient
            assert t.grad_fn is None and not t.requires_grad, name


@pytest.mark.parametrize("setup", SETUPS)
def test_detach_returns_new_state_without_graph_and_same_values(setup):
    model = make_model(setup)
    state = state_after(model)
    det = state.detach()
    assert det is not state
    for name, t in tensors(det).items():
        assert t.grad_fn is None and not t.requires_grad, name
    assert_states_equal(det, state)  # values unchanged (torch.equal ignores autograd)
    for name in GRAPH_FIELDS.get(SETUPS[setup][0], ()):
        # functional: the original keeps its graph
        assert getattr(state, name).grad_fn is not None, name


def test_detached_rmt_state_stops_gradient_into_previous_segment():
    model = make_model("rmt").train()
    tokens, targets = random_tokens(2, 2, seed=3)
    first = model(tokens[:, :SEG], None, targets=targets[:, :SEG])
    w = model.core.init_memory
    # Through the carried tokens, the second segment's loss reaches the learned initial
    # memory read by the first segment; after detach nothing reaches it (the state is no
    # longer fresh, so the second segment reads only the detached tokens).
    attached = model(tokens[:, SEG:], first.state, targets=targets[:, SEG:]).loss
    (g,) = torch.autograd.grad(attached, w)
    assert g.abs().sum() > 0
    detached = model(tokens[:, SEG:], first.state.detach(), targets=targets[:, SEG:]).loss
    (g,) = torch.autograd.grad(detached, w, allow_unused=True)
    assert g is None or g.abs().sum() == 0


# --------------------------------------------------------------------------- select_rows
@pytest.mark.parametrize("setup", SETUPS)
def test_select_rows_keeps_the_given_rows_in_the_given_order(setup):
    model = make_model(setup)
    state = state_after(model, batch=4)
    index = torch.tensor([3, 0, 2])
    sel = state.select_rows(index)
    assert type(sel) is type(state) and sel.batch_size == 3
    full, part = tensors(state), tensors(sel)
    assert full.keys() == part.keys()
    for name in full:
        assert part[name].dtype == full[name].dtype, name
        for k, r in enumerate(index.tolist()):
            assert torch.equal(part[name][k], full[name][r]), f"{name} row {k} != row {r}"


@pytest.mark.parametrize("setup", SETUPS)
def test_select_rows_then_next_segment_equals_those_rows_of_full_batch(setup):
    model = make_model(setup)
    tokens, targets = random_tokens(4, 3, seed=4)
    with torch.no_grad():
        _, state = run(model, tokens[:, :2 * SEG], targets[:, :2 * SEG])
        nxt, nxt_t = tokens[:, 2 * SEG:], targets[:, 2 * SEG:]
        full = model(nxt, state, targets=nxt_t).nll
        index = torch.tensor([3, 1])
        part = model(nxt[index], state.select_rows(index), targets=nxt_t[index]).nll
        # The memory matters: the same rows without their memory score differently.
        fresh = model(nxt[index], None, targets=nxt_t[index]).nll
    assert_close(part, full[index])
    assert (fresh - full[index]).abs().max() > 1e-3


@pytest.mark.parametrize("setup", SETUPS)
def test_concat_rows_of_per_rank_parts_rebuilds_the_whole_state(setup):
    # What a resume on another world size does: rank parts joined in rank order.
    model = make_model(setup)
    state = state_after(model, batch=4)
    parts = [state.select_rows(torch.tensor(rows)) for rows in ([0, 1], [2], [3])]
    assert_states_equal(MemoryState.concat_rows(parts), state)
    swapped = MemoryState.concat_rows([parts[2], parts[0], parts[1]])
    assert_states_equal(swapped, state.select_rows(torch.tensor([3, 0, 1, 2])))


def test_concat_rows_refuses_states_of_different_kinds():
    xl, rmt = state_after(make_model("xl")), state_after(make_model("rmt"))
    with pytest.raises(ValueError, match="kinds"):
        MemoryState.concat_rows([xl, rmt])


# --------------------------------------------------------------------------- reset_rows
@pytest.mark.parametrize("setup", SETUPS)
def test_reset_row_continues_like_a_fresh_document_and_other_rows_are_unchanged(setup):
    # Documents end at different times per row: row 1's document starts at segment 2, the
    # others continue. Row 1 must then score exactly like a fresh run of its new document
    # (for two segments, so the memory written after the reset is checked too), and the
    # other rows exactly like a run without any reset.
    model = make_model(setup)
    tokens, targets = random_tokens(BATCH, 4, seed=5)
    r = 1
    mask = torch.tensor([False, True, False])
    with torch.no_grad():
        _, state = run(model, tokens[:, :2 * SEG], targets[:, :2 * SEG])
        rest, rest_t = tokens[:, 2 * SEG:], targets[:, 2 * SEG:]
        with_reset, _ = run(model, rest, rest_t, state.reset_rows(mask))
        no_reset, _ = run(model, rest, rest_t, state)
        fresh, _ = run(model, rest[r:r + 1], rest_t[r:r + 1], None)
    for seg in range(2):
        assert_close(with_reset[seg][r:r + 1], fresh[seg])
        assert_close(with_reset[seg][~mask], no_reset[seg][~mask], atol=1e-6, rtol=1e-6)
    # The test can fail: without the reset, row r scores differently from the fresh run.
    assert (no_reset[0][r:r + 1] - fresh[0]).abs().max() > 1e-3


@pytest.mark.parametrize("setup", SETUPS)
def test_reset_rows_is_functional_and_keeps_batch_size(setup):
    model = make_model(setup)
    state = state_after(model)
    before = {k: v.clone() for k, v in tensors(state).items()}
    reset = state.reset_rows(torch.tensor([True, False, False]))
    assert reset is not state and type(reset) is type(state)
    assert reset.batch_size == BATCH
    for k, v in tensors(state).items():
        assert torch.equal(v, before[k]), f"reset_rows modified the original state's {k}"


# --------------------------------------------------------------------------- to(dtype)
@pytest.mark.parametrize("setup", SETUPS)
def test_to_float64_converts_floats_but_keeps_the_fp32_fields_and_int_bool_dtypes(setup):
    model = make_model(setup)
    state = state_after(model).detach()
    moved = state.to(dtype=torch.float64)
    assert type(moved) is type(state)
    orig = tensors(state)
    fp32 = FP32_FIELDS.get(SETUPS[setup][0], ())
    for name, t in tensors(moved).items():
        o = orig[name]
        if name.startswith(fp32):
            assert t.dtype == torch.float32, name
        elif o.is_floating_point():
            assert t.dtype == torch.float64, name
        else:
            assert t.dtype == o.dtype, name  # lengths stay long, RMT's fresh stays bool
        assert torch.equal(t.to(o.dtype), o), name
    names = tensors(moved)
    if setup == "lamemo":
        assert any(n.startswith("log_norm") for n in names)
    if setup in ("xl", "lamemo", "rmt+cache"):
        assert any(n.endswith("length") and names[n].dtype == torch.long for n in names)
    if SETUPS[setup][0] == "rmt":
        assert names["fresh"].dtype == torch.bool


@pytest.mark.parametrize("setup", SETUPS)
def test_float64_state_continues_a_float64_model_like_the_float32_run(setup):
    model = make_model(setup)
    tokens, targets = random_tokens(BATCH, 3, seed=12)
    with torch.no_grad():
        _, state = run(model, tokens[:, :2 * SEG], targets[:, :2 * SEG])
        want, _ = run(model, tokens[:, 2 * SEG:], targets[:, 2 * SEG:], state)
        got, new = run(make_model(setup).double(), tokens[:, 2 * SEG:], targets[:, 2 * SEG:],
                       state.to(dtype=torch.float64))
    assert got[0].dtype == torch.float64
    for g, w in zip(got, want, strict=True):
        assert_close(g.float(), w, atol=1e-4, rtol=1e-4)
    for name, t in tensors(new).items():
        if t.is_floating_point():
            # LaMemo computes its log-normalisers in float32 whatever the model's dtype;
            # ARMT's A and z are float32 at least, so a float64 model keeps float64.
            fp32 = ("log_norm",) if SETUPS[setup][0] == "lamemo" else ()
            assert t.dtype == (torch.float32 if name.startswith(fp32) else torch.float64)


# --------------------------------------------------------------------------- state_dict
def _save_load(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    # A memory state_dict holds only tensors, lists, str, bool and None: the safe loader
    # (weights_only) must accept it.
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("setup", SETUPS)
def test_state_dict_round_trip_via_from_state_dict_continues_bit_identically(setup):
    model = make_model(setup)
    tokens, targets = random_tokens(BATCH, 4, seed=6)
    with torch.no_grad():
        _, state = run(model, tokens[:, :2 * SEG], targets[:, :2 * SEG])
        restored = MemoryState.from_state_dict(_save_load(state.state_dict()))
        assert_states_equal(restored, state.detach())
        rest, rest_t = tokens[:, 2 * SEG:], targets[:, 2 * SEG:]
        want, want_state = run(model, rest, rest_t, state)
        got, got_state = run(model, rest, rest_t, restored)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert_states_equal(got_state.detach(), want_state.detach())


@pytest.mark.parametrize("setup", SETUPS)
def test_state_dict_round_trip_via_in_place_load_continues_bit_identically(setup):
    model = make_model(setup)
    tokens, targets = random_tokens(BATCH, 4, seed=7)
    with torch.no_grad():
        _, state = run(model, tokens[:, :2 * SEG], targets[:, :2 * SEG])
        target = model.initial_state(BATCH)
        assert target.load_state_dict(_save_load(state.state_dict())) is None
        assert_states_equal(target, state.detach())
        rest, rest_t = tokens[:, 2 * SEG:], targets[:, 2 * SEG:]
        want, _ = run(model, rest, rest_t, state)
        got, _ = run(model, rest, rest_t, target)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("setup", SETUPS)
def test_state_dict_is_a_detached_copy(setup):
    model = make_model(setup)
    state = state_after(model)
    sd = state.state_dict()
    assert sd["kind"] == SETUPS[setup][0]
    for name, t in tensors(MemoryState.from_state_dict(sd)).items():
        assert t.grad_fn is None, name
    # Writing into the saved copy must not change the live state.
    first = next(iter(tensors(state)))
    live = tensors(state)[first].clone()
    for t in tensors(MemoryState.from_state_dict(sd)).values():
        if t.is_floating_point():
            t.add_(1.0)
    assert torch.equal(tensors(state)[first], live)


def test_load_state_dict_of_another_kind_raises_and_leaves_state_unchanged():
    xl = state_after(make_model("xl"))
    lamemo_sd = state_after(make_model("lamemo")).state_dict()
    before = xl.state_dict()
    with pytest.raises(ValueError, match="lamemo") as info:
        xl.load_state_dict(lamemo_sd)
    assert "xl" in str(info.value)
    assert_states_equal(xl, MemoryState.from_state_dict(before))


@pytest.mark.parametrize("setup", SETUPS)
def test_load_state_dict_of_another_batch_size_raises(setup):
    model = make_model(setup)
    state = state_after(model, batch=BATCH)
    other = state_after(model, batch=BATCH + 2).state_dict()
    with pytest.raises(ValueError, match="batch size"):
        state.load_state_dict(other)
    assert state.batch_size == BATCH


def test_from_state_dict_with_unknown_kind_raises():
    sd = state_after(make_model("xl")).state_dict()
    sd["kind"] = "mamba"
    with pytest.raises(ValueError, match="unknown kind 'mamba'"):
        MemoryState.from_state_dict(sd)
    with pytest.raises(ValueError, match="unknown kind"):
        MemoryState.from_state_dict({"hids": []})


def test_from_state_dict_with_missing_field_raises():
    sd = state_after(make_model("lamemo")).state_dict()
    del sd["log_norm"]
    with pytest.raises(ValueError, match="log_norm"):
        MemoryState.from_state_dict(sd)
