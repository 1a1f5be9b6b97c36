"""Host synchronisations in the training hot path, counted rather than read
(BENCHMARKS.md, "Host synchronisations per micro-step").

Every call that makes the host wait for a device result is wrapped with a counter:
`Tensor.item/tolist/cpu/numpy`, `bool()/float()/int()/index` of a tensor, `nonzero`
(function and method), `masked_select`, and boolean-mask indexing `x[mask]` (data-dependent
shape). On CPU nothing waits, so these calls stand for the syncs they would be on a GPU. On
CUDA the same check is `torch.cuda.set_sync_debug_mode("error")` around the step (it also
catches blocking host-to-device copies, which a CPU run cannot see); not available here.

The real training loop (`TrainingLoop.run`: micro-step, backward, step, logging) runs on one process
with the bare model behind a fake engine (as tests/test_nonfinite_steps.py drives it; what
DeepSpeed's engine does inside backward/step is DeepSpeed's). Allowed: ONE sync per optimizer
step, the combined all-reduced read of the stop / non-finite flags and the step's loss sums
(train/loop.py `_read_flags`: every rank must agree on stopping, fp32/bf16 must stop
before the update, fp16 must know before the next window which memory to carry), plus what
the logging steps read. The adaptive softmax and the model's forward make none.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from contextlib import contextmanager

import pytest
import torch

from data_pipeline.streams import SegmentBatch
from model import build_model
from model.adaptive import AdaptiveEmbedding, AdaptiveSoftmax
from train.bptt import StreamWindows, TrainState
from train.config import from_dict
from train.loop import LoopParts, TrainingLoop

B, L, V = 2, 6, 64
CUTOFFS = [8, 24]          # three clusters, so the adaptive softmax routes rows

COUNTS: Counter = Counter()
_METHODS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "__index__",
            "nonzero", "masked_select")
# `.numpy()` raises for a device tensor, so it cannot hide a sync: the step uses it for what
# the data loader made on the host (reset flags, target ids for the adaptive softmax's
# routing). Counted apart, and checked to see only token ids / flags, never activations.
HOST_READS: Counter = Counter()


def _counted(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        COUNTS[name] += 1
        return fn(*args, **kwargs)
    return wrapper


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@contextmanager
def counting_syncs():
    """Count every would-be host sync in the body into COUNTS (by kind)."""
    saved = {name: getattr(torch.Tensor, name) for name in _METHODS}
    saved_fns = {name: getattr(torch, name) for name in ("nonzero", "masked_select")}
    getitem = torch.Tensor.__getitem__
    numpy = torch.Tensor.numpy

    def host_numpy(self, *args, **kwargs):
        assert not self.is_floating_point() and not self.requires_grad, (
            f"numpy() of a {self.dtype} tensor: only host data may be read this way")
        HOST_READS[str(self.dtype)] += 1
        return numpy(self, *args, **kwargs)

    def bool_getitem(self, index):
        if _is_bool_index(index):
            COUNTS["x[bool mask]"] += 1
        return getitem(self, index)

    try:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, _counted(name, fn))
        for name, fn in saved_fns.items():
            setattr(torch, name, _counted(f"torch.{name}", fn))
        torch.Tensor.__getitem__ = bool_getitem
        torch.Tensor.numpy = host_numpy
        COUNTS.clear()
        HOST_READS.clear()
        yield COUNTS
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        for name, fn in saved_fns.items():
            setattr(torch, name, fn)
        torch.Tensor.__getitem__ = getitem
        torch.Tensor.numpy = numpy


# --------------------------------------------------------------------------- the loop
class FakeEngine:
    """The bare model behind the engine interface: a real backward, a plain SGD step (no
    optimizer state), and a record of the sync count at every optimizer step."""

    def __init__(self, model, grad_accum: int):
        self.module, self.grad_accum = model, grad_accum
        self.micro = 0
        self.at_step: list[int] = []

    def __call__(self, tokens, state, **kw):
        return self.module(tokens, state, **kw)

    def train(self):
        self.module.train()

    def backward(self, loss):
        loss.backward()

    def is_gradient_accumulation_boundary(self):
        return (self.micro + 1) % self.grad_accum == 0

    def step(self):
        self.micro += 1
        if self.micro % self.grad_accum:
            return
        with torch.no_grad():
            for p in self.module.parameters():
                if p.grad is not None:
                    p.sub_(1e-3 * p.grad)
                    p.grad = None
        self.at_step.append(sum(COUNTS.values()))

    def get_global_grad_norm(self):
        return None


class _Null:
    def __getattr__(self, _name):
        return lambda *a, **k: None


def stream():
    g = torch.Generator().manual_seed(1)
    t = 0
    while True:
        yield SegmentBatch(torch.randint(0, V, (B, L + 1), generator=g),
                           torch.full((B,), t % 5 == 0), None, 0, t)
        t += 1


def make_loop(mechanism: str, *, steps: int, log_every: int, grad_accum: int = 1,
              mode: str = "window", depth: int = 1, precision: str = "fp32",
              cutoffs=CUTOFFS, div_val: int = 2, **bptt):
    model = {"mechanism": mechanism, "vocab_size": V, "n_layer": 2, "d_model": 16,
             "n_head": 2, "d_inner": 32, "tgt_len": L, "mem_len": L, "dropout": 0.1,
             "cutoffs": list(cutoffs), "div_val": div_val}
    if mechanism == "rmt":
        model["rmt"] = {"num_mem_tokens": 2, "mem_loss_weight": 0.01, "mem_loss_token": 1}
    if mechanism == "titans":   # no XL cache (model/mechanisms/titans/mechanism.py)
        model["mem_len"] = 0
        model["titans"] = {"d_mem": 8, "chunk_size": 2, "num_persistent": 2}
    cfg = from_dict({"model": model, "data": {"path": "unused", "global_batch": B},
                     "bptt": {"mode": mode, "depth": depth, **bptt},
                     "deepspeed": {"precision": precision, "grad_accum": grad_accum},
                     "log_every": log_every, "max_steps": steps})
    torch.manual_seed(0)
    curriculum = _Null()
    curriculum.metrics = dict
    loop = TrainingLoop(LoopParts(
        cfg=cfg, engine=FakeEngine(build_model(cfg.model), grad_accum),
        state=TrainState(plan=StreamWindows(cfg.bptt)),
        device=torch.device("cpu"), stage=0,  # 0: the loop computes the grad norm itself
        env=type("Env", (), {"is_main": False, "rank": 0})(),
        schedule=type("Schedule", (), {"get_last_lr": lambda self: [1e-3]})(),
        stream=stream(), tracker=_Null(), curriculum=curriculum,
        signals=type("NoSignal", (), {"received": None})()))
    loop.save = loop.final_reports = lambda *a, **k: None  # no checkpoints, no evaluation
    return loop


def syncs_per_step(loop) -> list[int]:
    with counting_syncs():
        assert loop.run() == "finished"
    marks = [0] + loop.engine.at_step
    return [b - a for a, b in zip(marks, marks[1:], strict=False)]


STEPS, LOG_EVERY = 6, 3


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt"])
@pytest.mark.parametrize("mode", ["window", "sliding"])
def test_one_sync_per_optimizer_step_outside_logging_steps(mechanism, mode):
    loop = make_loop(mechanism, steps=STEPS, log_every=LOG_EVERY, mode=mode)
    per_step = syncs_per_step(loop)
    assert len(per_step) == STEPS
    # The sync of a logging step's log block is counted with the next step (after step()).
    quiet = [n for s, n in enumerate(per_step, 1) if s == 1 or (s - 1) % LOG_EVERY]
    assert quiet == [1] * len(quiet), (per_step, dict(COUNTS))


@pytest.mark.parametrize("mechanism,recompute", [("rmt", "full"),
                                                  ("rmt", "save-masks+ffn-out:1"),
                                                  ("lamemo", "save-masks+matmul"),
                                                  ("xl", "save-linear")])
def test_checkpointed_windows_with_any_recompute_policy_add_no_sync(mechanism, recompute,
                                                                    monkeypatch):
    """Segment checkpointing and the selective policies (train/recompute.py) in the real
    loop: still one read per optimizer step. save-masks packs its bits with the device-side
    ops a GPU uses (on the CPU it reads numpy, which has no device to wait for)."""
    import train.recompute as recompute_mod

    def unpack_on_device(target, packed):
        bits = recompute_mod._unpack_on_device(packed, target.numel())
        return target.copy_(bits.view(target.shape))
    monkeypatch.setattr(recompute_mod, "_pack", recompute_mod._pack_on_device)
    monkeypatch.setattr(recompute_mod, "_unpack_into", unpack_on_device)
    loop = make_loop(mechanism, steps=4, log_every=100, depth=2, checkpoint_segments=True,
                     recompute=recompute, keep_last_segments=1)
    assert syncs_per_step(loop) == [1, 1, 1, 1], dict(COUNTS)
    assert not HOST_READS.get("torch.float32")


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt"])
def test_gradient_accumulation_still_reads_once_per_optimizer_step(mechanism):
    loop = make_loop(mechanism, steps=4, log_every=100, grad_accum=3)
    per_step = syncs_per_step(loop)
    assert per_step == [1, 1, 1, 1], (per_step, dict(COUNTS))
    assert math.isfinite(loop.state.tokens_seen) and loop.state.tokens_seen == 4 * 3 * 2 * B * L


def test_fp16_reads_the_flags_once_per_window():
    # The next window's memory depends on whether this one was finite (after_nonfinite).
    loop = make_loop("xl", steps=2, log_every=100, grad_accum=2, precision="fp16")
    assert syncs_per_step(loop) == [2, 2]


@pytest.mark.parametrize("div_val", [1, 2])
def test_adaptive_softmax_and_embedding_forward_and_backward_make_no_sync(div_val):
    torch.manual_seed(0)
    emb = AdaptiveEmbedding(V, 16, 12, CUTOFFS, div_val=div_val)
    sm = AdaptiveSoftmax(V, 16, 12, CUTOFFS, div_val=div_val)
    tokens = torch.randint(0, V, (B, L + 1))
    with counting_syncs() as counts:
        hidden = emb(tokens[:, :-1])
        nll = sm(hidden, tokens[:, 1:])
        logp = sm(hidden)
        (nll.sum() + logp.sum()).backward()
    assert dict(counts) == {}


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt"])
def test_model_forward_makes_no_sync(mechanism):
    loop = make_loop(mechanism, steps=1, log_every=1)
    model = loop.engine.module
    tokens = torch.randint(0, V, (B, L + 1))
    with counting_syncs() as counts:
        state = None
        for _ in range(3):
            out = model(tokens[:, :-1], state, targets=tokens[:, 1:])
            out.loss.backward()
            state = out.state.detach().reset_rows(torch.tensor([True, False]))
    assert dict(counts) == {}


# --------------------------------------------------------------------------- same numerics
def test_host_routing_picks_the_rows_nonzero_picks_out_of_range_ids_included():
    from model.adaptive import _cluster_mask, _host_cluster_rows
    ends = [0, *CUTOFFS, V]
    ids = torch.tensor([-3, 0, 7, 8, 23, 24, V - 1, V, V + 5, 3, 30, 8])
    rows = _host_cluster_rows(ids, ends, torch.device("cpu"))
    for i, idx in enumerate(rows):
        assert torch.equal(idx, _cluster_mask(ids, ends, i).nonzero().squeeze(1)), i


def _reference_nll(sm: AdaptiveSoftmax, hidden, target):
    """The adaptive softmax's nll as it was before it went sync-free (nonzero routing)."""
    from model.adaptive import _cluster_mask, _fp32
    params = sm._cluster_params()
    head = torch.nn.functional.log_softmax(_fp32(sm._logits(hidden, 0, params)), dim=-1)
    nll = torch.zeros(target.shape, dtype=head.dtype)
    for i in range(sm.n_clusters):
        idx = _cluster_mask(target, sm.ends, i).nonzero().squeeze(1)
        t_i = target[idx] - sm.ends[i]
        if i == 0:
            lp = head[idx].gather(1, t_i[:, None]).squeeze(1)
        else:
            logits = sm._logits(hidden[idx], i, params)
            tail = torch.nn.functional.log_softmax(_fp32(logits), dim=-1)
            lp = head[idx, sm.shortlist + i - 1] + tail.gather(1, t_i[:, None]).squeeze(1)
        nll.index_copy_(0, idx, -lp)
    return nll


