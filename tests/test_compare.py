"""`memtrain compare`: runs selected from MLflow (a real server, and a local sqlite store)
become one self-contained HTML report and a markdown summary, logged as a comparison run.

Two real tiny trainings (XL with an 8-token memory, LaMemo with a 4-token memory and the
memory-off baseline) go to a real `mlflow server`, with a run of another project and a
failed run beside them. Thirty synthetic runs, written with MlflowClient, test the layout
of a large comparison; synthetic sweep metrics stand in for the memory-length sweep.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from compare_helpers import MANY_EXP, PROTOCOL, REAL_EXP, Page, _compare, _experiment, synthetic_run
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

# mlflow_server_fixture provides the `mlflow_server` fixture: pytest collects it from here.
from mlflow_server import free_port, mlflow_server_fixture  # noqa: F401
from train_helpers import run_train, tiny_config

from compare import plots
from compare.cli import main_compare
from compare.summary import describe_protocol

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def real(tmp_path_factory, mlflow_server):
    """Two real trainings on the server plus, in their experiment, a sweep and a one-off
    evaluation on the XL run, a run of another project and a failed memtrain run."""
    tmp = tmp_path_factory.mktemp("compare_real")
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    configs = [tiny_config(tmp, "xl-m8", max_steps=12, eval={"every": 4, "max_segments": 4},
                           tracking={"experiment": REAL_EXP}),
               tiny_config(tmp, "lamemo-m4", max_steps=12,
                           model={"mechanism": "lamemo", "mem_len": 4},
                           eval={"every": 4, "max_segments": 4, "no_memory_baseline": True},
                           tracking={"experiment": REAL_EXP})]
    client = MlflowClient(mlflow_server)
    # Made here: two runs starting at once would both try to create it, and the loser would
    # train without MLflow.
    exp_id = _experiment(client, REAL_EXP)
    with ThreadPoolExecutor(2) as pool:  # 2 cores, one thread each: both at once
        list(pool.map(lambda c: run_train(c, env=env), configs))
    ids = [json.loads((tmp / "runs" / n / "tracking.json").read_text())["run_id"]
           for n in ("xl-m8", "lamemo-m4")]
    now = int(time.time() * 1000)
    client.log_batch(ids[0], metrics=[Metric("sweep_valid_loss_tgt8", 3.0 - m / 16, now, m)
                                      for m in (0, 4, 8, 16)]
                     + [Metric("eval_valid_m32_l8_loss", 1.5, now, 12)])
    foreign = client.create_run(exp_id, run_name="someone-elses-run").info.run_id
    client.log_metric(foreign, "accuracy", 0.9)
    # Crashed at step 3: the XL run's params (all but model.n_layer), three losses, no more.
    failed = client.create_run(exp_id, run_name="crashed", tags={
        "model_type": "memory-augmented-lm", "mechanism": "xl"}).info.run_id
    params = {**client.get_run(ids[0]).data.params, "name": "crashed", "run_dir": "runs/crashed"}
    params.pop("model.n_layer")
    client.log_batch(failed, metrics=[Metric("loss", 2.8 - 0.1 * s, now, s) for s in (1, 2, 3)],
                     params=[Param(k, v) for k, v in params.items()])
    client.set_terminated(failed, "FAILED")
    return {"uri": mlflow_server, "ids": ids, "foreign": foreign, "failed": failed,
            "client": client}


@pytest.fixture(scope="module")
def real_report(real, tmp_path_factory):
    """`memtrain compare` of the real experiment (and an unknown run id), logged to MLflow."""
    out = tmp_path_factory.mktemp("real_report") / "report"
    code = main_compare(["--tracking-uri", real["uri"], "--experiment", REAL_EXP,
                         "--run-ids", "0" * 32, "--out", str(out)])
    assert code == 0
    return out, Page((out / "report.html").read_text())


@pytest.fixture(scope="module")
def many_report(mlflow_server, tmp_path_factory):
    client = MlflowClient(mlflow_server)
    exp_id = _experiment(client, MANY_EXP)
    with ThreadPoolExecutor(4) as pool:   # the server's latency, not its work, is the cost
        ids = list(pool.map(lambda i: synthetic_run(client, exp_id, i, sweep=i < 12), range(30)))
    out = tmp_path_factory.mktemp("many_report") / "report"
    code = main_compare(["--tracking-uri", mlflow_server, "--experiment", MANY_EXP, "--out",
                         str(out), "--no-log"])
    assert code == 0
    return out, Page((out / "report.html").read_text()), ids


@pytest.fixture(scope="module")
def local_store(tmp_path_factory):
    """A sqlite store as training makes one (runs/mlflow.db), three synthetic runs."""
    root = tmp_path_factory.mktemp("local_store")
    uri = f"sqlite:///{root}/mlflow.db"
    client = MlflowClient(uri)
    exp_id = _experiment(client, "memtrain", root / "mlartifacts")
    ids = [synthetic_run(client, exp_id, i) for i in range(3)]   # xl, lamemo, rmt
    return root, uri, ids


# ---------------------------------------------------------------------------- the report
def test_two_trained_runs_on_a_real_server_are_compared_in_one_report(real, real_report):
    out, page = real_report
    runs = page.table("runs")
    expected = {real["ids"][0]: ("xl-m8", "xl", "FINISHED", "12"),
                real["ids"][1]: ("lamemo-m4", "lamemo", "FINISHED", "12"),
                real["failed"]: ("crashed", "xl", "FAILED", "3")}
    assert {r["run id"]: (r["run"], r["mechanism"], r["status"], r["steps"]) for r in runs} \
        == expected
    # numbered #1, #2, #3 by start time (the two trainings ran at the same time)
    started = sorted(expected, key=lambda i: real["client"].get_run(i).info.start_time)
    assert [(r["#"], r["run id"]) for r in runs] == [(f"#{n}", i)
                                                      for n, i in enumerate(started, 1)]
    for section in ("curves", "speed", "sweep"):
        assert page.sections[section]["imgs"], section


def test_parameters_that_differ_are_listed_and_constant_ones_are_not(real_report):
    _, page = real_report
    differ = page.table("params", 0)
    by_run = {r["run"]: r for r in differ}
    assert by_run["xl-m8"]["model.mechanism"] == "xl"
    assert by_run["lamemo-m4"]["model.mechanism"] == "lamemo"
    assert (by_run["xl-m8"]["model.mem_len"], by_run["lamemo-m4"]["model.mem_len"]) == ("8", "4")
    # A param a run did not log is a value of its own: model.n_layer differs through it.
    assert [r["model.n_layer"] for r in differ] == ["2", "2", "—"]
    constant = {r["parameter"]: r["value (all runs)"] for r in page.table("params", 1)}
    assert constant["model.d_model"] == "32" and constant["bptt.mode"] == "window"
    assert not {"model.n_layer", "model.mechanism", "model.mem_len"} & set(constant)
    assert set(differ[0]) == {"#", "run", "model.mechanism", "model.mem_len", "model.n_layer",
                              "eval.no_memory_baseline", "valid_protocol.mem_len",
                              "final_protocol.mem_len"}
    assert "name" not in differ[0] and "run_dir" not in differ[0]   # differ by design


def test_final_and_best_metrics_are_shown_with_their_evaluation_protocol(real, real_report):
    _, page = real_report
    rows = {r["run"]: r for r in page.table("metrics")}
    client = real["client"]
    for run_id, name in zip(real["ids"], ("xl-m8", "lamemo-m4"), strict=True):
        metrics = client.get_run(run_id).data.metrics
        report = json.loads(Path(client.download_artifacts(
            run_id, "eval_report.json", str(Path(real_report[0]).parent))).read_text())
        assert report["main"]["metric"] == "ppl"   # a word-level corpus
        assert rows[name]["final"] == f"ppl {metrics['final_ppl']:.2f}"
        assert rows[name]["final loss (nats)"] == f"{metrics['final_loss']:.4f}"
        assert rows[name]["final protocol"] == report["main"]["protocol_text"]
        valid = client.get_metric_history(run_id, "valid_loss")
        best = min(valid, key=lambda m: m.value)
        assert rows[name]["best valid loss"].startswith(
            f"{best.value:.4f} nats @ step {best.step} (ppl ")
        assert f"mem_len {'8' if name == 'xl-m8' else '4'}," in rows[name]["valid protocol"]
    lamemo_off = client.get_run(real["ids"][1]).data.metrics["final_loss_no_memory"]
    assert rows["lamemo-m4"]["memory off (nats)"] == f"{lamemo_off:.4f}"
    assert rows["xl-m8"]["memory off (nats)"] == "n/a"
    assert rows["crashed"]["final"] == "n/a"
    assert "used different mem_len" in page.sections["metrics"]["text"]


def test_the_memory_length_sweep_is_tabulated_and_plotted_against_mem_len(real_report):
    out, page = real_report
    (row,) = page.table("sweep")
    assert row["run"] == "xl-m8"
    assert [row[f"mem_len {m}"] for m in (0, 4, 8, 16, 32)] == [
        "3.0000", "2.7500", "2.5000", "2.0000", "1.5000*"]   # * = one-off memtrain eval
    assert (out / "sweep_valid_tgt8.png").is_file()


def test_throughput_is_the_median_and_peak_memory_the_maximum(real, real_report):
    _, page = real_report
    rows = {r["run"]: r for r in page.table("speed")}
    client = real["client"]
    run_id = real["ids"][0]
    tps = statistics.median(m.value for m in client.get_metric_history(run_id, "tokens_per_s"))
    mem = max(m.value for m in client.get_metric_history(run_id, "peak_mem_mb"))
    assert rows["xl-m8"]["median tokens/s"] == f"{tps:.0f}"
    assert rows["xl-m8"]["peak memory (MB)"] == f"{mem:.0f}"
    assert rows["crashed"]["median tokens/s"] == "n/a"


def test_foreign_failed_and_unknown_runs_are_listed_not_crashing(real, real_report):
    _, page = real_report
    text = " ".join(page.sections["left-out"]["text"].split())
    assert f"run {real['foreign']} (someone-elses-run): not a memtrain training run" in text
    assert f"run {'0' * 32}: no such run in the store" in text
    assert (f"Incomplete: #3 crashed ({real['failed']}): run FAILED; no eval_report.json "
            "artifact; no validation loss (valid_loss) logged; no final evaluation "
            "(final_loss) logged") in text
    assert "Incomplete: #1" not in text and "Incomplete: #2" not in text
    assert real["foreign"] not in str(page.table("runs"))


def test_the_markdown_summary_has_the_tables_and_its_images_exist(real, real_report):
    out, page = real_report
    md = (out / "report.md").read_text()
    for heading in ("## Runs (3)", "## Parameters that differ", "## Final and best metrics",
                    "## Memory-length sweeps", "## Throughput and memory",
                    "## Runs left out / incomplete"):
        assert heading in md
    xl = next(r for r in page.table("runs") if r["run"] == "xl-m8")
    assert f"| {xl['#']} | xl-m8 | {real['ids'][0]} |" in md
    assert "| # | run | model.mechanism | model.mem_len | model.n_layer |" in md
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert {"train_loss.png", "valid_loss.png", "speed.png", "sweep_valid_tgt8.png"} <= set(
        images)
    for name in images:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_the_comparison_run_holds_the_report_and_names_the_compared_runs(real, real_report):
    out, page = real_report
    client = real["client"]
    exp = client.get_experiment_by_name("memtrain-compare")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    compared = [r["run id"] for r in page.table("runs")]
    assert sorted(compared) == sorted([*real["ids"], real["failed"]])
    assert run.data.tags["memtrain.compared_run_ids"] == ",".join(compared)
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"report.html", "report.md", "train_loss.png", "speed.png"} <= arts
    got = client.download_artifacts(run.info.run_id, "report.html", str(out.parent))
    assert Path(got).read_bytes() == (out / "report.html").read_bytes()


def test_the_report_loads_nothing_from_outside_the_file(real_report, many_report):
    for _, page, *_ in (real_report, many_report):
        assert all(s.startswith(("data:image/png;base64,", "#")) for s in page.srcs)
        for src in (s for s in page.srcs if s.startswith("data:")):
            assert base64.b64decode(src.split(",", 1)[1])[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------- 30 runs
def test_thirty_runs_each_get_a_row_a_distinct_style_and_a_legend_entry(many_report):
    out, page, ids = many_report
    for section in ("runs", "params", "metrics", "speed"):
        assert len(page.table(section)) == 30, section
    assert [r["run id"] for r in page.table("runs")] == ids    # oldest first: #1 .. #30
    styles = {(plots.style(i)["color"], plots.style(i)["linestyle"]) for i in range(30)}
    assert len(styles) == 30
    assert len(page.table("sweep")) == 12
    assert "None: every selected run is compared" in page.sections["left-out"]["text"]


def _boxes(fig, artists):
    fig.canvas.draw()   # lay the figure out as png() will
    renderer = fig.canvas.get_renderer()
    return [a.get_window_extent(renderer) for a in artists]


def test_thirty_runs_plots_keep_legends_outside_and_labels_apart():
    labels = [f"#{i + 1} lamemo-mem{i}-seed{i}-a-long-name" for i in range(30)]
    series = [(i, labels[i], [(s, 2 + i / 30 + 1 / s) for s in range(1, 50)])
              for i in range(30)]
    fig = plots.curves_figure(series, title="t", xlabel="step", ylabel="loss")
    ax = fig.axes[0]
    (legend_box, axes_box) = _boxes(fig, [ax.get_legend(), ax])
    assert legend_box.x0 >= axes_box.x1           # beside the axes, hiding no curve
    assert len(ax.get_legend().get_texts()) == 30
    fig = plots.bars_figure(labels, [("tokens/s", [1000.0 + i for i in range(30)], ".0f")],
                            list(range(30)))
    ticks = _boxes(fig, fig.axes[0].get_yticklabels())
    assert len(ticks) == 30
    assert all(not a.overlaps(b) for a, b in zip(ticks, ticks[1:], strict=False))


# ---------------------------------------------------------------------------- local store
def test_a_local_sqlite_store_is_filtered_and_the_comparison_is_stored_beside_it(
        local_store, tmp_path, capsys):
    root, uri, ids = local_store
    code, out, _ = _compare(["--tracking-uri", uri, "--filter", "params.model.mechanism != 'rmt'",
                             "--out", str(tmp_path / "cmp")], capsys)
    assert code == 0
    page = Page((tmp_path / "cmp" / "report.html").read_text())
    assert [r["run id"] for r in page.table("runs")] == ids[:2]   # xl and lamemo, not rmt
    run_id = re.search(r"comparison run: (\w+)", out)[1]
    assert f"report: {tmp_path / 'cmp' / 'report.html'}" in out
    client = MlflowClient(uri)
    assert client.get_run(run_id).data.tags["memtrain.compared_run_ids"] == ",".join(ids[:2])
    # as a training run's store: artifacts beside the db, not in ./mlruns
    assert (root / "mlartifacts" / run_id / "artifacts" / "report.html").is_file()


def test_runs_beyond_max_runs_and_unknown_experiments_are_left_out_with_the_reason(
        local_store, tmp_path, capsys):
    _, uri, ids = local_store
    code, _, _ = _compare(["--tracking-uri", uri, "--experiment", "memtrain", "--experiment",
                           "no-such-experiment", "--max-runs", "2", "--out", str(tmp_path),
                           "--no-log"], capsys)
    assert code == 0
    page = Page((tmp_path / "report.html").read_text())
    assert [r["run id"] for r in page.table("runs")] == ids[1:]
    text = " ".join(page.sections["left-out"]["text"].split())
    assert f"run {ids[0]} (xl-mem4-seed0-a-long-suffix-to-cut): beyond --max-runs 2" in text
    assert "experiment 'no-such-experiment': no such experiment in the store" in text


def _dead_server() -> str:
    return f"http://127.0.0.1:{free_port()}"


@pytest.mark.parametrize("case", ["no store in runs/", "missing sqlite file", "dead server",
                                  "only foreign or unknown runs", "invalid filter"])
def test_nothing_to_compare_exits_2_with_a_clear_message(case, real, local_store, tmp_path,
                                                         capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # no runs/mlflow.db here: the default store is missing
    args, expect = {
        "no store in runs/": ([], f"{tmp_path}/runs/mlflow.db does not exist (training runs "
                                  "share <runs root>/mlflow.db"),
        "missing sqlite file": (["--tracking-uri", f"sqlite:///{tmp_path}/nope/mlflow.db"],
                                "does not exist"),
        "dead server": (["--tracking-uri", _dead_server()], "no MLflow server answers"),
        "only foreign or unknown runs": (
            ["--tracking-uri", real["uri"], "--run-ids", real["foreign"], "f" * 32],
            "nothing to compare (run "),
        "invalid filter": (["--tracking-uri", local_store[1], "--filter", "params.x ==="],
                           "invalid --filter"),
    }[case]
    code, _, err = _compare([*args, "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert expect in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "nope").exists()   # no empty store created by a typo
    assert not (tmp_path / "runs").exists()


def test_protocol_text_from_params_reads_like_the_training_log():
    from train.evaluate import EvalProtocol

    for changes in ({}, {"max_segments": 0}, {"carry_memory": False, "same_length": True},
                    {"weights": "bf16 (training copy)"}, {"weights": ""}):
        proto = EvalProtocol(**{**PROTOCOL, **changes})
        params = {k: str(v) for k, v in {**PROTOCOL, **changes}.items()}
        assert describe_protocol(params) == proto.describe()


# ---------------------------------------------------------------------------- browser
def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe:
        return exe
    why = "chromium is not installed (Debian: bash scripts/setup.sh as root installs it)"
    if os.environ.get("CI") or os.environ.get("MEMTRAIN_REQUIRE_CHROMIUM") == "1":
        pytest.fail(f"{why}; required because CI or MEMTRAIN_REQUIRE_CHROMIUM=1 is set")
    pytest.skip(why)


def _render(html: Path, profile: Path) -> tuple[dict[str, str], list[str]]:
    """Load the page in headless Chromium: (#selfcheck's attributes after load, console
    lines). --virtual-time-budget lets the load event and the page's check run first."""
    done = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
         "--virtual-time-budget=5000", "--enable-logging=stderr", "--v=0", "--dump-dom",
         html.absolute().as_uri()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return Page(done.stdout).selfcheck, console


