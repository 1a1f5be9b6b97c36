"""The numbers of a comparison, computed once for both renderings (report.html, report.md).

Every table is a `Table` of plain strings whose rows are runs, in selection order, so run i is
"#i+1" in every table and every figure. A number is never shown without its evaluation
protocol: a loss on another split, segment length or memory length is another quantity.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .runs import BABILONG, ONE_OFF, SWEEP, RunData, Selection

# Different in every run by design (the runs table names each run): not worth a column.
IDENTITY_PARAMS = ("name", "run_dir")
# Order of the differing params: what defines the model and its memory first, then the
# top-level ones ("": seed, max_steps, ...), then how it was trained and evaluated.
SECTION_ORDER = ("model", "", "bptt", "optim", "data", "eval", "valid_protocol",
                 "final_protocol", "deepspeed", "ds", "tracking")
PROTOCOL_FIELDS = ("split", "tgt_len", "mem_len", "clamp_len", "same_length", "batch",
                   "skip_segments", "max_segments", "carry_memory")
CONTEXT_FIELDS = ("mem_len", "clamp_len", "same_length")
# eval_report.json's main.metric -> the final metric logged with it (else: loss in nats).
FINAL_METRIC = {"bpc": "final_bpc", "ppl": "final_ppl", "accuracy": "final_accuracy"}
VALID_METRIC = {"bpc": "valid_bpc", "ppl": "valid_ppl", "accuracy": "valid_accuracy"}


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]
    keys: list[int | None]   # index of the run each row is about: HTML colours its first cell


def key(i: int) -> str:
    return f"#{i + 1}"


def label(i: int, run: RunData, width: int = 30) -> str:
    """'#3 name' for legends and axes, cut to `width` so that no label pushes a plot away.
    Cut in the middle: runs of one sweep often share a prefix and differ at the end."""
    text = f"{key(i)} {run.name}"
    if len(text) <= width:
        return text
    head = (width - 1) * 3 // 5
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def num(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


# ---------------------------------------------------------------------------- runs, params
def runs_table(runs: list[RunData]) -> Table:
    rows = [[key(i), r.name, r.run_id, r.experiment, r.mechanism, r.status,
             str(r.steps) if r.steps is not None else "n/a"] for i, r in enumerate(runs)]
    return Table(["#", "run", "run id", "experiment", "mechanism", "status", "steps"], rows,
                 list(range(len(runs))))


def _param_order(name: str) -> tuple[int, str]:
    section = name.split(".", 1)[0] if "." in name else ""
    rank = SECTION_ORDER.index(section) if section in SECTION_ORDER else len(SECTION_ORDER)
    return rank, name


def param_tables(runs: list[RunData]) -> tuple[Table, Table]:
    """(params whose value is not the same in every run, params that are): a param a run
    does not have counts as a value of its own ("—"), so it differs."""
    names = sorted({k for r in runs for k in r.params if k not in IDENTITY_PARAMS},
                   key=_param_order)
    differ = [n for n in names if len({r.params.get(n) for r in runs}) > 1]
    same = [n for n in names if n not in differ]
    table = Table(["#", "run", *differ],
                  [[key(i), r.name, *(r.params.get(n, "—") for n in differ)]
                   for i, r in enumerate(runs)], list(range(len(runs))))
    constant = Table(["parameter", "value (all runs)"],
                     [[n, runs[0].params[n]] for n in same], [None] * len(same))
    return table, constant


# ---------------------------------------------------------------------------- protocols
def describe_protocol(p: dict[str, str]) -> str:
    """The words of EvalProtocol.describe (train/evaluate.py), so that a report
    reads like the training log, from the logged params; written out here because that
    module imports torch."""
    g = {f: p.get(f, "?") for f in PROTOCOL_FIELDS}
    text = (f"{g['split']}: tgt_len {g['tgt_len']}, mem_len {g['mem_len']}, clamp_len "
            f"{g['clamp_len']}, same_length {g['same_length']}, {g['batch']} rows, first "
            f"{g['skip_segments']} segments of each row not scored")
    if p.get("max_segments", "0") not in ("0", "", "None"):
        text += f", {g['max_segments']} segments per row"
    if p.get("carry_memory") == "False":
        text += ", memory reset before every segment"
    if p.get("weights"):
        text += f", weights {p['weights']}"
    return text


def protocol_params(run: RunData, kind: str) -> dict[str, str]:
    prefix = f"{kind}_protocol."
    return {k[len(prefix):]: v for k, v in run.params.items() if k.startswith(prefix)}


def protocol(run: RunData, kind: str) -> str:
    """`kind` "final" or "valid". The final one is taken from eval_report.json when there is
    one: it is what was scored, while params keep the values of the run's first start."""
    if kind == "final":
        main = _main(run)
        if isinstance(main.get("protocol_text"), str):
            return main["protocol_text"]
    fields = protocol_params(run, kind)
    return describe_protocol(fields) if fields else "protocol not recorded"


