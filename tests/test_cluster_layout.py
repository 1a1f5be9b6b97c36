"""`memtrain submit` checks the job's rank layout against the run config before sbatch: the
batches divide among the ranks (the trainer's own rule, so submit and start agree), one rank
per GPU, a precision the GPU generation has; the errors name the fix. The paper configs say
which rank counts they fit and how they start on 32 ranks."""

import re
from pathlib import Path

import pytest
import torch

from cluster import torch_check
from cluster.layout import check_layout, default_precision, gpu_capability, gpu_model
from cluster.submit import main_submit
from data_pipeline.streams import LayoutError
from train.config import ConfigError, load_config
from train.trainer import check_run

ROOT = Path(__file__).resolve().parents[1]
PAPER_CONFIGS = ["enwik8-xl-base", "enwik8-lamemo-base", "wt103-xl-base", "wt103-rmt",
                 "copy-rmt"]


@pytest.fixture(autouse=True)
def cuda_torch(monkeypatch):
    """The nodes' python has a CUDA 12.6 torch (this venv's is the CPU build, which a GPU
    submit refuses: tests/test_cluster_torch.py)."""
    monkeypatch.setattr(torch_check, "probe", lambda python: {
        "version": "2.13.0+cu126", "cuda": "12.6",
        "archs": ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]})