def test_the_report_renders_in_headless_chromium_with_every_image_and_no_error(
        real_report, many_report, tmp_path):
    for out, page, *_ in (real_report, many_report):
        check, console = _render(out / "report.html", tmp_path / "profile")
        n_imgs = sum(len(s["imgs"]) for s in page.sections.values())
        assert check["data-status"] == "ok", check
        assert (check["data-images"], check["data-broken"], check["data-errors"]) == (
            str(n_imgs), "0", "0")
        assert console == []


def test_the_browser_check_catches_a_broken_image_and_a_script_error(real_report, tmp_path):
    """The harness above can fail: the same page with an external image (refused by the
    page's Content-Security-Policy), a corrupt one and a script error."""
    out, _ = real_report
    bad = (out / "report.html").read_text().replace("</footer>", (
        '</footer><img src="http://example.invalid/x.png" alt="external">'
        '<img src="data:image/png;base64,AAAA" alt="corrupt"><script>noSuchFunction();</script>'))
    (tmp_path / "bad.html").write_text(bad)
    check, console = _render(tmp_path / "bad.html", tmp_path / "profile")
    assert check["data-status"] == "failed"
    assert check["data-broken"] == "2" and int(check["data-errors"]) >= 1
    assert any("Content Security Policy" in line for line in console)
    assert any("noSuchFunction" in line for line in console)
