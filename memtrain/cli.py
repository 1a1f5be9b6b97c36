"""The `memtrain` command: a thin dispatcher over train/, evaluation/, compare/, data_pipeline/
and cluster/.

Each subcommand lives in the package that owns it and is imported only when chosen, so
`memtrain smoke` never pays for DeepSpeed or MLflow imports. The command-line conventions
the subcommands share (`CommandParser`, `error_line`, `invalid_config`) live in
memtrain/command_line.py, which they import instead of this dispatcher.

A failing command prints one line on stderr, `memtrain <command>: <problem>`, and exits
non-zero (2 for a usage or configuration error): never a usage block, never a traceback.
"""

from __future__ import annotations

import importlib
import sys

# Kept for one release: subcommands that still import these from the dispatcher.
from .command_line import INPUT_ERRORS, CommandParser, error_line  # noqa: F401

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
    "export": ("train.cli", "main_export", "write a run's weights: one fp32 safetensors file, "
               "a peft adapter, or the RMT authors' layout"),
    "import": ("train.cli", "main_import", "turn a checkpoint of the RMT authors' wrapper "
               "into a memtrain model directory"),
    "plan": ("planner.plan", "main_plan",
             "per-GPU memory before submitting: ZeRO model states, one BPTT window, the "
             "largest bptt.depth and mem_len that fit"),
    "submit": ("cluster.submit", "main_submit", "render a run's sbatch script and submit it"),
    "jobs": ("cluster.jobs", "main_jobs", "the project's SLURM jobs: state, nodes, step, run"),
    "smoke": ("train.smoke", "main", "train tiny XL / LaMemo / RMT briefly; memory vs baseline"),
    "prepare": ("data_pipeline.prepare", "main_prepare",
                "tokenize a corpus into ordered webdataset shards + manifest"),
    "tasks": ("data_pipeline.prepare", "main_tasks",
              "generate an RMT algorithmic task (copy, reverse, ...) or BABILong-style "
              "samples as shards"),
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
