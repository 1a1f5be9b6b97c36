"""BPTT windows (train/bptt.py) on the bare model: where gradients reach, what sliding
re-runs, that segment checkpointing changes nothing but memory, that the stream's reset
flags forget the memory on exactly the flagged rows, and the LR schedules."""

import itertools
import math

import numpy as np
import pytest
import torch

from data_pipeline.shard_writer import write_manifest, write_token_split
from data_pipeline.shards import Manifest, id_dtype, load_manifest
from data_pipeline.streams import SegmentBatch, TokenStream
from data_pipeline.vocab import fingerprint
from model import ModelConfig, build_model
from model.typed import ConfigError
from train.bptt import SlidingHistory, episode_cuts, run_window
from train.config import load_config
from train.engine import LRSchedule

L, V = 6, 16


def _rmt(dropout=0.0, mem_len=0):
    torch.manual_seed(0)
    # Untied input/output embeddings: an embedding row then gets gradient only through the
    # inputs, so "row of a token seen only in segment j has gradient" means "the loss reached
    # segment j".
    return build_model(ModelConfig(mechanism="rmt", vocab_size=V, n_layer=2, d_model=32,
                                   n_head=2, d_inner=64, tgt_len=L, mem_len=mem_len,
                                   dropout=dropout, tie_weight=False,
                                   rmt={"num_mem_tokens": 3}))


def _segments(n, rows=2, seed=0):
    """Segment j uses only the token ids {2j, 2j+1}, so each segment has its own rows."""
    g = torch.Generator().manual_seed(seed)
    segs = []
    for j in range(n):
        toks = 2 * j + torch.randint(0, 2, (rows, L + 1), generator=g)
        segs.append(SegmentBatch(toks, torch.zeros(rows, dtype=torch.bool), None, 0, j))
    return segs


def _reached(model, n):
    """Which segments' input embeddings received gradient."""
    g = model.embedding.emb_layers[0].weight.grad if hasattr(model.embedding, "emb_layers") \
        else next(model.embedding.parameters()).grad
    return [bool(g[2 * j:2 * j + 2].abs().sum() > 0) for j in range(n)]


def _last_only(n):
    return [False] * (n - 1) + [True]


def test_window_gradient_reaches_every_segment_of_the_window_from_the_last_loss():
    model = _rmt()
    segs = _segments(4)
    # Only the last segment's loss counts; the memory chain carries it back 3 segments.
    res = run_window(model, None, segs, torch.device("cpu"), counted=_last_only(4))
    res.loss.backward()
    assert _reached(model, 4) == [True, True, True, True]


def test_a_detach_point_stops_the_gradient_exactly_there():
    model = _rmt()
    segs = _segments(4)
    res = run_window(model, None, segs, torch.device("cpu"), counted=_last_only(4),
                     detach_before={2})
    res.loss.backward()
    assert _reached(model, 4) == [False, False, True, True]


def test_the_memory_entering_a_window_carries_no_graph():
    model = _rmt()
    first = run_window(model, None, _segments(2), torch.device("cpu"))
    assert not first.state.tokens.requires_grad
    model.zero_grad()
    second = run_window(model, first.state, _segments(2, seed=1), torch.device("cpu"))
    second.loss.backward()  # would fail ("backward through the graph a second time") otherwise


def test_sliding_reruns_the_previous_k_segments_so_the_new_loss_reaches_k_back():
    k, n_steps = 2, 5
    model = _rmt()
    segs = _segments(n_steps)
    history, memory = SlidingHistory(k), None
    for t, new in enumerate(segs):
        start, window = history.window(new, memory)
        assert [s.step for s in window] == list(range(max(0, t - k), t + 1))
        model.zero_grad()
        res = run_window(model, start, window, torch.device("cpu"),
                         counted=_last_only(len(window)))
        res.loss.backward()
        reached = _reached(model, n_steps)
        assert reached == [max(0, t - k) <= j <= t for j in range(n_steps)], t
        history.push(new, res.state_before_last)
        memory = res.state


def test_sliding_history_round_trips_through_its_state_dict():
    model = _rmt(mem_len=4)
    history = SlidingHistory(2)
    memory = None
    for new in _segments(3):
        start, window = history.window(new, memory)
        res = run_window(model, start, window, torch.device("cpu"))
        history.push(new, res.state_before_last)
        memory = res.state
    copy = SlidingHistory(2)
    copy.load_state_dict(history.state_dict(), torch.device("cpu"))
    new = _segments(4)[3]
    a = run_window(model, *history.window(new, memory), torch.device("cpu"))
    b = run_window(model, *copy.window(new, memory), torch.device("cpu"))
    assert torch.equal(a.loss, b.loss)


