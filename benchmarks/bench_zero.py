"""ZeRO through the DeepSpeed engine on CPU: model-state memory, 1 vs 2 rank throughput,
segment-checkpointing overhead. Launcher (default) and torchrun worker (--worker) in one.

    B=benchmarks; R=benchmarks/results
    python $B/bench_zero.py --parts memory --json $R/zero_memory.json
    python $B/bench_zero.py --parts memory --mem-stages 1,2,3 --bucket 2000000 \
        --json $R/zero_memory_bucket2M.json
    python $B/bench_zero.py --parts speed,ckpt --json $R/zero_speed_ckpt.json
    python $B/bench_zero.py --quick                    # smoke check, < 60 s

Each part launches `python -m torch.distributed.run --nproc_per_node N THIS --worker PART`
(gloo; OMP_NUM_THREADS = torch threads = --threads per rank); rank 0 prints one JSON line.
  memory  ZeRO 0-3 on --mem-world ranks, a fresh launch per stage, XL --mem-layers x
          --mem-d-model, tiny batch. Per rank: bytes of its parameters (ZeRO-3: ds_tensor),
          fp32 master partition, Adam moments (wrapped torch optimizer's state), gradients
          held right after engine.backward (p.grad + ZeRO's partitioned gradient buffers;
          IPG bucket buffers apart, allocated size); peak-RSS growth (VmHWM,
          MALLOC_MMAP_THRESHOLD_=65536) from before the model is built through init + 2
          steps. A tiny engine is built, stepped and freed first: DeepSpeed's one-time costs
          are not counted.
  speed   tokens/s over all ranks, 1 vs 2 ranks at the same per-rank batch (weak scaling),
          ZeRO 0-3 per launch, --steps timed steps after --warmup; launches alternate 1, 2,
          1, 2 for --rounds rounds; ratio = median of per-round ratios, tokens/s from the
          median step wall time (also reported: total wall time, and CPU time).
  ckpt    RMT window k=--ckpt-depth, ZeRO 0/1/2, --ckpt-world ranks: steps with and without
          checkpoint_segments alternate on one engine; overhead = median of per-round ratios
          of process CPU time (and of wall time).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
from common import finish, status_kib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- worker side
def union_bytes(tensors) -> int:
    """Bytes covered by the tensors, views of one buffer counted once."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in tensors if isinstance(t, torch.Tensor) and t.numel())
    total, end = 0, -1
    for lo, hi in spans:
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def _flat(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else []
    return [t for v in items for t in _flat(v)]


def state_bytes(engine, stage: int) -> dict:
    opt = engine.optimizer
    inner = opt.optimizer if stage > 0 else opt
    params = list(engine.module.parameters())
    local = [p.ds_tensor for p in params] if stage == 3 else params
    master = {1: "single_partition_of_fp32_groups", 2: "single_partition_of_fp32_groups",
              3: "fp32_partitioned_groups_flat"}.get(stage)
    return {"params": union_bytes(local),
            "master_fp32": union_bytes(_flat(getattr(opt, master))) if master else 0,
            "adam_moments": union_bytes(_flat(list(inner.state.values())))}


def grad_bytes(engine, stage: int) -> tuple[int, int]:
    """(gradient bytes held after backward, IPG bucket bytes allocated)."""
    opt = engine.optimizer
    held = [p.grad for p in engine.module.parameters()]
    for name in ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer"):
        held += _flat(getattr(opt, name, None))
    buckets = [b.buffer for b in getattr(opt, "ipg_buckets", {}).values()]
    return union_bytes(held), union_bytes(_flat(buckets))


def build_engine(a, env, stage: int, mech: str, n_layer: int, d_model: int, batch: int,
                 mem_len: int):
    from model import ModelConfig, build_model
    from train.config import load_config
    from train.engine import build_ds_config, initialize

    zero = "deepspeed.overrides.zero_optimization"
    buckets = [f"{zero}.{k}={a.bucket}" for k in ("reduce_bucket_size", "allgather_bucket_size",
                                                 "stage3_prefetch_bucket_size")] * (a.bucket > 0)
    cfg = load_config(None, ["data.path=unused", f"data.global_batch={batch * env.world_size}",
                             f"deepspeed.zero_stage={stage}", *buckets])
    torch.manual_seed(0)
    model = build_model(ModelConfig(mechanism=mech, vocab_size=a.vocab, n_layer=n_layer,
                                    d_model=d_model, n_head=a.n_head, d_inner=4 * d_model,
                                    dropout=0.1, tgt_len=a.seg_len, mem_len=mem_len,
                                    rmt={"num_mem_tokens": a.num_mem_tokens}))
    n_params = sum(p.numel() for p in model.parameters())
    engine, _ = initialize(model, cfg, build_ds_config(cfg, env.world_size))
    return engine, n_params


class Stepper:
    """Micro-steps (run_window + engine.backward + engine.step) over random segments."""

    def __init__(self, a, env, engine, batch: int, depth: int):
        from data_pipeline.streams import SegmentBatch

        g = torch.Generator().manual_seed(env.rank)
        n = depth + 1
        data = torch.randint(0, a.vocab, (batch, n * a.seg_len + 1), generator=g)
        self.segs = [SegmentBatch(data[:, j * a.seg_len:(j + 1) * a.seg_len + 1],
                                  torch.zeros(batch, dtype=torch.bool), None, 0, j)
                     for j in range(n)]
        self.engine, self.state = engine, None
        self.tokens = n * a.seg_len * batch

    def step(self, ckpt: bool = False, on_backward=None) -> None:
        from train.bptt import run_window

        res = run_window(self.engine, self.state, self.segs, torch.device("cpu"),
                         checkpoint_segments=ckpt)
        self.engine.backward(res.loss)
        if on_backward is not None:
            on_backward()
        self.engine.step()
        self.state = res.state


def _free(engine) -> None:
    getattr(engine, "destroy", lambda: None)()
    gc.collect()


def worker(a) -> None:
    import train.bptt  # noqa: F401  (imported before the memory baseline is read)
    import train.engine  # noqa: F401
    from train.distributed import resolve_env
    from train.process_group import barrier, init_process_group

    env = resolve_env()
    init_process_group(env)
    torch.set_num_threads(a.threads)
    out = []
    if a.worker == "memory":
        stage = a.stages[0]
        # A tiny engine first, stepped and freed: DeepSpeed's lazy imports, op loads and
        # communication buffers are not charged to the model's states.
        tiny, _ = build_engine(a, env, stage, "xl", 1, 32, 1, a.seg_len)
        Stepper(a, env, tiny, 1, 0).step()
        _free(tiny)
        before = status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        engine, n_params = build_engine(a, env, stage, "xl", a.mem_layers, a.mem_d_model,
                                        a.mem_batch, a.seg_len)
        stepper = Stepper(a, env, engine, a.mem_batch, 0)
        grads = []
        stepper.step(on_backward=lambda: grads.append(grad_bytes(engine, stage)))
        init_peak = status_kib("VmHWM")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the second step's own peak, init transients excluded
        stepper.step(on_backward=lambda: grads.append(grad_bytes(engine, stage)))
        out.append({"stage": stage, "rank": env.rank, "world": env.world_size,
                    "n_params": n_params, **state_bytes(engine, stage),
                    "grads": max(g[0] for g in grads), "ipg_buckets_allocated": grads[-1][1],
                    "peak_rss_growth": (max(init_peak, status_kib("VmHWM")) - before) * 1024,
                    "step2_peak_rss_growth": (status_kib("VmHWM") - before) * 1024,
                    "end_rss_growth": (status_kib("VmRSS") - before) * 1024})
    elif a.worker == "speed":
        for stage in a.stages:
            engine, n_params = build_engine(a, env, stage, "xl", a.n_layer, a.d_model,
                                            a.batch, a.seg_len)
            stepper = Stepper(a, env, engine, a.batch, 0)
            for _ in range(a.warmup):
                stepper.step()
            barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            marks = [t0]
            for _ in range(a.steps):
                stepper.step()  # the gradient all-reduce keeps the ranks in step
                marks.append(time.perf_counter())
            barrier()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            per_step = [y - x for x, y in zip(marks, marks[1:], strict=False)]
            tokens = stepper.tokens * env.world_size
            out.append({"stage": stage, "world": env.world_size, "n_params": n_params,
                        "wall_s": wall, "cpu_s": cpu, "step_wall_s": per_step,
                        "tokens_per_s": tokens * a.steps / wall,
                        "tokens_per_s_median_step": tokens / statistics.median(per_step)})
            _free(engine)
    else:  # ckpt
        for stage in a.stages:
            engine, n_params = build_engine(a, env, stage, "rmt", a.n_layer, a.d_model,
                                            a.batch, 0)
            stepper = Stepper(a, env, engine, a.batch, a.ckpt_depth)
            stepper.step(False)
            stepper.step(True)
            cpu, wall = {False: [], True: []}, {False: [], True: []}
            for rnd in range(a.ckpt_rounds):
                for ck in ((False, True) if rnd % 2 == 0 else (True, False)):
                    barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    stepper.step(ck)
                    barrier()
                    wall[ck].append(time.perf_counter() - t0)
                    cpu[ck].append(time.process_time() - c0)
            out.append({"stage": stage, "world": env.world_size, "depth": a.ckpt_depth,
                        "n_params": n_params, "cpu_s": {str(k): v for k, v in cpu.items()},
                        "wall_s": {str(k): v for k, v in wall.items()},
                        "overhead_cpu": statistics.median(
                            c / p for c, p in zip(cpu[True], cpu[False], strict=True)),
                        "overhead_wall": statistics.median(
                            c / p for c, p in zip(wall[True], wall[False], strict=True))})
            _free(engine)
    gathered = [None] * env.world_size
    torch.distributed.all_gather_object(gathered, out)
    if env.rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- launcher side
WORKER_FLAGS = ("n_layer", "d_model", "n_head", "seg_len", "num_mem_tokens", "batch", "vocab",
                "threads", "steps", "warmup", "ckpt_rounds", "ckpt_depth", "mem_layers",
                "mem_d_model", "mem_batch", "bucket")


def launch(a, part: str, world: int, stages) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
           "--master_port", str(port), os.path.abspath(__file__), "--worker", part,
           "--stages", ",".join(map(str, stages)),
           *[f"--{k.replace('_', '-')}={getattr(a, k)}" for k in WORKER_FLAGS]]
    env = {"TORCH_EXTENSIONS_DIR": os.path.join(ROOT, ".cache", "torch_ext"), **os.environ,
           "OMP_NUM_THREADS": str(a.threads),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           **({"MALLOC_MMAP_THRESHOLD_": "65536"} if part == "memory" else {})}
    for attempt in range(2):
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
        if lines:  # a rank aborting at teardown after printing (seen once with gloo) is moot
            if res.returncode:
                print(f"  (launch exited {res.returncode} after reporting)", flush=True)
            return json.loads(lines[-1][len("RESULT "):])
        print(f"  launch {part}/{world} failed (attempt {attempt + 1}):\n"
              f"{res.stderr[-3000:]}", flush=True)
    raise RuntimeError(f"{part} world {world} failed twice")