def protocol_differences(runs: list[RunData], kind: str) -> tuple[list[str], list[str]]:
    """Protocol fields that are not the same in all runs (from the params), as (fields that
    change which tokens are scored, fields that change the model's context). The first make
    numbers incomparable; the second usually are what is compared (mem_len follows each
    model's own unless eval.mem_len overrides it)."""
    values = [protocol_params(r, kind) for r in runs]
    differ = [f for f in PROTOCOL_FIELDS if len({v.get(f) for v in values}) > 1]
    return ([f for f in differ if f not in CONTEXT_FIELDS],
            [f for f in differ if f in CONTEXT_FIELDS])


def _main(run: RunData) -> dict:
    main = (run.eval_report or {}).get("main")
    return main if isinstance(main, dict) else {}


# ---------------------------------------------------------------------------- metrics
def _with_unit(metric: str, value: float | None) -> str:
    if value is None:
        return "n/a"
    if metric == "ppl":
        return f"ppl {value:.2f}"
    if metric == "nats":
        return f"{value:.4f} nats"
    return f"{metric} {value:.4f}"


def final_value(run: RunData) -> tuple[str, float | None]:
    metric = run.reported_metric
    name = FINAL_METRIC.get(metric, "final_loss")
    return metric, run.latest.get(name)


def best_valid(run: RunData) -> tuple[int, float, str] | None:
    """(step, lowest valid loss, the reported metric at that step) or None."""
    curve = run.curves.get("valid_loss")
    if not curve:
        return None
    step, loss = min(curve, key=lambda p: p[1])
    metric = run.reported_metric
    at_step = dict(run.curves.get(VALID_METRIC.get(metric, ""), []))
    extra = _with_unit(metric, at_step[step]) if step in at_step else ""
    return step, loss, extra


def metrics_table(runs: list[RunData]) -> Table:
    rows = []
    for i, r in enumerate(runs):
        metric, value = final_value(r)
        best = best_valid(r)
        best_text = "n/a" if best is None else (
            f"{best[1]:.4f} nats @ step {best[0]}" + (f" ({best[2]})" if best[2] else ""))
        rows.append([key(i), r.name, _with_unit(metric, value), num(r.latest.get("final_loss")),
                     num(r.latest.get("final_loss_no_memory")), protocol(r, "final"),
                     best_text, protocol(r, "valid")])
    header = ["#", "run", "final", "final loss (nats)", "memory off (nats)", "final protocol",
              "best valid loss", "valid protocol"]
    return Table(header, rows, list(range(len(runs))))


# ---------------------------------------------------------------------------- speed
def speed(run: RunData) -> tuple[float | None, float | None]:
    """(median tokens/s over the logged steps, max peak memory in MB). The median, because
    the first steps (compilation, warm-up) and evaluation pauses are outliers."""
    tps = [v for _, v in run.curves.get("tokens_per_s", [])]
    mem = [v for _, v in run.curves.get("peak_mem_mb", [])]
    return (statistics.median(tps) if tps else None, max(mem) if mem else None)


def speed_table(runs: list[RunData]) -> Table:
    rows = []
    for i, r in enumerate(runs):
        tps, mem = speed(r)
        rows.append([key(i), r.name, num(tps, 0), num(mem, 0),
                     r.tags.get("world_size", "?"), r.tags.get("zero_stage", "?")])
    return Table(["#", "run", "median tokens/s", "peak memory (MB)", "world size",
                  "ZeRO stage"], rows, list(range(len(runs))))


# ---------------------------------------------------------------------------- sweeps
Group = tuple[str, int]   # (split, tgt_len)


