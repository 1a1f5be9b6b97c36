"""Background text for BABILong-style samples on a machine without PG19: the docstrings of
Python's standard library, read from its source files with `ast` (nothing is imported, no
network). English prose with some code, several MB, the same bytes for the same Python.

    .venv/bin/python benchmarks/babilong_background.py --out data/stdlib-docs.txt

PG19 (BABILong's own background, Kuratov et al. 2024 §2) is narrative books; this text is
technical prose. What the facts hide in changes what a model must skip, not the protocol.
"""

from __future__ import annotations

import argparse
import ast
import sysconfig
from pathlib import Path


def docstrings(root: Path, min_chars: int = 200):
    """Every module, class and function docstring of at least `min_chars` characters under
    `root` (sorted file order), as paragraphs."""
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "idlelib" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars and doc.isascii():
                    yield doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--max-bytes", type=int, default=4_000_000)
    args = p.parse_args(argv)
    root = Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for doc in docstrings(root):
        out.append(doc.strip() + "\n\n")
        size += len(out[-1])
        if size >= args.max_bytes:
            break
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(out), encoding="ascii")
    print(f"wrote {args.out}: {size:,} bytes from {len(out):,} docstrings under {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
