"""DeepSpeed for every run: the resolved ds_config, the optimizer, the LR schedule.

The run config owns what the papers specify (lr, schedule, clipping, batch layout); the
DeepSpeed JSON owns the systems side (ZeRO stage, offload, bucket sizes). Batch sizes are
always derived from the run config, so the two cannot disagree: DeepSpeed's "sample" is one
stream row, its micro batch is this rank's rows, and one micro-step is one BPTT window.
"""

from __future__ import annotations

import copy
import json
import math
import warnings

import torch
import torch.distributed as dist

from data_pipeline.streams import rows_of_rank
from model.compiled import compile_core

from .config import RunConfig, resolve_path
from .deepspeed_setup import import_deepspeed
from .precision import precision_sections


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_ds_config(cfg: RunConfig, world_size: int, *, load_universal: bool = False) -> dict:
    """The DeepSpeed config of this run: base JSON <- run config <- deepspeed.overrides."""
    s = cfg.deepspeed
    with open(resolve_path(s.config)) as f:
        ds = json.load(f)
    if cfg.data.global_batch % world_size:
        rows_of_rank(cfg.data.global_batch, 0, world_size)  # raises with the numbers
    micro = cfg.data.global_batch // world_size
    ds["train_micro_batch_size_per_gpu"] = micro
    ds["gradient_accumulation_steps"] = s.grad_accum
    ds["train_batch_size"] = micro * s.grad_accum * world_size
    ds["gradient_clipping"] = cfg.optim.grad_clip
    ds["steps_per_print"] = ds.get("steps_per_print", 10**9)
    if s.zero_stage is not None:
        ds.setdefault("zero_optimization", {})["stage"] = s.zero_stage
    # The run config's precision wins over the JSON's; the JSON's other keys (loss-scale
    # window, ...) stay, and deepspeed.overrides can still change anything.
    precision = precision_sections(s, zero_stage(ds))
    for key in ("bf16", "fp16"):
        ours = precision.pop(key)
        ds[key] = {**ours, **ds.get(key, {}), "enabled": ours["enabled"]}
    ds = _merge(ds, precision)
    ds = _merge(ds, s.overrides)
    if load_universal:
        ds.setdefault("checkpoint", {})["load_universal"] = True
    # The optimizer and schedule come from the run config (they are the papers' settings).
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ValueError(f"ds_config {key!r} section: set the optimizer and schedule in "
                             f"the run config (optim.*), not in the DeepSpeed JSON")
    return ds


