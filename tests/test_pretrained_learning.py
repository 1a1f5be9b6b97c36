"""A pretrained Hugging Face backbone with RMT memory tokens learns to use its memory: a tiny
random GPT-2 (learned absolute positions) and a tiny random Llama (RoPE), each built from
a config, written with save_pretrained and loaded back through model.hf.path, learn the copy
task across 3 segments through the training command's code path; the same checkpoint
without memory tokens, trained alike, cannot.

The runs are the example configs (configs/copy-gpt2-hf-cpu.yaml, copy-llama-hf-cpu.yaml),
shortened; the measurements behind the steps and thresholds are in
docs/pretrained-learning.md.

What the score can reach without memory. A copy sample with source x1 x2 x3 is the stream
x1 x2 x3 > x1 x2 x3 x1 x2 x3 (data_pipeline/tasks.py), cut into 3 segments of 3 inputs;
the final evaluation scores the 6 answer targets of segments 2 and 3. Segment 2 reads
`> x1 x2` and must predict x1 x2 x3; segment 3 reads `x3 x1 x2` and must predict x1 x2 x3.
Only the last of the 6 (x3, the first input of segment 3) can be copied from inside its own
segment; the other 5 are uniform over the 8 symbols and independent of everything their
segment holds. A model that sees one segment at a time therefore expects at most
(5 x 1/8 + 1) / 6 = 0.27.
"""

import json

import pytest
from train_helpers import ROOT, train_in_process

from data_pipeline.prepare import main_tasks
from model.pretrained.tiny import tiny_gpt2, tiny_llama
from train.config import load_config

NO_MEMORY_CEILING = (5 / 8 + 1) / 6   # 0.271: see the module docstring

# arch -> (tiny checkpoint builder, example config, steps of the run with memory).
# GPT-2's head is untied: with the tied default it stayed near chance for 200 steps on 3 of
# 3 seeds (docs/pretrained-learning.md). Steps: at these settings every one of 5
# seeds was at 0.85 or more by step 150 (GPT-2) and at 1.0 by step 100 (Llama).
ARCHS = {
    "gpt2": (lambda path: tiny_gpt2(path, tied=False), "copy-gpt2-hf-cpu", 250),
    "llama": (tiny_llama, "copy-llama-hf-cpu", 150),
}
NO_MEMORY_STEPS = 100   # the no-memory model reaches its ceiling in ~75 steps (measured)


@pytest.fixture(scope="module")
def copy3(tmp_path_factory):
    out = tmp_path_factory.mktemp("copy") / "copy3-s3"
    assert main_tasks(["copy", "--src-len", "3", "--n-segments", "3", "--train-size", "4000",
                       "--valid-size", "64", "--test-size", "512", "--out", str(out)]) == 0
    return out


def _train(tmp_path, monkeypatch, config: str, ckpt, data, name: str, steps: int,
           *overrides) -> dict:
    """Train the example config on the tiny checkpoint; its final report (eval_report.json)."""
    run_dir = tmp_path / "runs" / name
    cfg = load_config(ROOT / "configs" / f"{config}.yaml", [
        f"name={name}", f"run_dir={run_dir}", f"model.hf.path={ckpt}", f"data.path={data}",
        f"max_steps={steps}", "eval.every=0", "tracking.enabled=false", *overrides])
    train_in_process(cfg, monkeypatch)
    return json.loads((run_dir / "eval_report.json").read_text())


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_tiny_pretrained_model_learns_a_three_segment_copy_only_through_its_memory(
        tmp_path, monkeypatch, copy3, arch):
    """With m = 3 memory tokens the model answers from segment 1's source (measured 0.85 to
    1.0); the plain base model (num_mem_tokens 0) and the trained model with its memory
    reset before every segment stay at what one segment allows (0.27)."""
    build, config, steps = ARCHS[arch]
    ckpt = build(tmp_path / arch)
    memory = _train(tmp_path, monkeypatch, config, ckpt, copy3, f"{arch}-m3", steps)
    plain = _train(tmp_path, monkeypatch, config, ckpt, copy3, f"{arch}-m0", NO_MEMORY_STEPS,
                   "model.rmt.num_mem_tokens=0", "eval.no_memory_baseline=false")
    assert memory["main"]["tokens"] == plain["main"]["tokens"] == 512 * 6
    assert memory["main"]["accuracy"] > 0.75, memory["main"]
    assert plain["main"]["accuracy"] < NO_MEMORY_CEILING + 0.08, plain["main"]
    assert memory["no_memory"]["accuracy"] < NO_MEMORY_CEILING + 0.08, memory["no_memory"]
