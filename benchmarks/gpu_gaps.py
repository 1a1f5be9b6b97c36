"""The known gaps re-measured at a realistic shape: the gaps part of benchmarks/gpu_scale.py.

Each gap is an existing benchmark run as a child process with --json (no second copy of
its harness): LaMemo / XL (bench_lamemo_cost.py at the WikiText-103 shape), model.compile
(bench_compile.py at GPT-2-124M's width, segments of 512), selective recompute
(bench_recompute.py at the same shape, keep_last_segments 1, step times only: its peaks
take a fresh process per variant and depth, a minute of start-ups on a GPU; the mfu part
measures the checkpointed peaks). Each child gets the time left
of the part's share; its JSON is read back into the part's. In --quick every child runs at
tiny sizes on the CPU, side by side, with TorchDynamo disabled (Inductor's C++ build would
take minutes there): what it checks is that every command line and file is right.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


# --quick: flags appended to each GPU command line (argparse keeps the last value), so that
# the CPU rehearsal parses the GPU's flags too and only the sizes change.
QUICK = {
    "lamemo_vs_xl": ["--shape=small", "--batch=1", "--rounds=1", "--warmup=0"],
    "recompute": ["--rounds=1", "--n-layer=1", "--d-model=32", "--n-head=2", "--d-inner=64",
                  "--seg-len=8", "--batch=1", "--num-mem-tokens=2", "--policies=full",
                  "--recompute-time-depths=1", "--recompute-memory-depths="],
    "compile": ["--quick", "--n-head=2", "--mechanisms=xl", "--steps=1"],
}


def gap_commands(o, out: Path) -> dict:
    """The child benchmarks of the gaps part: name -> argv (the existing harnesses)."""
    py, dev = sys.executable, [f"--device={o.device}", f"--dtype={o.dtype}"]
    gpt2 = ["--n-layer=12", "--d-model=768", "--n-head=12", "--d-inner=3072"]
    cmds = {
        "lamemo_vs_xl": [py, str(HERE / "bench_lamemo_cost.py"), "--shape=wt103",
                         "--batch=8", "--rounds=5", *dev],
        "recompute": [py, str(HERE / "bench_recompute.py"), *gpt2, "--seg-len=512",
                      "--batch=8", "--num-mem-tokens=16", "--rounds=3",
                      "--policies=full,save-ffn-out:2,save-ffn-out,save-linear",
                      "--keep-last=1", "--recompute-time-depths=8",
                      "--recompute-memory-depths=", *dev],
        "compile": [py, str(HERE / "bench_compile.py"), "--parts=model", *gpt2,
                    "--seg-len=512", "--mem-len=512", "--batch=8", "--rounds=3",
                    "--mechanisms=rmt,xl", *dev],
    }
    if o.quick:
        cmds = {name: [*cmd, *QUICK[name], f"--threads={o.threads}"]
                for name, cmd in cmds.items()}
    return cmds


def run_gap(name: str, cmd: list[str], out: Path, env: dict, deadline: float) -> dict:
    """One child benchmark under the time left, its JSON read back into the result."""
    left = deadline - time.time()
    if left < 5:
        return {"skipped": "time budget spent", "command": cmd}
    path = out / f"gaps_{name}.json"
    started = time.time()
    try:
        p = subprocess.run([*cmd, f"--json={path}"], capture_output=True, text=True,
                           timeout=left, env=env, cwd=HERE.parent)
        r = {"returncode": p.returncode, "tail": (p.stdout + p.stderr)[-3000:]}
    except subprocess.TimeoutExpired as e:
        r = {"timeout_s": left, "tail": str(e.stdout or "")[-3000:]}
    r.update(command=cmd, wall_s=time.time() - started)
    if path.exists():   # read into the part's JSON (a device call returns at most 8 files)
        r["results"] = json.loads(path.read_text())
        path.unlink()
    print(f"  gaps {name}: {'ok' if r.get('returncode') == 0 else 'FAILED'} in "
          f"{r['wall_s']:.0f} s", flush=True)
    return r


def run_gaps(o, deadline: float, out: Path) -> dict:
    from concurrent.futures import ThreadPoolExecutor
    # The checkout first, then what the caller had (the staged wheels: scripts/gpu_session.sh).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        x for x in (str(HERE.parent), os.environ.get("PYTHONPATH")) if x)}
    if o.quick:   # Inductor's C++ build would take minutes here: dynamo off, eager
        env["TORCHDYNAMO_DISABLE"] = "1"
    cmds = gap_commands(o, out)
    # One at a time on a GPU (timings); side by side in the CPU rehearsal (nothing timed).
    with ThreadPoolExecutor(max_workers=len(cmds) if o.quick else 1) as pool:
        futures = {name: pool.submit(run_gap, name, cmd, out, env, deadline)
                   for name, cmd in cmds.items()}
        return {"children": {name: f.result() for name, f in futures.items()}}
