"""The one GPU run at realistic shapes (benchmarks/gpu_scale.py), rehearsed on the CPU: its
--quick mode runs every part end to end at tiny shapes, so that the GPU call cannot fail on
a typo, a missing file or a field; and the fast-path check (benchmarks/gpu_kernels.py):
which attention pattern passes SDPA an arbitrary mask (no FlashAttention) and which not."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_kernels, gpu_scale


def test_the_kernel_check_sees_which_patterns_pass_an_arbitrary_mask():
    real = torch.nn.functional.scaled_dot_product_attention
    report = gpu_kernels.kernel_report(
        "cpu", cases=["hf base (no memory)", "hf rmt paper", "hf rmt paper (mask)",
                      "hf rmt causal", "native xl"])
    assert torch.nn.functional.scaled_dot_product_attention is real   # put back
    cases = report["cases"]
    # 2 layers x 2 segments, forward only (the backward calls no SDPA); RMT's paper pattern
    # by default as three calls per layer (model/pretrained/paper_attention.py)
    assert {c: r["sdpa_calls"] for c, r in cases.items()} == {
        **dict.fromkeys(cases, 4), "hf rmt paper": 12}
    # The base model and the RMT authors' causal pattern: no mask, is_causal: flash can run.
    for case in ("hf base (no memory)", "hf rmt causal"):
        assert cases[case]["patterns"] == {"mask=none,is_causal=True": 4}
        assert cases[case]["flash_eligible"]
    # RMT's paper pattern (RMT §3): the tokens' causal call and the read and write rows'
    # maskless ones, or with paper_attention "mask" a [2m+L]^2 boolean mask; native XL: a
    # float bias.
    assert cases["hf rmt paper"]["patterns"] == {"mask=none,is_causal=True": 4,
                                                 "mask=none,is_causal=False": 8}
    assert cases["hf rmt paper"]["flash_eligible"]
    assert cases["hf rmt paper (mask)"]["patterns"] == {"mask=bool,is_causal=False": 4}
    assert cases["native xl"]["patterns"] == {"mask=float,is_causal=False": 4}
    assert not cases["hf rmt paper (mask)"]["flash_eligible"]
    assert not cases["native xl"]["flash_eligible"]
    assert cases["hf rmt paper (mask)"]["first_call"]["q"][-2] == 16 + 2 * 4   # L + 2m rows
    assert cases["hf rmt paper"]["first_call"]["q"][-2] == 4 + 16   # [read; tokens] rows


def test_mfu_counts_the_matmul_parameters_and_the_memory_rows_apart():
    class Base(torch.nn.Module):   # embeddings 10 x 4 (tied head), positions 6 x 4, one 4x4
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = torch.nn.Embedding(10, 4), torch.nn.Embedding(6, 4)
            self.proj = torch.nn.Linear(4, 4, bias=False)

        def get_input_embeddings(self):
            return self.wte

        def get_output_embeddings(self):
            return self.wte
    model = torch.nn.Module()
    model.base = Base()
    f = gpu_scale.flops(model, n_layer=1, seg_len=8, rows=2)
    assert f["matmul_params"] == 16 + 40   # the 4x4 and the tied head's d x V
    assert f["flops_per_text_token"] == 6 * 56 + 12 * 1 * 4 * 8
    assert f["memory_flops_per_segment"] == 6 * 16 * 2 + 12 * 4 * (10 ** 2 - 8 ** 2)
    assert gpu_scale.peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert gpu_scale.peak_flops("NVIDIA H100 PCIe") == 756.0e12
    assert gpu_scale.peak_flops(None) is None


def test_the_goals_are_read_off_the_rows_present():
    def row(variant, n, tokens_per_s, peak_mb, **extra):
        return {"shape": "gpt2-124m", "seg_len": 1024, "variant": variant, "n": n,
                "batch": 8, "tokens_per_s": tokens_per_s, "peak_mb": peak_mb, "base_mb": 100,
                **extra}
    goals = gpu_scale.mfu_goals([
        row("base", 1, 1000, 900, mfu=0.42), row("rmt-ckpt-last1", 1, 900, 1000),
        row("rmt-ckpt-last1", 32, 800, 1300), row("armt-ckpt-last1", 32, 650, 1200),
        {"shape": "gpt2-124m", "seg_len": 1024, "variant": "rmt-unroll", "n": 32,
         "error": "out of memory at batch 1"}])
    assert goals["base MFU >= 40% (gpt2-124m, L 1024)"] == [0.42, True]
    assert goals["gpt2-124m rmt-ckpt-last1 n=32 tokens/s >= 0.75x base"] == [0.8, True]
    peak = goals["gpt2-124m rmt-ckpt-last1 n=32 peak <= 1.2x its n=1 peak"]
    assert peak[:2] == [1400 / 1100, False]
    assert goals["gpt2-124m armt-ckpt-last1 n=32 tokens/s >= 0.7x base"] == [0.65, False]
    assert not any(k.startswith("smollm2") for k in goals)   # not measured: no verdict


def test_babilong_samples_hold_the_story_in_order_and_mask_only_the_answer(tmp_path):
    import numpy as np

    from benchmarks.gpu_babilong import Sampler
    from data_pipeline.babilong.babi import generate_story
    from model.config import PretrainedOptions
    from model.pretrained.loading import load_tokenizer
    from model.pretrained.tiny import save_char_tokenizer
    save_char_tokenizer(tmp_path)
    tok = load_tokenizer(PretrainedOptions(path=str(tmp_path)))
    rng = np.random.default_rng(0)
    stories = [generate_story("qa1", rng, 2) for _ in range(3)]
    sentences = ["The river ran on.", "Light fell through the window.", "Nobody came."]
    one = Sampler(tok, sentences, seg_len=512)    # 0k fits one segment: no padding to 512
    tokens, mask, n_seg = one.batch(stories, 0, rng)
    longest = max(len(one.row(s, 0, rng)[0]) for s in stories)
    assert n_seg == 1 and tokens.shape[1] == longest and mask.shape[1] == longest - 1
    many = Sampler(tok, sentences, seg_len=32)
    tokens, mask, n_seg = many.batch(stories, 256, rng)
    assert n_seg == 8 and tokens.shape == (3, 257) and mask.shape == (3, 256)
    for b, story in enumerate(stories):
        text = tok.decode(tokens[b].tolist()).replace(" ", "")
        places = [text.find(f.lower().replace(" ", "")) for f in story.facts]
        assert -1 not in places and places == sorted(places), (text, story.facts)
        answer = tok.decode(tokens[b, 1:][mask[b]].tolist()).replace(" ", "")
        assert answer == story.answer.lower() and text.endswith("answer:" + answer)
    assert tok.decode([many.pad]).strip() == ""    # a newline, not an end-of-text token


def test_a_spent_budget_starts_no_part(tmp_path):
    o = gpu_scale.parse_args(["--out", str(tmp_path), "--budget-s", "0", "--device", "cpu",
                              "--parts", "mfu,kernels"])
    summary = gpu_scale.run(o)
    assert set(summary["parts"]) == {"mfu", "kernels"}
    assert all("skipped" in p for p in summary["parts"].values())
    assert json.loads((tmp_path / "summary.json").read_text())["parts"] == summary["parts"]


def test_a_missing_gguf_fails_before_any_part(tmp_path, capsys):
    code = gpu_scale.main(["--out", str(tmp_path), "--parts", "babilong", "--device", "cpu",
                           "--gguf", str(tmp_path / "none.gguf")])
    assert code == 2
    assert "none.gguf does not exist" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists()


def check_engine_part(part: dict) -> None:
    """benchmarks/gpu_engine.py through gpu_scale.py's engine part (a child process), at tiny
    shapes on the CPU: both steps of each variant timed, their peaks beside the planner's."""
    import statistics
    shapes = part["shapes"]
    assert list(shapes) == ["gpt2-124m"]
    result = shapes["gpt2-124m"]
    assert "error" not in result, result.get("tail")
    assert result["gpu"] is None and result["peak_flops"] is None     # the CPU: no MFU
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"base", "rmt-ckpt-last1"} and rows["rmt-ckpt-last1"]["n"] == 2
    for r in rows.values():
        for kind in ("plain", "engine"):
            m = r[kind]
            assert len(m["steps_s"]) >= 5 and m["step_s"] == statistics.median(m["steps_s"])
            assert 0 < m["forward_share"] < 1 and m["peak_gb"] >= m["step_peak_gb"] >= 0
            assert m["predicted_step_peak_gb"] > 0 and m["mfu"] is None
            assert m["model_tflops_per_s"] == pytest.approx(
                r["model_flops_per_step"] / m["step_s"] / 1e12)
        assert r["engine"]["zero_stage"] == 1 and r["plain"]["predicted_peak_gb"] is None
        assert r["engine"]["predicted_peak_gb"] > r["engine"]["predicted_step_peak_gb"]
        assert r["engine_over_plain"] == r["engine"]["step_s"] / r["plain"]["step_s"]
    # the memory variant's rows: 2 segments of L + 2m (RMT) rows against 1 of L tokens
    assert rows["rmt-ckpt-last1"]["model_flops_per_step"] > 2 * rows["base"][
        "model_flops_per_step"]


