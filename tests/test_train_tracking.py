"""MLflow through real training runs: the default sqlite store and a real `mlflow server`
both hold the params, per-step metrics, artifacts and tags of a run; an unreachable server
never stops training and the metrics stay in the run directory."""

import json

import pytest
from mlflow import MlflowClient

# mlflow_server_fixture provides the `mlflow_server` fixture: pytest collects it from here.
from mlflow_server import free_port, mlflow_server_fixture  # noqa: F401
from train_helpers import run_train, step_losses, tiny_config

pytestmark = pytest.mark.slow

# model TFLOP/s always (train/throughput.py); no "mfu": the CPU has no known peak
METRICS = ("loss", "bpc", "lr", "tokens_per_s", "model_tflops_per_s", "grad_norm",
           "peak_mem_mb", "valid_loss", "final_loss")


def _artifacts(client, run_id, path=None):
    out = []
    for item in client.list_artifacts(run_id, path):
        out += _artifacts(client, run_id, item.path) if item.is_dir else [item.path]
    return out


def _check_run(client, run_id, steps):
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["model.mem_len"] == "8" and params["model.mechanism"] == "xl"
    assert params["ds.zero_optimization.stage"] == "1" and params["bptt.mode"] == "window"
    assert set(METRICS) <= set(run.data.metrics) and "mfu" not in run.data.metrics
    history = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, steps + 1))
    assert run.data.tags["mechanism"] == "xl" and run.data.tags["git_commit"]
    arts = _artifacts(client, run_id)
    for name in ("config/config.yaml", "config/ds_config.json", "eval_report.json",
                 "loss_curve.png"):
        assert name in arts, arts


def _config(tmp_path, name, **top):
    return tiny_config(tmp_path, name, max_steps=6, eval={"every": 3, "max_segments": 4},
                       deepspeed={"zero_stage": 1}, tracking={"experiment": "tracking-test"},
                       **top)


def test_a_run_logs_params_metrics_artifacts_and_tags_to_the_default_store(tmp_path):
    run_train(_config(tmp_path, "local"), nproc=1, env={"MLFLOW_TRACKING_URI": ""})
    run_dir = tmp_path / "runs" / "local"
    state = json.loads((run_dir / "tracking.json").read_text())
    assert state["tracking_uri"] == f"sqlite:///{(tmp_path / 'runs').absolute()}/mlflow.db"
    _check_run(MlflowClient(state["tracking_uri"]), state["run_id"], 6)


def test_a_two_rank_run_logs_once_to_a_real_mlflow_server(tmp_path, mlflow_server):
    run_train(_config(tmp_path, "served"), nproc=2, env={"MLFLOW_TRACKING_URI": mlflow_server})
    state = json.loads((tmp_path / "runs" / "served" / "tracking.json").read_text())
    assert state["tracking_uri"] == mlflow_server
    client = MlflowClient(mlflow_server)
    _check_run(client, state["run_id"], 6)
    exp = client.get_experiment_by_name("tracking-test")
    assert len(client.search_runs([exp.experiment_id])) == 1  # rank 0 only


def test_an_unreachable_server_warns_once_and_training_goes_on(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    # A peak given by hand (peak_tflops): the CPU's log lines then carry an MFU too.
    done = run_train(_config(tmp_path, "offline", peak_tflops=0.01), nproc=1,
                     env={"MLFLOW_TRACKING_URI": dead})
    out = done.stdout + done.stderr
    assert out.count(f"MLflow tracking at {dead} failed") == 1
    run_dir = tmp_path / "runs" / "offline"
    assert sorted(step_losses(run_dir)) == list(range(1, 7))
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mfu = [r["mfu"] for r in logged if "loss" in r]
    assert len(mfu) == 6 and all(0 < x < 1 for x in mfu)
    assert out.count(" tok/s | MFU ") == 6
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert (run_dir / "loss_curve.png").is_file() and (run_dir / "eval_report.json").is_file()
