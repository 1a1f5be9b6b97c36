"""The run's state at the start of a SLURM job, set by the sbatch script before the ranks.

The script's end requeues a job only when the run's status.json says "interrupted" (the
ranks checkpointed on a warning or a preemption). That file is the previous job's until a
rank writes its own: a requeued job whose ranks die before they write anything (a config
that no longer loads, a bad data path, an import error, a python that does not start) would
leave the previous "interrupted" and be requeued again, up to --max-requeues times, each
time failing the same way. So the script first turns an "interrupted" into "running" at the
same step:

    python -m cluster.job_state start <run_dir>

and ranks that end without writing a state leave "running", which the end reads as a crash
and does not requeue (docs/cluster.md, "The rendered script, line by line"). The ranks write
"running" themselves too, first thing in train/trainer.py, for runs started without this
script. Stdlib only (train/run_dir.py), like the status command the script's end runs.
"""

from __future__ import annotations

import sys

from train.run_dir import INTERRUPTED, RUNNING, RunDir


def start(run_dir: str) -> str | None:
    """Mark a run about to be started by a job: "interrupted" becomes "running" at the same
    step. Returns the state it found (None: no status yet, a fresh run)."""
    run = RunDir(run_dir)
    status = run.read_status()
    state = status.get("state")
    if state == INTERRUPTED:
        run.write_status(RUNNING, int(status.get("step", 0)))
    return state


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "start":
        print("usage: python -m cluster.job_state start <run_dir>", file=sys.stderr)
        return 2
    start(args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
