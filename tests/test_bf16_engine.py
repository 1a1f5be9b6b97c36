"""bf16 through the whole DeepSpeed engine on 2 gloo ranks (DeepSpeed's CPU accelerator runs
bf16): one mechanism per ZeRO stage, XL at ZeRO-1 (DeepSpeed's bf16 optimizer, fp32 gradient
sums), LaMemo at ZeRO-2, RMT with a BPTT window and segment checkpointing at ZeRO-3. For each:

- the losses follow the fp32 run of the same seed, rows and dropout masks (conftest.zero_run);
- the checkpoint holds what train/precision.py says: bf16 module weights, fp32 master weights
  and Adam moments, every row's memory in bf16; the exported weights are the fp32 masters;
- the run continued from its step-6 checkpoint reproduces the uninterrupted bf16 run bit for
  bit;
- continued from that checkpoint on 1 rank, through DeepSpeed's universal conversion of its
  bf16 checkpoint, it goes on learning.

Tolerance of bf16 against fp32: bf16 rounds every matmul input and activation to 8 bits of
mantissa (relative error up to 2^-9 = 0.2%), so a step's loss moves by a few 1e-3 nats at
most at this size, and the weights drift apart step by step. Measured over these 10 steps:
at most 3.5e-4 (XL), 6.9e-4 (LaMemo), 5.8e-4 (RMT) nats. 0.01 leaves ~15x of room and is
still 15x smaller than what the runs learn (their loss falls by > 0.15 over these steps).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import (
    ROOT,
    ZERO_RUN_SECTIONS,
    copy_run,
    rewind_run,
    run_train,
    step_losses,
    tiny_config,
)

from train.checkpoint import find_latest, load_rank_payload

pytestmark = pytest.mark.slow

CASES = [("xl", 1), ("lamemo", 2), ("rmt", 3)]
BF16_TOLERANCE = 0.01   # nats per step against fp32 (module docstring)


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory):
    """(mechanism, stage) -> (uninterrupted run dir, its copy stopped at step 6, that copy
    continued to the end), each trained once for this module: two launches, the whole run
    saving at step 6 on its way (save_every), and its copy resuming from that checkpoint."""
    cache = {}

    def get(mechanism, stage):
        if (mechanism, stage) not in cache:
            tmp = tmp_path_factory.mktemp(f"bf16-{mechanism}-z{stage}")
            sections = dict(ZERO_RUN_SECTIONS[mechanism])
            ds = {"zero_stage": stage, "precision": "bf16"}
            whole = tiny_config(tmp, "whole", deepspeed=ds, save_every=6, **sections)
            run_train(whole, nproc=2)
            # The run as a stop at step 6 leaves it: its step-6 checkpoint the latest.
            for name in ("at-six", "continued"):
                copy_run(tmp / "runs" / "whole", tmp, name)
                rewind_run(tmp / "runs" / name, 6)
            done = run_train(tmp / "continued.yaml", nproc=2)
            assert "resumed from" in done.stdout, done.stdout[-3000:]
            cache[mechanism, stage] = tuple(tmp / "runs" / n for n in ("whole", "at-six",
                                                                        "continued"))
        return cache[mechanism, stage]

    return get


@pytest.mark.parametrize("mechanism, stage", CASES)
def test_bf16_training_follows_the_fp32_run_within_bf16_rounding(mechanism, stage, bf16_runs,
                                                                 zero_run):
    whole, _, _ = bf16_runs(mechanism, stage)
    bf16, fp32 = step_losses(whole), step_losses(zero_run(mechanism, stage))
    assert sorted(bf16) == sorted(fp32) == list(range(1, 11))
    gaps = {s: abs(bf16[s] - fp32[s]) for s in fp32}
    assert max(gaps.values()) < BF16_TOLERANCE, gaps
    assert gaps[1] > 0, "the bf16 run computed exactly what fp32 did: was it bf16 at all?"
    first, last = sum(bf16[s] for s in (1, 2, 3)) / 3, sum(bf16[s] for s in (8, 9, 10)) / 3
    assert last < first - 0.15   # it learned
    ds = json.loads((whole / "ds_config.json").read_text())
    assert ds["bf16"]["enabled"] and ds["data_types"]["grad_accum_dtype"] == "fp32"
    assert ds["communication_data_type"] == "fp32"


@pytest.mark.parametrize("mechanism, stage", CASES)
def test_a_bf16_checkpoint_holds_bf16_weights_and_memory_and_fp32_master_weights(
        mechanism, stage, bf16_runs):
    whole, _, _ = bf16_runs(mechanism, stage)
    info = find_latest(whole / "checkpoints")
    module = {}
    if stage < 3:   # ZeRO-3 keeps each rank's parameter shards in its optimizer file only
        module = torch.load(info.path / "mp_rank_00_model_states.pt", map_location="cpu",
                            weights_only=False)["module"]
        assert module and {t.dtype for t in module.values()} == {torch.bfloat16}
    # The optimizer's master weights and both Adam moments: fp32, in every rank's file.
    for rank_file in sorted(info.path.glob("*zero_pp_rank_*optim_states.pt")):
        opt = torch.load(rank_file, map_location="cpu", weights_only=False)
        opt = opt["optimizer_state_dict"]
        masters = opt.get("single_partition_of_fp32_groups") or opt.get("fp32_flat_groups")
        assert masters and {t.dtype for t in masters} == {torch.float32}, rank_file.name
        inner = opt.get("base_optimizer_state") or opt["optimizer_state_dict"]
        moments = [t for s in inner["state"].values() for k, t in s.items()
                   if k in ("exp_avg", "exp_avg_sq")]
        assert moments and {t.dtype for t in moments} == {torch.float32}, rank_file.name
    # Every rank's rows of memory were carried (and saved) in bf16, but for LaMemo's
    # log-normalisers (the s of Eq. 11, LaMemo paper), kept in fp32 by design: they are
    # log-sum-exps of tens, where bf16's steps of 0.125 would move the mixing weight α by 10%.
    for rank in range(2):
        memory = load_rank_payload(info, rank)["memory"]
        dtypes = {(path.startswith("log_norm"), t.dtype) for path, t in _tensors(memory)
                  if t.is_floating_point()}
        assert dtypes and all(d == (torch.float32 if log_norm else torch.bfloat16)
                              for log_norm, d in dtypes), (rank, dtypes)
    # The exported weights are the fp32 masters, of which the module's are the rounding.
    exported = load_file(str(whole / "model.safetensors"))
    assert {t.dtype for t in exported.values()} == {torch.float32}
    if stage < 3:
        for name, weight in module.items():
            if name in exported:
                assert torch.equal(exported[name].bfloat16(), weight), name
        assert any(not torch.equal(exported[n], module[n].float()) for n in exported
                   if n in module), "the exported weights are only the bf16 copy, widened"


def _tensors(obj, path=""):
    """(dotted path, tensor) of every tensor in a nested dict / list."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}.{i}")


