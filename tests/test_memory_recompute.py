"""The planner's count of what a selective `bptt.recompute` policy keeps
(planner/recompute.py) and of `bptt.keep_last_segments` (planner/window.py),
against the bytes measured on the CPU (train/memory_probe.py) and by hand."""

from __future__ import annotations

import pytest

from model import ModelConfig
from planner.activations import Dims, count_params
from planner.plan import main_plan, recompute_notes
from planner.recompute import kept_bytes, segment_ops
from planner.window import predict_window, window_memory
from train.config import load_config
from train.memory_probe import measure

ROWS = 4
TINY = {
    "xl": dict(mechanism="xl", mem_len=48),
    "xl-adaptive": dict(mechanism="xl", mem_len=32, vocab_size=600, cutoffs=[100, 300],
                        div_val=2),
    "lamemo": dict(mechanism="lamemo", mem_len=48, dropatt=0.1),
    "rmt": dict(mechanism="rmt", mem_len=0, rmt={"num_mem_tokens": 8}),
    "rmt-cache": dict(mechanism="rmt", mem_len=32, pre_lnorm=True,
                      rmt={"num_mem_tokens": 4, "mem_loss_weight": 0.1}),
}


def _tiny(name: str) -> ModelConfig:
    kw = dict(vocab_size=200, n_layer=3, d_model=64, n_head=4, d_inner=256, tgt_len=32)
    return ModelConfig(**{**kw, **TINY[name]})


@pytest.mark.parametrize("name,policy,keep_last", [
    ("xl", "save-ffn-out:2", 0),
    ("xl-adaptive", "save-linear", 1),
    ("lamemo", "save-masks+matmul", 0),
    ("rmt", "save-masks+ffn-out", 1),
    ("rmt-cache", "save-matmul", 0),
])
def test_the_peak_a_policy_adds_is_what_its_checkpointed_segments_keep(name, policy,
                                                                       keep_last):
    """Measured: the allocator's peak over one window (k=2) with the policy minus the same
    window under full recompute; predicted: the planner's peaks, the same difference. The
    difference is the policy's own figure, so a mistake in it cannot hide in the rest."""
    cfg, depth = _tiny(name), 2
    window = {"keep_last": keep_last}
    measured = [measure(cfg, ROWS, depth, True, recompute=r, **window)["peak"]
                for r in ("full", policy)]
    predicted = [predict_window(cfg, ROWS, depth, True, recompute=r, **window)["peak"]
                 for r in ("full", policy)]
    grown = measured[1] - measured[0]
    assert grown > 0, (name, measured)
    # Within 10%: the adaptive head's tail clusters get their Zipf share of rows only on
    # average (the measured rows are a random draw), off by 5% in the xl-adaptive case.
    assert predicted[1] - predicted[0] == pytest.approx(grown, rel=0.10)
    assert predicted[1] == pytest.approx(measured[1], rel=0.05)


def test_keeping_the_last_segments_whole_matches_the_measured_peak():
    cfg = _tiny("xl")
    for keep_last in (1, 2):
        got = measure(cfg, ROWS, 3, True, keep_last=keep_last)["peak"]
        want = predict_window(cfg, ROWS, 3, True, keep_last=keep_last)["peak"]
        assert want == pytest.approx(got, rel=0.05), keep_last


def test_what_each_policy_keeps_by_hand_for_xl():
    cfg = _tiny("xl")
    dm = Dims(cfg, ROWS, cfg.mem_len, "fp32", kernel="cpu")
    w2_out = ROWS * cfg.tgt_len * cfg.d_model * 4          # [B, L, d] fp32 per layer
    assert kept_bytes(dm, "full") == 0
    assert kept_bytes(dm, "save-ffn-out:1") == w2_out
    assert kept_bytes(dm, "save-ffn-out:2") == 2 * w2_out
    assert kept_bytes(dm, "save-ffn-out") == cfg.n_layer * w2_out
    assert kept_bytes(dm, "save-ffn-out:9") == cfg.n_layer * w2_out   # more than n_layer
    draws = segment_ops(dm).draws
    # Dropout of the embeddings, of R, per layer after W_o, W1 and W2, and of the output.
    n, d, k = cfg.tgt_len, cfg.d_model, cfg.tgt_len + cfg.mem_len
    assert draws == ROWS * n * d + k * d + cfg.n_layer * ROWS * n * (2 * d + cfg.d_inner) \
        + ROWS * n * d
    assert kept_bytes(dm, "save-masks") == draws / 8
    order = ["full", "save-masks", "save-ffn-out", "save-linear", "save-matmul"]
    assert [kept_bytes(dm, p) for p in order] == sorted(kept_bytes(dm, p) for p in order)


def test_on_cuda_save_masks_keeps_nothing_and_the_plan_says_so():
    cfg = _tiny("rmt")
    cpu, cuda = (Dims(cfg, ROWS, 0, "bf16", kernel=k) for k in ("cpu", "cuda"))
    assert kept_bytes(cpu, "save-masks") > 0 and kept_bytes(cuda, "save-masks") == 0
    assert kept_bytes(cuda, "save-masks+ffn-out") == kept_bytes(cuda, "save-ffn-out")
    (note,) = recompute_notes(load_config(None, ["data.path=x", "bptt.checkpoint_segments=true",
                                                 "bptt.recompute=save-masks"]))
    assert "keeps (and saves) nothing there" in note
    assert recompute_notes(load_config(None, ["data.path=x", "bptt.checkpoint_segments=true",
                                              "bptt.recompute=save-linear"]))
    for plain in ([], ["bptt.keep_last_segments=2"]):   # modelled: nothing to warn of
        assert recompute_notes(load_config(None, ["data.path=x", "bptt.checkpoint_segments=true",
                                                  *plain])) == []


def test_a_policy_peak_grows_with_the_depth_and_keeping_the_last_segment_is_free():
    cfg = _tiny("rmt")
    p, dm = count_params(cfg), Dims(cfg, ROWS, 0, "bf16")
    by_k = [window_memory(dm, p, k + 1, True, "save-ffn-out").peak for k in range(6)]
    full = [window_memory(dm, p, k + 1, True).peak for k in range(6)]
    steps = [b - a for a, b in zip(by_k, by_k[1:], strict=False)]
    full_steps = [b - a for a, b in zip(full, full[1:], strict=False)]
    # Every extra checkpointed segment adds what it keeps on top of full recompute's step.
    for s, f in zip(steps[1:], full_steps[1:], strict=True):
        assert s - f == pytest.approx(kept_bytes(dm, "save-ffn-out"), rel=1e-9)
    last1 = window_memory(dm, p, 4, True, "full", keep_last=1).peak
    assert last1 == pytest.approx(full[3], rel=0.02)


def test_the_plan_prints_what_each_checkpointed_segment_keeps(capsys):
    argv = ["--config", "quickstart", "--gpu", "a100-80gb", "bptt.checkpoint_segments=true",
            "bptt.depth=4"]
    assert main_plan(argv) == 0
    full = capsys.readouterr().out
    assert main_plan([*argv, "bptt.recompute=save-linear"]) == 0
    linear = capsys.readouterr().out
    assert "kept by each checkpointed segment (bptt.recompute): " in linear
    assert "kept by each checkpointed segment" not in full

    def deepest(text):   # the depth search runs with the configured policy
        prefix = "largest bptt.depth that fits, checkpoint_segments true:"
        line = next(x for x in text.splitlines() if x.strip().startswith(prefix))
        return int(line.split()[-1])
    assert 0 < deepest(linear) < deepest(full) / 2
