"""Helpers shared by the benchmark scripts (run as `python benchmarks/<script>.py`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB: VmRSS (now) or VmHWM (peak since reset).
    Not ru_maxrss: Linux carries that high-water mark across fork + exec."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def add_model_size_args(parser) -> None:
    """The model size options every benchmark takes; defaults: the "small" model (4 layers,
    d_model 256, 4 heads, d_inner 1024, 256 symbols) that BENCHMARKS.md reports on."""
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--d-inner", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=256)


def step_clock(device) -> Callable[[], float]:
    """The clock a benchmark step is timed with. CPU: process CPU time (on a shared VM the
    time the hypervisor steals is not charged to us; never wall time). CUDA: wall time
    read after the device has finished what was queued (the host only queues kernels, so
    its own CPU time says nothing of the step)."""
    import time

    import torch

    if torch.device(device).type != "cuda":
        return time.process_time

    def cuda_wall() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return cuda_wall


def add_device_args(parser) -> None:
    """--device / --dtype of the benchmarks that can run on a GPU (the model is cast to the
    dtype as DeepSpeed casts it for bf16 / fp16 training)."""
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")


def model_dtype(args):
    """The torch dtype of --dtype."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]


def write_json(path: str | None, results: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def finish(path: str | None, results: dict, started: float) -> int:
    """End of a benchmark run: record and print its wall time, write the JSON; exit code 0."""
    import time

    results["wall_s"] = time.time() - started
    print(f"done in {results['wall_s']:.0f} s")
    write_json(path, results)
    return 0


def timed_step(model, seg, state):
    """One segment's forward + backward with the memory carried: (CPU seconds, new state).
    CPU time of this process (all threads), not wall time: on a shared VM, time the
    hypervisor steals from us is not charged to the process, so this is far steadier."""
    import time

    start = time.process_time()
    out = model(seg[:, :-1], state, targets=seg[:, 1:])
    out.loss.backward()
    elapsed = time.process_time() - start
    model.zero_grad(set_to_none=True)
    return elapsed, out.state.detach()


def interleaved(steps: dict[str, Callable[[], float]], rounds: int,
                on_round: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """One measurement per variant per round, the variants run in an order rotated every
    round, so that a slow spell of the shared machine falls on each in turn: compare them by
    per-round ratios. steps: name -> a callable returning one measurement (e.g. CPU s)."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rnd in range(rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            times[name].append(steps[name]())
        if on_round is not None:
            on_round(rnd)
    return times


def run_child(script: str, a, spec: dict, flags: tuple[str, ...]) -> dict:
    """Run `script --_child SPEC` in a fresh process (a clean peak-RSS measurement) with
    the size flags `flags` of `a`; its last stdout line is the JSON result. glibc's mmap
    threshold is pinned so that freed activations go back to the OS as they do at scale."""
    import json
    import os
    import subprocess
    import sys
    cmd = [sys.executable, os.path.abspath(script), "--_child", json.dumps(spec),
           *[f"--{k.replace('_', '-')}={getattr(a, k)}" for k in flags]]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(a.threads)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode:
        raise RuntimeError(f"child {spec} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])