def _reference_embedding(emb: AdaptiveEmbedding, tokens):
    """The adaptive input as it was before it went sync-free (nonzero routing,
    index_copy)."""
    from model.adaptive import _cluster_mask
    if emb.div_val == 1:
        return emb(tokens)  # one table: unchanged
    flat = tokens.reshape(-1)
    out = torch.zeros(flat.numel(), emb.d_proj)
    for i in range(emb.n_clusters):
        idx = _cluster_mask(flat, emb.ends, i).nonzero().squeeze(1)
        e = torch.nn.functional.linear(emb.emb_layers[i](flat[idx] - emb.ends[i]),
                                       emb.emb_projs[i])
        out.index_copy_(0, idx, e)
    return out.view(*tokens.shape, emb.d_proj) * emb.emb_scale


@pytest.mark.parametrize("div_val", [1, 2])
def test_sync_free_adaptive_layers_equal_the_nonzero_reference_with_gradients(div_val):
    torch.manual_seed(0)
    emb = AdaptiveEmbedding(V, 16, 12, CUTOFFS, div_val=div_val)
    sm = AdaptiveSoftmax(V, 16, 12, CUTOFFS, div_val=div_val)
    with torch.no_grad():
        for p in [*emb.parameters(), *sm.parameters()]:
            p.normal_(0.0, 0.3)
    tokens = torch.cat([torch.arange(V), torch.randint(0, V, (40,))]).view(8, -1)
    params = [*emb.parameters(), *sm.parameters()]

    def run(embed, nll):
        hidden = embed(tokens[:, :-1])
        out = nll(hidden.reshape(-1, 12), tokens[:, 1:].reshape(-1))
        grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
        return hidden, out, grads

    new = run(emb, sm.nll)
    ref = run(lambda t: _reference_embedding(emb, t), lambda h, t: _reference_nll(sm, h, t))
    assert torch.equal(new[0], ref[0]) and torch.equal(new[1], ref[1])  # bitwise, here
    for g, r in zip(new[2], ref[2], strict=True):
        assert (g is None) == (r is None)
        if g is not None:
            assert torch.allclose(g, r, atol=1e-5, rtol=1e-5)