@pytest.mark.parametrize("mechanism", ["rmt", "lamemo", "xl"])
def test_segment_checkpointing_reproduces_losses_and_gradients_with_dropout(mechanism):
    def run(ckpt):
        torch.manual_seed(0)
        model = build_model(ModelConfig(mechanism=mechanism, vocab_size=V, n_layer=2,
                                        d_model=32, n_head=2, d_inner=64, tgt_len=L,
                                        mem_len=L, dropout=0.2, dropatt=0.1,
                                        rmt={"num_mem_tokens": 3}))
        torch.manual_seed(1)
        res = run_window(model, None, _segments(3), torch.device("cpu"),
                         checkpoint_segments=ckpt)
        res.loss.backward()
        return res.loss.detach(), [p.grad.clone() for p in model.parameters()
                                   if p.grad is not None]
    loss_a, grads_a = run(False)
    loss_b, grads_b = run(True)
    assert torch.equal(loss_a, loss_b)
    assert len(grads_a) == len(grads_b)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7)


def test_window_loss_is_the_token_weighted_mean_of_the_counted_segments():
    model = _rmt()
    segs = _segments(3)
    res = run_window(model, None, segs, torch.device("cpu"))
    state, total = None, 0.0
    for seg in segs:
        out = model(seg.tokens[:, :-1], state, targets=seg.tokens[:, 1:])
        state, total = out.state, total + out.nll.sum()
    torch.testing.assert_close(res.loss, total / (3 * 2 * L))


