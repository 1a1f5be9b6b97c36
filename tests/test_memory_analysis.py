"""Memory analyses: recording attention changes nothing, the recorded probabilities are
distributions over the allowed keys, the analyses equal naive loops over them, and
`memtrain analyze` writes its plots into a trained run and its MLflow run."""

import json
from collections import defaultdict

import matplotlib.image
import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from reference import tiny_model
from train_helpers import run_train, tiny_config

import model.attention as attention
from evaluation.analyze_cli import main_analyze
from evaluation.memory_plots import DistanceProfile, MemoryAnalysis, RMTBlocks, recording
from model.mechanisms.rmt.core import rmt_allowed

SEG = 4
CASES = {
    "xl": dict(mechanism="xl", mem_len=6),
    "lamemo": dict(mechanism="lamemo", mem_len=6),
    "rmt": dict(mechanism="rmt", mem_len=0),
    "rmt+cache": dict(mechanism="rmt", mem_len=6),
}


def _model(case: str, **extra):
    kw = {**CASES[case], **extra}
    return tiny_model(kw.pop("mechanism"), **kw)


def _run(model, x, reset_at=None):
    """Segments of x with the memory carried; row 0's memory is reset before segment
    `reset_at`. Returns [(state entering, output)] per segment."""
    state, out = None, []
    with torch.no_grad():
        for s in range(x.shape[1] // SEG):
            if s == reset_at:
                state = state.reset_rows(torch.tensor([True] + [False] * (x.shape[0] - 1)))
            res = model(x[:, s * SEG:(s + 1) * SEG], state, targets=x[:, s * SEG:(s + 1) * SEG])
            out.append((state, res))
            state = res.state
    return out


def _tensors(state):
    return [t for v in vars(state).values()
            for t in (v if isinstance(v, list) else [v]) if isinstance(t, torch.Tensor)]


# ----------------------------------------------------------------------------- recording
@pytest.mark.parametrize("case", list(CASES))
def test_recording_attention_gives_the_plain_paths_outputs_exactly_and_the_fused_ones_closely(
        case):
    x = torch.randint(0, 23, (2, 5 * SEG))
    fused = _model(case)
    plain = _model(case, attn_impl="plain")
    recorded = _model(case, attn_impl="fused")
    runs = [_run(fused, x), _run(plain, x)]
    with recording(recorded.core, alpha=case == "lamemo") as (logs, _):
        runs.append(_run(recorded, x))
    assert all(len(log) > 0 for log in logs)
    for (_, f), (_, p), (_, r) in zip(*runs, strict=True):
        assert torch.equal(p.nll, r.nll)
        torch.testing.assert_close(f.nll, r.nll, rtol=1e-5, atol=1e-5)
        for tp, tr in zip(_tensors(p.state), _tensors(r.state), strict=True):
            assert torch.equal(tp, tr)


def test_recording_restores_the_logs_and_without_it_the_fused_kernel_runs(monkeypatch):
    calls = []
    sdpa = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    model = _model("xl")
    x = torch.randint(0, 23, (2, 2 * SEG))
    with recording(model.core) as (logs, _):
        _run(model, x)
    assert calls == [] and [len(log) for log in logs] == [2, 2]
    assert all(layer.attn.attn_log is None for layer in model.core.layers)
    _run(model, x)
    assert len(calls) == 2 * 2  # segments x layers


@pytest.mark.parametrize("case", list(CASES))
def test_recorded_probabilities_sum_to_one_per_row_and_masked_keys_get_zero(case):
    model = _model(case)
    x = torch.randint(0, 23, (3, 5 * SEG))
    with recording(model.core) as (logs, _):
        _run(model, x, reset_at=3)
    m = model.cfg.rmt.num_mem_tokens
    for log in logs:
        seg = -1
        for rec in log:
            prob, lay = rec.prob, rec.layout
            seg += lay.branch == "causal"  # LaMemo adds a look-ahead record once memory exists
            torch.testing.assert_close(prob.sum(-1), torch.ones(prob.shape[:-1]))
            q_pos = lay.query_start + torch.arange(prob.shape[2])
            k_pos = lay.key_start + torch.arange(prob.shape[3])
            if case.startswith("rmt"):
                masked = ~rmt_allowed(m, SEG, lay.query_start, None, False, "cpu")[0]
            elif lay.branch == "look_ahead":
                masked = k_pos[None] <= q_pos[:, None]  # only keys right of the memory row
            else:
                masked = k_pos[None] > q_pos[:, None]  # causal
            assert (prob[:, :, masked] == 0).all()
            # Row 0's memory (XL, LaMemo) or cache (RMT) was reset before segment 3.
            blocks = dict(lay.blocks)
            old = blocks.get("memory", blocks.get("cache", 0))  # columns 0 .. old-1
            if seg == 3 and old and lay.branch == "causal":
                assert (prob[0, :, :, :old] == 0).all()
                assert (prob[1:, :, :, :old] > 0).any()


# ----------------------------------------------------------------------------- analyses
def test_lamemo_alpha_has_one_mean_per_layer_and_memory_slot_within_zero_one():
    model = tiny_model("lamemo", n_layer=3, mem_len=8)
    analysis = MemoryAnalysis(model)
    x = torch.randint(0, 23, (3, 6 * SEG))
    state, manual = None, []
    for s in range(6):
        model.core.alpha_log = []
        with torch.no_grad():
            model(x[:, s * SEG:(s + 1) * SEG], state)
        manual.append(model.core.alpha_log)
        state = analysis.step(x[:, s * SEG:(s + 1) * SEG], state, count=s >= 2)
    model.core.alpha_log = None
    alpha = analysis.alpha.mean()
    assert alpha.shape == (3, 8)  # [n_layer, mem_len], slot 0 = oldest
    assert np.isfinite(alpha).all() and (alpha >= 0).all() and (alpha <= 1).all()
    # Full memory from segment 2 on: the mean over segments, rows and heads of alpha_log.
    for layer in range(3):
        expect = torch.stack([m[layer] for m in manual[2:]]).double().mean(dim=(0, 1, 3))
        np.testing.assert_allclose(alpha[layer], expect.numpy(), rtol=1e-6)
    data = analysis.alpha.result()
    assert data["memory_index"] == list(range(8)) and len(data["alpha"]) == 3


def test_alpha_leaves_out_memory_entries_of_reset_rows():
    model = tiny_model("lamemo", n_layer=2, mem_len=8)
    analysis = MemoryAnalysis(model)
    x = torch.randint(0, 23, (3, 6 * SEG))
    state = None
    for s in range(6):
        if s == 3:  # row 0: memory empty at segment 3, half full (4 of 8) at segment 4
            state = state.reset_rows(torch.tensor([True, False, False]))
        state = analysis.step(x[:, s * SEG:(s + 1) * SEG], state, count=s >= 2)
    heads, forwards = 2, 4
    full = 3 * heads * forwards
    expect = [full - 2 * heads] * 4 + [full - heads] * 4
    assert analysis.alpha.result()["entries"] == [expect, expect]


def _naive_distance(runs, logs):
    """mass[layer][d] from loops: query i of a segment entering with m_now memory entries
    sits at m_now + i on [memory ∘ segment], key j at j."""
    out = []
    for log in logs:
        causal = [rec for rec in log if rec.layout.branch == "causal"]
        mass, rows, memory = defaultdict(float), 0, 0.0
        for (state, _), rec in zip(runs, causal, strict=True):
            m_now = state.mem_len_now if state is not None else 0
            for b_row in rec.prob.tolist():
                for head in b_row:
                    for i, row in enumerate(head):
                        rows += 1
                        for j, p in enumerate(row):
                            if m_now + i - j >= 0:
                                mass[m_now + i - j] += p
                            memory += p if j < m_now else 0.0
        out.append(([mass[d] / rows for d in range(max(mass) + 1)], memory / rows))
    return out


@pytest.mark.parametrize("mechanism", ["xl", "lamemo"])
def test_attention_mass_vs_distance_sums_to_one_per_layer_and_equals_a_naive_loop(mechanism):
    model = tiny_model(mechanism, mem_len=6)
    x = torch.randint(0, 23, (2, 5 * SEG))
    analysis, state = MemoryAnalysis(model), None
    for s in range(5):
        state = analysis.step(x[:, s * SEG:(s + 1) * SEG], state)
    with recording(model.core) as (logs, _):
        runs = _run(model, x)
    result = analysis.distance.result()
    assert result["distance"] == list(range(6 + SEG))
    for layer, (mass, memory) in enumerate(_naive_distance(runs, logs)):
        got = np.array(result["mass"][layer])
        assert got.sum() == pytest.approx(1.0, abs=1e-6)  # float32 rows
        np.testing.assert_allclose(got, mass, rtol=1e-9, atol=1e-12)
        assert result["memory_share"][layer] == pytest.approx(memory, rel=1e-9)


def test_distance_profile_grows_with_the_memory_and_counts_every_query_row():
    model = tiny_model("xl", mem_len=6)
    profile = DistanceProfile(2)
    with recording(model.core) as (logs, _):
        _run(model, torch.randint(0, 23, (2, 3 * SEG)))
    for layer, log in enumerate(logs):
        for rec in log:
            profile.add(layer, rec)
    result = profile.result()
    assert result["query_rows"] == [3 * 2 * 2 * SEG] * 2  # segments x rows x heads x queries
    assert len(result["distance"]) == 6 + SEG  # longest: newest query to oldest memory entry


@pytest.mark.parametrize("mem_len", [0, 6])
def test_rmt_map_marks_read_segment_write_blocks_and_blocks_share_sums_to_one(mem_len):
    model = tiny_model("rmt", mem_len=mem_len, rmt={"num_mem_tokens": 2})
    with recording(model.core) as (logs, _):
        _run(model, torch.randint(0, 23, (2, 3 * SEG)))
    rec = logs[1][-1]
    sample = RMTBlocks.sample_map(rec)
    cache = min(mem_len, 2 * (2 * 2 + SEG))  # cache holds every position of earlier segments
    assert sample["query_blocks"] == [("read", 0, 2), ("segment", 2, 6), ("write", 6, 8)]
    expect_keys = [("read", 0, 2), ("segment", 2, 6), ("write", 6, 8)]
    if cache:
        expect_keys = [("cache", 0, cache)] + [(n, a + cache, b + cache) for n, a, b in expect_keys]
    assert sample["key_blocks"] == expect_keys
    m = sample["map"]
    assert m.shape == (8, 8 + cache)
    np.testing.assert_allclose(m.sum(1), 1.0, rtol=1e-5)
    assert (m[0:2, cache + 2:] == 0).all()      # read rows see only the read block
    assert (np.triu(m[2:6, cache + 2:cache + 6], 1) == 0).all()  # causal among tokens
    assert (m[2:6, cache + 6:] == 0).all()      # tokens do not see the write block
    assert (m[6:8, cache:] > 0).all()           # write rows see every block
    blocks = RMTBlocks(2)
    for layer, log in enumerate(logs):
        for r in log[1:]:
            blocks.add(layer, r)
    for layer in blocks.result()["block_share"]:
        assert set(layer) == {"read", "segment", "write"}
        for shares in layer.values():
            assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6)


