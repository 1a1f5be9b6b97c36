"""`memtrain jobs`: the project's SLURM jobs with their state and where their runs are.

`memtrain submit` records every job in `<run_dir>/jobs.jsonl`; this command reads those
records under a runs folder, asks `squeue` about the jobs still known to SLURM (no slurmdbd
needed) and takes the rest from the run directory (`status.json`). For each job: state, node
count, elapsed time, the last logged step (`metrics.jsonl`) and the MLflow run id.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from train.run_dir import RUNNING, RunDir


def record_job(run_dir: Path, job_id: str, script: Path, nodes: int) -> None:
    with open(RunDir(run_dir).jobs, "a") as f:
        f.write(json.dumps({"job_id": job_id, "script": str(script), "nodes": nodes,
                            "submitted": time.time()}) + "\n")


def _squeue(job_ids: list[str]) -> dict[str, dict]:
    if not job_ids:
        return {}
    try:
        out = subprocess.run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i|%T|%D|%M"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = {}
    for line in out.splitlines():
        job, state, nodes, elapsed = line.split("|")
        rows[job] = {"state": state, "nodes": int(nodes), "elapsed": elapsed}
    return rows


def list_jobs(runs_root: Path) -> list[dict]:
    records = []
    for jobs_file in sorted(runs_root.glob(f"*/{RunDir.JOBS}")):
        for line in jobs_file.read_text().splitlines():
            records.append({**json.loads(line), "run_dir": jobs_file.parent})
    live = _squeue([r["job_id"] for r in records])
    rows = []
    for r in records:
        run_dir = r["run_dir"]
        run = RunDir(run_dir)
        now = live.get(r["job_id"])
        status = run.read_status().get("state", "unknown")
        if status == RUNNING:        # written at start; the job is over: the ranks died
            status = "crashed"
        rows.append({
            "job_id": r["job_id"], "run": run_dir.name,
            "state": now["state"] if now else f"ended ({status})",
            "nodes": now["nodes"] if now else r["nodes"],
            "elapsed": now["elapsed"] if now else "-",
            "last_step": run.last_step(),
            "mlflow_run_id": run.read_tracking().get("run_id", "-"),
            "run_dir": str(run_dir)})
    return rows


def main_jobs(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memtrain jobs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs-root", default="runs", help="folder holding the run directories")
    p.add_argument("--json", action="store_true", help="one JSON object per job")
    args = p.parse_args(argv)
    rows = list_jobs(Path(args.runs_root))
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    if not rows:
        print(f"no memtrain jobs recorded under {args.runs_root}", file=sys.stderr)
        return 0
    cols = ("job_id", "run", "state", "nodes", "elapsed", "last_step", "mlflow_run_id")
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.upper().ljust(width[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(width[c]) for c in cols))
    return 0
