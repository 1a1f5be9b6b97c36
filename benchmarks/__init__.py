"""The benchmark scripts behind BENCHMARKS.md, each run as `python benchmarks/<script>.py`.

A package so that the tests of a script's mechanics import it as `benchmarks.<script>`
from the checkout's root (pyproject.toml, pytest's `pythonpath`), never with benchmarks/
itself on the path. Not part of the wheel: what the project and the benchmarks share lives
in the project (e.g. train/memory_probe.py).
"""
