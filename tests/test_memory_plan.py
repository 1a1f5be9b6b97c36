"""`memtrain plan` (planner/plan.py) and its activation model (planner/activations.py,
planner/window.py).

ZeRO model states against hand-computed numbers and against the bytes DeepSpeed was measured
to hold (BENCHMARKS.md, "ZeRO: model-state memory per rank"); monotonicity in k and mem_len;
the largest-k search; the CLI's exit code when nothing fits; one tiny window measured on the
CPU (saved-tensor bytes and peak allocation, train/memory_probe.py) against the
model.
"""

from __future__ import annotations

import pytest

from model import ModelConfig
from planner.activations import Dims, count_params
from planner.plan import (
    GIB,
    largest,
    main_plan,
    model_states,
    setup_for,
    total_bytes,
    zero_buffers,
)
from planner.window import predict_window, window_memory
from train.config import load_config
from train.memory_probe import measure

PSI = 1_000_000


@pytest.mark.parametrize("precision,stage,expected", [
    # mixed precision, Rajbhandari et al. 2020 §5: 2 + 2 + K=12 bytes, N_d = 8
    ("bf16", 0, (2_000_000, 2_000_000, 12_000_000)),
    ("bf16", 1, (2_000_000, 2_000_000, 1_500_000)),
    ("fp16", 2, (2_000_000, 250_000, 1_500_000)),
    ("bf16", 3, (250_000, 250_000, 1_500_000)),
    # fp32: 4 + 4 + 8 (Adam m, v), plus DeepSpeed's fp32 master partition from stage 1 on
    ("fp32", 0, (4_000_000, 4_000_000, 8_000_000)),
    ("fp32", 1, (4_000_000, 4_000_000, 1_500_000)),
    ("fp32", 2, (4_000_000, 500_000, 1_500_000)),
    ("fp32", 3, (500_000, 500_000, 1_500_000)),
])
def test_zero_model_states_by_hand(precision, stage, expected):
    got = tuple(v for _, v in model_states(PSI, stage, precision, 8))
    assert got == pytest.approx(expected)


@pytest.mark.parametrize("precision,stage,expected", [
    # bf16/fp16 with fp32 gradient sums (the default deepspeed.grad_dtype): at stage 1 the
    # half gradients plus a whole fp32 buffer (2 + 4 B); from stage 2 fp32 partitions
    ("bf16", 1, (2_000_000, 6_000_000, 1_500_000)),
    ("fp16", 2, (2_000_000, 500_000, 1_500_000)),
    ("bf16", 3, (250_000, 500_000, 1_500_000)),
])
def test_fp32_gradient_sums_are_counted_in_the_model_states(precision, stage, expected):
    got = tuple(v for _, v in model_states(PSI, stage, precision, 8, grad_fp32=True))
    assert got == pytest.approx(expected)


def test_the_reduce_bucket_is_counted_in_the_communication_dtype():
    p = count_params(ModelConfig())
    z2 = {"zero_optimization": {"stage": 2}}
    assert zero_buffers({**z2, "communication_data_type": "fp32"}, "bf16", p) == 5e8 * 4


@pytest.mark.parametrize("stage,measured_mib", [(0, 314.4), (2, 235.8), (3, 196.5)])
def test_zero_model_states_match_deepspeed_measurement(stage, measured_mib):
    # BENCHMARKS.md: XL with 20,607,232 parameters, fp32, 2 ranks, bytes DeepSpeed held.
    got = sum(v for _, v in model_states(20_607_232, stage, "fp32", 2)) / 2 ** 20
    assert got == pytest.approx(measured_mib, abs=0.1)


def test_zero_buffers_follow_the_ds_config():
    p = count_params(ModelConfig())
    assert zero_buffers({"zero_optimization": {"stage": 0}}, "bf16", p) == 0
    assert zero_buffers({"zero_optimization": {"stage": 2}}, "bf16", p) == 5e8 * 2
    assert zero_buffers({"zero_optimization": {"stage": 2, "overlap_comm": True,
                                               "reduce_bucket_size": 1000}}, "fp32", p) == 8000
    z3 = zero_buffers({"zero_optimization": {"stage": 3}}, "bf16", p)
    assert z3 == (2 * 5e8 + 5e7 + p.largest_module) * 2     # stage 3 overlaps by default


def test_param_count_is_exact():
    from model import build_model

    cfg = ModelConfig(mechanism="rmt", vocab_size=300, cutoffs=[100, 200],
                      tie_projs=[False, True, True], mem_len=0)
    assert count_params(cfg).total == build_model(cfg).num_params()


TINY = {
    "xl": dict(mechanism="xl", mem_len=48),
    "lamemo": dict(mechanism="lamemo", mem_len=48),
    "rmt": dict(mechanism="rmt", mem_len=0, rmt={"num_mem_tokens": 8}),
    "rmt-cache": dict(mechanism="rmt", mem_len=32, pre_lnorm=True, rmt={"num_mem_tokens": 4}),
    "armt": dict(mechanism="armt", mem_len=0, pre_lnorm=True, rmt={"num_mem_tokens": 8},
                 armt={"d_key": 16}),
}


def _tiny(name, **extra) -> ModelConfig:
    kw = dict(vocab_size=200, n_layer=2, d_model=64, n_head=4, d_inner=256, tgt_len=32)
    return ModelConfig(**{**kw, **TINY[name], **extra})


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("seg,layers", [(False, False), (True, False), (False, True),
                                        (True, True)])
