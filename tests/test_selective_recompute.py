"""Selective recompute of checkpointed BPTT segments (`bptt.recompute`, train/recompute.py;
`bptt.keep_last_segments`, train/bptt.py): the same losses and gradients as no checkpointing,
kept bytes between full recompute and none, config errors, and the DeepSpeed engine."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from data_pipeline.streams import SegmentBatch
from model import ConfigError, ModelConfig, build_model
from train.bptt import run_window
from train.config import load_config
from train.recompute import (
    RECOMPUTE_POLICIES,
    _draws,
    _pack_on_device,
    _unpack_on_device,
    context_fn,
)

ROOT = Path(__file__).resolve().parents[1]
L, V, ROWS, LAYERS, D_MODEL, D_INNER, MEM_TOKENS = 6, 16, 2, 2, 32, 64, 3
SELECTIVE = [p for p in RECOMPUTE_POLICIES if p != "full"]


def _model(mechanism: str, dropout: float = 0.2, dropatt: float = 0.1):
    torch.manual_seed(0)
    return build_model(ModelConfig(mechanism=mechanism, vocab_size=V, n_layer=LAYERS,
                                   d_model=D_MODEL, n_head=2, d_inner=D_INNER, tgt_len=L,
                                   mem_len=L if mechanism != "rmt" else 0, dropout=dropout,
                                   dropatt=dropatt, rmt={"num_mem_tokens": MEM_TOKENS}))


def _segments(n: int, seed: int = 0) -> list[SegmentBatch]:
    g = torch.Generator().manual_seed(seed)
    return [SegmentBatch(torch.randint(0, V, (ROWS, L + 1), generator=g),
                         torch.zeros(ROWS, dtype=torch.bool), None, 0, j) for j in range(n)]


def _losses_and_grads(mechanism: str, **window):
    model = _model(mechanism)
    torch.manual_seed(1)   # the dropout masks: the same draws in every variant
    res = run_window(model, None, _segments(3), torch.device("cpu"), **window)
    res.loss.backward()
    return res.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}


@pytest.mark.parametrize("mechanism", ["rmt", "xl", "lamemo"])
def test_every_policy_gives_the_losses_and_gradients_of_the_uncheckpointed_window(mechanism):
    """Dropout 0.2 and dropatt 0.1: a recompute that drew other masks would change the
    gradients far beyond the tolerance. keep_last_segments 1 mixes a whole segment in."""
    loss0, grads0 = _losses_and_grads(mechanism)
    for policy in (*RECOMPUTE_POLICIES, "save-ffn-out:1", "save-masks+ffn-out:1"):
        for keep in (0, 1):
            loss, grads = _losses_and_grads(mechanism, checkpoint_segments=True,
                                            recompute=policy, keep_last_segments=keep)
            assert torch.equal(loss, loss0), (policy, keep)
            assert grads.keys() == grads0.keys()
            for name, g in grads.items():
                torch.testing.assert_close(g, grads0[name], rtol=1e-5, atol=1e-7,
                                           msg=f"{policy}, keep_last {keep}: {name}")


class _LiveStorages(TorchDispatchMode):
    """Every storage an op creates during the forward, to count what is still alive after
    it. Not saved_tensors_hooks: a checkpoint's own hooks hide the saved tensors inside it
    from outer hooks, and what selective recompute keeps never passes through hooks."""

    def __init__(self):
        super().__init__()
        self.made: dict = {}
        self.noise_elements = 0   # dropout's draws (aten.bernoulli_ on CPU)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func == torch.ops.aten.bernoulli_.float:
            self.noise_elements += out.numel()
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                ref = StorageWeakRef(t.untyped_storage())
                self.made.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        return out

    def alive_bytes(self) -> int:
        return sum(n for ref, n in self.made.values() if not ref.expired())


def _kept(n_segments: int, dropout: float = 0.0, **window) -> tuple[int, int]:
    """(bytes the window's forward leaves alive for its backward, dropout draws made)."""
    model = _model("rmt", dropout=dropout, dropatt=0.0)
    segs = _segments(n_segments)
    run_window(model, None, segs, torch.device("cpu"), **window)   # warm-up, freed
    live = _LiveStorages()
    with live:
        res = run_window(model, None, segs, torch.device("cpu"), **window)
    alive = live.alive_bytes()
    del res
    return alive, live.noise_elements


def _kept_bytes(n_segments: int, **window) -> int:
    return _kept(n_segments, **window)[0]


def test_selective_policies_keep_more_than_full_recompute_and_less_than_no_checkpointing():
    n = 3
    kept = {p: _kept_bytes(n, checkpoint_segments=True, recompute=p)
            for p in RECOMPUTE_POLICIES}
    plain = _kept_bytes(n)
    assert kept["full"] < kept["save-ffn-out"] < kept["save-linear"] < kept["save-matmul"] \
        < plain, (kept, plain)
    # save-ffn-out keeps exactly each layer's W2 output [rows, 2m+L, d_model] fp32.
    ffn_out = n * LAYERS * ROWS * (2 * MEM_TOKENS + L) * D_MODEL * 4
    assert kept["save-ffn-out"] - kept["full"] == ffn_out
    # save-ffn-out:1: the first layer's only, in every checkpointed segment.
    one_layer = _kept_bytes(n, checkpoint_segments=True, recompute="save-ffn-out:1")
    assert one_layer - kept["full"] == ffn_out // LAYERS


def test_save_masks_keeps_dropouts_draws_as_bits():
    full, draws = _kept(3, dropout=0.1, checkpoint_segments=True)
    masks, _ = _kept(3, dropout=0.1, checkpoint_segments=True, recompute="save-masks")
    n_draws = 3 * (1 + 1 + 3 * LAYERS + 1)   # per segment: embedding, R, 3 per layer, top
    assert full < masks <= full + draws // 8 + n_draws   # a byte per 8 draws, rounded up
    assert masks - full >= draws // 8


def test_keep_last_segments_keeps_whole_segments_one_by_one_from_the_end():
    n = 3
    kept = [_kept_bytes(n, checkpoint_segments=True, keep_last_segments=j) for j in range(n + 1)]
    assert kept[0] < kept[1] < kept[2] < kept[3]
    assert kept[3] == _kept_bytes(n)   # every segment whole: no checkpointing at all


@pytest.mark.parametrize("n", [1, 7, 8, 13, 1000])
def test_the_device_side_bit_packing_is_numpys_bit_order_and_round_trips(n):
    """On CUDA the masks are packed with torch ops on the device, not numpy: the same bytes,
    and unpacking gives the draws back (run here on CPU tensors: the ops are the same)."""
    draw = torch.bernoulli(torch.full((n,), 0.9), generator=torch.Generator().manual_seed(n))
    packed = _pack_on_device(draw)
    assert torch.equal(packed, torch.from_numpy(np.packbits(draw.numpy() != 0)))
    assert torch.equal(_unpack_on_device(packed, n).float(), draw)


def test_the_device_side_bit_packing_copies_nothing_from_the_host(monkeypatch):
    # On a GPU, torch.tensor(data, device=...) is a blocking host-to-device copy: a sync per
    # dropout draw. The packing and unpacking make every tensor on the draw's device.
    def from_host(*args, **kwargs):
        raise AssertionError("a tensor built from host data")
    monkeypatch.setattr(torch, "tensor", from_host)
    monkeypatch.setattr(torch, "as_tensor", from_host)
    draw = torch.ones(20)
    assert _unpack_on_device(_pack_on_device(draw), 20).sum() == 20


def _noisy_block(x: torch.Tensor) -> torch.Tensor:
    # One dropout (bernoulli_ on the CPU) and one other draw, as CUDA's fused dropout is.
    return F.dropout(x, 0.3, training=True) * torch.rand_like(x)


def test_save_masks_warns_and_stays_exact_when_the_forward_draws_other_random_numbers():
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(3)
    _noisy_block(x).square().sum().backward()
    plain = x.grad.clone()
    x.grad = None
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match="drawn again in the recompute"):
        out = checkpoint(_noisy_block, x, use_reentrant=False,
                         context_fn=context_fn("save-masks", d_inner=8))
    out.square().sum().backward()
    assert torch.equal(x.grad, plain)


