"""benchmarks/bench_loss.py in its quick CPU mode, as the prepared GPU call runs it at
GPT-2's head (scripts/gpu_session.sh LOSS=1): both variants measured in child processes,
the head GEMM timed at V and at V padded to a multiple of 128."""

import json

from benchmarks.bench_loss import main


def test_the_loss_benchmark_reports_both_paths_and_the_padded_gemm(tmp_path):
    out = tmp_path / "loss.json"
    assert main(["--rows", "128", "--vocab", "1000", "--d-model", "32", "--gemm",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for variant in ("plain", "chunked"):
        assert res[variant]["peak_mb"] >= 0 and res[variant]["step_s"] > 0
    assert res["gemm"]["V"]["vocab"] == 1000 and res["gemm"]["V128"]["vocab"] == 1024
    assert res["gemm"]["padded_over_plain"] > 0