@pytest.mark.slow
def test_quick_mode_runs_every_part_on_the_cpu_and_writes_its_json(tmp_path):
    threads = torch.get_num_threads()
    try:
        assert gpu_scale.main(["--out", str(tmp_path), "--quick", "--device", "cpu"]) == 0
    finally:
        torch.set_num_threads(threads)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {p: s["status"] for p, s in summary["parts"].items()} == dict.fromkeys(
        gpu_scale.PARTS, "done")
    parts = {p: json.loads((tmp_path / f"{p}.json").read_text()) for p in gpu_scale.PARTS}
    for part in parts.values():   # the device facts in every file (gpu: its name on CUDA)
        assert {"gpu", "torch", "device", "date"} <= set(part["facts"])
    rows = parts["mfu"]["rows"]
    assert {r["variant"] for r in rows} == set(gpu_scale.DEFAULT_VARIANTS)
    assert {r["shape"] for r in rows} == set(gpu_scale.SHAPES)   # each shape's flags parsed
    for r in rows:
        assert {"tokens_per_s", "batch", "n", "peak_mb", "flops_per_text_token",
                "model_flops_per_s", "memory_flops_per_s"} <= set(r), r
        assert r["tokens_per_s"] > 0 and r["memory_rows"] == (
            0 if r["variant"] == "base" else gpu_scale.VARIANTS[r["variant"]][2] * 2)
    assert parts["kernels"]["cases"]["hf rmt paper"]["flash_eligible"] is True
    assert parts["kernels"]["cases"]["hf rmt paper (mask)"]["flash_eligible"] is False
    gaps = parts["gaps"]["children"]
    assert set(gaps) == {"lamemo_vs_xl", "compile", "recompute"}
    for name, gap in gaps.items():   # each child ran and wrote its JSON
        assert gap.get("returncode") == 0, (name, gap.get("tail"))
        assert gap["results"], name
    bab = parts["babilong"]
    assert set(bab["arms"]) == {"memory", "no memory"}
    assert bab["arms"]["memory"]["stage_steps"] == bab["arms"]["no memory"]["stage_steps"]
    for arm in bab["arms"].values():
        assert set(arm["scores"]) == {str(n) for n in bab["lengths"]}
        assert all(0 <= s["accuracy"] <= 1 for s in arm["scores"].values())
    check_engine_part(parts["engine"])