@pytest.mark.parametrize("mechanism, stage", CASES)
def test_a_stopped_bf16_run_resumes_to_the_uninterrupted_losses_bit_for_bit(mechanism, stage,
                                                                             bf16_runs):
    whole, _, continued = bf16_runs(mechanism, stage)
    assert step_losses(continued) == step_losses(whole)
    a, b = load_file(str(whole / "model.safetensors")), load_file(
        str(continued / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mechanism, stage", CASES)
def test_a_bf16_checkpoint_of_2_ranks_continues_on_1_rank_through_the_universal_format(
        tmp_path, mechanism, stage, bf16_runs):
    whole, at_six, _ = bf16_runs(mechanism, stage)
    cfg = copy_run(at_six, tmp_path, "one-rank")
    done = run_train(cfg, ["max_steps=10"], nproc=1)   # its saved config says 6
    out = done.stdout + done.stderr
    assert "resuming a 2-rank checkpoint on 1 ranks" in out, out[-3000:]
    losses, ref = step_losses(tmp_path / "runs" / "one-rank"), step_losses(whole)
    assert sorted(losses) == list(range(1, 11))
    # Only dropout draws differ from the 2-rank run (its RNG restarts on a new world size):
    # the converted bf16 weights and fp32 optimizer state carry the training on.
    assert max(abs(losses[s] - ref[s]) for s in range(7, 11)) < 0.1, (losses, ref)
    assert max(losses[s] for s in range(7, 11)) < ref[1] - 0.15


def test_the_quickstart_in_bf16_ends_within_0_1_nats_of_its_fp32_run(tmp_path):
    # The README's first command, 1200 steps, in both precisions (same seed and data). Its
    # test loss sits on a slope of learning to copy, where rounding moves a run by a few
    # hundredths of a nat (measured on this CPU: fp32 1.874, bf16 1.916); a precision that
    # broke the memory or the optimizer would end near chance, 2.77.
    final = {}
    for precision in ("fp32", "bf16"):
        run_dir = tmp_path / "runs" / precision
        run_train(ROOT / "configs" / "quickstart.yaml",
                  [f"run_dir={run_dir}", f"data.path={tmp_path / 'data'}",
                   "tracking.enabled=false", f"deepspeed.precision={precision}"])
        final[precision] = json.loads((run_dir / "eval_report.json").read_text())["main"]
    assert final["bf16"]["loss"] == pytest.approx(final["fp32"]["loss"], abs=0.1), final
    assert final["fp32"]["loss"] < 2.2, final   # the memory was learned