def _dropout_then_attention(x: torch.Tensor) -> torch.Tensor:
    q = F.dropout(x, 0.3, training=True).view(2, 2, 4, 8)
    return F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)


def test_save_masks_replays_the_draws_past_an_attention_kernel_without_dropout():
    """SDPA's kernels are tagged as seeded whatever their dropout_p; with dropout_p 0 they
    draw nothing, so the masks are still replayed: no warning, no bernoulli_ in the
    recompute, the plain gradient."""
    x = torch.randn(4, 4, 8, requires_grad=True)
    torch.manual_seed(3)
    _dropout_then_attention(x).square().sum().backward()
    plain = x.grad.clone()
    x.grad = None
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = checkpoint(_dropout_then_attention, x, use_reentrant=False,
                         context_fn=context_fn("save-masks", d_inner=8))
    count = _OpCount()
    with count:
        out.square().sum().backward()
    assert torch.ops.aten.bernoulli_.float not in count.n
    assert torch.equal(x.grad, plain)


def test_an_op_draws_random_numbers_when_seeded_and_not_an_attention_kernel_at_dropout_0():
    aten = torch.ops.aten
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.zeros(1, 1, 2, 4)
    assert not _draws(sdpa, (q, q, q), {})                      # dropout_p defaults to 0
    assert not _draws(sdpa, (q, q, q, 0.0), {})
    assert _draws(sdpa, (q, q, q, 0.1), {})
    assert _draws(sdpa, (q, q, q), {"dropout_p": 0.1})
    assert _draws(aten.bernoulli_.float, (q, 0.5), {})
    assert _draws(aten.native_dropout.default, (q, 0.5, True), {})
    assert not _draws(aten.mm.default, (q[0, 0], q[0, 0].T), {})


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[func] = self.n.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def _backward_op_counts(**window) -> dict:
    model = _model("rmt", dropout=0.1, dropatt=0.0)
    res = run_window(model, None, _segments(2), torch.device("cpu"), **window)
    count = _OpCount()
    with count:
        res.loss.backward()
    return count.n