def zero_stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def build_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """Adam(W) over two groups: weight decay only on matrices (projections, embeddings);
    LayerNorm gains and biases, the u/v biases, RMT's initial memory and every other vector
    are not decayed (the usual practice: decaying a gain towards 0 shrinks the layer).
    Frozen parameters (a pretrained base with `model.hf.finetune` frozen or lora) are left
    out: no optimizer state, no fp32 master copy."""
    o = cfg.optim
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # u/v ([H, dh]) and the initial memory ([m, d]) are 2-D but are vectors per row.
        matrix = p.dim() >= 2 and "rel_" not in name and "memory_init" not in name
        (decay if matrix else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": o.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return cls([g for g in groups if g["params"]], lr=o.lr, betas=tuple(o.betas), eps=o.eps)


class LRSchedule:
    """lr(step) for the papers' schedules, with a state_dict so DeepSpeed checkpoints it.

    cosine / linear: linear warmup over warmup_steps, then decay to min_lr at max_steps
    (XL, LaMemo: cosine annealing to 0, no warmup). constant: warmup then lr. wsd: warmup,
    lr, then linear decay to min_lr over the last decay_steps. plateau:
    constant lr multiplied by `plateau_factor` once `plateau_patience` validations in a row
    did not improve and the next one does not either (torch's ReduceLROnPlateau counting;
    patience 0 drops at the first), never below min_lr (RMT algorithmic tasks: factor 0.5,
    min 1e-6).
    DeepSpeed calls step() after every optimizer step; report() is called by validation.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: RunConfig):
        self.optimizer, self.o, self.max_steps = optimizer, cfg.optim, cfg.max_steps
        self.last_step = 0
        self.scale = 1.0          # plateau multiplier
        self.best = math.inf
        self.bad_evals = 0
        self.apply()

    def lr_at(self, step: int) -> float:
        o = self.o
        if o.warmup_steps and step < o.warmup_steps:
            return o.lr * (step + 1) / o.warmup_steps
        if o.schedule in ("constant", "plateau"):
            return max(o.lr * self.scale, o.min_lr)
        if o.schedule == "wsd":   # the linear decay below, over the last decay_steps only
            progress = max(0.0, (step - self.max_steps + o.decay_steps) / o.decay_steps)
        else:
            progress = (step - o.warmup_steps) / max(1, self.max_steps - o.warmup_steps)
        progress = min(1.0, progress)
        if o.schedule == "cosine":
            return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))
        return o.lr + (o.min_lr - o.lr) * progress

    def apply(self) -> None:
        """Write lr(last_step) into the optimizer's param groups."""
        lr = self.lr_at(self.last_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, *_args, **_kwargs) -> None:
        self.last_step += 1
        self.apply()

    def report(self, metric: float) -> bool:
        """Record a validation loss; True if the plateau schedule just lowered the lr."""
        if self.o.schedule != "plateau":
            return False
        if metric < self.best:
            self.best, self.bad_evals = metric, 0
            return False
        self.bad_evals += 1
        if self.bad_evals > self.o.plateau_patience:
            self.scale *= self.o.plateau_factor
            self.bad_evals = 0
            self.apply()
            return True
        return False

    def restart_patience(self) -> None:
        """Forget the best validation loss (a curriculum stage makes the task harder, so the
        old best would count every later evaluation as a plateau)."""
        self.best, self.bad_evals = math.inf, 0

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_step": self.last_step, "scale": self.scale, "best": self.best,
                "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict) -> None:
        self.last_step, self.scale = state["last_step"], state["scale"]
        self.best, self.bad_evals = state["best"], state["bad_evals"]
        self.apply()


def _register_parameter_lists(model: torch.nn.Module) -> None:
    """ZeRO-3 gathers a module's own parameters around its forward and backward. A
    ParameterList is a child module that is never called: its parameters are used by the
    parent (the adaptive softmax's cluster weights and projections), so without this the
    backward meets them still partitioned (numel 0)."""
    import_deepspeed()
    from deepspeed.runtime.zero import register_external_parameter

    for module in model.modules():
        for child in module.children():
            if isinstance(child, (torch.nn.ParameterList, torch.nn.ParameterDict)):
                for param in child.parameters():
                    register_external_parameter(module, param)


def initialize(model: torch.nn.Module, cfg: RunConfig, ds_config: dict):
    """deepspeed.initialize with our optimizer and schedule; returns (engine, schedule)."""
    deepspeed = import_deepspeed()  # seconds: only when an engine is built (not --print-config)

    if cfg.model.compile:
        # Before DeepSpeed wraps it; names and state_dict unchanged.
        compile_core(model, backend=cfg.model.compile_backend)
        first_rank = not dist.is_initialized() or dist.get_rank() == 0
        if zero_stage(ds_config) == 3 and first_rank:
            warnings.warn(
                "model.compile under ZeRO-3: DeepSpeed gathers each module's parameters in "
                "hooks on that module, and every hook breaks the compiled graph (the "
                "quickstart model: 31 graphs instead of 2), so expect no speed-up; the "
                "losses are eager's. ZeRO-1/2 keep whole graphs", stacklevel=2)
    optimizer = build_optimizer(model, cfg)
    schedule = LRSchedule(optimizer, cfg)
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                      lr_scheduler=schedule, config=ds_config)
    if zero_stage(ds_config) == 3:
        _register_parameter_lists(engine.module)
    # ZeRO wraps the optimizer; the schedule must write into the wrapper's param groups,
    # which are the ones the update reads.
    schedule.optimizer = ds_optimizer
    schedule.apply()
    return engine, schedule