def sweeps(runs: list[RunData]) -> dict[Group, dict[int, list[tuple[int, float]]]]:
    """{(split, tgt_len): {run index: [(mem_len, loss), ...]}} of the sweep metrics."""
    out: dict[Group, dict[int, list[tuple[int, float]]]] = {}
    for i, r in enumerate(runs):
        for name, points in r.curves.items():
            m = SWEEP.match(name)
            if m and points:
                out.setdefault((m["split"], int(m["tgt"])), {})[i] = points
    return dict(sorted(out.items()))


def one_offs(runs: list[RunData]) -> dict[Group, dict[int, list[tuple[int, float]]]]:
    """The same shape for single `memtrain eval` results (eval_<split>_m<M>_l<T>_loss)."""
    out: dict[Group, dict[int, list[tuple[int, float]]]] = {}
    for i, r in enumerate(runs):
        for name, value in r.latest.items():
            m = ONE_OFF.match(name)
            if m:
                pts = out.setdefault((m["split"], int(m["tgt"])), {}).setdefault(i, [])
                pts.append((int(m["mem"]), value))
    for group in out.values():
        for pts in group.values():
            pts.sort()
    return dict(sorted(out.items()))


def sweep_table(runs: list[RunData], curves: dict[int, list[tuple[int, float]]],
                singles: dict[int, list[tuple[int, float]]]) -> Table:
    """Loss (nats) per run and evaluation mem_len; one-off evaluations marked with '*'."""
    mems = sorted({m for pts in (*curves.values(), *singles.values()) for m, _ in pts})
    rows, keys = [], []
    for i in sorted(set(curves) | set(singles)):
        cells = {m: f"{v:.4f}" for m, v in curves.get(i, [])}
        cells.update({m: f"{v:.4f}*" for m, v in singles.get(i, []) if m not in cells})
        rows.append([key(i), runs[i].name, *(cells.get(m, "") for m in mems)])
        keys.append(i)
    return Table(["#", "run", *(f"mem_len {m}" for m in mems)], rows, keys)


# ---------------------------------------------------------------------------- BABILong
def babilong(runs: list[RunData]) -> dict[str, dict[int, dict[str, dict[int, float]]]]:
    """{split: {run index: {task: {length in tokens: accuracy}}}} of the babilong_<split>_
    <task> metrics (evaluation/babilong_report.py logs the length as the metric's step)."""
    out: dict[str, dict[int, dict[str, dict[int, float]]]] = {}
    for i, r in enumerate(runs):
        for name, points in r.curves.items():
            m = BABILONG.match(name)
            if m and points:
                out.setdefault(m["split"], {}).setdefault(i, {})[m["task"]] = dict(points)
    return dict(sorted(out.items()))


def _task_order(task: str) -> tuple[int, str]:
    digits = "".join(ch for ch in task if ch.isdigit())
    return (int(digits) if digits else 1 << 30), task   # qa2 before qa10


def babilong_table(runs: list[RunData], split_data: dict[int, dict[str, dict[int, float]]]
                   ) -> Table:
    """Task rows x (run, length) columns, one column group per run side by side: accuracy,
    or "" where a run has no score for that task and length."""
    tasks = sorted({t for per_run in split_data.values() for t in per_run}, key=_task_order)
    header, columns = ["task"], []
    for i in sorted(split_data):
        lengths = sorted({n for pts in split_data[i].values() for n in pts})
        header += [f"{key(i)} {n} tokens" for n in lengths]
        columns += [(i, n) for n in lengths]
    rows = [[t, *(num(split_data[i].get(t, {}).get(n), 3) if n in split_data[i].get(t, {})
                  else "" for i, n in columns)] for t in tasks]
    return Table(header, rows, [None] * len(rows))


# ---------------------------------------------------------------------------- left out
def left_out_lines(sel: Selection, limit: int = 100) -> list[str]:
    """One line per left-out run, at most `limit` (a store full of other projects' runs
    must not bury the report)."""
    lines = [f"{x.who}: {x.reason}" for x in sel.left_out[:limit]]
    if len(sel.left_out) > limit:
        lines.append(f"... and {len(sel.left_out) - limit} more")
    return lines


def incomplete_lines(runs: list[RunData]) -> list[str]:
    return [f"{key(i)} {r.name} ({r.run_id}): {'; '.join(r.problems)}"
            for i, r in enumerate(runs) if r.problems]