def test_more_depth_or_memory_never_predicts_less(name, seg, layers):
    cfg = _tiny(name, checkpoint_layers=layers)
    p = count_params(cfg)
    lo = 1 if name == "lamemo" else 0
    by_k = [window_memory(Dims(cfg, 4, cfg.mem_len), p, k + 1, seg).peak for k in range(6)]
    assert by_k == sorted(by_k) and by_k[-1] > by_k[0]
    by_m = [window_memory(Dims(cfg, 4, m), p, 2, seg).peak for m in range(lo, 200, 7)]
    assert by_m == sorted(by_m) and by_m[-1] > by_m[0]


def test_largest_finds_the_boundary():
    assert largest(lambda n: n <= 37, 0) == 37
    assert largest(lambda n: n <= 0, 0) == 0
    assert largest(lambda n: False, 0) is None
    assert largest(lambda n: n <= 5, 1) == 5


@pytest.fixture(scope="module")
def quickstart_setup():
    cfg = load_config("quickstart", ["deepspeed.precision=bf16"])
    return setup_for(cfg, 1024, nodes=1, per_node=1, margin_gib=0.0)


def test_largest_depth_fits_and_one_more_does_not(quickstart_setup):
    s = quickstart_setup
    m = s.cfg.model
    for seg in (False, True):
        # a GPU size that lands between two depths: the plan at k = 7 plus half a step
        at7 = total_bytes(s, 7, m.mem_len, seg, False)
        at8 = total_bytes(s, 8, m.mem_len, seg, False)
        s.gpu_bytes = (at7 + at8) / 2
        k = largest(lambda d, seg=seg: total_bytes(s, d, m.mem_len, seg, False) <= s.gpu_bytes,
                    0)
        assert k == 7
        assert total_bytes(s, k, m.mem_len, seg, False) <= s.gpu_bytes
        assert total_bytes(s, k + 1, m.mem_len, seg, False) > s.gpu_bytes


def test_cli_plans_and_exits_zero_when_it_fits(capsys):
    assert main_plan(["--config", "quickstart", "--gpu", "v100-16gb",
                      "deepspeed.precision=fp16"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "largest bptt.depth that fits" in out
    # The carried cache as the model keeps it: mem_len rows per layer, not mem_len + tgt_len.
    assert "model states, ZeRO-1" in out and "XL cache 2 x [16, 16, 64]" in out


def test_a_compiled_run_is_planned_with_eager_activations_and_says_so(capsys):
    # bench_memory_plan.py --compile: compiled windows peak below the eager window the
    # planner models (tests/test_compile.py holds it for checkpointed layers).
    args = ["--config", "quickstart", "--gpu", "v100-16gb", "deepspeed.precision=fp16"]
    assert main_plan(args) == 0
    eager = capsys.readouterr().out
    assert main_plan(args + ["model.compile=true"]) == 0
    compiled = capsys.readouterr().out
    assert "model.compile" not in eager
    assert "model.compile: activations are counted as the eager model keeps them" in compiled


def test_cli_refuses_a_plan_that_cannot_fit_even_at_depth_zero(capsys):
    code = main_plan(["--config", "wt103-xl-base", "--gpu-memory-gb", "2", "--nodes", "1",
                      "--gpus-per-node", "1", "bptt.depth=3"])
    captured = capsys.readouterr()
    assert code == 1
    assert "DOES NOT FIT" in captured.out
    assert "does not fit on 2-GiB GPU even at bptt.depth=0" in captured.err


def test_cli_names_the_depth_that_fits_when_the_configured_one_does_not(capsys):
    cfg = load_config("quickstart", ["bptt.depth=400"])
    s = setup_for(cfg, 1024, 1, 1, 0.0)
    m = cfg.model.mem_len
    between = (total_bytes(s, 3, m, False, False) + total_bytes(s, 4, m, False, False)) / 2
    code = main_plan(["--config", "quickstart", "--gpu-memory-gb", repr(between / GIB),
                      "--margin-gb", "0", "bptt.depth=400"])
    captured = capsys.readouterr()
    assert code == 1
    assert "largest bptt.depth that fits, checkpoint_segments false: 3" in captured.out
    assert "at bptt.depth=400" in captured.err


def test_cli_usage_errors_exit_two(capsys):
    assert main_plan(["--config", "quickstart", "--gpu", "a100-80gb", "model.n_layer=0"]) == 2
    assert "model.n_layer" in capsys.readouterr().err
    for argv in (["--config", "quickstart"],                       # no GPU given
                 ["--config", "quickstart", "--gpu", "a100-81gb"]):
        with pytest.raises(SystemExit) as e:
            main_plan(argv)
        assert e.value.code == 2


@pytest.mark.parametrize("name,depth,ckpt", [("xl", 1, False), ("lamemo", 0, False),
                                             ("rmt", 2, False), ("rmt-cache", 1, True),
                                             ("armt", 2, False), ("armt", 1, True)])
def test_activation_model_matches_measured_bytes(name, depth, ckpt):
    """A tiny window on the CPU: the allocator's peak over forward + backward within 15% of
    the model (the accuracy target), and autograd's saved tensors (bytes by storage), which the
    model counts tensor by tensor, within 1%."""
    cfg = _tiny(name)
    got = measure(cfg, 4, depth, ckpt)
    want = predict_window(cfg, 4, depth, ckpt)
    assert want["peak"] == pytest.approx(got["peak"], rel=0.15)
    if not ckpt:
        assert want["saved"] == pytest.approx(got["saved"], rel=0.01)
