"""train.tracking: what a run records in MLflow and locally, and that tracking never stops
training (dead server, server dying mid-run, disabled ranks).

Checks read the runs back with a separate MlflowClient, i.e. as a user browsing them would.
"""

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

# mlflow_server_fixture provides the `mlflow_server` fixture: pytest collects it from here.
from daemons import run_ok
from mlflow import MlflowClient
from mlflow_server import free_port, mlflow_server_fixture, start_mlflow_server  # noqa: F401

from train.run_dir import HEALTH_TIMEOUT_S
from train.tracking import Tracker, TrackingWarning, flatten_params

PARAMS = {"model": {"mem_len": 4, "cutoffs": [10, 20], "clamp_len": None},
          "optim": {"lr": 2.5e-4, "betas": [0.9, 0.999]}, "seed": 0}
FLAT = {"model.mem_len": "4", "model.cutoffs": "[10, 20]", "model.clamp_len": "None",
        "optim.lr": "0.00025", "optim.betas": "[0.9, 0.999]", "seed": "0"}
TAGS = {"model_type": "transformer_xl", "mechanism": "xl", "git_commit": "abc123"}
LOSSES = {1: 3.0, 2: 2.5, 3: 2.25, 4: 2.0}


@pytest.fixture(autouse=True)
def clean_mlflow_env():
    """No MLFLOW_* from the caller's shell, and none of what Tracker sets for http URIs
    (retries, timeout) leaks into later tests."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    for k in saved:
        del os.environ[k]
    yield
    for k in [k for k in os.environ if k.startswith("MLFLOW_")]:
        del os.environ[k]
    os.environ.update(saved)


def run_training(tracker: Tracker, losses: dict[int, float]) -> None:
    for step, loss in losses.items():
        tracker.log_metrics({"train/loss": loss, "lr": 1e-3 * step}, step=step)
    tracker.log_metrics({"valid/loss": 2.2}, step=max(losses))


def history(client: MlflowClient, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tracking_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, TrackingWarning)]


def assert_complete_run(client: MlflowClient, run_id: str) -> None:
    """Params, metric history, tags, artifacts and final status of a run logged by
    run_training + log_json + close()."""
    run = client.get_run(run_id)
    assert run.data.params == FLAT
    assert history(client, run_id, "train/loss") == LOSSES
    assert history(client, run_id, "lr") == pytest.approx({s: 1e-3 * s for s in LOSSES})
    assert history(client, run_id, "valid/loss") == {4: 2.2}
    assert TAGS.items() <= run.data.tags.items()
    assert {a.path for a in client.list_artifacts(run_id)} >= {"eval.json", "loss_curve.png"}
    assert run.info.status == "FINISHED"


def test_default_store_records_params_metrics_tags_artifacts_and_status(tmp_path):
    run_dir = tmp_path / "run"
    tracker = Tracker(run_dir, run_name="xl-tiny", params=PARAMS, tags=TAGS)
    # One store for every run under the runs root (the run dir's parent).
    assert tracker.tracking_uri == f"sqlite:///{tmp_path.absolute()}/mlflow.db"
    run_training(tracker, LOSSES)
    path = tracker.log_json({"valid_loss": 2.2}, "eval.json")
    tracker.close()

    assert json.loads(path.read_text()) == {"valid_loss": 2.2}
    assert (run_dir / "loss_curve.png").stat().st_size > 1000
    assert_complete_run(MlflowClient(tracker.tracking_uri), tracker.run_id)
    # The artifacts stay beside the store (not ./mlruns of the working directory).
    assert (tmp_path / "mlartifacts" / tracker.run_id / "artifacts" / "loss_curve.png").exists()
    lines = jsonl(run_dir)
    assert [(r["step"], r.get("train/loss")) for r in lines] == [*LOSSES.items(), (4, None)]
    assert all(abs(r["time"] - time.time()) < 600 for r in lines)


def test_close_without_status_leaves_a_live_training_run_running(tmp_path):
    """An evaluation tool logging into a run whose training is still live (status.json says
    "running") closes its own tracker with None: the run must stay RUNNING, not FAILED."""
    run_dir = tmp_path / "run"
    training = Tracker(run_dir, params={"lr": 1.0})
    training.log_metrics({"train/loss": 3.0}, step=1)
    evaluation = Tracker(run_dir, params={"lr": 1.0})
    assert evaluation.run_id == training.run_id
    evaluation.log_metrics({"valid/loss": 2.5}, step=1)
    evaluation.close(None)
    client = MlflowClient(training.tracking_uri)
    assert client.get_run(training.run_id).info.status == "RUNNING"
    training.close()
    assert client.get_run(training.run_id).info.status == "FINISHED"


def test_resume_continues_the_same_run_and_keeps_first_param_values(tmp_path):
    run_dir = tmp_path / "run"
    first = Tracker(run_dir, params={"lr": 1.0, "seed": 0})
    first.log_metrics({"train/loss": 3.0}, step=1)
    first.close("KILLED")  # e.g. preempted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = Tracker(run_dir, params={"lr": 0.5, "seed": 0, "extra": 7})
    assert second.run_id == first.run_id
    client = MlflowClient(second.tracking_uri)
    assert client.get_run(second.run_id).info.status == "RUNNING"
    second.log_metrics({"train/loss": 2.0}, step=2)
    second.close()

    run = client.get_run(first.run_id)
    assert history(client, first.run_id, "train/loss") == {1: 3.0, 2: 2.0}
    assert run.info.status == "FINISHED"
    # MLflow refuses to change a param: the first value stays, the new one is a tag.
    assert run.data.params == {"lr": "1.0", "seed": "0", "extra": "7"}
    assert run.data.tags["memtrain.resumed_param.lr"] == "0.5"
    assert any("lr" in m for m in tracking_warnings(caught))
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert len(jsonl(run_dir)) == 2


def test_changed_tracking_uri_starts_a_new_run_and_warns(tmp_path):
    run_dir = tmp_path / "run"
    first = Tracker(run_dir)
    first.close()
    other = f"sqlite:///{tmp_path}/other.db"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = Tracker(run_dir, tracking_uri=other)
    second.close()
    assert second.run_id is not None and second.run_id != first.run_id
    assert any("changed" in m and other in m for m in tracking_warnings(caught))
    assert json.loads((run_dir / "tracking.json").read_text())["tracking_uri"] == other


def test_jobs_opening_a_new_shared_sqlite_store_at_once_all_get_their_run(tmp_path):
    # Sweep elements share one store; MLflow's first-use schema migration is not safe to run
    # twice at once (the loser leaves the database half-migrated for every later job).
    uri = f"sqlite:///{tmp_path}/shared.db"
    code = ("import sys, warnings; warnings.simplefilter('error', UserWarning); "
            "from train.tracking import Tracker; "
            "t = Tracker(sys.argv[1], tracking_uri=sys.argv[2], run_name=sys.argv[3]); "
            "t.log_metrics({'loss': 1.0}, 1); t.close(); "
            "sys.exit(0 if t.run_id else 1)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / n), uri, n],
                              cwd=Path(__file__).resolve().parents[1], stderr=subprocess.PIPE,
                              text=True) for n in ("a", "b", "c")]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    runs = MlflowClient(uri).search_runs(
        [MlflowClient(uri).get_experiment_by_name("memtrain").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["a", "b", "c"]


def test_many_and_long_params_are_batched_and_truncated(tmp_path, monkeypatch):
    # MLflow 3.17's own stores accept 250 params in one call and cut long values themselves;
    # its REST API documents <= 100 per call, and with MLFLOW_TRUNCATE_LONG_VALUES=false (or
    # other backends) a long value is refused. So: watch the batch sizes, turn truncation off.
    monkeypatch.setenv("MLFLOW_TRUNCATE_LONG_VALUES", "false")
    sizes = []
    log_batch = MlflowClient.log_batch

    def counting_log_batch(self, run_id, metrics=(), params=(), tags=(), **kw):
        sizes.append(len(params))
        return log_batch(self, run_id, metrics=metrics, params=params, tags=tags, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", counting_log_batch)
    params = {f"p{i:03d}": i for i in range(250)} | {"long": "x" * 7000}
    tracker = Tracker(tmp_path / "run", tracking_uri=f"sqlite:///{tmp_path}/m.db",
                      params=params)
    tracker.close()
    assert sum(sizes) == 251 and max(sizes) <= 100
    run = MlflowClient(tracker.tracking_uri).get_run(tracker.run_id)
    assert len(run.data.params) == 251 and run.data.params["p249"] == "249"
    assert len(run.data.params["long"]) == 6000 and run.data.params["long"].endswith("]")
    assert "long" in run.data.tags["memtrain.truncated_params"]


@pytest.mark.slow  # starts a real mlflow server (~10 s)
def test_real_server_records_params_metrics_tags_artifacts_and_status(tmp_path,
                                                                      mlflow_server):
    tracker = Tracker(tmp_path / "run", tracking_uri=mlflow_server, experiment="srv",
                      params=PARAMS, tags=TAGS)
    assert tracker.tracking_uri == mlflow_server and tracker.run_id is not None
    run_training(tracker, LOSSES)
    tracker.log_json({"valid_loss": 2.2}, "eval.json")
    tracker.close()
    client = MlflowClient(mlflow_server)
    assert_complete_run(client, tracker.run_id)
    local = tmp_path / "downloaded"
    local.mkdir()
    got = client.download_artifacts(tracker.run_id, "eval.json", str(local))
    assert json.loads(Path(got).read_text()) == {"valid_loss": 2.2}


def test_a_store_directory_without_file_locks_is_not_used_and_the_warning_says_why_and_the_fix(
        tmp_path, monkeypatch):
    """Lustre mounted without -o flock refuses flock (ENOLCK here, ENOSYS on some mounts):
    the sqlite store is not touched, and the one warning names the directory, where the
    numbers go instead and how to get MLflow back."""
    def no_locks(_file, _operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    runs = tmp_path / "runs"
    run_dir = runs / "t"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = Tracker(run_dir, run_name="t", params=PARAMS, tags=TAGS)
        run_training(tracker, LOSSES)
        tracker.close()
    [message] = tracking_warnings(caught)
    assert f"{runs.absolute()} does not support them (flock failed with ENOLCK" in message
    assert f"metrics go only to {run_dir.absolute() / 'metrics.jsonl'}" in message
    assert "mount that file system with -o flock" in message
    assert "tracking.uri" in message and "MLflow server" in message
    assert tracker.run_id is None and not (runs / "mlflow.db").exists()
    assert [r["step"] for r in jsonl(run_dir)] == [1, 2, 3, 4, 4]
    assert not list(runs.glob(".memtrain-lock-probe-*"))      # the probe file is gone


@pytest.mark.parametrize("server", ["refusing", "silent"])
def test_unreachable_server_warns_once_and_keeps_local_metrics(tmp_path, server):
    # refusing: nothing listens on the port. silent: the kernel accepts the connection but
    # no one ever answers (a hung server), which only a timeout can end.
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    run_dir = tmp_path / "run"
    # What opening a tracker costs here and now without any server wait (a refused
    # connection answers at once): a busy machine slows this part, not the timeouts.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.monotonic()
        Tracker(tmp_path / "baseline", tracking_uri=f"http://127.0.0.1:{free_port()}",
                params=PARAMS, tags=TAGS).close()
        baseline = time.monotonic() - start
    with socket.socket() as listener, warnings.catch_warnings(record=True) as caught:
        if server == "silent":
            listener.bind(("127.0.0.1", port))
            listener.listen(16)
        warnings.simplefilter("always")
        start = time.monotonic()
        tracker = Tracker(run_dir, tracking_uri=uri, params=PARAMS, tags=TAGS)
        # A hung server costs the /health probe's timeout, not MLflow's 5 s request timeout.
        waited = time.monotonic() - start - baseline
        assert waited < (HEALTH_TIMEOUT_S + 1.5 if server == "silent" else 10), (waited,
                                                                                 baseline)
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
        for step in range(1, 51):
            tracker.log_metrics({"train/loss": 1.0 / step}, step=step)
        tracker.log_json({"a": 1}, "eval.json")
        tracker.set_tags({"x": "y"})
        tracker.close("FAILED")
    messages = tracking_warnings(caught)
    assert len(messages) == 1 and uri in messages[0]
    assert tracker.run_id is None
    assert [r["step"] for r in jsonl(run_dir)] == list(range(1, 51))
    assert (run_dir / "loss_curve.png").exists()


def test_a_test_server_never_takes_a_foreign_listener_on_its_port_for_itself(tmp_path,
                                                                           monkeypatch):
    # tests/mlflow_server.py picks a free port; were it taken before the server binds, the
    # process listening there (here: this test) is named and refused, on every try.
    import mlflow_server

    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", 0))
        foreign.listen()
        monkeypatch.setattr(mlflow_server, "free_port", lambda: foreign.getsockname()[1])
        with pytest.raises(RuntimeError, match=rf"port taken by pid {os.getpid()} \("):
            start_mlflow_server(tmp_path / "server")


@pytest.mark.slow  # starts a real mlflow server (~10 s)
def test_server_dying_mid_run_warns_once_and_keeps_local_metrics(tmp_path):
    uri, stop = start_mlflow_server(tmp_path / "server")
    try:
        tracker = Tracker(tmp_path / "run", tracking_uri=uri)
        tracker.log_metrics({"train/loss": 1.0}, step=1)
    finally:
        stop()
    # Worst case: the port now accepts connections but never answers (a hung server). Every
    # MLflow request would wait the 5 s timeout; only the first one may.
    port = int(uri.rsplit(":", 1)[1])
    # The same local work without a server (the metrics file, the curve at close): what a
    # busy machine adds to it is not waiting on the hung server.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        local = Tracker(tmp_path / "local", tracking_uri=f"http://127.0.0.1:{free_port()}")
        start = time.monotonic()
        for step in range(2, 22):
            local.log_metrics({"train/loss": 1.0 / step}, step=step)
        local.close()
        baseline = time.monotonic() - start
    with socket.socket() as hung, warnings.catch_warnings(record=True) as caught:
        hung.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        hung.bind(("127.0.0.1", port))
        hung.listen(64)
        warnings.simplefilter("always")
        start = time.monotonic()
        for step in range(2, 22):
            tracker.log_metrics({"train/loss": 1.0 / step}, step=step)
        tracker.close()
        waited = time.monotonic() - start - baseline
        assert waited < 12, (waited, baseline)   # one 5 s timeout, not one per request
    messages = tracking_warnings(caught)
    assert len(messages) == 1 and uri in messages[0]
    assert [r["step"] for r in jsonl(tmp_path / "run")] == list(range(1, 22))


def test_nan_loss_and_odd_metric_names_do_not_stop_mlflow_logging(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = Tracker(tmp_path / "run", tracking_uri=f"sqlite:///{tmp_path}/m.db")
        tracker.log_metrics({"train/loss": float("nan"), "grad norm (max)": 1.0}, step=1)
        tracker.log_metrics({"train/loss": 2.0}, step=2)
        tracker.close()
    assert tracking_warnings(caught) == []
    client = MlflowClient(tracker.tracking_uri)
    got = history(client, tracker.run_id, "train/loss")
    assert got[2] == 2.0 and got[1] != got[1]  # NaN
    assert history(client, tracker.run_id, "grad norm _max_") == {1: 1.0}
    # A user's sqlite store keeps artifacts beside its db, not in ./mlruns of the cwd.
    assert (tmp_path / "mlartifacts" / tracker.run_id / "artifacts" / "loss_curve.png").exists()


def test_disabled_tracker_writes_nothing_and_does_not_import_mlflow(tmp_path):
    run_dir = tmp_path / "run"
    tracker = Tracker(run_dir, enabled=False, params=PARAMS, tags=TAGS)
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    tracker.log_json({"a": 1}, "eval.json")
    tracker.log_artifact(__file__)
    tracker.set_tags({"x": "y"})
    tracker.close()
    assert not run_dir.exists() and tracker.run_id is None
    # A fresh interpreter: this one has mlflow imported already.
    code = ("import sys; from train.tracking import Tracker; "
            f"t = Tracker({str(run_dir)!r}, enabled=False); "
            "t.log_metrics({'loss': 1.0}, step=1); t.close(); "
            "print('mlflow' in sys.modules)")
    out = run_ok([sys.executable, "-c", code], cwd=Path(__file__).parents[1])
    assert out.stdout.strip() == "False"
    assert not run_dir.exists()


def test_flatten_params_joins_keys_with_dots_and_renders_lists_and_none():
    tree = {"model": {"mem_len": 4, "rmt": {"num_mem_tokens": 2}, "cutoffs": [1, 2],
                      "names": ("a", "b"), "clamp_len": None, "tie": True, "opts": {}},
            "lr": 0.5}
    assert flatten_params(tree) == {
        "model.mem_len": "4", "model.rmt.num_mem_tokens": "2", "model.cutoffs": "[1, 2]",
        "model.names": '["a", "b"]', "model.clamp_len": "None", "model.tie": "True",
        "model.opts": "{}", "lr": "0.5"}
    assert flatten_params({"x": 1}, prefix="cfg") == {"cfg.x": "1"}


def test_mfu_reaches_mlflow_only_where_the_device_peak_is_known(tmp_path):
    """The loop's throughput metrics (train/throughput.py) as a user browsing the run sees
    them: model TFLOP/s always, MFU with a peak (here `peak_tflops`), none without one (the
    CPU): no made-up number."""
    from types import SimpleNamespace

    import torch

    from train.config import from_dict
    from train.throughput import Throughput
    model = {"mechanism": "xl", "vocab_size": 16, "n_layer": 2, "d_model": 16, "n_head": 2,
             "d_inner": 32, "tgt_len": 4, "mem_len": 4}
    segment = SimpleNamespace(tokens=torch.zeros(2, 5, dtype=torch.long))
    runs = {}
    for name, peak in (("with-peak", 0.001), ("cpu", None)):
        cfg = from_dict({"model": model, "data": {"path": "unused"}, "peak_tflops": peak})
        throughput = Throughput(cfg, torch.device("cpu"))
        throughput.add([segment, segment])
        tracker = Tracker(tmp_path / name, run_name=name)
        tracker.log_metrics({"loss": 2.0, **throughput.read(0.01)}, step=10)
        runs[name] = (MlflowClient(tracker.tracking_uri), tracker.run_id, throughput)
    client, run_id, throughput = runs["with-peak"]
    flops = 2 * 2 * throughput.per_row(4)
    assert history(client, run_id, "mfu") == pytest.approx({10: flops / 0.01 / 1e9})
    assert history(client, run_id, "model_tflops_per_s") == pytest.approx(
        {10: flops / 0.01 / 1e12})
    client, run_id, _ = runs["cpu"]
    metrics = client.get_run(run_id).data.metrics
    assert "mfu" not in metrics and metrics["model_tflops_per_s"] > 0