def test_plots_are_pngs_with_the_plotted_numbers_as_json(tmp_path):
    for mechanism in ("lamemo", "rmt"):
        model = tiny_model(mechanism, mem_len=6)
        analysis, state = MemoryAnalysis(model), None
        x = torch.randint(0, 23, (2, 4 * SEG))
        for s in range(4):
            state = analysis.step(x[:, s * SEG:(s + 1) * SEG], state, count=s >= 2)
        files = analysis.write(tmp_path, mechanism, {"run": "t", "tgt_len": SEG, "mem_len": 6})
        names = sorted(p.name for p in files)
        expect = (["alpha_by_memory_index", "attention_vs_distance"] if mechanism == "lamemo"
                  else ["rmt_attention_maps"])
        assert names == sorted(f"{n}_{mechanism}.{ext}" for n in expect for ext in ("json", "png"))
        for path in files:
            if path.suffix == ".png":
                assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            else:
                data = json.loads(path.read_text())
                assert data["meta"]["segments"] == 2 and data["layers"] == [1, 2]


# ----------------------------------------------------------------------------- memtrain analyze
@pytest.fixture(scope="module")
def lamemo_run(tmp_path_factory):
    """A tiny LaMemo run trained for a few steps, tracked in its own sqlite MLflow store."""
    tmp = tmp_path_factory.mktemp("analyze")
    config = tiny_config(tmp, "lm", max_steps=4, model={"mechanism": "lamemo"},
                         eval={"max_segments": 2}, tracking={"experiment": "analysis-test"})
    run_train(config, launcher="single")
    return config, tmp / "runs" / "lm"


