"""The `memtrain` command: a thin dispatcher over train/, evaluation/, compare/, data_pipeline/
and cluster/.

Each subcommand lives in the package that owns it and is imported only when chosen, so
`memtrain smoke` never pays for DeepSpeed or MLflow imports. The subcommands import from here
only the command-line conventions they share (`CommandParser`, `error_line`), which import
nothing heavy.

A failing command prints one line on stderr, `memtrain <command>: <problem>`, and exits
non-zero (2 for a usage or configuration error): never a usage block, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys


class CommandParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line naming the problem, exit code 2 (argparse's
    own print the whole usage block first, and the problem on a second line)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


# Errors that mean the command's inputs are wrong (exit 2); any other OSError is a failure
# while working, e.g. a download or a full disk (exit 1).
INPUT_ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError,
                NotADirectoryError, FileExistsError)


def error_line(prog: str, err: BaseException) -> int:
    """Print `prog: <err>` as one line on stderr; the exit code for it (2 or 1)."""
    text = str(err)
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        text = f"{err.filename}: {err.strerror}"  # not "[Errno 13] Permission denied: '/x'"
    print(f"{prog}: {' '.join(text.split()) or type(err).__name__}", file=sys.stderr)
    return 2 if isinstance(err, INPUT_ERRORS) else 1

# name -> (module, function `f(argv) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("train.cli", "main_train", "train a model (DeepSpeed; resumes a run directory)"),
    "eval": ("evaluation.cli", "main_eval",
             "score a run's checkpoint under an evaluation protocol"),
    "recl": ("evaluation.recl_cli", "main_recl",
             "relative effective context length of a group of runs (XL App. C)"),
    "analyze": ("evaluation.analyze_cli", "main_analyze",
                "plot how a checkpoint uses its memory (attention vs distance, LaMemo alpha, "
                "RMT maps) into the run's MLflow run"),
    "generate": ("evaluation.generate_cli", "main_generate",
                 "sample text from a checkpoint, memory carried across segments"),
    "compare": ("compare.cli", "main_compare",
                "compare MLflow runs in one self-contained HTML report (+ markdown)"),
    "export": ("train.cli", "main_export", "write a run's weights as one fp32 safetensors file"),
    "plan": ("planner.plan", "main_plan",
             "per-GPU memory before submitting: ZeRO model states, one BPTT window, the "
             "largest bptt.depth and mem_len that fit"),
    "submit": ("cluster.submit", "main_submit", "render a run's sbatch script and submit it"),
    "jobs": ("cluster.jobs", "main_jobs", "the project's SLURM jobs: state, nodes, step, run"),
    "smoke": ("train.smoke", "main", "train tiny XL / LaMemo / RMT briefly; memory vs baseline"),
    "prepare": ("data_pipeline.prepare", "main_prepare",
                "tokenize a corpus into ordered webdataset shards + manifest"),
    "tasks": ("data_pipeline.prepare", "main_tasks",
              "generate an RMT algorithmic task (copy, reverse, ...) as shards"),
}


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = ["usage: memtrain <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in SUBCOMMANDS.items()]
    lines += ["", "`memtrain <command> --help` describes a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"memtrain: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func, _ = SUBCOMMANDS[name]
    return int(getattr(importlib.import_module(module_name), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