def test_the_recompute_skips_exactly_the_kept_matmuls():
    """Ops the backward runs: the plain backward's, plus the recomputed forward's minus what
    the policy kept (2 segments x 2 layers: one FFN-out addmm each)."""
    aten = torch.ops.aten
    plain = _backward_op_counts()
    full = _backward_op_counts(checkpoint_segments=True)
    ffn = _backward_op_counts(checkpoint_segments=True, recompute="save-ffn-out")
    linear = _backward_op_counts(checkpoint_segments=True, recompute="save-linear")
    assert full[aten.addmm.default] > plain.get(aten.addmm.default, 0)
    assert ffn[aten.addmm.default] == full[aten.addmm.default] - 2 * LAYERS
    for op in (aten.addmm.default, aten.mm.default):
        assert linear.get(op, 0) == plain.get(op, 0), op
    # Dropout is drawn again (same masks: RNG restored) unless its draws are kept.
    assert linear[aten.bernoulli_.float] == full[aten.bernoulli_.float] > 0
    one_layer = _backward_op_counts(checkpoint_segments=True, recompute="save-ffn-out:1")
    assert one_layer[aten.addmm.default] == full[aten.addmm.default] - 2
    masks = _backward_op_counts(checkpoint_segments=True, recompute="save-masks")
    assert masks.get(aten.bernoulli_.float, 0) == 0
    assert masks[aten.addmm.default] == full[aten.addmm.default]


@pytest.mark.parametrize("override,field", [
    (["bptt.checkpoint_segments=true", "bptt.recompute=save-everything"], "bptt.recompute"),
    (["bptt.recompute=save-linear"], "bptt.recompute"),   # without checkpoint_segments
    (["bptt.checkpoint_segments=true", "bptt.keep_last_segments=-1"],
     "bptt.keep_last_segments"),
    (["bptt.keep_last_segments=1"], "bptt.keep_last_segments"),
    (["bptt.checkpoint_segments=true", "bptt.recompute=save-linear:2"], "bptt.recompute"),
    (["bptt.checkpoint_segments=true", "bptt.recompute=save-ffn-out:0"], "bptt.recompute"),
    (["bptt.checkpoint_segments=true", "bptt.recompute=save-ffn-out:two"], "bptt.recompute"),
])
def test_a_bad_recompute_setting_is_a_config_error_naming_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.path=x", *override])
    assert str(err.value).startswith(field + ":")


def test_a_valid_recompute_setting_loads():
    cfg = load_config(None, ["data.path=x", "bptt.checkpoint_segments=true",
                             "bptt.recompute=save-ffn-out", "bptt.keep_last_segments=1"])
    assert (cfg.bptt.recompute, cfg.bptt.keep_last_segments) == ("save-ffn-out", 1)
    cfg = load_config(None, ["data.path=x", "bptt.checkpoint_segments=true",
                             "bptt.recompute=save-masks+ffn-out:2"])
    assert cfg.bptt.recompute == "save-masks+ffn-out:2"


# ----------------------------------------------------------------------------- engine
def _engine_losses(stage: int) -> dict:
    """3 optimizer steps of RMT windows (k=2, dropout 0.1) through a 1-rank DeepSpeed engine
    at ZeRO `stage`, per variant, each from the same initial weights and RNG state."""
    from train.distributed import resolve_env
    from train.engine import build_ds_config, initialize
    from train.process_group import init_process_group

    env = resolve_env()
    init_process_group(env)
    cfg = load_config(None, ["data.path=unused", f"data.global_batch={ROWS}",
                             f"deepspeed.zero_stage={stage}", "optim.lr=0.01"])
    out = {}
    variants = {"plain": {}, "full": {"checkpoint_segments": True},
                **{p: {"checkpoint_segments": True, "recompute": p} for p in SELECTIVE}}
    for name, window in variants.items():
        engine, _ = initialize(_model("rmt", dropout=0.1, dropatt=0.0), cfg,
                               build_ds_config(cfg, env.world_size))
        torch.manual_seed(1)
        losses, state = [], None
        for step in range(3):
            res = run_window(engine, state, _segments(3, seed=step), torch.device("cpu"),
                             **window)
            engine.backward(res.loss)
            engine.step()
            losses.append(res.loss.item())
            state = res.state
        out[name] = losses
    torch.distributed.destroy_process_group()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_selective_recompute_through_the_deepspeed_engine_gives_the_plain_losses(stage):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, __file__, str(stage)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    losses = json.loads(done.stdout.strip().splitlines()[-1])
    # Steps 2 and 3 depend on the updates: equal losses mean equal gradients reached Adam.
    for name, series in losses.items():
        assert series == pytest.approx(losses["plain"], rel=1e-6, abs=1e-7), name


if __name__ == "__main__":
    print(json.dumps(_engine_losses(int(sys.argv[1]))))