def formula_bytes(stage: int, n: int, psi: int) -> float:
    """ZeRO paper, fp32 Adam: 4 B weights + 4 B grads + 8 B moments per parameter."""
    return psi * {0: 16, 1: 4 + 4 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}[stage]


def run_memory(a) -> list:
    rows = []
    for stage in a.mem_stages:
        ranks = [r for per in launch(a, "memory", a.mem_world, [stage]) for r in per]
        for r in ranks:
            r["model_states"] = r["params"] + r["master_fp32"] + r["adam_moments"] + r["grads"]
            r["formula"] = formula_bytes(stage, a.mem_world, r["n_params"])
            m = {k: v / 2 ** 20 for k, v in r.items() if isinstance(v, (int, float))}
            print(f"  ZeRO-{stage} rank {r['rank']}: params {m['params']:.0f} + master "
                  f"{m['master_fp32']:.0f} + Adam {m['adam_moments']:.0f} + grads {m['grads']:.0f}"
                  f" = {m['model_states']:.0f} MB (formula {m['formula']:.0f}); buckets "
                  f"{m['ipg_buckets_allocated']:.0f} MB allocated; peak RSS "
                  f"+{m['peak_rss_growth']:.0f} MB, end +{m['end_rss_growth']:.0f}", flush=True)
        rows += ranks
    return rows


