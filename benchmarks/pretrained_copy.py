"""The longer version of tests/test_pretrained_learning.py (docs/pretrained-learning.md):
tiny random GPT-2 and Llama checkpoints with and without RMT memory tokens on the copy task
across 3 segments, over several seeds, every row one `memtrain train` run of the example
configs (configs/copy-gpt2-hf-cpu.yaml, copy-llama-hf-cpu.yaml).

    .venv/bin/python benchmarks/pretrained_copy.py                       # 3 seeds, both archs
    .venv/bin/python benchmarks/pretrained_copy.py --arch gpt2 --seeds 0 1 2 3 4
    .venv/bin/python benchmarks/pretrained_copy.py --src-len 6 --steps 400   # m = src_len

A seed changes everything random at once: the checkpoint's weights (model.pretrained.tiny
seed), the task samples (`memtrain tasks --seed`), the initial memory and the sample order
(run seed, data.seed). Each row reports the test accuracy of periodic evaluations (eval.every
with data.valid_split=test, so the curve and the final number score the same samples), the
final report's accuracy, the trained model scored with its memory reset before every segment
(eval.no_memory_baseline), and wall time. The no-memory rows are the same config with
model.rmt.num_mem_tokens=0. Results: benchmarks/results/pretrained_copy.json and a markdown
table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.pretrained.tiny import tiny_gpt2, tiny_llama  # noqa: E402

MEMTRAIN = str(ROOT / ".venv" / "bin" / "memtrain")
CONFIG = {"gpt2": "copy-gpt2-hf-cpu", "llama": "copy-llama-hf-cpu"}


def checkpoint(arch: str, seed: int, tied: bool, work: Path) -> Path:
    if arch == "gpt2":
        return tiny_gpt2(work / f"ckpt/gpt2-{'tied' if tied else 'untied'}-s{seed}", tied=tied,
                         seed=seed)
    return tiny_llama(work / f"ckpt/llama-s{seed}", seed=seed)


def task_data(src_len: int, seed: int, work: Path) -> Path:
    out = work / f"data/copy{src_len}-s3-seed{seed}"
    if not (out / "manifest.json").exists():
        subprocess.run([MEMTRAIN, "tasks", "copy", "--src-len", str(src_len), "--n-segments",
                        "3", "--train-size", "4000", "--valid-size", "64", "--test-size", "512",
                        "--seed", str(seed), "--out", str(out)], check=True,
                       capture_output=True)
    return out


def run(row: dict, work: Path) -> dict:
    run_dir = work / "runs" / row["name"]
    overrides = [f"name={row['name']}", f"run_dir={run_dir}", f"model.hf.path={row['ckpt']}",
                 f"data.path={row['data']}", f"max_steps={row['steps']}", f"seed={row['seed']}",
                 f"data.seed={row['seed']}", f"model.tgt_len={row['src_len']}",
                 f"model.rmt.num_mem_tokens={row['m']}", f"optim.lr={row['lr']}",
                 f"eval.every={row['every']}", "data.valid_split=test", "tracking.enabled=false",
                 f"model.rmt.pattern={row['pattern']}", "--no-resume"]
    if row["m"] == 0:
        overrides.append("eval.no_memory_baseline=false")
    cmd = [MEMTRAIN, "train", "--config", CONFIG[row["arch"]], *overrides]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    row["wall_s"] = round(time.perf_counter() - start, 1)
    row["command"] = " ".join(cmd)
    if done.returncode:
        row["error"] = done.stderr.strip().splitlines()[-1:]
        return row
    curve = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "valid_accuracy" in rec:
            curve[rec["step"]] = round(rec["valid_accuracy"], 3)
    report = json.loads((run_dir / "eval_report.json").read_text())
    row["curve"] = curve
    row["final"] = round(report["main"]["accuracy"], 3)
    row["memory_reset"] = (round(report["no_memory"]["accuracy"], 3)
                           if "no_memory" in report else None)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", nargs="+", default=["gpt2", "llama"], choices=sorted(CONFIG))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--src-len", type=int, default=3, help="also the segment length and m")
    p.add_argument("--steps", type=int, default=0, help="default: the example config's")
    p.add_argument("--no-memory-steps", type=int, default=100, help="0: no such rows")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--tied", action="store_true", help="GPT-2 with its tied default head")
    p.add_argument("--pattern", nargs="+", default=["paper"], choices=["paper", "causal"],
                   help="model.rmt.pattern of the memory runs (each one a row)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "pretrained_copy")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/pretrained_copy.json")
    args = p.parse_args(argv)
    default_steps = {"gpt2": 400, "llama": 200}   # the example configs' max_steps
    rows = []
    for arch in args.arch:
        for seed in args.seeds:
            ckpt = checkpoint(arch, seed, args.tied, args.work)
            data = task_data(args.src_len, seed, args.work)
            arms = [(args.src_len, args.steps or default_steps[arch], p) for p in args.pattern]
            if args.no_memory_steps:
                arms.append((0, args.no_memory_steps, "paper"))
            for m, steps, pattern in arms:
                tied = args.tied and arch == "gpt2"
                name = (f"{arch}{'-tied' * tied}-src{args.src_len}-m{m}-s{seed}"
                        + ("-causal" if pattern == "causal" else ""))
                rows.append(dict(name=name, arch=arch, tied=tied, seed=seed, pattern=pattern,
                                 src_len=args.src_len, m=m, steps=steps,
                                 lr=args.lr, every=args.every, ckpt=str(ckpt), data=str(data)))
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda r: run(r, args.work), rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print("| run | steps | test accuracy by step | final | memory reset | wall s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | {r['steps']} | failed: {r['error']} | | | |")
            continue
        curve = ", ".join(f"{s}: {a}" for s, a in r["curve"].items())
        print(f"| {r['name']} | {r['steps']} | {curve} | {r['final']} | "
              f"{r['memory_reset'] if r['memory_reset'] is not None else '-'} | {r['wall_s']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
