"""Helpers of tests/test_compare.py: an HTML parser for report.html and runs written
straight into MLflow the way training logs them (for the 30-run layout checks)."""

from __future__ import annotations

import math
import random
import time
from html.parser import HTMLParser
from pathlib import Path

from mlflow.entities import Metric, Param

from compare.cli import main_compare
from compare.summary import describe_protocol

REAL_EXP, MANY_EXP = "cmp-real", "cmp-many"
MECHS = ("xl", "lamemo", "rmt")
PROTOCOL = {"split": "valid", "tgt_len": 8, "mem_len": 8, "clamp_len": -1,
            "same_length": False, "batch": 4, "skip_segments": 0, "max_segments": 4,
            "carry_memory": True}


# ---------------------------------------------------------------------------- helpers
class Page(HTMLParser):
    """report.html as {section id: {"text", "tables": [[row cells]], "imgs": [src]}}."""

    def __init__(self, text: str):
        super().__init__()
        self.sections: dict[str, dict] = {}
        self.srcs: list[str] = []      # every src/href of the page, wherever it is
        self.selfcheck: dict[str, str] = {}
        self._sec = self._row = self._cell = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.srcs += [a[k] for k in ("src", "href") if k in a]
        if a.get("id") == "selfcheck":
            self.selfcheck = a
        if tag == "section":
            self._sec = self.sections.setdefault(a["id"], {"text": "", "tables": [], "imgs": []})
        elif self._sec is None:
            return
        elif tag == "table":
            self._sec["tables"].append([])
        elif tag == "tr":
            self._row = []
            self._sec["tables"][-1].append(self._row)
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            self._sec["imgs"].append(a["src"])

    def handle_endtag(self, tag):
        if tag == "section":
            self._sec = None
        elif tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._sec is not None:
            self._sec["text"] += data
        if self._cell is not None:
            self._cell.append(data)

    def table(self, section: str, n: int = 0) -> list[dict[str, str]]:
        header, *rows = self.sections[section]["tables"][n]
        return [dict(zip(header, row, strict=True)) for row in rows]


def _compare(args: list[str], capsys) -> tuple[int, str, str]:
    code = main_compare(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def _protocol(prefix: str, mem: int) -> dict[str, str]:
    return {f"{prefix}.{k}": str(v) for k, v in {**PROTOCOL, "mem_len": mem}.items()}


def synthetic_run(client, exp_id: str, i: int, steps: int = 30, sweep: bool = False) -> str:
    """A finished memtrain-like run: params, tags, loss/valid/speed histories, final
    metrics and an eval_report.json, as training logs them."""
    mech, mem = MECHS[i % 3], 4 * (1 + i % 5)
    name = f"{mech}-mem{mem}-seed{i}-a-long-suffix-to-cut"
    params = {"name": name, "run_dir": f"runs/{name}", "seed": str(i), "model.mechanism": mech,
              "model.mem_len": str(mem), "model.n_layer": "2", **_protocol("valid_protocol", mem),
              **_protocol("final_protocol", mem)}
    tags = {"model_type": "memory-augmented-lm", "mechanism": mech, "world_size": "1",
            "zero_stage": "1"}
    now, rng, floor = int(time.time() * 1000), random.Random(i), 1.5 + 0.02 * i
    # Start times 1 s apart: the report numbers runs by start time, oldest first.
    run_id = client.create_run(exp_id, start_time=now - 1000 * (100 - i), run_name=name,
                               tags=tags).info.run_id
    ms = []
    for s in range(1, steps + 1):
        ms += [Metric("loss", floor + math.exp(-s / 6) + rng.uniform(-0.03, 0.03), now, s),
               Metric("tokens_per_s", 1000.0 + 10 * i + s, now, s),
               Metric("peak_mem_mb", 500.0 + i + s, now, s)]
        if s % 10 == 0:
            ms += [Metric("valid_loss", floor + math.exp(-s / 6), now, s),
                   Metric("valid_ppl", math.exp(floor + math.exp(-s / 6)), now, s)]
    final = floor + 0.05
    ms += [Metric("final_loss", final, now, steps), Metric("final_ppl", math.exp(final), now,
                                                           steps)]
    if sweep:
        ms += [Metric("sweep_valid_loss_tgt8", final + 1 / (1 + m), now, m) for m in (0, 8, 32)]
    client.log_batch(run_id, metrics=ms, params=[Param(k, v) for k, v in params.items()])
    client.log_dict(run_id, {"main": {"metric": "ppl", "loss": final,
                                      "protocol_text": describe_protocol(
                                          {**PROTOCOL, "mem_len": mem})}}, "eval_report.json")
    client.set_terminated(run_id, "FINISHED")
    return run_id


def _experiment(client, name: str, artifacts: Path | None = None) -> str:
    return client.create_experiment(name, artifact_location=artifacts and str(artifacts))