def run_speed(a) -> dict:
    runs = {1: [], 2: []}
    for rnd in range(a.rounds):
        for world in (1, 2):
            ranks = launch(a, "speed", world, a.stages)
            runs[world].append({r["stage"]: {**r, "cpu_s_ranks": [x[i]["cpu_s"] for x in ranks]}
                                for i, r in enumerate(ranks[0])})
            print(f"  round {rnd + 1}, {world} rank(s): " + "  ".join(
                f"ZeRO-{s} {r['tokens_per_s']:.0f} tok/s" for s, r in runs[world][-1].items()),
                flush=True)
    out = {"runs": runs, "ratio": {}}
    pairs = list(zip(runs[1], runs[2], strict=True))
    for s in a.stages:
        total = [r2[s]["tokens_per_s"] / r1[s]["tokens_per_s"] for r1, r2 in pairs]
        median_step = [r2[s]["tokens_per_s_median_step"] / r1[s]["tokens_per_s_median_step"]
                       for r1, r2 in pairs]
        # If each rank had a core of its own: 2 x (CPU-s per step of 1 rank) / (of the
        # busiest of 2 ranks). Communication and ZeRO bookkeeping show; stolen time does not.
        cpu = [2 * r1[s]["cpu_s"] / max(r2[s]["cpu_s_ranks"]) for r1, r2 in pairs]
        out["ratio"][s] = {k: {"median": statistics.median(v), "per_round": v} for k, v in
                           (("wall_total", total), ("wall_median_step", median_step),
                            ("cpu_time", cpu))}
        m = statistics.median(median_step)
        print(f"GOAL ZeRO-{s}: tokens/s 2 ranks / 1 rank = {m:.2f}x by median step "
              f"(rounds {', '.join(f'{x:.2f}' for x in median_step)}), "
              f"{statistics.median(total):.2f}x by total wall, {statistics.median(cpu):.2f}x "
              f"by CPU time; >= 1.7x: {'met' if m >= 1.7 else 'NOT met'}", flush=True)
    return out