@pytest.mark.slow
def test_analyze_writes_the_mechanisms_plots_into_the_run_and_its_mlflow_run(lamemo_run, capsys):
    config, run_dir = lamemo_run
    assert main_analyze(["--config", str(config), "--split", "test", "--segments", "3",
                         "--rows", "2"]) == 0
    out = capsys.readouterr().out
    stems = ("attention_vs_distance", "alpha_by_memory_index")
    pngs = [run_dir / "analysis" / f"{s}_step00000004_test_m8_l8.png" for s in stems]
    for png in pngs:
        assert f"wrote {png}" in out
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(png)
        assert image.ndim == 3 and min(image.shape[:2]) > 100
        meta = json.loads(png.with_suffix(".json").read_text())["meta"]
        assert meta["segments"] == 3 and meta["mechanism"] == "LaMemo"
    state = json.loads((run_dir / "tracking.json").read_text())
    client = MlflowClient(state["tracking_uri"])
    logged = {a.path for a in client.list_artifacts(state["run_id"], "analysis")}
    assert {f"analysis/{p.name}" for p in pngs} <= logged
    assert {f"analysis/{p.with_suffix('.json').name}" for p in pngs} <= logged
    assert client.get_run(state["run_id"]).info.status == "FINISHED"


@pytest.mark.slow
def test_analyze_names_the_splits_when_asked_for_one_the_data_lacks(lamemo_run, capsys):
    config, _ = lamemo_run
    assert main_analyze(["--config", str(config), "--split", "tset", "--no-track"]) == 1
    err = capsys.readouterr().err
    assert "no split 'tset'" in err and "test, train, valid" in err


def test_analyze_without_a_checkpoint_says_so(tmp_path, capsys):
    config = tiny_config(tmp_path, "untrained")
    assert main_analyze(["--config", str(config)]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "untrained" / "analysis").exists()
