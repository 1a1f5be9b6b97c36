"""Helpers shared by the benchmark scripts (run as `python benchmarks/<script>.py`)."""

from __future__ import annotations

import json
import os


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


def write_json(path: str | None, results: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


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
