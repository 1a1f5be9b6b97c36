"""The command-line conventions every subcommand shares (memtrain/command_line.py): a failing
command prints one line on stderr, `memtrain <command>: <problem>`, and exits 2 for wrong
inputs (a bad option, an invalid config) or 1 for a failure while working.

The subcommands import these conventions from memtrain/command_line.py, a stdlib-only leaf,
never from the dispatcher memtrain/cli.py, which names every subcommand's module.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from memtrain.command_line import CommandParser, error_line, invalid_config
from model import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
def test_an_invalid_config_is_one_line_naming_the_field_and_exit_2(capsys):
    err = ConfigError("bptt.mode", "unknown 'zigzag';\n  choose window or sliding")
    assert invalid_config("memtrain train", err) == 2
    assert capsys.readouterr().err == (
        "memtrain train: invalid config: bptt.mode: unknown 'zigzag'; choose window or "
        "sliding\n")


def test_an_input_error_exits_2_and_a_failure_while_working_1(capsys):
    assert error_line("memtrain prepare", ValueError("--corpus: unknown 'x'")) == 2
    assert error_line("memtrain prepare", ConnectionResetError("peer reset")) == 1
    assert capsys.readouterr().err.splitlines() == [
        "memtrain prepare: --corpus: unknown 'x'", "memtrain prepare: peer reset"]


def test_an_os_error_names_the_file_not_the_errno(capsys):
    assert error_line("memtrain train", PermissionError(13, "Permission denied", "/x")) == 2
    assert capsys.readouterr().err == "memtrain train: /x: Permission denied\n"


def test_a_command_may_choose_its_exit_code(capsys):
    assert error_line("memtrain train", RuntimeError("loss is nan\nat step 3"), code=3) == 3
    assert capsys.readouterr().err == "memtrain train: loss is nan at step 3\n"


def test_a_usage_error_is_one_line_and_exit_2(capsys):
    p = CommandParser(prog="memtrain export")
    p.add_argument("--run-dir", required=True)
    with pytest.raises(SystemExit) as done:
        p.parse_args([])
    assert done.value.code == 2
    assert capsys.readouterr().err == ("memtrain export: the following arguments are required: "
                                       "--run-dir (see memtrain export --help)\n")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
    return out


def test_the_conventions_import_only_the_standard_library():
    found = _imports(ROOT / "memtrain" / "command_line.py")
    assert {name.split(".")[0] for name in found} <= set(sys.stdlib_module_names) | {
        "__future__"}


def test_no_subcommand_imports_the_dispatcher():
    offenders = sorted(
        str(p.relative_to(ROOT)) for pkg in PACKAGES if pkg != "memtrain"
        for p in (ROOT / pkg).rglob("*.py")
        if any(name.startswith("memtrain.cli") for name in _imports(p)))
    assert offenders == []
