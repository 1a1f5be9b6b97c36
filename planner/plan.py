"""`memtrain plan`: per-GPU memory of a run before it is submitted, and what fits.

    memtrain plan --config wt103-xl-base --gpu a100-80gb --nodes 4 --gpus-per-node 8 \\
        deepspeed.precision=bf16 data.global_batch=64
    python -m planner ...                               (the same command)

Per GPU (one rank per GPU, as `memtrain submit` lays them out):
- model states under the run's ZeRO stage (Rajbhandari et al. 2020, §5): fp16/bf16 training
  holds 2 B of parameters and 2 B of gradients per parameter plus K = 12 B of optimizer state
  (fp32 master copy, Adam m and v); fp32 training is taken as 4 + 4 + 8 (Adam m, v), plus
  the fp32 master partition DeepSpeed keeps from stage 1 on (4 B / N_d; measured in
  BENCHMARKS.md, "ZeRO: model-state memory per rank"). Stage 1 partitions the optimizer
  state over the N_d data-parallel ranks, stage 2 also the gradients, stage 3 the parameters;
  the frozen weights of a pretrained base (`model.hf.finetune` frozen or lora) cost their
  model dtype alone (`model_states`);
- DeepSpeed's reduce bucket (and at stage 3 its prefetch bucket and one gathered tensor);
- the memory state carried between windows and the peak of one BPTT window, from
  planner/activations.py (what each block of a segment saves, from the shapes each mechanism
  states in model/, model/shapes.py) and planner/window.py (the window's peak), validated on
  the CPU by benchmarks/bench_memory_plan.py;
- a fixed safety margin for the CUDA context, NCCL and allocator fragmentation.
The largest BPTT depth k and the largest mem_len that fit are searched with that model.
Exit code 0 if the run fits, 1 if it does not (the message names what does), 2 for a bad
config or option.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from data_pipeline.shards import ShardError, load_manifest
from memtrain.command_line import CommandParser, invalid_config
from model import ConfigError, backbone_of
from train.config import RunConfig, load_config
from train.engine import build_ds_config, zero_stage
from train.regime import DataRegime, TokenStreamRegime, regime_of

from .activations import Dims, Params, count_params, shapes, state_bytes
from .recompute import kept_bytes
from .window import window_memory

GIB = 2 ** 30
# Memory per GPU as nvidia-smi reports it, MiB.
GPUS = {"a100-80gb": 81920, "a100-40gb": 40960, "v100-16gb": 16160, "v100-32gb": 32510,
        "h100-80gb": 81559}
CATEGORIES = {"scores": "attention scores, probabilities, masks [B,H,Q,K]",
              "rel-pos": "relative-position terms (q+v, W_kR R)",
              "qkv": "q/k/v copies and projection inputs",
              "ffn": "FFN hidden [B,Q,d_inner] and its masks",
              "layernorm": "LayerNorm inputs and statistics",
              "dropout": "dropout masks (embeddings, sub-layer outputs)",
              "rotary": "rotary position cos/sin [B,Q,d_head]",
              # "extra": what the mechanism's layers also save (its `saved_label`)
              "head": "softmax head: log-probabilities, weight copy, targets"}
SEARCH_CAP = 1 << 20     # depth and mem_len searches stop here


def model_states(psi: int, stage: int, precision: str, n_d: int,
                 grad_fp32: bool = False, frozen: int = 0) -> list[tuple[str, float]]:
    """(label, bytes per GPU) of parameters, gradients and optimizer state (module doc) of
    the psi parameters that train, and of `frozen` ones that do not (a pretrained base
    under `model.hf.finetune` frozen or lora).

    Frozen parameters are held in the model dtype only: no gradient, no fp32 master, no
    optimizer state (train/engine.py `build_optimizer` gives DeepSpeed only the parameters
    that train, and its ZeRO optimizers build their flat fp32 partitions from those groups
    alone). ZeRO-1/2 leave them whole on every rank (the engine casts the whole module to
    bf16/fp16); ZeRO-3 partitions every parameter of the module, frozen ones too
    (deepspeed/runtime/zero/parameter_offload.py `_convert_to_zero_parameters`), so they
    cost 2 B / N_d.

    grad_fp32 (bf16/fp16 with `deepspeed.grad_dtype: fp32`, train/precision.py): DeepSpeed
    sums the gradients in fp32 buffers. At stage 1 beside the half-precision gradients, whole
    (2 + 4 B: the bf16 optimizer's fp32 gradient buffer, or ZeRO-1's per-parameter
    `grad_accum`); from stage 2 the partitioned gradients are fp32 (4 B / N_d). Read from
    deepspeed/runtime/bf16_optimizer.py and zero/stage_1_and_2.py, stage3.py (0.19.8), not
    measured on a GPU."""
    half = precision != "fp32"
    p_b, g_b = (2, 2) if half else (4, 4)
    if half and grad_fp32:
        g_b = 6 if stage <= 1 else 4
    opt_b = 12 if half else 8 + (4 if stage >= 1 else 0)
    part = lambda b, from_stage: b * psi / (n_d if stage >= from_stage else 1)  # noqa: E731
    kind = "bf16/fp16" if half else "fp32"
    opt = "fp32 master + Adam m, v" if half or stage >= 1 else "Adam m, v"
    n_3 = ', /N_d' if stage >= 3 else ''
    trained = " trained" if frozen else ""
    states = [(f"{kind}{trained} parameters ({p_b} B/param{n_3})", part(p_b, 3)),
              (f"{kind} gradients ({g_b} B/param{', /N_d' if stage >= 2 else ''})",
               part(g_b, 2)),
              (f"{opt} ({opt_b} B/param{', /N_d' if stage >= 1 else ''})", part(opt_b, 1))]
    if frozen:
        states.append((f"{kind} frozen parameters ({p_b} B/param{n_3})",
                       p_b * frozen / (n_d if stage >= 3 else 1)))
    return states


def zero_buffers(ds: dict, precision: str, params: Params) -> float:
    """DeepSpeed's communication buffers, allocated whole (deepspeed/runtime/zero): the
    gradient reduce bucket (twice with overlap_comm), and at stage 3 the prefetch bucket
    plus the largest tensor gathered whole."""
    stage, z = zero_stage(ds), ds.get("zero_optimization", {})
    if stage == 0:
        return 0.0
    # The buckets hold the gradients in the communication dtype (fp32 under grad_dtype fp32).
    s = 4 if precision == "fp32" or ds.get("communication_data_type") == "fp32" else 2
    reduce = float(z.get("reduce_bucket_size", 5e8)) * s
    if z.get("contiguous_gradients", True) is False and stage < 3:
        reduce = 0.0
    overlap = z.get("overlap_comm", stage == 3)
    total = reduce * (2 if overlap else 1)
    if stage == 3:
        total += (float(z.get("stage3_prefetch_bucket_size", 5e7)) + params.largest_module) * s
    return total


@dataclasses.dataclass
class Setup:
    cfg: RunConfig
    world: int
    rows: int
    gpu_bytes: float
    margin: float
    params: Params
    static: list[tuple[str, float]]      # model states and buffers
    regime: DataRegime                   # the data's: the window, what memory it carries
    notes: list[str]


def _window(setup: Setup, depth: int, mem_len: int, seg_ckpt: bool, layer_ckpt: bool):
    """(carried state bytes, WindowMemory) of the run at this depth and mem_len: the largest
    over the windows the data regime trains on (task data: every curriculum stage)."""
    c, b = setup.cfg, setup.cfg.bptt
    stages = setup.regime.planned_windows(c.model.tgt_len, depth, c.curriculum.segments)
    best = None
    for seg_len, n_seg in stages:
        mc = dataclasses.replace(c.model, tgt_len=seg_len, mem_len=mem_len,
                                 checkpoint_layers=layer_ckpt)
        dims = Dims(mc, setup.rows, mem_len, c.deepspeed.precision, "cuda")
        w = window_memory(dims, setup.params, n_seg, seg_ckpt, b.recompute,
                          b.keep_last_segments)
        n_states = setup.regime.carried_states(b.mode, depth)
        carried = state_bytes(dims) * n_states if n_states else 0.0
        if best is None or carried + w.peak > best[0] + best[1].peak:
            best = (carried, w)
    return best


def total_bytes(setup: Setup, depth: int, mem_len: int, seg_ckpt: bool, layer_ckpt: bool
                ) -> float:
    carried, w = _window(setup, depth, mem_len, seg_ckpt, layer_ckpt)
    return sum(v for _, v in setup.static) + carried + w.peak + setup.margin


def largest(fits, lo: int) -> int | None:
    """The largest n >= lo with fits(n) (fits is monotone: True up to some n), None if
    fits(lo) is False; capped at SEARCH_CAP."""
    if not fits(lo):
        return None
    hi = max(lo, 1)
    while hi < SEARCH_CAP and fits(hi):
        lo, hi = hi, hi * 2
    if hi >= SEARCH_CAP and fits(SEARCH_CAP):
        return SEARCH_CAP
    while hi - lo > 1:           # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def data_regime(cfg: RunConfig, notes: list[str]) -> DataRegime:
    """The data regime of the run's manifest (train/regime.py): its windows, and whether
    memory is carried between them; a token stream when there is no manifest (with a note)."""
    try:
        return regime_of(load_manifest(cfg.data.path))
    except (ShardError, OSError, KeyError, ValueError):
        notes.append(f"no manifest at {cfg.data.path}: planned as a token stream (for task "
                     "data a window is the whole sample)")
    return TokenStreamRegime()


def setup_for(cfg: RunConfig, gpu_mib: float, nodes: int, per_node: int,
              margin_gib: float) -> Setup:
    world = nodes * per_node
    notes = []
    rows = -(-cfg.data.global_batch // world)
    if cfg.data.global_batch % world:
        notes.append(f"data.global_batch {cfg.data.global_batch} is not divisible by {world} "
                     f"ranks (memtrain submit refuses it); planned for {rows} rows per rank")
    ds = build_ds_config(cfg, 1)  # world size 1: only the ZeRO section is read
    params = count_params(cfg.model)
    stage, prec = zero_stage(ds), cfg.deepspeed.precision
    static = [(f"model states, ZeRO-{stage}: {label}", v)
              for label, v in model_states(params.trained_total, stage, prec, world,
                                           grad_fp32=cfg.deepspeed.grad_dtype == "fp32",
                                           frozen=params.frozen)]
    extra = ", prefetch, gathered tensor" if stage == 3 else ""
    static.append((f"ZeRO-{stage} buffers (reduce bucket{extra})", zero_buffers(ds, prec, params)))
    regime = data_regime(cfg, notes)
    if prec == "fp32":
        notes.append("deepspeed.precision is fp32: bf16 (A100/H100) or fp16 (V100) halves "
                     "activations and model states")
    if cfg.model.cutoffs:
        notes.append("adaptive softmax: tail-cluster rows assume Zipf-distributed words "
                     "(an upper bound for natural text)")
    if cfg.model.compile:
        notes.append("model.compile: activations are counted as the eager model keeps them; "
                     "compiled windows peaked at 0.70-0.98x the eager peak on the CPU "
                     "(BENCHMARKS.md, \"Memory planner\")")
    notes += recompute_notes(cfg)
    return Setup(cfg, world, rows, gpu_mib * 2 ** 20, margin_gib * GIB, params, static,
                 regime, notes)


def recompute_notes(cfg: RunConfig) -> list[str]:
    """What a selective recompute policy keeps on a GPU (planner/recompute.py)."""
    b, notes = cfg.bptt, []
    if b.checkpoint_segments and b.recompute != "full":
        notes.append(f"bptt.recompute {b.recompute}: each checkpointed segment also keeps "
                     "the op outputs the policy names (counted below)"
                     + ("; on CUDA dropout is a fused kernel whose masks are drawn again, "
                        "so save-masks keeps (and saves) nothing there"
                        if "masks" in b.recompute else ""))
    return notes


def state_shape(setup: Setup, mem: int) -> str:
    """What the carried memory holds, as shapes (the mechanism's `segment_shapes`)."""
    if not setup.regime.carries_memory:
        return f"none ({setup.regime.name} start fresh)"
    return shapes(Dims(setup.cfg.model, setup.rows, mem)).state_text


def _shown(n: int | None) -> str:
    return "none" if n is None else (f">= {n} (search limit)" if n == SEARCH_CAP else str(n))


def _gib(x: float) -> str:
    return f"{x / GIB:9.2f}"


def report(setup: Setup, gpu: str, nodes: int, per_node: int) -> tuple[str, bool]:
    c = setup.cfg
    m, b = c.model, c.bptt
    k, mem = b.depth, m.mem_len
    seg, lay = b.checkpoint_segments, m.checkpoint_layers
    carried, w = _window(setup, k, mem, seg, lay)
    trained = (f" ({setup.params.trained_total:,} trained, model.hf.finetune "
               f"{m.hf.finetune})" if setup.params.frozen else "")
    what = backbone_of(m).label(m)
    lines = [f"memtrain plan: {c.name}, {what} {m.n_layer} x {m.d_model}, "
             f"{setup.params.total:,} parameters{trained}",
             f"  {nodes} x {per_node} {gpu} = {setup.world} ranks, {_gib(setup.gpu_bytes).strip()}"
             f" GiB each; {c.deepspeed.precision}; rows per rank {setup.rows} x "
             f"{m.tgt_len} tokens; mem_len {mem}; bptt.depth {k} ({b.mode}"
             f"{setup.regime.plan_note})"]
    lines += [f"  note: {n}" for n in setup.notes]
    lines += ["", f"{'per GPU':<72}{'GiB':>9}"]
    lines += [f"  {label:<70}{_gib(v)}" for label, v in setup.static]
    n_states = setup.regime.carried_states(b.mode, k)
    times = f" x {n_states} (sliding history)" if b.mode == "sliding" and n_states else ""
    lines.append(f"  {'memory state carried between windows' + times:<70}{_gib(carried)}")
    lines.append(f"      {state_shape(setup, mem)}")
    lines.append(f"  {'activations of one window (peak, configured checkpointing)':<70}"
                 f"{_gib(w.peak)}")
    saved_label = shapes(Dims(m, setup.rows, mem)).saved_label
    for cat, v in sorted(w.per_segment.items(), key=lambda kv: -kv[1]):
        if not v:
            continue
        lines.append(f"      {'one segment: ' + CATEGORIES.get(cat, saved_label):<66}{_gib(v)}")
    lines.append(f"      {'softmax head backward (log-prob and [V, d] weight gradients)':<66}"
                 f"{_gib(w.head_transient)}")
    if seg and b.recompute != "full":
        kept = kept_bytes(Dims(m, setup.rows, mem, c.deepspeed.precision, "cuda"), b.recompute)
        label = f"kept by each checkpointed segment (bptt.recompute): {kept / 2**20:.1f} MiB"
        lines.append(f"      {label:<66}{_gib(kept)}")
    lines.append(f"  {'safety margin for CUDA context, NCCL, fragmentation (--margin-gb)':<70}"
                 f"{_gib(setup.margin)}")
    total = sum(v for _, v in setup.static) + carried + w.peak + setup.margin
    fits = total <= setup.gpu_bytes
    lines.append(f"  {'total':<70}{_gib(total)}   of {_gib(setup.gpu_bytes).strip()}: "
                 + ("fits" if fits else "DOES NOT FIT"))
    modes = {"none": (False, False), "checkpoint_segments": (True, False),
             "checkpoint_layers": (False, True), "both": (True, True)}
    lines += ["", f"window peak at bptt.depth {k} by checkpointing (GiB):"]
    lines += [f"  {name:<70}{_gib(_window(setup, k, mem, *sl)[1].peak)}"
              + ("   (configured)" if sl == (seg, lay) else "") for name, sl in modes.items()]
    lines.append("")
    fixed = setup.regime.fixed_window
    if fixed:
        lines.append(f"  largest bptt.depth: not applicable ({fixed})")
    for s_ in () if fixed else (False, True):
        fit_k = largest(lambda d, s_=s_: total_bytes(setup, d, mem, s_, lay) <= setup.gpu_bytes,
                        0)
        lines.append(f"  largest bptt.depth that fits, checkpoint_segments {str(s_).lower()}: "
                     f"{_shown(fit_k)}")
    try:
        m.check_lengths(0, m.clamp_len, m.same_length)
        lo = 0
    except ConfigError:   # this config's mem_len must be > 0
        lo = 1
    try:
        m.check_lengths(max(lo, 1), m.clamp_len, m.same_length)
    except ConfigError as err:   # no mem_len > 0 (a pretrained backbone keeps no XL cache)
        lines.append(f"  largest model.mem_len: not applicable ({err.reason})")
        return "\n".join(lines), fits
    fit_m = largest(lambda x: total_bytes(setup, k, x, seg, lay) <= setup.gpu_bytes, lo)
    adds = shapes(Dims(m, setup.rows, mem)).mem_len_adds
    label = f"largest model.mem_len ({adds})" if adds else "largest model.mem_len"
    lines.append(f"  {label} that fits at bptt.depth {k}: {_shown(fit_m)}")
    return "\n".join(lines), fits


def main_plan(argv: list[str] | None = None) -> int:
    p = CommandParser(prog="memtrain plan", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML run config, or a name in configs/")
    p.add_argument("overrides", nargs="*", metavar="section.field=value")
    p.add_argument("--gpu", choices=sorted(GPUS), help="GPU model (memory as nvidia-smi "
                   "reports it)")
    p.add_argument("--gpu-memory-gb", type=float, help="any other GPU: its memory in GiB")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--margin-gb", type=float, default=2.0, help="kept free for the CUDA "
                   "context, NCCL and allocator fragmentation (GiB, default 2)")
    args = p.parse_intermixed_args(argv)
    if (args.gpu is None) == (args.gpu_memory_gb is None):
        p.error("give either --gpu or --gpu-memory-gb")
    if args.nodes < 1 or args.gpus_per_node < 1 or args.margin_gb < 0:
        p.error("--nodes and --gpus-per-node must be >= 1, --margin-gb >= 0")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        return invalid_config("memtrain plan", err)
    mib = GPUS[args.gpu] if args.gpu else args.gpu_memory_gb * 1024
    gpu = args.gpu or f"{args.gpu_memory_gb:g}-GiB GPU"
    try:   # a pretrained backbone's shapes are read when it is planned
        setup = setup_for(cfg, mib, args.nodes, args.gpus_per_node, args.margin_gb)
        text, fits = report(setup, gpu, args.nodes, args.gpus_per_node)
    except ConfigError as err:
        return invalid_config("memtrain plan", err)
    print(text)
    if fits:
        return 0
    b, m = cfg.bptt, cfg.model
    fixed = setup.regime.fixed_window
    if fixed or total_bytes(setup, 0, m.mem_len, b.checkpoint_segments,
                            m.checkpoint_layers) > setup.gpu_bytes:
        what = "its window" if fixed else "bptt.depth=0"
        print(f"memtrain plan: {cfg.name} does not fit on {gpu} even at {what}: fewer rows "
              f"per rank (data.global_batch or more ranks), a smaller model.mem_len, "
              f"checkpointing, a higher ZeRO stage or bf16/fp16 would reduce it",
              file=sys.stderr)
    else:
        print(f"memtrain plan: {cfg.name} does not fit on {gpu} at bptt.depth={b.depth}; "
              f"the largest depth that fits is listed above", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main_plan())
