"""memtrain's own training step beside the plain-torch step, on the same model and window:
the engine part of benchmarks/gpu_scale.py (run there as a child process, since it starts a
process group).

    python benchmarks/gpu_engine.py --shape gpt2-124m --json engine.json     # one GPU
    python benchmarks/gpu_engine.py --quick --json /tmp/engine.json          # CPU, tiny

plain   benchmarks/bench_pretrained.py's Runner: the model cast to --dtype, eager, torch
        Adam, no clipping (the mfu part of gpu_scale.py times this step).
engine  the step `memtrain train` runs, built by train/ itself: the run config's DeepSpeed
        engine (train/engine.py `initialize`, the default ds_config.json at --zero-stage,
        bf16 with fp32 master weights and gradient sums, gradient clipping 0.25), the
        model as train/pretrained.py builds it for the engine, and one micro-step of
        train/loop.py's TrainingLoop (`_micro_step`: the BPTT window, the loss, its
        non-finite check and host read, engine.backward, engine.step) over a token stream
        whose memory is carried from window to window, as in training.

Variants (gpu_scale.py's names): base = the model without memory, one segment; a memory
variant = n segments of RMT (`rmt-ckpt-last1`: segment-checkpointed but the last,
`rmt-unroll`: not checkpointed) in one window with one backward. Per row, after --warmup
steps: --steps timed steps (median step_s; CUDA wall time after a synchronize, CPU process
time, benchmarks/common.py `step_clock`); the forward share (the window's forwards until
its backward starts, over the step); the peak over one step, with the weights, optimizer
state and carried memory (`peak_gb`: CUDA max_memory_allocated; CPU the process's peak
RSS) and without them (`step_peak_gb`: that peak above `held_gb`, what was held before the
step: a variant's held memory also shows what an earlier one left allocated);
beside each, the planner's prediction (planner/: `predicted_peak_gb` its model states of
the run's ZeRO stage plus the carried memory plus the window's peak, for the engine only,
since it plans DeepSpeed's states, not torch Adam's; `predicted_step_peak_gb` the window's
peak, for both); model TFLOP/s and MFU (train/throughput.py; MFU null on the CPU). GB = 10^9
bytes. engine_over_plain: the engine's step_s over the plain step's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_pretrained as bp  # noqa: E402
from benchmarks.common import status_kib, step_clock, write_json  # noqa: E402
from data_pipeline.streams import SegmentBatch  # noqa: E402

GB = 1e9
# (bench_pretrained variant, memory tokens per m, checkpointed) of each engine variant
VARIANTS = {"base": ("base", 0, False), "rmt-unroll": ("unroll", 1, False),
            "rmt-ckpt-last1": ("full+last1", 1, True)}


class TimedEngine:
    """The DeepSpeed engine as the loop sees it, noting when the step's backward starts
    (the end of its forwards: a checkpointed segment's recompute runs inside the
    backward, so calls of the forward are not what to time)."""

    def __init__(self, engine, clock):
        self._engine, self._clock, self.backward_at = engine, clock, None

    def __call__(self, *args, **kwargs):
        return self._engine(*args, **kwargs)

    def backward(self, loss):
        self.backward_at = self._clock()
        return self._engine.backward(loss)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class Memory:
    """Peak memory over one step: CUDA's allocator, or the CPU process's RSS."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.device = device

    def start(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # reset VmHWM to the current RSS
        return status_kib("VmRSS") * 1024

    def peak(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device)
        return status_kib("VmHWM") * 1024


def run_config(a, path: str, variant: str, n: int, zero_stage: int):
    """The run config of the engine variant: the model bench_pretrained builds, one window
    of n segments per optimizer step, the default DeepSpeed config at `zero_stage`."""
    from train.config import from_dict
    _, per_m, ckpt = VARIANTS[variant]
    model = bp.model_config(a, path, per_m * a.num_mem_tokens).to_dict()
    return from_dict({
        "model": model, "data": {"path": "unused", "global_batch": a.batch},
        "bptt": {"depth": n - 1, "checkpoint_segments": ckpt,
                 "keep_last_segments": 1 if ckpt else 0},
        "deepspeed": {"precision": a.dtype, "zero_stage": zero_stage},
        "max_steps": 10 ** 6, "log_every": 10 ** 6})


def predicted(cfg, rows: int, n: int, device) -> dict:
    """The planner's figures for this run (module docstring), GB."""
    from planner.activations import Dims, state_bytes
    from planner.plan import setup_for
    from planner.window import predict_window
    b, kernel = cfg.bptt, "cuda" if device.type == "cuda" else "cpu"
    window = predict_window(cfg.model, rows, n - 1, b.checkpoint_segments,
                            cfg.deepspeed.precision, b.recompute, b.keep_last_segments,
                            kernel=kernel)["peak"]
    setup = setup_for(cfg, 0, 1, 1, 0.0)
    carried = state_bytes(Dims(cfg.model, rows, cfg.model.mem_len, cfg.deepspeed.precision,
                               kernel)) * setup.regime.carried_states(b.mode, n - 1)
    return {"predicted_peak_gb": (sum(v for _, v in setup.static) + carried + window) / GB,
            "predicted_step_peak_gb": window / GB}


def stream(a, seed: int = 0):
    """Consecutive segments of --batch rows of random tokens (a token stream)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seg_len + 1), generator=g)
    for j in range(10 ** 9):
        yield SegmentBatch(tokens, torch.full((a.batch,), j == 0), None, 0, j)
        tokens = torch.cat([tokens[:, -1:], torch.randint(0, a.vocab, (a.batch, a.seg_len),
                                                          generator=g)], 1)


def timed(step, memory: Memory, o) -> dict:
    """Warm-up steps, one step under the peak measurement, then o.steps timed ones. `step`
    returns its clock seconds and those of its forwards."""
    for _ in range(o.warmup):
        step()
    held = memory.start()
    step()
    peak = memory.peak()
    times, forwards = zip(*[step() for _ in range(o.steps)], strict=True)
    return {"step_s": statistics.median(times), "steps_s": list(times),
            "forward_share": statistics.median(f / t for f, t in zip(forwards, times,
                                                                       strict=True)),
            "peak_gb": peak / GB, "step_peak_gb": (peak - held) / GB, "held_gb": held / GB}


def measure_plain(a, path, variant, n, o, memory) -> dict:
    runner = bp.Runner(a, path, VARIANTS[variant][0], n, optimizer=True)

    def step():
        elapsed = runner.step()
        return elapsed, runner.fwd_s[-1]
    return timed(step, memory, o)


def measure_engine(cfg, a, o, clock, memory, device) -> dict:
    from train.bptt import StreamWindows, TrainState
    from train.engine import build_ds_config, initialize, zero_stage
    from train.loop import LoopParts, TrainingLoop
    from train.pretrained import build_for_engine
    ds = build_ds_config(cfg, 1)
    torch.manual_seed(a.seed)
    engine, _ = initialize(build_for_engine(cfg.model, ds), cfg, ds)
    timed_engine = TimedEngine(engine, clock)
    loop = TrainingLoop(LoopParts(
        cfg=cfg, engine=timed_engine, state=TrainState(plan=StreamWindows(cfg.bptt)),
        device=device, stage=zero_stage(ds), signals=type("NoSignal", (), {"received": None})()))
    batches = stream(a)
    engine.train()

    def step():
        start = clock()
        loop._micro_step(batches)
        return clock() - start, timed_engine.backward_at - start
    return {"zero_stage": zero_stage(ds), **timed(step, memory, o)}


def model_flops(cfg, a, n: int) -> float:
    """Model FLOPs of one step (train/throughput.py: memory rows in, recompute out)."""
    from train.throughput import model_counts, segment_flops
    return n * a.batch * segment_flops(cfg.model, model_counts(cfg.model), a.seg_len)


def run(o) -> dict:
    from train.distributed import resolve_env
    from train.process_group import init_process_group
    from train.throughput import matmul_dtype, peak_flops
    device = torch.device(o.device)
    if not torch.distributed.is_initialized():
        init_process_group(resolve_env())
    clock, memory = step_clock(device), Memory(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = peak_flops(gpu, matmul_dtype(o.dtype, True, gpu or ""))
    from benchmarks.gpu_scale import QUICK_SHAPE, SHAPES
    flags = [*SHAPES[o.shape], *(QUICK_SHAPE if o.quick else []), f"--seg-len={o.seg_len}",
             f"--num-mem-tokens={o.mem}", f"--device={o.device}", f"--dtype={o.dtype}",
             f"--threads={o.threads}", f"--batch={o.batch}"]
    a = bp.parse_args(flags)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = bp.save_backbone(a, os.path.join(tmp, o.shape))
        for variant in o.variants:
            n = 1 if variant == "base" else o.segments
            cfg = run_config(a, path, variant, n, o.zero_stage)
            flops = model_flops(cfg, a, n)
            row = {"variant": variant, "n": n, "batch": a.batch, "seg_len": a.seg_len,
                   "text_tokens": n * a.batch * a.seg_len, "model_flops_per_step": flops}
            for kind in ("plain", "engine"):
                if kind == "plain":
                    r = measure_plain(a, path, variant, n, o, memory)
                else:
                    r = measure_engine(cfg, a, o, clock, memory, device)
                r.update(predicted(cfg, a.batch, n, device))
                if kind == "plain":
                    r["predicted_peak_gb"] = None
                    r["predicted_peak_note"] = ("the planner plans DeepSpeed's model "
                                                "states, not torch Adam's")
                r["tokens_per_s"] = row["text_tokens"] / r["step_s"]
                r["model_tflops_per_s"] = flops / r["step_s"] / 1e12
                r["mfu"] = flops / r["step_s"] / peak if peak else None
                row[kind] = r
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            row["engine_over_plain"] = row["engine"]["step_s"] / row["plain"]["step_s"]
            rows.append(row)
            print(f"  {o.shape} {variant:<15} n={n:<3} " + "  ".join(
                f"{k} {row[k]['step_s'] * 1e3:.1f} ms (fwd {row[k]['forward_share']:.0%}, "
                f"peak {row[k]['peak_gb']:.2f} GB, step {row[k]['step_peak_gb']:.2f} GB)"
                for k in ("plain", "engine")) + f"  engine/plain {row['engine_over_plain']:.2f}x",
                flush=True)
    return {"shape": o.shape, "device": str(device), "gpu": gpu, "dtype": o.dtype,
            "peak_flops": peak, "steps": o.steps, "warmup": o.warmup, "rows": rows}


def run_child(o, shape: str, deadline: float) -> dict:
    """This script for one shape in a child process, with gpu_scale.py's options `o`, under
    the time left; its JSON, or what went wrong."""
    import subprocess
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "engine.json")
        cmd = [sys.executable, os.path.abspath(__file__), f"--shape={shape}",
               f"--seg-len={o.seg_lens[0]}", f"--mem={o.mem}", f"--device={o.device}",
               f"--dtype={o.dtype}", f"--threads={o.threads}", f"--json={out}",
               *(["--quick"] if o.quick else [])]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True,
                                 timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            return {"error": "out of time", "cmd": cmd}
        if res.returncode or not os.path.exists(out):
            return {"error": f"exit {res.returncode}", "cmd": cmd,
                    "tail": (res.stdout + res.stderr)[-3000:]}
        with open(out) as f:
            return json.load(f)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="gpt2-124m", help="gpt2-124m or smollm2-135m")
    p.add_argument("--variants", default="base,rmt-ckpt-last1", help=", ".join(VARIANTS))
    p.add_argument("--seg-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="rows of every step")
    p.add_argument("--segments", type=int, default=8, help="n of the memory variants")
    p.add_argument("--mem", type=int, default=16, help="m, memory tokens")
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=5, help="timed steps (at least 5)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (rehearsal)")
    p.add_argument("--json", help="write the rows here")
    o = p.parse_args(argv)
    o.device = o.device or ("cuda" if torch.cuda.is_available() else "cpu")
    o.variants = [v for v in o.variants.split(",") if v]
    if set(o.variants) - set(VARIANTS):
        p.error(f"--variants: unknown {sorted(set(o.variants) - set(VARIANTS))}")
    if o.steps < 5:
        p.error("--steps: at least 5 timed steps (a median of fewer is one noisy step)")
    if o.quick:
        o.seg_len, o.batch, o.segments, o.mem, o.warmup = 16, 2, 2, 2, 1
        o.dtype = "fp32" if o.device == "cpu" else o.dtype
    return o


def main(argv=None) -> int:
    o = parse_args(argv)
    torch.set_num_threads(o.threads)
    started = time.time()
    result = {**run(o), "wall_s": None, "args": vars(o)}
    result["wall_s"] = time.time() - started
    write_json(o.json, result)
    print(json.dumps({"rows": len(result["rows"]), "wall_s": result["wall_s"]}))
    # DeepSpeed keeps gloo's worker threads alive past destroy_process_group; leave without
    # the interpreter's teardown once the results are out (tests/engine_probe.py).
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