def run_ckpt(a) -> list:
    rows = launch(a, "ckpt", a.ckpt_world, a.ckpt_stages)[0]
    for r in rows:
        print(f"GOAL ZeRO-{r['stage']}, {r['world']} rank(s), window k={r['depth']}: "
              f"checkpointing overhead {r['overhead_cpu']:.2f}x CPU time, "
              f"{r['overhead_wall']:.2f}x wall (<= 1.4x: "
              f"{'met' if r['overhead_cpu'] <= 1.4 else 'NOT met'})", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default, help_ in (
            ("parts", "memory,speed,ckpt", ""), ("n-layer", 4, "speed / ckpt model"),
            ("d-model", 256, "d_inner = 4 d_model throughout"), ("n-head", 4, ""),
            ("seg-len", 128, "also XL mem_len"), ("num-mem-tokens", 16, "RMT (ckpt)"),
            ("batch", 8, "rows per rank (speed, ckpt)"), ("vocab", 256, ""),
            ("threads", 1, "torch threads per rank"), ("stages", "0,1,2,3", "speed part"),
            ("steps", 10, "timed steps (speed)"), ("warmup", 2, ""),
            ("rounds", 3, "speed: 1-rank/2-rank launch pairs"), ("ckpt-depth", 4, ""),
            ("ckpt-rounds", 4, ""), ("ckpt-world", 1, ""), ("ckpt-stages", "0,1,2", ""),
            ("mem-world", 2, ""), ("mem-stages", "0,1,2,3", ""), ("mem-layers", 6, ""),
            ("mem-d-model", 512, ""), ("mem-batch", 2, "rows per rank (memory)"),
            ("bucket", 0, "ZeRO reduce/allgather/prefetch bucket size in elements (0: "
                          "DeepSpeed's defaults, 5e8 for reduce)")):
        p.add_argument(f"--{flag}", type=type(default), default=default, help=help_ or None)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one stage (smoke)")
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--worker", choices=("memory", "speed", "ckpt"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick and not a.worker:
        a.n_layer, a.d_model, a.seg_len, a.batch, a.steps, a.warmup = 2, 64, 32, 2, 3, 1
        a.mem_layers, a.mem_d_model, a.rounds, a.ckpt_depth, a.ckpt_rounds = 2, 128, 1, 2, 1
        a.stages = a.mem_stages = a.ckpt_stages = "2"
    for k in ("stages", "mem_stages", "ckpt_stages"):
        setattr(a, k, [int(x) for x in str(getattr(a, k)).split(",")])
    if a.worker:
        worker(a)
        return 0
    t0 = time.time()
    results = {"args": {k: v for k, v in vars(a).items() if k != "worker"}}
    parts = a.parts.split(",")
    print(f"torch {torch.__version__}; {a.threads} thread(s) per rank; memory: XL "
          f"{a.mem_layers} x {a.mem_d_model}, {a.mem_batch} rows/rank; speed: XL {a.n_layer} x "
          f"{a.d_model}, {a.batch} rows/rank, segment = memory = {a.seg_len}", flush=True)
    for part, fn in (("memory", run_memory), ("speed", run_speed), ("ckpt", run_ckpt)):
        if part in parts:
            results[part] = fn(a)
    return finish(a.json, results, t0)


if __name__ == "__main__":
    sys.exit(main())
