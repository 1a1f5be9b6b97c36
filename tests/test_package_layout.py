"""The packages depend one way (README, "Layout"), read from the source with `ast`:

    model, data_pipeline  <-  train  <-  evaluation
                                     <-  cluster  (launches train; reads its run directory)
    model, data_pipeline, train's run config, ds-config rendering and data regime  <-  planner
        (`memtrain plan`; train/ never imports it)
    compare: reads MLflow; of train/ only the run directory's layout (train/run_dir.py)
    memtrain: the dispatcher; names subcommand modules as strings, imports none of them

and no module imports, at import time, a module that imports it back (directly or around a
longer loop). Every import counts for the direction rules, function-local ones included: a
local import hides a dependency, it does not remove it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("memtrain", "model", "data_pipeline", "train", "planner", "evaluation", "compare",
            "cluster")
# What planner/ reads beyond model/ and data_pipeline/: the run config, the ZeRO section of
# the DeepSpeed config, the data regime (the window a run trains on), and the command-line
# conventions every subcommand shares.
# train.recompute: the grammar of the run config's `bptt.recompute` policies (parse_policy).
PLANNER_READS = {"train.config", "train.engine", "train.regime", "train.recompute",
                 "memtrain.command_line"}
HEAVY = {"torch", "deepspeed"}  # what compare/ must not pull in (README: no training stack)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, at_import_time: bool):
    """Import nodes of a module: all of them, or only those run when it is imported (not in
    a function body, not under `if TYPE_CHECKING:`)."""
    if not at_import_time:
        yield from (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        return
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


class Source:
    """Every module of the project's packages, with what it imports."""

    def __init__(self, root: Path = ROOT):
        self.files = {_module_name(p, root): p for pkg in PACKAGES
                      for p in sorted((root / pkg).rglob("*.py"))}
        self.trees = {name: ast.parse(p.read_text(), str(p)) for name, p in self.files.items()}

    def targets(self, module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
        """Fully qualified names the import statement loads: x for `import x` and for
        `from x import name`, x.y for `from x import y` when y is a module."""
        if isinstance(node, ast.Import):
            return {a.name for a in node.names}
        base = node.module or ""
        if node.level:
            package = module if self.files[module].name == "__init__.py" else \
                module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}".strip(".")
        subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in self.files}
        # `from pkg import module` loads pkg as a package above the module (see
        # project_edges), `from pkg import name` reads pkg/__init__.py itself.
        return subs if len(subs) == len(node.names) else {base} | subs

    def imports(self, module: str, at_import_time: bool = False) -> set[str]:
        return set().union(*(self.targets(module, n) for n in
                             _imports(self.trees[module], at_import_time)))

    def project_edges(self, module: str, at_import_time: bool = True) -> set[str]:
        """Project modules loaded when `module` is imported: each import, and every package
        above it (importing a.b.c runs a/__init__.py and a/b/__init__.py first) except the
        importing module's own packages, which Python initialises before the module itself.
        An explicit import of its own package (`from model import X` in model/lm.py) stays."""
        parts = module.split(".")
        own = {".".join(parts[:i]) for i in range(1, len(parts))}
        out = set()
        for name in self.imports(module, at_import_time):
            parts = name.split(".")
            out |= {".".join(parts[:i]) for i in range(1, len(parts))} - own
            out.add(name)
        return out & self.files.keys() - {module}


def _top(name: str) -> str:
    return name.split(".")[0]


def forbidden_imports(src: Source, packages: tuple[str, ...], banned: set[str],
                      allowed: set[str] = frozenset()) -> list[str]:
    """`module -> import` for every import in `packages` of a package in `banned`."""
    return sorted(f"{m} -> {t}" for m in src.files if _top(m) in packages
                  for t in src.imports(m) if _top(t) in banned and t not in allowed)


def import_cycles(src: Source, at_import_time: bool = True) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing
    itself) in the graph of imports run at import time, or of all imports (Tarjan)."""
    graph = {m: src.project_edges(m, at_import_time) for m in src.files}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def import_closure(src: Source, modules: list[str]) -> set[str]:
    seen, todo = set(), list(modules)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(src.project_edges(m))
    return seen


# ------------------------------------------------------------------------------- tests
SRC = Source()


def test_every_package_is_seen():
    assert {_top(m) for m in SRC.files} == set(PACKAGES)
    assert "evaluation.cli" in SRC.files and "compare.cli" in SRC.files
    assert not [*(ROOT / "train").glob("evaluation/*.py"), *(ROOT / "train").glob("compare/*.py")]


def test_compare_reads_only_the_run_directory_layout_of_train():
    assert forbidden_imports(SRC, ("compare",), {"train", "evaluation", "cluster"},
                             allowed={"train.run_dir"}) == []


def test_compare_never_loads_torch():
    """compare/ starts without a training stack: nothing it loads at import time (train's
    run directory module included) imports torch or DeepSpeed."""
    closure = import_closure(SRC, [m for m in SRC.files if _top(m) == "compare"])
    heavy = sorted(f"{m} -> {t}" for m in closure
                   for t in SRC.imports(m, at_import_time=True) if _top(t) in HEAVY)
    assert heavy == []


def test_train_model_and_data_import_no_tool_built_on_them():
    assert forbidden_imports(SRC, ("train", "model", "data_pipeline"),
                             {"evaluation", "compare", "cluster"}) == []


def test_model_and_data_pipeline_do_not_import_train():
    assert forbidden_imports(SRC, ("model", "data_pipeline"), {"train"}) == []


def test_nothing_below_the_planner_imports_it():
    assert forbidden_imports(SRC, ("train", "model", "data_pipeline"), {"planner"}) == []


def test_the_planner_reads_model_data_and_the_run_config_only():
    banned = {"train", "evaluation", "compare", "cluster", "memtrain"}
    assert forbidden_imports(SRC, ("planner",), banned, allowed=PLANNER_READS) == []


def test_cluster_launches_train_only():
    assert forbidden_imports(SRC, ("cluster",), {"evaluation", "compare"}) == []


def test_the_dispatcher_imports_no_subcommand():
    assert forbidden_imports(SRC, ("memtrain",), set(PACKAGES) - {"memtrain"}) == []


def test_no_import_cycle():
    assert import_cycles(SRC) == []


def test_no_import_cycle_hidden_in_a_function():
    """Nor one that a function-local import would hide (as evaluation/cli.py <-> sweep.py
    did before both took log_to_run from train/run_access.py)."""
    assert import_cycles(SRC, at_import_time=False) == []


def test_the_checks_see_a_forbidden_import_and_a_cycle(tmp_path):
    """The same checks on a copy of the source with one bad import each."""
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            out = tmp_path / p.relative_to(ROOT)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(p.read_text())
    (tmp_path / "compare" / "cli.py").write_text(
        (ROOT / "compare" / "cli.py").read_text() + "\nfrom train.config import RunConfig\n")
    (tmp_path / "train" / "run_dir.py").write_text(
        (ROOT / "train" / "run_dir.py").read_text() + "\nfrom .config import RunConfig\n")
    (tmp_path / "train" / "config.py").write_text(
        (ROOT / "train" / "config.py").read_text() + "\nfrom .run_dir import RunDir\n")
    src = Source(tmp_path)
    assert "compare.cli -> train.config" in forbidden_imports(src, ("compare",), {"train"},
                                                              allowed={"train.run_dir"})
    assert ["train.config", "train.run_dir"] in import_cycles(src)

