"""Write tests/durations.json, the seconds each test module took, from a pytest JUnit XML
report. tests/conftest.py hands the modules to the suite's workers longest first with it
(docs/testing.md, "Workers"); refresh it when modules grow or are added:

    .venv/bin/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder \\
        --junitxml=/tmp/junit.xml
    .venv/bin/python scripts/test_durations.py /tmp/junit.xml
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def module_seconds(report: Path) -> dict[str, float]:
    """{tests/<module>.py: seconds} summed over the report's test cases (setup, call and
    teardown, as JUnit XML times them)."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        module = "tests/" + case.get("classname", "").split(".")[-1] + ".py"
        seconds[module] += float(case.get("time") or 0)
    return dict(seconds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path, help="pytest --junitxml output")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    seconds = module_seconds(args.report)
    if not seconds:
        p.error(f"{args.report} holds no test cases")
    ordered = dict(sorted(((m, round(s, 1)) for m, s in seconds.items()),
                          key=lambda kv: (-kv[1], kv[0])))
    args.out.write_text(json.dumps(ordered, indent=1) + "\n")
    print(f"{args.out}: {len(ordered)} modules, {sum(ordered.values()):.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