def _submit(capsys, *argv):
    code = main_submit(["--dry-run", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_submit_refuses_batches_that_do_not_divide_among_32_ranks_and_names_the_fix(capsys):
    code, _, err = _submit(capsys, "--config", "enwik8-xl-base", "--nodes", "4",
                           "--gpus-per-node", "8", "--gpu-type", "a100")
    assert code == 2
    assert "data.global_batch: 22 rows do not divide among 32 ranks" in err
    assert "use data.global_batch=32" in err
    assert "eval.batch: 10 rows do not divide among 32 ranks" in err
    assert "use eval.batch=32" in err
    code, _, err = _submit(capsys, "--config", "wt103-xl-base", "--nodes", "4",
                           "--gpus-per-node", "8", "eval.batch=32")
    assert code == 2 and "use data.global_batch=64 (the multiple of 32 nearest 60)" in err
    # The documented 32-rank overrides pass, and the script is printed.
    code, out, err = _submit(capsys, "--config", "wt103-xl-base", "--nodes", "4",
                             "--gpus-per-node", "8", "data.global_batch=64", "eval.batch=32")
    assert code == 0, err
    assert out.startswith("#!/bin/bash")


def test_a_sweep_element_with_a_bad_layout_fails_before_sbatch(capsys):
    code, _, err = _submit(capsys, "--config", "quickstart", "--gpus-per-node", "0",
                           "--tasks-per-node", "2", "--sweep", "data.global_batch=8,7")
    assert code == 2 and "7 rows do not divide among 2 ranks" in err


def test_tasks_per_node_must_match_gpus_per_node(capsys):
    code, _, err = _submit(capsys, "--config", "copy-rmt", "--nodes", "2", "--gpus-per-node",
                           "4", "--tasks-per-node", "8")
    assert code == 2 and "would share GPUs: use --tasks-per-node 4" in err
    code, _, err = _submit(capsys, "--config", "copy-rmt", "--gpus-per-node", "8",
                           "--tasks-per-node", "4")
    assert code == 2 and "leave 4 of 8 GPUs idle" in err


def test_bf16_is_refused_on_v100_and_on_cpu_jobs_fp16_is_fine_on_both_generations(capsys):
    code, _, err = _submit(capsys, "--config", "copy-rmt", "--gpus-per-node", "8",
                           "--gpu-type", "v100", "deepspeed.precision=bf16")
    assert code == 2
    assert "bf16 needs an Ampere (compute capability 8.0) or newer GPU; v100 is 7.0" in err
    assert "use deepspeed.precision=fp16" in err
    # A site's type name resolves to its generation.
    code, _, err = _submit(capsys, "--config", "copy-rmt", "--gpus-per-node", "8",
                           "--gpu-type", "v100-sxm2-32gb", "deepspeed.precision=bf16")
    assert code == 2 and "v100-sxm2-32gb is 7.0" in err
    for gpu in ("v100", "a100"):
        code, out, err = _submit(capsys, "--config", "copy-rmt", "--gpus-per-node", "8",
                                 "--gpu-type", gpu, "deepspeed.precision=fp16")
        assert code == 0, err
    code, out, err = _submit(capsys, "--config", "copy-rmt", "--gpus-per-node", "8",
                             "--gpu-type", "v100")
    assert code == 0 and "deepspeed.precision=fp16" in out  # the generation's default
    code, _, err = _submit(capsys, "--config", "quickstart", "--gpus-per-node", "0",
                           "deepspeed.precision=bf16")
    assert code == 2 and "a CPU job (--gpus-per-node 0): use deepspeed.precision=fp32" in err


def test_gpu_generations():
    assert gpu_capability("A100_80GB") == (8, 0) and gpu_capability("a10g") == (8, 6)
    assert gpu_capability("mystery") is None and default_precision("mystery") is None
    assert default_precision("v100") == "fp16" and default_precision("h100") == "bf16"


# (name as SLURM gres or NVML / torch.cuda.get_device_name write it, its model, capability)
GPU_NAMES = [
    ("tesla_v100", "v100", (7, 0)), ("tesla_v100-sxm2-32gb", "v100", (7, 0)),
    ("Tesla V100-SXM2-32GB", "v100", (7, 0)), ("v100-sxm2-32gb", "v100", (7, 0)),
    ("nvidia_a100-sxm4-80gb", "a100", (8, 0)), ("NVIDIA A100-SXM4-80GB", "a100", (8, 0)),
    ("a100_80gb", "a100", (8, 0)), ("NVIDIA H100 80GB HBM3", "h100", (9, 0)),
    ("h100", "h100", (9, 0)), ("NVIDIA H200", "h200", (9, 0)),
    ("NVIDIA A10", "a10", (8, 6)), ("a10", "a10", (8, 6)), ("a10g", "a10g", (8, 6)),
    ("NVIDIA L4", "l4", (8, 9)), ("l4", "l4", (8, 9)), ("NVIDIA L40S", "l40s", (8, 9)),
    ("l40s", "l40s", (8, 9)), ("l40", "l40", (8, 9)), ("Tesla T4", "t4", (7, 5)),
    ("NVIDIA A30", "a30", (8, 0)), ("NVIDIA A40", "a40", (8, 6)),
    ("NVIDIA RTX A6000", "a6000", (8, 6)), ("Quadro RTX 8000", "rtx8000", (7, 5)),
]


@pytest.mark.parametrize("name, model, capability", GPU_NAMES)
def test_gpu_names_of_slurm_gres_and_nvml_resolve_to_their_model_exactly(name, model,
                                                                        capability):
    """Vendor words (nvidia, tesla) are dropped and a word must equal the model: matched by
    prefix, "tesla_v100" or "NVIDIA A10" named nothing and the job kept fp32 silently."""
    assert gpu_model(name) == model
    assert gpu_capability(name) == capability
    assert default_precision(name) == ("bf16" if capability >= (8, 0) else "fp16")


@pytest.mark.parametrize("name", ["mystery", "tesla_k80", "NVIDIA GeForce RTX 3090", "a1000",
                                  "l4x", "h1000", "80gb"])
def test_a_name_without_a_known_model_word_has_no_capability(name):
    """Not the model its name starts with: an RTX A1000 is not an A100."""
    assert gpu_model(name) is None and gpu_capability(name) is None


def test_an_unknown_gpu_type_is_named_at_submit_and_the_configs_precision_stays(capsys):
    code, out, err = _submit(capsys, "--config", "copy-rmt", "--gpus-per-node", "8",
                             "--gpu-type", "tesla_k80", "deepspeed.precision=fp16")
    assert code == 0, err
    assert "--gpu-type tesla_k80 names no GPU model" in err
    assert "deepspeed.precision stays as the config says (fp16)" in err
    # A known model is not warned about, and its precision is chosen.
    code, out, err = _submit(capsys, "--config", "copy-rmt", "--gpus-per-node", "8",
                             "--gpu-type", "nvidia_a100-sxm4-80gb")
    assert code == 0 and "names no GPU model" not in err
    assert "deepspeed.precision=bf16" in out


@pytest.mark.parametrize("argv, why", [
    (["--gpus-per-node", "8"], "no --gpu-type was given"),
    (["--gpus-per-node", "8", "--gpu-type", "tesla_k80"],
     "--gpu-type tesla_k80 is not a known model"),
    (["--gpus-per-node", "8", "--gpu-type", "a100", "deepspeed.precision=fp32"],
     "the override deepspeed.precision=fp32 chooses it"),
    (["--gpus-per-node", "8", "--gpu-type", "a100"], None),                # bf16 chosen
    (["--gpus-per-node", "8", "--gpu-type", "tesla_v100"], None),          # fp16 chosen
    (["--gpus-per-node", "8", "--gpu-type", "mystery", "deepspeed.precision=bf16"], None),
    (["--gpus-per-node", "0"], None),                                      # a CPU job
])
def test_a_gpu_job_is_warned_loudly_exactly_when_it_would_train_in_fp32(capsys, argv, why):
    """The warning says why (no or an unknown --gpu-type, or fp32 chosen) and how to choose
    bf16 or fp16; a job whose GPUs train in half precision, or a CPU job, gets none."""
    code, _, err = _submit(capsys, "--config", "copy-rmt", *argv)
    assert code == 0, err
    if why is None:
        assert "trains in fp32" not in err
        return
    assert "WARNING: this job trains in fp32 on its GPUs (8 per node)" in err and why in err
    assert "deepspeed.precision=bf16" in err and "deepspeed.precision=fp16" in err
    assert "--gpu-type a100/h100 (bf16) or v100 (fp16)" in err


@pytest.mark.parametrize("global_batch, eval_batch, world", [
    (22, 10, 32), (32, 10, 32), (32, 32, 32), (64, 0, 32), (60, 10, 10), (60, 10, 4),
    (40, 0, 8), (16, 16, 2), (7, 0, 1)])
def test_submit_and_the_trainers_start_check_agree(global_batch, eval_batch, world):
    """One rule (data_pipeline.streams.rows_of_rank) for both: what submit accepts starts."""
    cfg = load_config("quickstart", [f"data.global_batch={global_batch}",
                                     f"eval.batch={eval_batch}"])
    try:
        check_run(cfg, world, torch.device("cpu"))
        starts = True
    except (ConfigError, LayoutError):
        starts = False
    try:
        check_layout(cfg, [], nodes=1, tasks_per_node=world, gpus_per_node=0)
        submits = True
    except ConfigError:
        submits = False
    assert submits == starts


def _rank_comments(name: str) -> tuple[list[int], str]:
    text = (ROOT / "configs" / f"{name}.yaml").read_text()
    fits = re.search(r"^# Fits ([\d, ]+) ranks as shipped", text, re.M)
    on32 = re.search(r"^# 32 ranks \(4 nodes x 8 GPUs\): (.+)$", text, re.M)
    assert fits and on32, f"{name}: no rank-count comment"
    return [int(x) for x in fits.group(1).split(",")], on32.group(1).strip()


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_paper_configs_say_which_rank_counts_they_fit_and_how_they_start_on_32(name):
    fits, on32 = _rank_comments(name)
    cfg = load_config(name)
    batches = [cfg.data.global_batch] + ([cfg.eval.batch] if cfg.eval.batch else [])
    assert fits == [n for n in range(1, 65) if all(b % n == 0 for b in batches)]
    overrides = [] if on32 == "as shipped" else on32.split()
    cfg32 = load_config(name, overrides)
    check_layout(cfg32, overrides, nodes=4, tasks_per_node=8, gpus_per_node=8,
                 gpu_type="a100")
    if overrides:  # as shipped it would not start there, which is why the line exists
        with pytest.raises(ConfigError):
            check_layout(cfg, [], nodes=4, tasks_per_node=8, gpus_per_node=8, gpu_type="a100")
