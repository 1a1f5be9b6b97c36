"""report.html and report.md of a comparison, from the tables of summary.py and the figures
of plots.py.

report.html is one self-contained file: images are data: URIs, styles and the one script are
inline, and a Content-Security-Policy forbids loading anything else, so it opens the same
from a mail attachment, an MLflow artifact view or a laptop without network (and a stray
external reference would show up as a console error). The inline script is the page's
self-check: once loaded it counts the images that rendered and any script errors into
#selfcheck, which a headless browser (tests/test_compare.py) or a reader can look at.
report.md carries the same tables and references the PNGs written beside it.
"""

from __future__ import annotations

import base64
import html
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import plots
from . import summary as S
from .runs import Selection

CSP = ("default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
       "script-src 'unsafe-inline'")
CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em;
color:#222;line-height:1.4}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.8em;border-bottom:1px solid #ddd}
.meta,.note,figcaption,footer{color:#555;font-size:.9em}.warn{color:#a14a00}
.scroll{overflow-x:auto;max-width:100%;margin:.5em 0}
table{border-collapse:collapse;font-size:.85em}
th,td{border:1px solid #ddd;padding:.25em .5em;text-align:left;white-space:nowrap;
vertical-align:top}
th{background:#f4f4f4}
tr>:first-child{position:sticky;left:0;background:#fff}th:first-child{background:#f4f4f4}
.sw{display:inline-block;width:1.6em;height:0;border-top-width:3px;vertical-align:middle;
margin-right:.3em}
img{max-width:100%;height:auto}figure{margin:1em 0}
nav a{margin-right:1em}
"""
# Collected before any image loads (image errors do not bubble; the capture phase sees them).
SCRIPT = """
(function () {
  var errors = [];
  function show() {
    var box = document.getElementById("selfcheck");
    if (!box) { return; }
    var imgs = document.images, broken = [];
    for (var i = 0; i < imgs.length; i++) {
      if (!imgs[i].complete || imgs[i].naturalWidth === 0) { broken.push(imgs[i].alt); }
    }
    box.setAttribute("data-images", String(imgs.length));
    box.setAttribute("data-broken", String(broken.length));
    box.setAttribute("data-errors", String(errors.length));
    box.setAttribute("data-status", broken.length || errors.length ? "failed" : "ok");
    box.textContent = "Page check: " + (imgs.length - broken.length) + " of " + imgs.length +
      " images rendered" + (broken.length ? " (broken: " + broken.join(", ") + ")" : "") +
      (errors.length ? "; errors: " + errors.join(" | ") : "; no script errors") + ".";
  }
  window.addEventListener("error", function (e) {
    var what = e.message || (e.target && e.target.alt ? "image " + e.target.alt : e.type);
    errors.push(String(what));
    show();
  }, true);
  window.addEventListener("load", show);
})();
"""
STYLE_BORDER = {"-": "solid", "--": "dashed", ":": "dotted", "-.": "double"}


@dataclass
class Figure:
    file: str        # PNG name beside report.md
    caption: str
    png: bytes


@dataclass
class Part:
    """One section: a title, notes (paragraphs), tables and figures, in that order."""
    anchor: str
    title: str
    notes: list[str] = field(default_factory=list)   # a leading "!" marks a warning
    items: list[str] = field(default_factory=list)   # a bullet list after the notes
    tables: list[tuple[str, S.Table]] = field(default_factory=list)   # (caption, table)
    figures: list[Figure] = field(default_factory=list)
    collapsed: tuple[str, S.Table] | None = None    # <details> in HTML, a count in markdown


def build_parts(sel: Selection) -> list[Part]:
    runs = sel.runs
    labels = [S.label(i, r) for i, r in enumerate(runs)]
    parts = [Part("runs", f"Runs ({len(runs)})", tables=[("", S.runs_table(runs))])]

    differ, constant = S.param_tables(runs)
    params = Part("params", "Parameters that differ")
    if len(differ.header) > 2:
        params.tables.append(("Without name and run_dir, which differ by design.", differ))
    else:
        params.notes.append("All runs have the same parameters (name and run_dir aside).")
    params.collapsed = (f"{len(constant.rows)} parameters identical in all runs", constant)
    parts.append(params)

    metrics = Part("metrics", "Final and best metrics")
    metrics.notes.append("Final: the end-of-training evaluation, in the unit the corpus is "
                         "reported in (bpc for characters, ppl for words, accuracy for tasks, "
                         "else the loss in nats). Best valid: the lowest validation loss "
                         "logged during training. Each with the protocol it was measured "
                         "under.")
    for kind in ("final", "valid"):
        scored, context = S.protocol_differences(runs, kind)
        if scored:
            metrics.notes.append(f"!The {kind} protocols differ in {', '.join(scored)}: the "
                                 "runs were scored on different tokens, so compare those "
                                 "numbers only between runs with the same protocol.")
        if context:
            metrics.notes.append(f"The {kind} evaluations used different {', '.join(context)} "
                                 "(each run's own unless eval.* set it).")
    metrics.tables.append(("", S.metrics_table(runs)))
    parts.append(metrics)

    loss = Part("curves", "Loss curves")
    for metric, file, title in (("loss", "train_loss.png", "Training loss"),
                                ("valid_loss", "valid_loss.png", "Validation loss")):
        series = [(i, labels[i], r.curves.get(metric, [])) for i, r in enumerate(runs)]
        png = plots.curves(series, title=title, xlabel="training step", ylabel="loss (nats)",
                           markers=metric == "valid_loss", clip_start=metric == "loss")
        if png:
            loss.figures.append(Figure(file, f"{title} (nats) against the training step.",
                                       png))
        missing = [S.key(i) for i, r in enumerate(runs) if not r.curves.get(metric)]
        if missing:
            loss.notes.append(f"No {metric} logged by {', '.join(missing)}.")
    parts.append(loss)
    parts.append(_sweep_part(sel, labels))
    parts.append(_babilong_part(sel))

    speed = Part("speed", "Throughput and memory")
    values = [S.speed(r) for r in runs]
    png = plots.bars(labels, [("median tokens/s", [v[0] for v in values], ".0f"),
                              ("peak memory (MB)", [v[1] for v in values], ".0f")],
                     list(range(len(runs))))
    if png:
        speed.figures.append(Figure("speed.png", "Median training throughput over the "
                                    "logged steps, and the largest peak memory logged.", png))
    speed.tables.append(("", S.speed_table(runs)))
    parts.append(speed)

    gone = Part("left-out", "Runs left out / incomplete")
    gone.items += ["Left out: " + x for x in S.left_out_lines(sel)]
    gone.items += ["Incomplete: " + x for x in S.incomplete_lines(runs)]
    if not gone.items:
        gone.notes.append("None: every selected run is compared, with all its metrics.")
    parts.append(gone)
    return parts


def _sweep_part(sel: Selection, labels: list[str]) -> Part:
    part = Part("sweep", "Memory-length sweeps")
    curves, singles = S.sweeps(sel.runs), S.one_offs(sel.runs)
    if not curves and not singles:
        part.notes.append("No memory-length sweep (sweep_<split>_loss_tgt<T>) or one-off "
                          "evaluation (eval_<split>_m<M>_l<T>_loss) logged by these runs.")
        return part
    part.notes.append("Evaluation loss (nats) against the memory length used at evaluation; "
                      "x marks and * in the tables are one-off `memtrain eval` results.")
    for split, tgt in sorted(set(curves) | set(singles)):
        c, s = curves.get((split, tgt), {}), singles.get((split, tgt), {})
        title = f"{split} split, tgt_len {tgt}"
        png = plots.curves([(i, labels[i], pts) for i, pts in c.items()],
                           title=f"Memory-length sweep: {title}", xlabel="evaluation mem_len",
                           ylabel="loss (nats)", markers=True, log_x=True,
                           extra=[(i, labels[i], pts) for i, pts in s.items()])
        if png:
            safe = re.sub(r"[^\w.-]", "_", split)   # a file name, whatever the split is
            part.figures.append(Figure(f"sweep_{safe}_tgt{tgt}.png", f"Loss against "
                                       f"mem_len, {title}.", png))
        part.tables.append((title, S.sweep_table(sel.runs, c, s)))
    return part


def _babilong_part(sel: Selection) -> Part:
    part = Part("babilong", "BABILong accuracy by task and length")
    data = S.babilong(sel.runs)
    if not data:
        part.notes.append("No BABILong evaluation (babilong_<split>_<task>, from `memtrain "
                          "eval --babilong`) logged by these runs.")
        return part
    part.notes.append("Accuracy of each bAbI task (rows) at each context length in tokens, "
                      "one group of columns per run (Kuratov et al. 2024's table); the last "
                      "`memtrain eval --babilong` of each run and length counts.")
    for split, per_run in data.items():
        runs = ", ".join(f"{S.key(i)} {sel.runs[i].name}" for i in sorted(per_run))
        part.tables.append((f"{split} split: {runs}", S.babilong_table(sel.runs, per_run)))
    return part


# ---------------------------------------------------------------------------- HTML
def _e(text: str) -> str:
    return html.escape(str(text), quote=True)


def _html_table(table: S.Table) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in table.header)
    body = []
    for row, i in zip(table.rows, table.keys, strict=True):
        cells = [f"<td>{_e(c)}</td>" for c in row]
        if i is not None:
            st = plots.style(i)
            swatch = (f'<span class="sw" style="border-top-style:'
                      f'{STYLE_BORDER[st["linestyle"]]};border-top-color:{st["color"]}">'
                      "</span>")
            cells[0] = f"<td>{swatch}{_e(row[0])}</td>"
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>'
            + "".join(body) + "</tbody></table></div>")


def _note_html(note: str) -> str:
    if note.startswith("!"):
        return f'<p class="note warn">{_e(note[1:])}</p>'
    return f'<p class="note">{_e(note)}</p>'


def render_html(parts: list[Part], title: str, meta: list[str]) -> str:
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{_e(title)}</title><style>{CSS}</style><script>{SCRIPT}</script>",
           "</head><body>", f"<h1>{_e(title)}</h1>"]
    out += [f'<p class="meta">{_e(m)}</p>' for m in meta]
    out.append("<nav>" + "".join(f'<a href="#{p.anchor}">{_e(p.title)}</a>' for p in parts)
               + "</nav>")
    for p in parts:
        out.append(f'<section id="{p.anchor}"><h2>{_e(p.title)}</h2>')
        out += [_note_html(n) for n in p.notes]
        if p.items:
            out.append("<ul>" + "".join(f"<li>{_e(i)}</li>" for i in p.items) + "</ul>")
        for caption, table in p.tables:
            if caption:
                out.append(f'<p class="note">{_e(caption)}</p>')
            out.append(_html_table(table))
        if p.collapsed:
            summary, table = p.collapsed
            out.append(f"<details><summary>{_e(summary)}</summary>{_html_table(table)}"
                       "</details>")
        for f in p.figures:
            data = base64.b64encode(f.png).decode("ascii")
            out.append(f'<figure><img src="data:image/png;base64,{data}" alt="{_e(f.file)}">'
                       f"<figcaption>{_e(f.caption)}</figcaption></figure>")
        out.append("</section>")
    out += ['<footer><p id="selfcheck" data-status="not-run">Page check: not run '
            "(JavaScript is off).</p></footer>", "</body></html>"]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------- markdown
def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _md_table(table: S.Table) -> list[str]:
    lines = ["| " + " | ".join(_md_cell(h) for h in table.header) + " |",
             "|" + "---|" * len(table.header)]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in table.rows]
    return lines


def render_markdown(parts: list[Part], title: str, meta: list[str]) -> str:
    out = [f"# {title}", "", *(f"{m}  " for m in meta), ""]
    for p in parts:
        out += [f"## {p.title}", ""]
        for n in p.notes:
            out += [f"**Warning:** {n[1:]}" if n.startswith("!") else n, ""]
        if p.items:
            out += [f"- {i}" for i in p.items] + [""]
        for caption, table in p.tables:
            out += ([caption, ""] if caption else []) + _md_table(table) + [""]
        if p.collapsed:
            out += [f"{p.collapsed[0]} (listed in report.html).", ""]
        for f in p.figures:
            out += [f"![{f.caption}]({f.file})", ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------- files
@dataclass
class ReportFiles:
    html: Path
    markdown: Path
    pngs: list[Path]

    @property
    def all(self) -> list[Path]:
        return [self.html, self.markdown, *self.pngs]


def write_report(sel: Selection, out_dir: str | Path, *, title: str | None = None,
                 source: str = "", selection: str = "") -> ReportFiles:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = len(sel.runs)
    title = title or f"memtrain: comparison of {n} run{'s' * (n != 1)}"
    meta = [f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by memtrain compare."]
    meta += [f"Store: {source}"] if source else []
    meta += [f"Selection: {selection}"] if selection else []
    parts = build_parts(sel)
    pngs = []
    for f in (f for p in parts for f in p.figures):
        path = out_dir / f.file
        path.write_bytes(f.png)
        pngs.append(path)
    files = ReportFiles(out_dir / "report.html", out_dir / "report.md", pngs)
    files.html.write_text(render_html(parts, title, meta), encoding="utf-8")
    files.markdown.write_text(render_markdown(parts, title, meta), encoding="utf-8")
    return files
