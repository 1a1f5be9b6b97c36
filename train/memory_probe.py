"""What one BPTT window really allocates, measured: the ground truth of the memory planner
(planner/window.py), checked against it by the tests and benchmarks/bench_memory_plan.py.

`measure` runs one window exactly as the trainer does (`train.bptt.run_window` over k+1
segments, the bare model as the engine, one backward) on the CPU, with a full memory carried
in (filled under no_grad first) and parameter gradients already allocated (a warm-up window),
so that what grows is the window's own memory. Two exact byte counts, no RSS:

- saved: the storages of every tensor autograd saves during the forward
  (`torch.autograd.graph.saved_tensors_hooks`), each storage once (a storage freed during
  the forward whose address a later one reuses counts as two), parameters and storages
  that existed before the window (the carried memory) excluded. Checkpointed segments and
  layers save through their own hooks, so this count misses what they keep.
- peak: the high-water mark of the bytes allocated by torch's CPU allocator between the
  start of the forward and the end of the backward, from the profiler's allocation events
  (`torch.profiler.profile(profile_memory=True)`, each event's size summed in time order).

`measure_cuda`: the growth of torch.cuda.max_memory_allocated over the same window on a GPU.
A pretrained backbone (`backbone: hf`) is built with random weights from its checkpoint's
config alone (`build_for_probe`).
"""

from __future__ import annotations

import gc
import math
import warnings
import weakref

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from data_pipeline.streams import SegmentBatch
from model import ModelConfig, backbone_of, build_model
from model.compiled import compile_core, compiled_graphs

from .bptt import run_window

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _segment(cfg: ModelConfig, rows: int, gen: torch.Generator) -> SegmentBatch:
    if cfg.cutoffs:   # the planner's assumption: Zipf-distributed word ranks
        zipf = 1.0 / torch.arange(1, cfg.vocab_size + 1, dtype=torch.float64)
        tokens = torch.multinomial(zipf, rows * (cfg.tgt_len + 1), replacement=True,
                                   generator=gen).view(rows, -1)
    else:
        tokens = torch.randint(0, cfg.vocab_size, (rows, cfg.tgt_len + 1), generator=gen)
    return SegmentBatch(tokens, torch.zeros(rows, dtype=torch.bool), None, 0, 0)


def _peak_growth(prof) -> int:
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
        todo.extend(e.children)
    now = peak = 0
    for _, size in sorted(events):
        now += size
        peak = max(peak, now)
    return peak


def _data_ptr(t: torch.Tensor) -> int | None:
    """The storage address of a live tensor; None for tensors without data (the fake
    tensors a torch.compile earlier in the process may leave behind)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def build_for_probe(cfg: ModelConfig, precision: str, device: str = "cpu") -> torch.nn.Module:
    """The model in training mode; a pretrained backbone with random weights made from its
    checkpoint's config alone (the directory holds nothing else)."""
    if not backbone_of(cfg).loads_checkpoint:
        return build_model(cfg).to(device, DTYPES[precision]).train()
    from transformers import AutoModelForCausalLM

    from model.pretrained.checkpoint_config import hf_config
    from model.pretrained.loading import training_activations
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(
            hf_config(cfg.hf), attn_implementation=cfg.hf.attn_implementation)
        base.config.use_cache = False
        training_activations(base, cfg.hf)   # as training runs them (loading.py load_base)
        model = build_model(cfg, base=base)
    return model.to(device, DTYPES[precision]).train()


def _warmed(forward, model, cfg: ModelConfig, rows: int, depth: int, window: dict,
            gen: torch.Generator, device):
    """The state after a full memory is carried in (filled under no_grad) and one warm-up
    window has allocated the parameter gradients (zeroed again)."""
    state = None
    with torch.no_grad():   # a full memory, as in the middle of a stream
        for _ in range(max(1, math.ceil(cfg.mem_len / cfg.tgt_len))):
            state = run_window(forward, state, [_segment(cfg, rows, gen)], device).state
    warm = run_window(forward, state, [_segment(cfg, rows, gen) for _ in range(depth + 1)],
                      device, **window)
    warm.loss.backward()
    for p in model.parameters():
        if p.grad is not None:   # a frozen parameter has none
            p.grad.zero_()
    return warm.state


def measure_cuda(cfg: ModelConfig, rows: int, depth: int, checkpoint_segments: bool,
                 precision: str = "bf16", seed: int = 0) -> dict:
    """The same window on a GPU: the growth of torch.cuda.max_memory_allocated over the
    forward and backward."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model, dev = build_for_probe(cfg, precision, "cuda"), torch.device("cuda")
    window = {"checkpoint_segments": checkpoint_segments}
    state = _warmed(model, model, cfg, rows, depth, window, gen, dev)
    gc.collect()
    segments = [_segment(cfg, rows, gen) for _ in range(depth + 1)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run_window(model, state, segments, dev, **window).loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del model, state
    gc.collect()
    torch.cuda.empty_cache()
    return {"peak": peak}


def measure(cfg: ModelConfig, rows: int, depth: int, checkpoint_segments: bool,
            precision: str = "fp32", seed: int = 0, recompute: str = "full",
            keep_last: int = 0, compiled: bool = False) -> dict:
    """Saved-tensor bytes and peak allocation growth of one window of depth+1 segments
    (compiled: with the decoder stack compiled as `model.compile` does)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = build_for_probe(cfg, precision)
    if compiled:
        # A fresh compile cache per row: every model's core shares its code, so graphs of
        # earlier rows would be reused (or count against torch.compile's graph limit).
        torch._dynamo.reset()
        compile_core(model)
        graphs_before = compiled_graphs()

    def forward(*args, **kwargs):
        return model(*args, **kwargs)

    window = {"checkpoint_segments": checkpoint_segments, "recompute": recompute,
              "keep_last_segments": keep_last}
    state = _warmed(forward, model, cfg, rows, depth, window, gen, "cpu")
    gc.collect()

    segments = [_segment(cfg, rows, gen) for _ in range(depth + 1)]
    with warnings.catch_warnings():   # isinstance() on deprecated torch.distributed aliases
        warnings.simplefilter("ignore", FutureWarning)
        before = {_data_ptr(t) for t in gc.get_objects() if isinstance(t, torch.Tensor)}
    # Per address, the storages saved there (bytes, and weak references to the saved
    # tensors): a tensor saved by a node the forward drops (e.g. topk's indices when only
    # its indices are used further) is freed with it, and its address may then hold
    # another saved tensor, a new storage, counted again.
    saved: dict[int, list[tuple[int, list[weakref.ref]]]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in before:
            there = saved.setdefault(ptr, [])
            if not there or not any(r() is not None for r in there[-1][1]):
                there.append((t.untyped_storage().nbytes(), []))
            there[-1][1].append(weakref.ref(t))
        return t

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            res = run_window(forward, state, segments, "cpu", **window)
        res.loss.backward()
        del res
    out = {"saved": sum(n for there in saved.values() for n, _ in there),
           "peak": _peak_growth(prof)}
    if compiled:
        out["graphs"] = compiled_graphs() - graphs_before
        if not out["graphs"]:
            raise RuntimeError("--compile: nothing was compiled")
    return out