def test_the_window_backpropagates_the_lm_loss_plus_the_mean_auxiliary_loss():
    """RMT §3.4's auxiliary loss is the model's `aux_loss`, apart from its LM `loss`; the
    window adds their means for backward and reports the LM loss alone (nll_sum)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(mechanism="rmt", vocab_size=V, n_layer=2, d_model=32,
                                    n_head=2, d_inner=64, tgt_len=L, mem_len=0, dropout=0.0,
                                    rmt={"num_mem_tokens": 3, "mem_loss_weight": 0.5,
                                         "mem_loss_token": 1}))
    segs = _segments(2)
    res = run_window(model, None, segs, torch.device("cpu"))
    state, nll, aux = None, 0.0, 0.0
    for seg in segs:
        out = model(seg.tokens[:, :-1], state, targets=seg.tokens[:, 1:])
        assert out.aux_loss is not None
        torch.testing.assert_close(out.loss, out.nll.sum() / out.n_tokens)
        state, nll, aux = out.state, nll + out.nll.sum(), aux + out.aux_loss
    torch.testing.assert_close(res.nll_sum, nll.detach())
    torch.testing.assert_close(res.loss, nll / (2 * 2 * L) + aux / 2)


def _tiny_token_manifest(tmp_path, rows: int, steps: int):
    """A token split of exactly `rows` streams of `steps` segments of L: the epoch ends
    after `steps` batches."""
    n = rows * (steps * L + 1)
    ids = np.random.default_rng(0).integers(0, V, n).astype(id_dtype(V))
    vocab = {"kind": "synthetic", "size": V}
    info = write_token_split(tmp_path, "train", [ids], id_dtype(V), 16, 2)
    write_manifest(tmp_path, Manifest(
        kind="tokens", source="test", vocab=vocab,
        vocab_fingerprint=fingerprint(vocab),
        vocab_size=V, dtype=str(id_dtype(V)), chunk_tokens=16, splits={"train": info}))
    return load_manifest(tmp_path)


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt", "armt"])
def test_reset_flags_forget_the_memory_on_exactly_the_flagged_rows_across_an_epoch_end(
        tmp_path, mechanism):
    """The consumer side of the stream's `reset` flags: run_window over a TokenStream that
    wraps into its next epoch twice, plus a forced reset of one row. Every row's loss in
    every segment must equal that row run alone with a fresh memory where its flag is set
    and with its own carried memory elsewhere; the two differ in every segment, so a
    forgotten reset, a reset of the wrong rows or a lost memory all fail."""
    rows, steps = 3, 3
    stream = TokenStream(_tiny_token_manifest(tmp_path, rows, steps), "train", rows, L,
                         prefetch=2)
    batches = list(itertools.islice(iter(stream), 7))
    assert [(b.epoch, b.step) for b in batches] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1),
                                                    (1, 2), (2, 0)]
    assert [b.reset.tolist() for b in batches] == [[t == 0] * rows for _, t in
                                                    ((b.epoch, b.step) for b in batches)]
    batches[5].reset = torch.tensor([False, True, False])   # a forced reset of row 1 only
    torch.manual_seed(0)
    model = build_model(ModelConfig(mechanism=mechanism, vocab_size=V, n_layer=2, d_model=32,
                                    n_head=2, d_inner=64, tgt_len=L, mem_len=L, dropout=0.0,
                                    rmt={"num_mem_tokens": 3})).eval()
    seen = []

    def forward(tokens, state, **kw):
        out = model(tokens, state, **kw)
        seen.append(out.log_probs)
        return out

    # Windows [0,1] [2,3,4] [5,6]: epoch starts at 3 and 6 fall inside a window, the forced
    # reset at 5 on a window's first segment, where the memory comes from the last window.
    with torch.no_grad():
        state = None
        for window in (batches[0:2], batches[2:5], batches[5:7]):
            state = run_window(forward, state, window, torch.device("cpu"), score=True).state
        for b in range(rows):
            carried = None
            for i, seg in enumerate(batches):
                tok = seg.tokens[b:b + 1]
                fresh = model(tok[:, :-1], None, targets=tok[:, 1:], return_log_probs=True)
                kept = model(tok[:, :-1], carried, targets=tok[:, 1:], return_log_probs=True)
                if i:  # the memory changes this row's predictions far beyond the tolerance
                    assert (kept.log_probs - fresh.log_probs).abs().max() > 1e-4, (b, i)
                want = fresh if bool(seg.reset[b]) else kept
                torch.testing.assert_close(seen[i][b], want.log_probs[0], rtol=0, atol=5e-6,
                                           msg=f"row {b}, segment {i}")
                carried = want.state


def test_episode_cuts_align_windows_to_the_end_of_the_sample():
    assert episode_cuts(6, 5) == frozenset()          # full BPTT through the sample
    assert episode_cuts(6, 1) == {2, 4}               # windows [0,1] [2,3] [4,5]
    assert episode_cuts(5, 1) == {1, 3}               # [0] [1,2] [3,4]: last window full
    assert episode_cuts(3, 0) == {1, 2}


def _schedule(**optim):
    cfg = load_config(None, ["data.path=x", "max_steps=100", "eval.every=10",
                             *[f"optim.{k}={v}" for k, v in optim.items()]])
    p = torch.nn.Parameter(torch.zeros(1))
    return LRSchedule(torch.optim.SGD([p], lr=1.0), cfg)


def test_cosine_schedule_warms_up_linearly_then_anneals_to_min_lr():
    s = _schedule(lr=1.0, warmup_steps=10, schedule="cosine", min_lr=0.1)
    assert s.lr_at(0) == pytest.approx(0.1) and s.lr_at(9) == pytest.approx(1.0)
    assert s.lr_at(10) == pytest.approx(1.0)
    assert s.lr_at(55) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert s.lr_at(100) == pytest.approx(0.1)


def test_wsd_schedule_is_the_constant_schedule_until_its_final_linear_decay():
    wsd = _schedule(lr=1.0, warmup_steps=10, schedule="wsd", decay_steps=40, min_lr=0.2)
    constant = _schedule(lr=1.0, warmup_steps=10, schedule="constant")
    assert [wsd.lr_at(t) for t in range(60)] == [constant.lr_at(t) for t in range(60)]
    assert wsd.lr_at(70) == pytest.approx(1.0 - 0.8 * 10 / 40)
    assert wsd.lr_at(100) == pytest.approx(0.2)


@pytest.mark.parametrize("optim, message", [
    ({"schedule": "wsd"}, "decay_steps"),                              # no decay length
    ({"schedule": "wsd", "decay_steps": 101}, "decay_steps"),          # longer than the run
    ({"schedule": "cosine", "decay_steps": 10}, "only the wsd"),       # would be ignored
])
def test_wsd_decay_steps_are_checked(optim, message):
    with pytest.raises(ConfigError, match=message):
        _schedule(**optim)


def test_plateau_schedule_halves_the_lr_after_patience_bad_validations():
    s = _schedule(lr=1.0, schedule="plateau", plateau_patience=1, plateau_factor=0.5,
                  min_lr=0.2)
    s.report(1.0)
    assert not s.report(1.1)          # first bad evaluation: within patience
    assert s.report(1.2)              # second: lr halves
    assert s.get_last_lr() == [0.5]
    s.report(2.0), s.report(2.0)
    s.report(2.0), s.report(2.0)
    assert s.get_last_lr() == [0.2]   # never below min_lr
    restored = _schedule(lr=1.0, schedule="plateau", plateau_patience=1, min_lr=0.2)
    restored.load_state_dict(s.state_dict())
    assert restored.get_last_lr() == [0.2]
