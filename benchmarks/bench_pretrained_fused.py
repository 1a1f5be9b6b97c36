"""Pretrained backbone: the fused GELU (`model.hf.fused_gelu`) and regional compilation
(`model.compile` around a pretrained model, model/pretrained/regional.py).

    python benchmarks/bench_pretrained_fused.py --parts ops,compile --json OUT.json
    python benchmarks/bench_pretrained_fused.py --parts step --device cuda --dtype bf16 \\
        --d-model 768 --layers 12 --heads 12 --seq 1024 --batch 8       # GPT-2-small shape

A random GPT-2 built from a config (never downloaded), written with `save_pretrained` and
loaded through `model.hf.path` as memtrain trains it (RMT with --mem tokens; 0: the base
model itself).

Parts:
  ops      pointwise aten ops (torch's `pointwise` tag) of one decoder layer's forward and
           backward, and of its MLP alone, with the fused GELU off and on (a
           TorchDispatchMode counting them, as tests/test_pretrained_fused.py does), in
           training mode with GPT-2's own dropout (0.1).
  compile  the cold compile time of each backend (aot_eager, inductor): a fresh process with
           an empty Inductor cache (TORCHINDUCTOR_CACHE_DIR) times its first compiled
           training step (forward + backward: Dynamo's trace, AOT autograd's split, the
           backend's build) less an eager step of the same shape.
  step     training steps (forward + backward + Adam) of {fused GELU off, on} x {eager,
           compiled with --backend}, interleaved round by round (common.interleaved); CPU
           seconds on the CPU, synchronised wall seconds on a GPU (common.step_clock).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402


class PointwiseOps(TorchDispatchMode):
    """Counts the pointwise aten ops (torch's `pointwise` tag) run inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.pointwise in func.tags:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def checkpoint(a, root: str) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel
    path = os.path.join(root, "gpt2")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(vocab_size=a.vocab, n_positions=max(64, a.seq + 2 * a.mem),
                                   n_embd=a.d_model, n_layer=a.layers, n_head=a.heads,
                                   bos_token_id=0, eos_token_id=0)).save_pretrained(path)
    return path


def build(a, path: str, fused: bool, compiled: bool, backend: str, recompute: bool = True):
    from model import ModelConfig, build_model
    from model.compiled import compile_core
    cfg = ModelConfig.from_dict({"mechanism": "rmt", "backbone": "hf", "tgt_len": a.seq,
                                 "mem_len": 0, "rmt": {"num_mem_tokens": a.mem},
                                 "hf": {"path": path, "fused_gelu": fused,
                                        "recompute_activation": recompute}})
    model = build_model(cfg).to(a.device, common.model_dtype(a)).train()
    if compiled:
        compile_core(model, backend)
    return model


def step_fn(a, model):
    opt = torch.optim.Adam(model.parameters(), 1e-4)
    gen = torch.Generator().manual_seed(0)
    clock = common.step_clock(a.device)

    def step() -> float:
        x = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen).to(a.device)
        start = clock()
        model(x[:, :-1], None, targets=x[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return clock() - start
    return step


def part_ops(a, path: str) -> dict:
    out = {}
    for fused in (False, True):
        # the activation's own ops (its output kept: no recompute in backward)
        layer = build(a, path, fused, False, "", recompute=False).base.transformer.h[0]
        x = torch.randn(2, 16, a.d_model, device=a.device, dtype=common.model_dtype(a),
                        requires_grad=True)
        counts = {}
        for name, module in (("layer", layer), ("mlp", layer.mlp)):
            module.zero_grad(set_to_none=True)   # no accumulation into earlier gradients
            x.grad = None
            with PointwiseOps() as count:
                y = module(x)
                (y[0] if isinstance(y, tuple) else y).sum().backward()
            counts[name] = {"total": sum(count.ops.values()), "by_op": dict(count.ops)}
        out["fused" if fused else "gelu_new"] = counts
        print(f"fused_gelu={fused}: pointwise ops per layer {counts['layer']['total']}, "
              f"per MLP {counts['mlp']['total']} {counts['mlp']['by_op']}", flush=True)
    return out


def child_compile(a, path: str) -> dict:
    eager_model = build(a, path, True, False, "")
    step = step_fn(a, eager_model)
    step()
    eager = min(step() for _ in range(3))
    model = build(a, path, True, True, a.backend)
    step = step_fn(a, model)
    wall = time.perf_counter()
    step()
    first = time.perf_counter() - wall
    return {"first_step_s": first, "eager_step_s": eager, "compile_s": first - eager}


def part_compile(a, path: str) -> dict:
    out = {}
    for backend in ("aot_eager", "inductor"):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            cmd = [sys.executable, __file__, "--_child", "compile", "--backend", backend,
                   "--root", path, *sizes(a)]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        out[backend] = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"cold compile, {backend}: {out[backend]['compile_s']:.1f} s (first compiled "
              f"step {out[backend]['first_step_s']:.1f} s)", flush=True)
    return out


def part_step(a, path: str) -> dict:
    steps = {}
    for fused in (False, True):
        for compiled in (False, True):
            name = f"{'fused' if fused else 'gelu_new'}{'+compiled' if compiled else ''}"
            fn = step_fn(a, build(a, path, fused, compiled, a.backend))
            for _ in range(3):   # warm-up (compiles)
                fn()
            steps[name] = fn
    # model.hf.recompute_activation (on in every row above): its cost, the output kept
    fn = step_fn(a, build(a, path, True, False, a.backend, recompute=False))
    for _ in range(3):
        fn()
    steps["fused, output kept"] = fn
    times = common.interleaved(steps, a.rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["gelu_new"]
    for k, v in med.items():
        print(f"{k:20s} {v * 1e3:9.2f} ms/step  speed-up {base / v:.3f}x", flush=True)
    return {"median_s": med, "speedup_vs_gelu_new": {k: base / v for k, v in med.items()}}


def sizes(a) -> list[str]:
    return ["--d-model", str(a.d_model), "--layers", str(a.layers), "--heads", str(a.heads),
            "--seq", str(a.seq), "--batch", str(a.batch), "--mem", str(a.mem), "--vocab",
            str(a.vocab), "--device", a.device, "--dtype", a.dtype]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="ops,compile")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--mem", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json")
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--_child", help=argparse.SUPPRESS)
    common.add_device_args(p)
    a = p.parse_args(argv)
    if a._child:
        print(json.dumps(child_compile(a, a.root)))
        return 0
    started, results = time.time(), {"args": vars(a)}
    with tempfile.TemporaryDirectory() as root:
        path = checkpoint(a, root)
        parts = {"ops": part_ops, "compile": part_compile, "step": part_step}
        for part in a.parts.split(","):
            results[part] = parts[part](a, path)
    return common.finish(a.json, results, started)


if __name__ == "__main__":
    raise SystemExit(main())
