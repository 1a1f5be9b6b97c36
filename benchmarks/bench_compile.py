"""model.compile: compiled vs eager training speed, and where a step's time goes.

    python benchmarks/bench_compile.py --parts model --rounds 6 \
        --json benchmarks/results/compile_model.json
    python benchmarks/bench_compile.py --parts train --json benchmarks/results/compile_train.json
    python benchmarks/bench_compile.py --parts profile
    python benchmarks/bench_compile.py --quick            # smoke check
    python benchmarks/bench_compile.py --parts model --checkpoint-layers --mechanisms xl,lamemo
    python benchmarks/bench_compile.py --parts model --device cuda --dtype bf16   # on a GPU

Shape (BENCHMARKS.md, "Compiled training step"): 4 layers, d_model 256, 4 heads, d_inner 1024, 256
symbols, segment 128, memory 128, batch 8, dropout 0.1, fp32, 2 threads. RMT: 10 memory tokens and
an XL cache of 128 (the bare-model part), full BPTT over 2 segments (the train part).

Parts:
  model    bare model (forward, backward, Adam) in ONE process: eager, compiled with eager
           RNG (what model.compile does), compiled with Inductor's own RNG; each variant its
           own copy of the model, interleaved step by step, rotated each round. Ratio =
           median over rounds of CPU-time(eager) / CPU-time(variant) (process CPU time: the
           machine is shared). Also: seconds to the first compiled step, graphs compiled.
           With --device cuda: wall time up to the device's end (common.step_clock), the
           models cast to --dtype; Inductor emits Triton kernels there (not run here).
  train    `memtrain train` at the same shape, eager then compiled, same seed and data:
           tokens/s from the run's own metrics.jsonl, median over the log intervals after
           the first (which holds the compile), the graphs it compiled, and the losses of
           both runs side by side. Whole runs one after the other: noisier than `model`.
  profile  torch.profiler: self CPU time per op category (ms per step) of 3 eager and 3
           compiled XL steps, one after the other in one process.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: a spinning thread is charged CPU time that
# does no work, which on a shared machine would blur the CPU-time ratios. Must be set before
# torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml
from common import (
    add_device_args,
    add_model_size_args,
    interleaved,
    model_dtype,
    step_clock,
    write_json,
)

from data_pipeline.shard_writer import write_manifest, write_token_split
from data_pipeline.shards import Manifest, id_dtype
from data_pipeline.vocab import fingerprint
from model import ModelConfig, build_model
from model.compiled import compile_core, compiled_graphs

ROOT = Path(__file__).resolve().parents[1]
MEMTRAIN = str(Path(sys.executable).parent / "memtrain")
MECHANISMS = ("xl", "lamemo", "rmt")


def model_config(a, mechanism: str) -> ModelConfig:
    return ModelConfig(mechanism=mechanism, vocab_size=a.vocab, n_layer=a.n_layer,
                       d_model=a.d_model, n_head=a.n_head, d_inner=a.d_inner, dropout=0.1,
                       tgt_len=a.seg_len, mem_len=a.mem_len, rmt={"num_mem_tokens": 10},
                       checkpoint_layers=a.checkpoint_layers)


class Stepper:
    """One model, its Adam and its memory, stepping over random segments."""

    def __init__(self, model, a):
        self.device = torch.device(a.device)
        self.model = model.to(self.device, model_dtype(a))
        self.a, self.state = a, None
        self.opt = torch.optim.Adam(model.parameters(), 2.5e-4)
        self.data = torch.Generator().manual_seed(1)
        self.clock = step_clock(self.device)

    def step(self) -> float:
        a = self.a
        seg = torch.randint(0, a.vocab, (a.batch, a.seg_len + 1), generator=self.data)
        start = self.clock()
        # Targets stay on the host, as the training step passes them (train/bptt.py).
        out = self.model(seg[:, :-1].to(self.device, non_blocking=True), self.state,
                         targets=seg[:, 1:])
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.state = out.state.detach()
        return self.clock() - start


def run_model(a) -> list[dict]:
    rows = []
    for mechanism in a.mechanisms:
        torch.manual_seed(0)
        base = build_model(model_config(a, mechanism))
        variants = {"eager": base}
        other = ("compiled, whole stack" if a.checkpoint_layers else "compiled, Inductor RNG")
        for name in ("compiled", other):
            model = copy.deepcopy(base)
            if name == "compiled":
                compile_core(model)   # with checkpoint_layers: each layer call
            elif a.checkpoint_layers:  # the checkpointed layers inside one graph (before)
                model.core.forward = torch.compile(model.core.forward,
                                                   options={"fallback_random": True})
            else:  # the same, with Inductor drawing dropout masks in its kernels
                model.core.forward = torch.compile(model.core.forward)
            variants[name] = model
        steppers = {name: Stepper(m, a) for name, m in variants.items()}
        first, graphs = {}, {}
        for name, stepper in steppers.items():
            before, start = compiled_graphs(), time.perf_counter()
            for _ in range(3):  # memory 0, then full (twice): every graph compiled
                stepper.step()
            first[name] = round(time.perf_counter() - start, 1)
            graphs[name] = compiled_graphs() - before
        times = interleaved({name: (lambda s=s: sum(s.step() for _ in range(a.steps)))
                             for name, s in steppers.items()}, a.rounds)
        for name in steppers:
            ratios = [e / t for e, t in zip(times["eager"], times[name], strict=True)]
            row = {"mechanism": mechanism, "variant": name,
                   "s_per_step": round(statistics.median(times[name]) / a.steps, 3),
                   "speedup_vs_eager": round(statistics.median(ratios), 3),
                   "speedup_range": [round(min(ratios), 3), round(max(ratios), 3)],
                   "first_3_steps_wall_s": first[name], "graphs": graphs[name]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def random_corpus(path: Path, vocab: int, n_tokens: int) -> Path:
    """Uniform random symbols: the speed of a step does not depend on what it learns."""
    path.mkdir(parents=True, exist_ok=True)
    ids = np.random.default_rng(0).integers(0, vocab, n_tokens).astype(id_dtype(vocab))
    splits = {split: write_token_split(path, split, [ids if split == "train" else ids[:20000]],
                                       id_dtype(vocab), 65536, 4)
              for split in ("train", "valid", "test")}
    meta = {"kind": "synthetic", "generator": "uniform", "size": vocab}
    write_manifest(path, Manifest(kind="tokens", source="uniform", vocab=meta,
                                  vocab_fingerprint=fingerprint(meta), vocab_size=vocab,
                                  dtype=str(id_dtype(vocab)), chunk_tokens=65536, splits=splits))
    return path


def run_train(a) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = random_corpus(tmp / "data", a.vocab, 2_000_000)
        for mechanism in a.mechanisms:
            results = {}
            for compiled in (False, True):
                name = f"{mechanism}-{'compiled' if compiled else 'eager'}"
                cfg = {"name": name, "run_dir": str(tmp / name), "max_steps": a.train_steps,
                       "log_every": a.log_every, "threads": a.threads, "seed": 0,
                       "model": {**model_config(a, mechanism).to_dict(), "compile": compiled},
                       "data": {"path": str(data), "global_batch": a.batch},
                       "optim": {"lr": 2.5e-4, "schedule": "constant"},
                       "eval": {"every": 0, "max_segments": 1},
                       "tracking": {"enabled": False}}
                if mechanism == "rmt":
                    cfg["bptt"] = {"depth": 1}
                (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
                start = time.perf_counter()
                subprocess.run([MEMTRAIN, "train", "--config", str(tmp / f"{name}.yaml"),
                                "--no-resume"], cwd=ROOT, check=True, capture_output=True)
                wall = time.perf_counter() - start
                lines = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text()
                         .splitlines()]
                logged = [x for x in lines if "tokens_per_s" in x]
                results[compiled] = {
                    "tokens_per_s": statistics.median(x["tokens_per_s"] for x in logged[1:]),
                    "graphs": logged[-1].get("compiled_graphs", 0), "wall_s": wall,
                    "losses": [round(x["loss"], 5) for x in logged]}
            eager, comp = results[False], results[True]
            row = {"mechanism": mechanism, "eager_tokens_per_s": round(eager["tokens_per_s"]),
                   "compiled_tokens_per_s": round(comp["tokens_per_s"]),
                   "speedup": round(comp["tokens_per_s"] / eager["tokens_per_s"], 3),
                   "graphs": comp["graphs"],
                   "extra_wall_s": round(comp["wall_s"] - eager["wall_s"], 1),
                   "eager_losses": eager["losses"], "compiled_losses": comp["losses"]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _category(op: str) -> str:
    if op in ("aten::mm", "aten::bmm", "aten::addmm"):
        return "matmuls (mm, bmm, addmm)"
    if op == "aten::bernoulli_":
        return "dropout's random draws (bernoulli_)"
    if "CompiledFxGraph" in op:
        return "compiled kernels (fused pointwise, softmax, LayerNorm, ...)"
    if "Adam" in op or op in ("aten::lerp_", "aten::addcdiv_", "aten::sqrt", "aten::addcmul_"):
        return "Adam update"
    return "other eager ops (pointwise, copies, reductions)"


def run_profile(a) -> dict:
    """Self CPU time per op category, ms per step, of 3 eager and 3 compiled XL steps."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        model = build_model(model_config(a, "xl"))
        if name == "compiled":
            compile_core(model)
        stepper = Stepper(model, a)
        for _ in range(3):
            stepper.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                stepper.step()
        shares: dict[str, float] = {}
        for e in prof.key_averages():
            if e.key.startswith("Optimizer.") or e.key.startswith("Torch-Compiled"):
                continue  # wrappers: their children carry the self time
            key = _category(e.key)
            shares[key] = shares.get(key, 0.0) + e.self_cpu_time_total / 3e3  # us -> ms/step
        out[name] = {k: round(v, 1) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}
        print(name, json.dumps(out[name], indent=1), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_size_args(p)
    p.add_argument("--parts", default="model,train,profile")
    p.add_argument("--mechanisms", default=",".join(MECHANISMS))
    p.add_argument("--seg-len", type=int, default=128)
    p.add_argument("--mem-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    p.add_argument("--train-steps", type=int, default=60)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint-layers", action="store_true",
                   help="model part with model.checkpoint_layers (compiled per layer call, "
                        "against the whole stack compiled)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, one round")
    add_device_args(p)
    p.add_argument("--json")
    a = p.parse_args(argv)
    a.mechanisms = a.mechanisms.split(",")
    if (a.device != "cpu" or a.dtype != "fp32") and a.parts != "model":
        p.error("--device / --dtype apply to --parts model only")
    if a.quick:
        a.n_layer, a.d_model, a.d_inner, a.seg_len, a.mem_len, a.batch = 1, 32, 64, 16, 16, 2
        a.rounds, a.train_steps, a.log_every = 1, 4, 2
    torch.set_num_threads(a.threads)
    results = {"shape": {k: getattr(a, k) for k in ("n_layer", "d_model", "n_head", "d_inner",
                                                     "vocab", "seg_len", "mem_len", "batch",
                                                     "threads", "device", "dtype")},
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    parts = a.parts.split(",")
    if "model" in parts:
        results["model"] = run_model(a)
    if "train" in parts:
        results["train"] = run_train(a)
    if "profile" in parts:
        results["profile"] = run_profile(a)
    write_json(a.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
