"""A pretrained Hugging Face backbone with memory tokens (`model.backbone: hf`) through the
whole engine: train, stop (SIGTERM) and resume, bf16, frozen / LoRA fine-tuning, segment
checkpointing with a selective recompute policy, export, load, `memtrain eval` and
`memtrain generate`. Tiny random GPT-2 / Llama checkpoints (tests/pretrained_helpers.py),
each run `train.trainer.train` in this process on 1 rank. Three runs, one per data regime:

- frozen: the copy task (episodes, the memory restarts at each), GPT-2, ZeRO-0, fp32;
- lora:   the word corpus (a token stream, memory carried), BPTT windows, Llama, ZeRO-1 in
          bf16 (DeepSpeed's bf16 optimizer: fp32 masters of the trained weights only),
          adapter dropout (its masks are random state to restore), segments checkpointed
          keeping the dropout masks and the FFN outputs (save-masks+ffn-out);
- full:   the word corpus, sliding BPTT (saved segments re-run), GPT-2, ZeRO-2, fp32,
          segments checkpointed keeping every linear layer's output (save-linear).

Each is trained once uninterrupted without segment checkpointing, and once stopped by
SIGTERM at step 3 and resumed, with the checkpointing of its regime: equal losses step by
step show the resume exact and the checkpointed recompute exact at once.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import yaml
from pretrained_helpers import hf_model_section, tiny_gpt2, tiny_llama
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from train_helpers import make_word_corpus, step_losses, train_in_process

from data_pipeline.prepare import main_tasks
from evaluation.cli import run_eval
from evaluation.generate_cli import main_generate
from evaluation.generation import DataIds
from model import build_model, generate, load_model
from model.io import CONFIG_KEY
from train import trainer
from train.config import load_config
from train.loop import TrainingLoop
from train.master_weights import master_state

pytestmark = pytest.mark.slow

STEPS, STOP = 6, 3
WORDS_V = 16   # the word corpus's ids (tests/train_helpers.py); the checkpoints have 32

RUNS = {
    "frozen": dict(arch="gpt2", data="copy", tgt_len=6, hf={"finetune": "frozen"},
                   bptt={"depth": 1}, deepspeed={"zero_stage": 0}),
    "lora": dict(arch="llama", data="words", tgt_len=8,
                 hf={"finetune": "lora", "lora_r": 4, "lora_dropout": 0.1},
                 bptt={"depth": 1, "mode": "window"},
                 deepspeed={"zero_stage": 1, "precision": "bf16"},
                 checkpointed={"checkpoint_segments": True,
                               "recompute": "save-masks+ffn-out"}),
    "full": dict(arch="gpt2", data="words", tgt_len=8, hf={"finetune": "full"},
                 bptt={"depth": 1, "mode": "sliding"}, deepspeed={"zero_stage": 2},
                 checkpointed={"checkpoint_segments": True, "recompute": "save-linear"}),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    copy = root / "copy4-s2"
    assert main_tasks(["copy", "--src-len", "4", "--n-segments", "2", "--train-size", "256",
                       "--valid-size", "16", "--test-size", "16", "--out", str(copy)]) == 0
    return {"gpt2": tiny_gpt2(root / "gpt2"), "llama": tiny_llama(root / "llama"),
            "copy": copy, "words": make_word_corpus(root / "words", 20_000, 2_000)}


def _config(tmp, sources, spec: dict, name: str, checkpointed: bool = False):
    bptt = dict(spec["bptt"], **(spec.get("checkpointed", {}) if checkpointed else {}))
    cfg = {"name": name, "run_dir": str(tmp / "runs" / name), "max_steps": STEPS,
           "log_every": 1, "threads": 1, "seed": 0,
           "model": hf_model_section(sources[spec["arch"]], m=2, tgt_len=spec["tgt_len"],
                                     **spec["hf"]),
           "data": {"path": str(sources[spec["data"]]), "global_batch": 4},
           "bptt": bptt, "deepspeed": spec["deepspeed"],
           "optim": {"lr": 1e-2, "schedule": "constant"},
           "eval": {"max_segments": 2}, "tracking": {"enabled": False}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path)


def _train(cfg, monkeypatch, stop_at: int | None = None) -> dict:
    """Train `cfg` in this process; a SIGTERM arrives during step `stop_at - 1` (the loop
    reads it at the next step's flags, so it checkpoints at `stop_at` and stops). Returns
    what the engine held at the end: its module's parameters and its fp32 masters."""
    seen = {}

    class Recording(TrainingLoop):
        def _engine_step(self, step):
            super()._engine_step(step)
            if stop_at is not None and step == stop_at - 1:
                os.kill(os.getpid(), signal.SIGTERM)

        def final_reports(self):
            seen["module"] = {n: p.detach().clone()
                              for n, p in self.engine.module.named_parameters()}
            seen["master"] = master_state(self.engine)
            super().final_reports()

    monkeypatch.setattr(trainer, "TrainingLoop", Recording)
    train_in_process(cfg, monkeypatch)
    return seen


@pytest.fixture(scope="module")
def runs(sources, tmp_path_factory):
    """kind -> (config, engine's final state, uninterrupted losses, losses until the stop,
    stopped-and-resumed losses, the steps the stopped run logged in order), each trained once
    for this module."""
    cache = {}

    def get(kind):
        if kind not in cache:
            tmp = tmp_path_factory.mktemp(kind)
            with pytest.MonkeyPatch.context() as mp:
                whole = _config(tmp, sources, RUNS[kind], "whole")
                seen = _train(whole, mp)
                stopped = _config(tmp, sources, RUNS[kind], "stopped", checkpointed=True)
                _train(stopped, mp, stop_at=STOP)
                at_stop = step_losses(stopped.resolved_run_dir)
                _train(stopped, mp)
            logged = [json.loads(line)["step"] for line in
                      (stopped.resolved_run_dir / "metrics.jsonl").read_text().splitlines()
                      if '"loss"' in line]
            cache[kind] = (whole, seen, step_losses(whole.resolved_run_dir), at_stop,
                           step_losses(stopped.resolved_run_dir), logged)
        return cache[kind]
    return get


def _exported(cfg) -> tuple[dict, dict]:
    path = cfg.resolved_run_dir / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        return load_file(str(path)), f.metadata()


def _fresh(cfg):
    """The model as the run built it before its first step (same seed): the base as
    pretrained, the memory and adapters at their initial draw."""
    torch.manual_seed(cfg.seed)
    return build_model(cfg.model)


def _log_probs(model, tokens, seg_len: int):
    """Log-probabilities of two segments in a row, the memory carried between them."""
    model.eval()
    with torch.no_grad():
        first = model(tokens[:, :seg_len], return_log_probs=True)
        second = model(tokens[:, seg_len:], first.state, return_log_probs=True)
    return torch.cat([first.log_probs, second.log_probs], dim=1)


@pytest.mark.parametrize("kind", list(RUNS))
def test_a_stopped_and_resumed_run_with_checkpointed_segments_repeats_the_uninterrupted_one(
        runs, kind):
    _, _, whole, at_stop, resumed, logged = runs(kind)
    assert sorted(at_stop) == list(range(1, STOP + 1))   # the SIGTERM stopped it there
    assert logged == list(range(1, STEPS + 1))           # and it went on from there
    assert sorted(whole) == sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == whole   # bit for bit, the steps after the resume included


def test_a_frozen_run_trains_and_exports_only_the_memory(runs):
    cfg, seen, *_ = runs("frozen")
    tensors, meta = _exported(cfg)
    assert list(tensors) == ["memory_init.value"]
    assert torch.equal(tensors["memory_init.value"], seen["module"]["memory_init.value"])
    fresh = dict(_fresh(cfg).named_parameters())
    assert not torch.equal(tensors["memory_init.value"], fresh["memory_init.value"])
    moved = [n for n, p in seen["module"].items() if n.startswith("base.")
             and not torch.equal(p, fresh[n])]
    assert moved == []
    # The metadata names the base the weights go with, and the resolved model config.
    assert meta["memtrain_base_path"] == cfg.model.hf.path and meta["memtrain_finetune"] == \
        "frozen" and meta["memtrain_base_revision"] == "" and "memtrain_base_gguf_file" in meta
    assert json.loads(meta[CONFIG_KEY]) == cfg.model.to_dict()


def test_a_bf16_lora_run_moves_only_its_adapters_and_memory_and_exports_their_masters(runs):
    cfg, seen, *_ = runs("lora")
    tensors, _ = _exported(cfg)
    fresh = dict(_fresh(cfg).named_parameters())
    adapters = sorted(n for n in fresh if "lora_" in n)
    assert adapters and sorted(tensors) == sorted(seen["master"]) == \
        sorted(adapters + ["memory_init.value"])
    for name, master in seen["master"].items():
        assert master.dtype == torch.float32 and torch.equal(tensors[name], master), name
        assert not torch.equal(master, fresh[name]), name   # lora_B starts at 0: all moved
    # It ran in bf16; the base is the pretrained one, cast to bf16 and never updated.
    assert {p.dtype for p in seen["module"].values()} == {torch.bfloat16}
    moved = [n for n, p in seen["module"].items() if n not in tensors
             and not torch.equal(p, fresh[n].to(torch.bfloat16))]
    assert moved == []


def test_a_full_finetune_exports_every_weight_as_trained(runs):
    cfg, seen, *_ = runs("full")
    tensors, _ = _exported(cfg)
    assert sorted(tensors) == sorted(seen["module"])   # tied input/output weights once
    for name, tensor in seen["module"].items():
        assert torch.equal(tensors[name], tensor), name


@pytest.mark.parametrize("kind", ["frozen", "full"])
def test_load_model_rebuilds_the_trained_model_from_its_base_and_the_export(runs, kind):
    cfg, seen, *_ = runs(kind)
    trained = _fresh(cfg)
    trained.load_state_dict(seen["module"], strict=False)
    loaded = load_model(cfg.resolved_run_dir / "model.safetensors")
    seg = cfg.model.tgt_len
    tokens = torch.randint(0, 10, (3, 2 * seg))
    assert torch.equal(_log_probs(loaded, tokens, seg), _log_probs(trained, tokens, seg))


def test_memtrain_eval_of_an_hf_run_scores_what_its_final_report_did(runs):
    for kind in RUNS:   # bf16 (lora): both score the fp32 masters with the fp32 base
        cfg = runs(kind)[0]
        final = json.loads((cfg.resolved_run_dir / "eval_report.json").read_text())["main"]
        report = run_eval(cfg, None, track=False)
        assert report["loss"] == pytest.approx(final["loss"], abs=1e-6), kind
        assert report["protocol"]["weights"] == final["protocol"]["weights"]


def test_a_zero3_lora_run_exports_its_fp32_masters_and_evaluates_as_trained(
        sources, tmp_path, monkeypatch):
    # ZeRO-3 partitions the trained weights' masters and stores the frozen base apart
    # ("frozen fragments"); the export reads only the former.
    spec = dict(RUNS["frozen"], hf={"finetune": "lora", "lora_r": 4},
                deepspeed={"zero_stage": 3})
    cfg = _config(tmp_path, sources, spec, "zero3")
    seen = _train(cfg, monkeypatch)
    tensors, _ = _exported(cfg)
    assert sorted(tensors) == sorted(seen["master"]) and "memory_init.value" in tensors
    for name, master in seen["master"].items():
        assert torch.equal(tensors[name], master), name
    final = json.loads((cfg.resolved_run_dir / "eval_report.json").read_text())["main"]
    assert run_eval(cfg, None, track=False)["loss"] == pytest.approx(final["loss"], abs=1e-6)


def test_an_export_missing_or_adding_trained_weights_is_refused_by_name(runs, tmp_path):
    cfg = runs("frozen")[0]
    tensors, meta = _exported(cfg)
    extra = tmp_path / "extra.safetensors"
    save_file({**tensors, "base.lm_head.weight": torch.zeros(32, 64)}, str(extra), meta)
    with pytest.raises(ValueError, match=r"unexpected \['base.lm_head.weight'\]"):
        load_model(extra)
    lora_meta = json.loads(meta[CONFIG_KEY])
    lora_meta["hf"]["finetune"] = "lora"
    missing = tmp_path / "missing.safetensors"
    save_file(tensors, str(missing), {**meta, CONFIG_KEY: json.dumps(lora_meta)})
    with pytest.raises(ValueError, match=r"missing \['base.transformer.h.0.attn.c_attn.lora_A"):
        load_model(missing)


def test_generate_samples_the_datas_ids_with_the_memory_carried(runs, capsys):
    cfg = runs("full")[0]
    capsys.readouterr()   # the run's own log, when this test is the first to need the run
    prompt = "1 2 3 4 5 6 7 8 9 10 11"      # more than a segment: one committed, one open
    args = ["--prompt-ids", prompt, "--max-new-tokens", "20", "--seed", "3", "--top-k", "8"]
    export = cfg.resolved_run_dir / "model.safetensors"
    assert main_generate(["--checkpoint", str(cfg.resolved_run_dir), *args]) == 0
    from_run = [int(x) for x in capsys.readouterr().out.split()]
    assert main_generate(["--checkpoint", str(export), "--data", cfg.data.path, *args]) == 0
    from_export = [int(x) for x in capsys.readouterr().out.split()]
    model = DataIds(load_model(export), WORDS_V).eval()
    expected = generate(model, torch.tensor([[int(x) for x in prompt.split()]]), 20, top_k=8,
                        generator=torch.Generator().manual_seed(3))[0, 11:].tolist()
    assert from_run == from_export == expected
    # The checkpoint has 32 output rows, the data 16 ids: only those are drawn.
    assert len(expected) == 20 and max(expected) < WORDS_V
