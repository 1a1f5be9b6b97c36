"""Model FLOPs of a training step and MFU, model FLOPs utilization: the one place both are
defined (the training loop's log line and MLflow, benchmarks/gpu_scale.py).

The count is PaLM's (Chowdhery et al. 2022, Appendix B), the estimate nanoGPT's
`estimate_mfu` also uses: a parameter multiplies each row it reads once in the forward
(2 FLOPs: a multiply and an add) and twice in the backward (the input's gradient and the
weight's), 6 per parameter and row; the attention adds, per layer and query row,
QK^T and P·V over its K keys, 2·2·d·K forward, 3x that for forward + backward. For a
segment of one batch row:

    flops = 6 N_body R + 6 N_head T + 12 sum_calls(d_attn Q K)

- N_body: the parameters of the decoder stack (every layer, and what the mechanism adds
  to it), multiplied with each of the R rows a layer runs: the segment's L tokens AND the
  memory rows the mechanism adds (RMT 2m read/write rows, ARMT m, Titans' persistent and
  retrieved rows, LaMemo's refreshed memory), as its `segment_shapes` states them
  (model/shapes.py; the numbers the planner reads);
- N_head: the output head's d x V (tied or not), for the T = L scored tokens only; an
  adaptive softmax (Grave et al. 2016) counts its head cluster only, so its tails, which
  only rare tokens reach, are left out: there the MFU is a lower bound;
- the attention of every call the shapes state, Q query rows against K keys (an XL memory
  adds its M cached keys: K = M + L), d_attn = heads x head width. PaLM's convention: the
  causal half is not subtracted.
The embedding lookups cost no FLOPs. A frozen parameter (a pretrained base under
`model.hf.finetune` frozen or lora) has no weight gradient: 4 FLOPs per row, not 6 (taken
over the model's share of trained parameters). Left out or approximated, as in PaLM's
estimate: normalisations, softmaxes and elementwise work; XL's re-projection of its M
cached keys and the relative-position projection over its D distances, both counted over
the segment's R rows instead; Titans' and ARMT's memory updates beyond their matrix
products on rows. An estimate of the model's work, not a count of the kernels run.

A checkpointed segment's forward runs again inside the backward (`bptt.checkpoint_segments`,
train/bptt.py): that recompute is real work but not useful work, and is NOT counted: MFU
is model FLOPs per second (PaLM's definition), so checkpointing shows as a lower MFU.

    MFU = model FLOPs done on this rank per second / the device's peak FLOP/s

tokens/s counts data tokens only (the tokens trained on for the first time); the FLOPs
count every row the model actually ran, memory rows and a sliding window's re-run segments
included. The peak is the dense tensor-core figure of NVIDIA's datasheets for the dtype the
matmuls run in (PEAK_TFLOPS); on the CPU or a GPU not listed MFU is absent, unless the run
sets `peak_tflops` (train/config.py).
"""

from __future__ import annotations

import functools
import warnings

import torch

from model import backbone_of
from model.backbones.base import FlopCounts

