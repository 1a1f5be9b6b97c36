"""The run configuration: one typed dataclass tree, read from YAML, overridable per field.

    cfg = load_config("configs/quickstart.yaml", ["model.mem_len=64", "bptt.depth=2"])

Every value is type-checked and range-checked here, before any process group, model or
tensor exists; a bad value raises `ConfigError` naming the dotted field and the reason (the
command line turns it into exit code 2). `model:` is `model.ModelConfig` itself, so the
model's own checks run too.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

# model.typed: the one typed builder of every config tree (the model's too) and its error.
# ConfigError is re-exported from here for the layers above (cluster/, the command lines),
# which build on the run config and need not know where in model/ it is defined.
from model import ModelConfig, backbone_of, resolve_shape
from model.io import model_file_metadata
from model.typed import ConfigError, build_dataclass
from model.weights_file import WeightsError
from train.recompute import parse_policy

# The shipped run configs and base DeepSpeed JSON, and how relative paths find them in a
# checkout and in an installed wheel (PROJECT_ROOT: the checkout, for the tests).
from .shipped import PROJECT_ROOT, config_file, locate_model_path, resolve_path  # noqa: F401

BPTT_MODES = ("window", "sliding")
SCHEDULES = ("cosine", "linear", "constant", "plateau", "wsd")
PRECISIONS = ("fp32", "bf16", "fp16")
GRAD_DTYPES = ("fp32", "half")  # half: the run's precision (bf16 or fp16)
OPTIMIZERS = ("adam", "adamw")
CURRICULUM_ADVANCE = ("steps", "accuracy")


@dataclass
class DataConfig:
    # Folder (or URL) holding manifest.json, written by `memtrain prepare` / `memtrain tasks`.
    path: str = ""
    # "repeat_blocks": write a generated long-range corpus into `path` if it has no manifest
    # (the quickstart; no download). "" = the data must exist.
    generate: str = ""
    train_split: str = "train"
    valid_split: str = "valid"
    test_split: str = "test"
    # B: stream rows summed over all ranks (README "Data: shards and ordered streams"); each
    # rank gets global_batch / world_size rows, which is also DeepSpeed's micro batch per GPU.
    global_batch: int = 16
    url_template: str = ""       # e.g. "pipe:aws s3 cp s3://bucket/enwik8/{shard} -"
    prefetch: int = 8            # batches the background reader keeps ready
    seed: int = 0                # episodic tasks: seed of the per-epoch sample permutation


@dataclass
class BPTTConfig:
    # k: gradients reach k segments back through RMT's memory (RMT §3.3 "BPTT-k"). For XL
    # and LaMemo, whose memory is detached, a window of k+1 segments only batches steps.
    depth: int = 0
    # window: non-overlapping windows of k+1 new segments, one backward each.
    # sliding: every step re-runs the previous k segments from the memory saved k steps
    # earlier, then the new one (the RMT LM code), so every loss reaches k segments back.
    mode: str = "window"
    # Activation checkpointing around every segment of a window: what stays alive across the
    # window is the memory passed between segments, so peak memory is nearly flat in k.
    checkpoint_segments: bool = False
    # What a checkpointed segment keeps besides its inputs, so that its recompute inside the
    # backward skips those ops (train/recompute.py; needs checkpoint_segments):
    #   full               nothing: the whole segment is recomputed (least memory)
    #   save-masks         dropout's 0/1 draws as bits (1/32 of the fp32 noise): no RNG in
    #                      the recompute (CPU; elsewhere the masks are drawn again)
    #   save-ffn-out       the FFN's d_inner -> d_model matmul output, every layer
    #                      (save-ffn-out:N, save-masks+ffn-out:N: in the first N layers only)
    #   save-linear        every linear-layer matmul output (q, k/v, positions, W_o, FFN, head)
    #   save-matmul        save-linear plus the attention matmuls (score matrices)
    #   save-masks+X       the masks and what save-X keeps
    # Results are exact under every policy (same losses and gradients as no checkpointing).
    # Measured time vs peak memory of each: BENCHMARKS.md, "Selective recompute for BPTT
    # windows".
    recompute: str = "full"
    # The last N segments of every window are not checkpointed (keep all activations).
    # N = 1 is free in peak memory (the last segment's backward runs first; recomputing it
    # would hold the same activations) and saves 1/(k+1) of the recompute time; every
    # further one costs a whole segment's activations. Needs checkpoint_segments.
    keep_last_segments: int = 0
    # sliding only: also count the re-run segments' losses (the RMT code's --bptt_bp).
    loss_on_rerun: bool = False


@dataclass
class CurriculumConfig:
    """Segment-count curriculum for task data. The RMT follow-up (Bulatov et al. 2023, "Scaling
    Transformer to 1M tokens and beyond with RMT", §3) reports that training straight on many
    segments fails and growing their number works. Here every stage cuts the same samples into
    more, shorter segments, so the memory has to carry more of each sample from stage to
    stage; the last stage is the task's own segment count. On a data set of several sample
    lengths (`memtrain tasks babilong --together`) a stage is instead the samples that are
    that many segments long: a curriculum over lengths at a fixed segment length."""

    # Segment counts, increasing, e.g. [1, 2, 3, 6]; each must divide the task's positions
    # (several-length data sets: each must be one of its lengths, in segments).
    # Empty: no curriculum (the task's own segment count from the first step).
    segments: list[int] = field(default_factory=list)
    # "steps": next stage every `every` optimizer steps; "accuracy": next stage at the first
    # validation (eval.every) whose answer accuracy reaches `threshold`.
    advance: str = "steps"
    every: int = 0
    threshold: float = 0.95


@dataclass
class OptimConfig:
    name: str = "adam"
    lr: float = 2.5e-4           # XL, LaMemo, RMT LM scripts
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    # cosine / linear decay to min_lr after warmup (XL, LaMemo); constant; plateau = constant
    # lr halved when validation stops improving (the RMT algorithmic tasks); wsd =
    # warmup-stable-decay: constant, then linear decay to min_lr over the last decay_steps
    # (Hu et al. 2024, MiniCPM §4.1). Its stable part is the constant schedule step for step,
    # so a constant run's checkpoint continues as a wsd run with a later max_steps.
    schedule: str = "cosine"
    warmup_steps: int = 0
    decay_steps: int = 0         # wsd only: length of the final decay
    min_lr: float = 0.0
    plateau_factor: float = 0.5
    plateau_patience: int = 8    # evaluations without improvement before the lr drops
    grad_clip: float = 0.25      # max global grad norm (XL code); 0 = off
    # fp16: windows in a row with a NaN/Inf loss before the run stops (each one's step is
    # skipped and its memory reset). 10 < the ~18 overflows in a row after which DeepSpeed's
    # loss scaler aborts from 2^16 (train/engine.py), so this clear error comes first.
    max_nonfinite_steps: int = 10


class EvalLengths(NamedTuple):
    tgt_len: int
    mem_len: int
    clamp_len: int
    same_length: bool


@dataclass
class EvalConfig:
    every: int = 0               # validate every N optimizer steps (0 = only at the end)
    split: str = "valid"         # split of the final evaluation (valid or test)
    # The papers evaluate with other lengths than they train with (XL §3.3, §4.5).
    # None (null, the default) means "as in training"; `lengths()` resolves them. Configs and
    # run directories written before kept 0 (tgt_len) and -1 (mem_len) for it: still read
    # as None, in __post_init__ only (mem_len 0 is a length: no memory).
    tgt_len: int | None = None
    mem_len: int | None = None
    clamp_len: int | None = None
    same_length: bool | None = None
    batch: int = 0               # eval rows over all ranks (0 = data.global_batch)
    max_segments: int = 0        # per row; 0 = the whole split
    # Segments at the start of each row excluded from the score, so that every counted
    # token has a full memory behind it.
    skip_segments: int = 0
    # Also evaluate the trained model with its memory switched off (mem_len 0), to show how
    # much of its score the memory carries.
    no_memory_baseline: bool = False

    def __post_init__(self):
        self.tgt_len = None if self.tgt_len == 0 else self.tgt_len
        self.mem_len = None if self.mem_len == -1 else self.mem_len

    def lengths(self, model: ModelConfig) -> EvalLengths:
        """The lengths evaluation runs with: each field set here, else the model's."""
        return EvalLengths(*(getattr(model, f) if getattr(self, f) is None else getattr(self, f)
                             for f in EvalLengths._fields))


@dataclass
class DeepSpeedSection:
    config: str = "ds_config.json"   # base DeepSpeed JSON (relative paths: project root)
    zero_stage: int | None = None    # overrides zero_optimization.stage
    precision: str = "fp32"          # fp32 (CPU), bf16 (A100), fp16 with loss scaling (V100)
    grad_accum: int = 1              # micro-steps (windows) per optimizer step
    # Under bf16/fp16, the dtype gradients are summed in: across micro-steps
    # (data_types.grad_accum_dtype) and across ranks (communication_data_type). fp32 by
    # default: a sum of 32 ranks' bf16 gradients keeps 8 bits of mantissa (train/precision.py).
    grad_dtype: str = "fp32"
    # fp32 runs on Ampere or newer GPUs multiply matrices in TF32 (10-bit mantissa inputs, fp32
    # sums); false keeps full fp32 matmuls. No effect on the CPU or under bf16/fp16.
    tf32: bool = True
    overrides: dict = field(default_factory=dict)  # merged into the JSON last


@dataclass
class TrackingConfig:
    enabled: bool = True
    experiment: str = "memtrain"
    # "" = env MLFLOW_TRACKING_URI, else one sqlite store shared by every run of the runs
    # root, <run_dir>/../mlflow.db (runs/mlflow.db); a run whose tracking.json names an
    # existing sqlite store keeps it. sqlite:///runs/<name>/mlflow.db gives a run its own.
    uri: str = ""


@dataclass
class DistributedConfig:
    # How long a collective (a barrier) waits for the slowest rank before the job fails.
    # DeepSpeed's default is 10 minutes (deepspeed/constants.py, DEEPSPEED_TIMEOUT), but rank
    # 0 alone converts a checkpoint to the universal format when the world size changes
    # (train/resume.py) and exports the final weights while the other ranks wait in a
    # barrier; on shared storage, for the 151M-parameter WikiText-103 model, either can take
    # longer. A rank that crashes ends the job anyway (srun --kill-on-bad-exit), so this only
    # bounds a real hang: 60 minutes is that much GPU time lost at most, once.
    timeout_minutes: int = 60


@dataclass
class RunConfig:
    name: str = "run"
    # Everything of a run lives here: resolved config, checkpoints, metrics, eval reports.
    run_dir: str = "runs/{name}"
    seed: int = 0
    max_steps: int = 1000            # optimizer steps
    log_every: int = 10
    save_every: int = 0              # checkpoint every N steps (0 = only at the end)
    keep_last: int = 3               # complete checkpoints kept
    threads: int = 0                 # torch intra-op threads per rank (0 = torch default)
    # A memtrain model file (`memtrain export` / `memtrain import`) whose weights start a
    # fresh run; a resumed run takes its weights from the checkpoint instead.
    init_from: str = ""
    # Dense TFLOP/s of one device in the run's matmul dtype, for the MFU beside tokens/s
    # (train/throughput.py); null: looked up from the GPU's name, absent on the CPU or an
    # unknown device.
    peak_tflops: float | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    bptt: BPTTConfig = field(default_factory=BPTTConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict[str, Any]:
        # The model writes its mechanisms' sections itself (model/config.py `to_dict`).
        return {**dataclasses.asdict(self), "model": self.model.to_dict()}

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir.format(name=self.name))


# ----------------------------------------------------------------------------- validation
def _check(cond: bool, name: str, reason: str) -> None:
    if not cond:
        raise ConfigError(name, reason)


def validate(cfg: RunConfig) -> RunConfig:
    """Cross-field checks the dataclasses cannot do alone."""
    _check(bool(cfg.name) and "/" not in cfg.name, "name", "must be a non-empty name without /")
    _check(cfg.log_every > 0, "log_every", f"must be > 0, got {cfg.log_every}")
    # 0 steps: the init_from weights checkpointed, scored and exported as a run, untrained.
    _check(cfg.max_steps > 0 or (cfg.max_steps == 0 and bool(cfg.init_from)), "max_steps",
           f"must be > 0 (0 only with init_from), got {cfg.max_steps}")
    for name in ("save_every", "threads"):
        _check(getattr(cfg, name) >= 0, name, f"must be >= 0, got {getattr(cfg, name)}")
    _check(cfg.peak_tflops is None or 0 < cfg.peak_tflops < float("inf"), "peak_tflops",
           f"must be a positive number of TFLOP/s (or null: from the GPU), got {cfg.peak_tflops}")
    _check(cfg.keep_last >= 1, "keep_last", f"must be >= 1, got {cfg.keep_last}")
    if cfg.init_from:
        # The header only (the tensors are read when the run starts): a file that is not a
        # model file is refused here, before a run directory is made.
        try:
            model_file_metadata(Path(cfg.init_from).expanduser())
        except WeightsError as err:
            what = ("" if "memtrain import" in str(err) else " (init_from takes a model "
                    "file `memtrain export` or `memtrain import` wrote)")
            raise ConfigError("init_from", f"{err}{what}") from None

    d = cfg.data
    _check(bool(d.path), "data.path", "is required (a folder with manifest.json)")
    _check(d.generate in ("", "repeat_blocks"), "data.generate",
           f"unknown generator {d.generate!r}; choose 'repeat_blocks' or ''")
    _check(d.global_batch > 0, "data.global_batch", f"must be > 0, got {d.global_batch}")
    _check(d.prefetch >= 1, "data.prefetch", f"must be >= 1, got {d.prefetch}")

    b = cfg.bptt
    _check(b.depth >= 0, "bptt.depth", f"must be >= 0, got {b.depth}")
    _check(b.mode in BPTT_MODES, "bptt.mode", f"unknown {b.mode!r}; choose "
           f"{' or '.join(BPTT_MODES)}")
    try:
        parse_policy(b.recompute)
    except ValueError as err:
        raise ConfigError("bptt.recompute", str(err)) from None
    _check(b.keep_last_segments >= 0, "bptt.keep_last_segments",
           f"must be >= 0, got {b.keep_last_segments}")
    if not b.checkpoint_segments:
        _check(b.recompute == "full", "bptt.recompute", f"{b.recompute!r} applies to "
               "checkpointed segments; set bptt.checkpoint_segments: true or leave it 'full'")
        _check(b.keep_last_segments == 0, "bptt.keep_last_segments", "applies to "
               "checkpointed segments; set bptt.checkpoint_segments: true or leave it 0")
    # The selective policies intercept aten ops with Python dispatch modes, under which
    # torch.compile does not compile: the forward would silently run eager.
    _check(not (cfg.model.compile and b.checkpoint_segments and b.recompute != "full"),
           "bptt.recompute", f"{b.recompute!r} cannot run with model.compile: true (torch."
           "compile does not trace its Python dispatch modes); use 'full' or compile: false")

    c = cfg.curriculum
    if c.segments:
        _check(all(n >= 1 for n in c.segments) and c.segments == sorted(set(c.segments)),
               "curriculum.segments", f"must be increasing segment counts >= 1, got "
               f"{c.segments}")
        _check(c.advance in CURRICULUM_ADVANCE, "curriculum.advance", f"unknown "
               f"{c.advance!r}; choose {' or '.join(CURRICULUM_ADVANCE)}")
        if c.advance == "steps":
            _check(c.every > 0, "curriculum.every", "advance 'steps' needs every > 0 "
                   f"(steps per stage), got {c.every}")
        else:
            _check(0 < c.threshold <= 1, "curriculum.threshold", f"must be in (0, 1], got "
                   f"{c.threshold}")
            _check(cfg.eval.every > 0, "eval.every", "curriculum advance 'accuracy' needs "
                   "periodic validation (eval.every > 0)")

    o = cfg.optim
    _check(o.name in OPTIMIZERS, "optim.name", f"unknown {o.name!r}; choose "
           f"{', '.join(OPTIMIZERS)}")
    _check(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
    _check(len(o.betas) == 2 and all(0 <= x < 1 for x in o.betas), "optim.betas",
           f"must be two numbers in [0, 1), got {o.betas}")
    _check(o.eps > 0, "optim.eps", f"must be > 0, got {o.eps}")
    _check(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    _check(o.schedule in SCHEDULES, "optim.schedule", f"unknown {o.schedule!r}; choose "
           f"{', '.join(SCHEDULES)}")
    _check(0 <= o.warmup_steps < max(cfg.max_steps, 1), "optim.warmup_steps",
           f"must be in [0, max_steps={cfg.max_steps}), got {o.warmup_steps}")
    _check(0 <= o.min_lr <= o.lr, "optim.min_lr", f"must be in [0, lr={o.lr}], got {o.min_lr}")
    _check(0 < o.plateau_factor < 1, "optim.plateau_factor", "must be in (0, 1)")
    _check(o.plateau_patience >= 0, "optim.plateau_patience", "must be >= 0")
    _check(o.grad_clip >= 0, "optim.grad_clip", f"must be >= 0, got {o.grad_clip}")
    _check(o.max_nonfinite_steps >= 1, "optim.max_nonfinite_steps",
           f"must be >= 1, got {o.max_nonfinite_steps}")
    if o.schedule == "wsd":
        _check(0 < o.decay_steps <= cfg.max_steps - o.warmup_steps, "optim.decay_steps",
               f"the wsd schedule needs 0 < decay_steps <= max_steps - warmup_steps = "
               f"{cfg.max_steps - o.warmup_steps}, got {o.decay_steps}")
    else:
        _check(o.decay_steps == 0, "optim.decay_steps",
               f"only the wsd schedule reads it; {o.schedule!r} would ignore {o.decay_steps}")
    if o.schedule == "plateau":
        _check(cfg.eval.every > 0, "eval.every", "the plateau schedule needs periodic "
               "validation (eval.every > 0)")

    e = cfg.eval
    _check(e.every >= 0, "eval.every", f"must be >= 0, got {e.every}")
    _check(e.split in (d.valid_split, d.test_split, d.train_split), "eval.split",
           f"{e.split!r} is none of the data splits ({d.train_split}, {d.valid_split}, "
           f"{d.test_split})")
    _check(e.tgt_len is None or e.tgt_len > 0, "eval.tgt_len",
           f"must be > 0 (or null: as trained), got {e.tgt_len}")
    _check(e.mem_len is None or e.mem_len >= 0, "eval.mem_len",
           f"must be >= 0 (or null: as trained), got {e.mem_len}")
    _check(e.batch >= 0, "eval.batch", f"must be >= 0, got {e.batch}")
    _check(e.max_segments >= 0, "eval.max_segments", "must be >= 0")
    _check(e.skip_segments >= 0, "eval.skip_segments", "must be >= 0")
    _check(e.max_segments == 0 or e.skip_segments < e.max_segments, "eval.skip_segments",
           f"skipping {e.skip_segments} of {e.max_segments} segments leaves nothing to score")
    # Evaluation lengths go through the model's own length check (e.g. same_length needs
    # mem_len > 0; RMT has no same_length), the one every protocol passes.
    lengths = e.lengths(cfg.model)
    cfg.model.check_lengths(lengths.mem_len, lengths.clamp_len, lengths.same_length, "eval")

    s = cfg.deepspeed
    _check(s.precision in PRECISIONS, "deepspeed.precision", f"unknown {s.precision!r}; "
           f"choose {', '.join(PRECISIONS)}")
    _check(s.grad_dtype in GRAD_DTYPES, "deepspeed.grad_dtype", f"unknown {s.grad_dtype!r}; "
           f"choose {', '.join(GRAD_DTYPES)} (the dtype half-precision gradients are summed in)")
    _check(s.zero_stage is None or s.zero_stage in (0, 1, 2, 3), "deepspeed.zero_stage",
           f"must be 0, 1, 2 or 3, got {s.zero_stage}")
    _check(s.grad_accum >= 1, "deepspeed.grad_accum", f"must be >= 1, got {s.grad_accum}")
    _check(cfg.distributed.timeout_minutes >= 1, "distributed.timeout_minutes",
           f"must be >= 1, got {cfg.distributed.timeout_minutes}")
    _check(resolve_path(s.config).is_file(), "deepspeed.config",
           f"no such file: {resolve_path(s.config)}")
    return cfg


def checkpoint_source(cfg: RunConfig) -> tuple[str, str] | None:
    """(config field, value) of the pretrained checkpoint the run's model starts from, a
    local directory or a hub name; None when its backbone reads none (model/backbones/)."""
    return backbone_of(cfg.model).checkpoint_source(cfg.model)


# ----------------------------------------------------------------------------- loading
def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for i, key in enumerate(keys[:-1]):
        nxt = node.setdefault(key, {})
        if not isinstance(nxt, dict):
            raise ConfigError(".".join(keys[:i + 1]), "is a value, not a section")
        node = nxt
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`model.mem_len=256` -> ("model.mem_len", 256); values are read as YAML scalars, so
    `true`, `1e-4`, `[1, 2]` and `null` have their YAML types."""
    if "=" not in text:
        raise ConfigError(text, "an override must look like section.field=value")
    key, raw = text.split("=", 1)
    key = key.strip().removeprefix("--")
    if not key:
        raise ConfigError(text, "an override needs a field name before '='")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(key, f"cannot read value {raw!r}: {err}") from None
    return key, value


def load_config(path: str | Path | None, overrides: list[str] | tuple = ()) -> RunConfig:
    """Read a YAML run config (or start from the defaults), apply `a.b=value` overrides in
    order, build the typed tree and validate it."""
    tree: dict = {}
    if path is not None:
        p = config_file(path)
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError("--config", f"{p} is not valid YAML: {err}") from None
        if not isinstance(tree, dict):
            raise ConfigError("--config", f"{p} must hold a mapping of sections")
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    locate_model_path(tree)
    return from_dict(tree)


def from_dict(tree: dict) -> RunConfig:
    """The typed, validated run config of a plain tree (YAML + overrides). Every section,
    `model` and its `lamemo` / `rmt` options included, goes through the same builder; then
    the model's shape is read where its backbone keeps it (a pretrained checkpoint's config:
    `resolve_shape`), so a run config is whole."""
    tree = json.loads(json.dumps(tree))  # a private deep copy
    cfg = build_dataclass(RunConfig, tree, "")
    resolve_shape(cfg.model)
    return validate(cfg)


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None)
