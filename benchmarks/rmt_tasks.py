"""The RMT memory-task table (docs/rmt.md): every row is one `memtrain train` run through the
full engine (DeepSpeed, BPTT windows, checkpoints, MLflow experiment `rmt-tasks`).

    .venv/bin/python benchmarks/rmt_tasks.py                 # the whole table, 2 runs at once
    .venv/bin/python benchmarks/rmt_tasks.py --only copy-s3-rmt,copy-s3-baseline

Each row prints the command it ran; the task data is generated first if missing
(`memtrain tasks ...`, 20k train / 500 valid / 2k test samples). Results (test accuracy
on the answer positions, teacher-forced; steps; wall time) go to
benchmarks/results/rmt_tasks.json and are printed as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEMTRAIN = str(ROOT / ".venv" / "bin" / "memtrain")
SIZES = ["--train-size", "20000", "--valid-size", "500", "--test-size", "2000"]

# task data: name -> `memtrain tasks` arguments (T = positions per sample)
DATA = {
    **{f"copy8-s{n}": ["copy", "--src-len", "8", "--n-segments", str(n)] for n in (2, 3, 4, 6)},
    **{f"reverse12-s{n}": ["reverse", "--src-len", "12", "--n-segments", str(n)]
       for n in (2, 3, 4)},
    "ar5-s3": ["associative_retrieval", "--param", "n_pairs=5", "--n-segments", "3"],
    "ar2-s3": ["associative_retrieval", "--param", "n_pairs=2", "--n-segments", "3"],
    "copy24-s6": ["copy", "--src-len", "24", "--n-segments", "6"],
}
SEG_LEN = {"copy8-s2": 12, "copy8-s3": 8, "copy8-s4": 6, "copy8-s6": 4, "reverse12-s2": 12,
           "reverse12-s3": 8, "reverse12-s4": 6, "ar5-s3": 4, "ar2-s3": 2, "copy24-s6": 12}
# AR runs need more samples than they see in 16k steps of 32 (100k: none is repeated often).
TRAIN_SIZE = {"ar2-s3": "100000", "ar5-s3": "100000"}


def rmt(data: str, **extra) -> list[str]:
    """Overrides for an RMT with m = segment length (as in the paper) on `data`."""
    seg = SEG_LEN[data]
    return [f"data.path=data/{data}", f"model.tgt_len={seg}",
            f"model.rmt.num_mem_tokens={seg}", *[f"{k}={v}" for k, v in extra.items()]]


def xl(data: str, mem_len: int) -> list[str]:
    """The same backbone as Transformer-XL with a cache of mem_len (0: no memory at all)."""
    return [f"data.path=data/{data}", f"model.tgt_len={SEG_LEN[data]}", "model.mechanism=xl",
            f"model.mem_len={mem_len}", "bptt.depth=0"]


# name -> (config, data, overrides, what the row shows), in the order they run
ROWS: dict[str, tuple[str, str, list[str], str]] = {}
_CFG = {"copy": "copy-rmt-cpu", "reverse": "reverse-rmt-cpu", "ar": "ar-rmt-cpu"}
_DATA = {"copy": "copy8-s{}", "reverse": "reverse12-s{}", "ar": "ar2-s{}"}


def _rows(task: str, n: int, kinds: tuple[str, ...]) -> None:
    data = _DATA[task].format(n)
    for kind in kinds:
        if kind == "rmt" and task == "ar":  # the config's m = 4 and curriculum 1 -> 3
            ROWS[f"{task}-s{n}-rmt"] = (_CFG[task], data, [f"data.path=data/{data}"],
                                        "RMT, full BPTT, curriculum 1 -> 3 segments")
            ROWS[f"{task}-s{n}-plain"] = (_CFG[task], data, [f"data.path=data/{data}",
                                          "curriculum.segments=[]"],
                                          "RMT, full BPTT, 3 segments from the start")
        elif kind == "rmt":
            ROWS[f"{task}-s{n}-rmt"] = (_CFG[task], data, rmt(data), "RMT, full BPTT")
        elif kind == "baseline":
            ROWS[f"{task}-s{n}-baseline"] = (_CFG[task], data, xl(data, 0),
                                             "no memory (XL, mem_len 0)")
        else:
            ROWS[f"{task}-s{n}-xl"] = (_CFG[task], data, xl(data, SEG_LEN[data]),
                                       f"Transformer-XL, cache {SEG_LEN[data]} (= segment)")


for _n in (2, 3, 4):
    _rows("copy", _n, ("rmt",))
    _rows("reverse", _n, ("rmt",))
_rows("ar", 3, ("rmt",))
_rows("copy", 4, ("baseline", "xl"))
_rows("reverse", 4, ("baseline", "xl"))
_rows("ar", 3, ("baseline",))
# BPTT depth k = 0, 1 on copy in 3 segments (k = 2 is copy-s3-rmt above).
for k in (0, 1):
    ROWS[f"copy-s3-bptt{k}"] = ("copy-rmt-cpu", "copy8-s3", rmt("copy8-s3", **{"bptt.depth": k}),
                                f"RMT, BPTT depth {k}")
# Segment curriculum (RMT follow-up, Bulatov et al. 2023): the same steps on copy in 6
# segments of 4 (m = 4), straight vs growing 1 -> 2 -> 3 -> 6 segments on valid accuracy.
_LONG = rmt("copy8-s6", max_steps=1000, **{"eval.every": 50})
ROWS["copy-s6-plain"] = ("copy-rmt-cpu", "copy8-s6", _LONG,
                         "RMT, full BPTT, 6 segments from the start")
ROWS["copy-s6-curriculum"] = ("copy-rmt-cpu", "copy8-s6", _LONG + [
    "curriculum.segments=[1,2,3,6]", "curriculum.advance=accuracy",
    "curriculum.threshold=0.95"], "RMT, full BPTT, curriculum 1-2-3-6 segments")
ROWS["copy-s6-curriculum-steps"] = ("copy-rmt-cpu", "copy8-s6", _LONG + [
    "curriculum.segments=[1,2,3,6]", "curriculum.advance=steps", "curriculum.every=200"],
    "RMT, full BPTT, curriculum 1-2-3-6 segments, a stage every 200 steps")
_rows("ar", 3, ("xl",))


def _run_seconds(run_dir: Path) -> float:
    """Wall time of a finished run from its metrics (first to last logged time)."""
    times = [json.loads(line)["time"] for line in
             (run_dir / "metrics.jsonl").read_text().splitlines()]
    return times[-1] - times[0]


def run_row(name: str, max_steps: int | None, reuse: bool = False) -> dict:
    config, data, overrides, what = ROWS[name]
    cmd = [MEMTRAIN, "train", "--config", config, *overrides, f"name=rmt-{name}",
           "tracking.experiment=rmt-tasks", "--no-resume"]
    if max_steps:
        cmd.append(f"max_steps={max_steps}")
    shown = " ".join(["memtrain", *cmd[1:]])
    print(f"[{name}] {shown}", flush=True)
    run_dir = ROOT / "runs" / f"rmt-{name}"
    if reuse and (run_dir / "eval_report.json").exists():
        returncode, seconds = 0, _run_seconds(run_dir)
    else:
        if run_dir.exists():
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        seconds, returncode = time.perf_counter() - start, proc.returncode
        (ROOT / "runs").mkdir(exist_ok=True)
        (ROOT / "runs" / f"rmt-{name}.log").write_text(proc.stdout + proc.stderr)
    row = {"name": name, "what": what, "data": data, "command": shown,
           "exit": returncode, "seconds": round(seconds)}
    if returncode == 0:
        report = json.loads((run_dir / "eval_report.json").read_text())
        row.update(accuracy=report["main"]["accuracy"], loss=report["main"]["loss"],
                   steps=report["step"])
        if "no_memory" in report:  # the same trained model, memory reset every segment
            row["no_memory_accuracy"] = report["no_memory"]["accuracy"]
        row["valid_accuracy"] = [json.loads(line).get("valid_accuracy") for line in
                                 (run_dir / "metrics.jsonl").read_text().splitlines()
                                 if "valid_accuracy" in line]
    print(f"[{name}] exit {returncode}, accuracy {row.get('accuracy')}, "
          f"{seconds:.0f} s", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help="comma-separated row names (default: all): "
                   + ", ".join(ROWS))
    p.add_argument("--parallel", type=int, default=2, help="runs at once (1 thread each)")
    p.add_argument("--max-steps", type=int, help="override every config's max_steps")
    p.add_argument("--reuse", action="store_true",
                   help="report a row from its finished run directory instead of re-running")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "rmt_tasks.json"))
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        p.error(f"unknown row(s) {', '.join(unknown)}; known: {', '.join(ROWS)}")
    for data in sorted({ROWS[n][1] for n in names}):  # before the parallel runs share it
        if not (ROOT / "data" / data / "manifest.json").exists():
            sizes = [*SIZES[:1], TRAIN_SIZE.get(data, SIZES[1]), *SIZES[2:]]
            subprocess.run([MEMTRAIN, "tasks", *DATA[data], *sizes, "--out", f"data/{data}"],
                           cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(lambda n: run_row(n, args.max_steps, args.reuse), names))
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {}
    old.update({r["name"]: r for r in rows})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(old, indent=1))
    print("| run | model | test accuracy | same model, memory off | steps | wall s |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        acc = f"{r['accuracy']:.3f}" if "accuracy" in r else f"exit {r['exit']}"
        off = f"{r['no_memory_accuracy']:.3f}" if "no_memory_accuracy" in r else "-"
        print(f"| {r['name']} | {r['what']} | {acc} | {off} | {r.get('steps', '-')} | "
              f"{r['seconds']} |")
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