# Dense (not 2:4 sparse) TFLOP/s by dtype, NVIDIA's datasheets; a device name is matched by
# the first entry it contains (the more specific names first: "A100" before "A10").
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("GH200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H200 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("A10G", {}),           # a cloud variant of its own, not the A10's figures: unknown
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("V100S", {"fp16": 130.0, "fp32": 16.4}),           # Volta: no bf16, no TF32
    ("V100-PCIE", {"fp16": 112.0, "fp32": 14.0}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
)


def matmul_dtype(precision: str, tf32: bool, device_name: str) -> str:
    """The dtype the run's matrix products use: bf16 / fp16 as configured; an fp32 run
    multiplies in TF32 on Ampere and newer unless `deepspeed.tf32: false`
    (train/precision.py `configure_matmul`)."""
    if precision != "fp32":
        return precision
    volta = "V100" in device_name
    return "tf32" if tf32 and not volta else "fp32"


def peak_flops(device_name: str | None, dtype: str = "bf16") -> float | None:
    """Peak FLOP/s of `device_name` (torch.cuda.get_device_name) in `dtype`; None when the
    device, or that dtype on it, is not in the table."""
    for name, peaks in PEAK_TFLOPS:
        if device_name and name in device_name:
            tflops = peaks.get(dtype)
            return None if tflops is None else tflops * 1e12
    return None


def training_flops(n_body: int, n_head: int, rows: float, targets: float,
                   attention: float, trained_share: float = 1.0) -> float:
    """THE formula (module docstring): FLOPs of one forward + backward of one batch row.
    rows: R, rows through each decoder layer (mean over layers); targets: T, rows through
    the head; attention: sum over the attention calls of d_attn x Q x K."""
    per_param = 4 + 2 * trained_share   # forward 2, input gradient 2, weight gradient 2
    return per_param * (n_body * rows + n_head * targets) + 12 * attention


# What the formula needs of the model that does not depend on the segment length, as each
# backbone counts it (model/backbones/: `flop_counts`).
ModelCounts = FlopCounts


def model_counts(cfg) -> ModelCounts:
    """N_body, N_head and the trained share of `cfg` (a ModelConfig), counted without
    weights by its backbone."""
    return backbone_of(cfg).flop_counts(cfg)


def segment_flops(cfg, counts: ModelCounts, seg_len: int) -> float:
    """Model FLOPs of one segment of `seg_len` tokens of one batch row with a full memory,
    from what its backbone and mechanism state of it (model/backbones/ `flop_terms`)."""
    rows, attention, aux_targets = backbone_of(cfg).flop_terms(cfg, seg_len)
    return training_flops(counts.n_body, counts.n_head, rows, seg_len + aux_targets,
                          attention, counts.trained_share)


class Throughput:
    """The model FLOPs of one rank's windows, summed on the host from their shapes (no
    device sync), read as {"model_tflops_per_s", "mfu"} per log interval.

        tp = Throughput(cfg, device)
        tp.add(window.segments)           # every micro-step
        metrics.update(tp.read(seconds))  # every log line; "mfu" only with a known peak
    """

    def __init__(self, cfg, device: torch.device):
        self.cfg, self.flops, self.note = cfg.model, 0.0, ""
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        dtype = matmul_dtype(cfg.deepspeed.precision, cfg.deepspeed.tf32, name)
        if cfg.peak_tflops is not None:
            self.peak: float | None = cfg.peak_tflops * 1e12
        else:
            self.peak = peak_flops(name, dtype) if device.type == "cuda" else None
            if self.peak is None:
                what = f"{dtype} on {name}" if device.type == "cuda" else f"the {name}"
                self.note = (f"MFU not reported: no peak FLOP/s known for {what} (set "
                             "peak_tflops=<dense TFLOP/s of one device>)")
        try:
            self.counts: ModelCounts | None = model_counts(cfg.model)
        except Exception as err:   # a metric never stops training
            self.counts, self.peak = None, None
            self.note = f"model FLOPs and MFU not reported: {type(err).__name__}: {err}"
            warnings.warn(self.note, stacklevel=2)

    @functools.lru_cache(maxsize=16)   # noqa: B019 (one per run; a few segment lengths)
    def per_row(self, seg_len: int) -> float:
        # A mechanism's stated shapes may be read off a module it builds (Titans'), which
        # draws from the random stream: counting inside the loop must leave it where the
        # run's dropout and an exact resume expect it.
        with torch.random.fork_rng(devices=[]):
            return segment_flops(self.cfg, self.counts, seg_len)

    def add(self, segments) -> None:
        """A window's segments (train/bptt.py `Window.segments`): tokens [rows, L + 1]."""
        if self.counts is None:
            return
        for s in segments:
            rows, width = s.tokens.shape
            self.flops += rows * self.per_row(width - 1)

    def read(self, seconds: float) -> dict[str, float]:
        """The interval's metrics since the last read (then starts a new interval)."""
        flops, self.flops = self.flops, 0.0
        if self.counts is None or seconds <= 0:
            return {}
        out = {"model_tflops_per_s": flops / seconds / 1e12}
        if self.peak:
            out["mfu"] = flops / seconds / self.peak
        return out
