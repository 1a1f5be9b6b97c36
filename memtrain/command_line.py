"""The command-line conventions every `memtrain` subcommand shares: one-line usage errors,
one-line failures, exit code 2 for wrong inputs (a bad option, an invalid config).

Why here, and why the subcommands may import it: this module is a leaf that imports only the
standard library, so any package can use it without taking on a dependency it should not have
(README, "Layout": data_pipeline/ never imports train/, compare/ never loads torch). It sits in
the `memtrain` package, beside the dispatcher, because these conventions are the `memtrain`
command's own, and because that package is installed with every other one (pyproject.toml
lists the packages; a new top-level module would not be importable from an installed
`memtrain`). What the packages below must not import is the dispatcher, memtrain/cli.py, which
names them all; this module names none of them (tests/test_command_line.py checks both).

A failing command prints one line on stderr, `memtrain <command>: <problem>`, and exits
non-zero: never a usage block, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["INPUT_ERRORS", "CommandParser", "error_line", "invalid_config"]


class CommandParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line naming the problem, exit code 2 (argparse's
    own print the whole usage block first, and the problem on a second line)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


# Errors that mean the command's inputs are wrong (exit 2); any other OSError is a failure
# while working, e.g. a download or a full disk (exit 1).
INPUT_ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError,
                NotADirectoryError, FileExistsError)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def error_line(prog: str, err: BaseException, code: int | None = None) -> int:
    """Print `prog: <err>` as one line on stderr; the exit code for it: `code` when given,
    else 2 for an input error (INPUT_ERRORS) and 1 for any other."""
    text = str(err)
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        text = f"{err.filename}: {err.strerror}"  # not "[Errno 13] Permission denied: '/x'"
    print(f"{prog}: {_one_line(text) or type(err).__name__}", file=sys.stderr)
    if code is not None:
        return code
    return 2 if isinstance(err, INPUT_ERRORS) else 1


def invalid_config(prog: str, err: BaseException) -> int:
    """A config that cannot be loaded (model.ConfigError, raised naming the field):
    `prog: invalid config: <field>: <problem>` as one line on stderr, before any compute;
    returns the exit code, 2."""
    print(f"{prog}: invalid config: {_one_line(str(err))}", file=sys.stderr)
    return 2
