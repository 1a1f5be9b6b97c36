"""Peak memory and time of one loss step (the LM head, the cross-entropy, their backward):
the plain path (the whole [N, V] logits, a float32 log-softmax) against memtrain's loss
(model/loss.py: chunks of rows recomputed in backward; only supervised rows reach the head).

Each variant runs in a child process of its own; the peak is the process's resident-set
high-water mark above what it held before the step (as bench_pretrained.py measures), after
one warm-up step. The default shape is GPT-2's head on 4,096 rows:

    .venv/bin/python benchmarks/bench_loss.py                       # N 4096, V 50257, d 768
    .venv/bin/python benchmarks/bench_loss.py --dtype bf16 --answer-share 0.05
    .venv/bin/python benchmarks/bench_loss.py --device cuda --dtype bf16 --rows 32768 --gemm

On a GPU the peak is torch.cuda.max_memory_allocated above what was allocated before the
step, and the time wall time after a synchronisation. `--gemm` also times the head's GEMM
(forward and both backward products) at V and at V padded to a multiple of 128 (50,304 for
GPT-2), the padding's whole case: an aligned vocabulary.

On CUDA two more variants run, the fused libraries of `model.loss_backend`
(model/fused_loss.py): "liger" (Liger Kernel's fused linear cross-entropy) and "cce" (Cut
Cross-Entropy), each timed and measured as above where it imports, and compared with the
chunked path on the same rows: the max relative difference of the per-row NLL, the hidden
rows' gradient and the head weight's gradient, and of both paths against a float32 chunked
reference (in bf16 the two paths round differently; the reference says which is nearer).
Where a library does not import the variant reports "not installed"; on the CPU "not run".

What a step holds that neither path can avoid: the hidden rows [N, d], the head's weight and
its gradient [V, d], the hidden rows' gradient. The plain path adds three float32 [N, V]
buffers at its peak (the up-cast logits, the saved log-softmax, its gradient), each
N x V x 4 bytes (786 MiB at the default shape).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from model.fused_loss import fused_rows, linear_head  # noqa: E402
from model.loss import chunk_rows, logits_nll, segment_nll  # noqa: E402
from model.typed import ConfigError  # noqa: E402

VARIANTS = ("plain", "chunked")
FUSED = ("liger", "cce")   # model.loss_backend's libraries: CUDA only
SHAPE_FLAGS = ("rows", "vocab", "d_model", "dtype", "answer_share", "threads", "seed",
               "device")


def loss_step(a, variant: str, head, hidden, targets, mask, fused=None) -> float:
    """One forward + backward of the loss; returns its seconds (CPU time; on a GPU wall
    time after a synchronisation). `fused`: a fused library's rows (the variants FUSED)."""
    clock = common.step_clock(a.device)
    start = clock()
    h = hidden.detach().requires_grad_()
    if variant == "plain":
        nll = logits_nll(head(h.reshape(-1, a.d_model)), targets.reshape(-1)).view(mask.shape)
        loss = (nll * mask).sum() / mask.sum()
    else:
        rows_nll = lambda x, t: logits_nll(head(x), t)   # noqa: E731
        loss = segment_nll(rows_nll, h, targets, mask, chunk_rows(a.vocab),
                           fused).sum() / mask.sum()
    loss.backward()
    elapsed = clock() - start
    head.zero_grad(set_to_none=True)
    return elapsed


def gemm_times(a, rounds: int = 10) -> dict:
    """Median seconds of the head's three GEMMs (logits, their input's and weight's
    gradients) at V and at V padded to a multiple of 128."""
    dtype, dev = common.model_dtype(a), torch.device(a.device)
    clock = common.step_clock(a.device)
    h = torch.randn(a.rows, a.d_model, dtype=dtype, device=dev)
    out = {}
    for name, v in (("V", a.vocab), ("V128", -(-a.vocab // 128) * 128)):
        w = torch.randn(v, a.d_model, dtype=dtype, device=dev)
        g = torch.randn(a.rows, v, dtype=dtype, device=dev)
        times = []
        for _ in range(rounds + 2):
            start = clock()
            h @ w.T, g @ w, g.T @ h
            times.append(clock() - start)
        out[name] = {"vocab": v, "median_s": sorted(times[2:])[rounds // 2]}
    out["padded_over_plain"] = out["V128"]["median_s"] / out["V"]["median_s"]
    return out


def _nll_and_grads(head, hidden, targets, mask, fused=None):
    """The chunked (or `fused`) per-row NLL and the gradients of its masked mean."""
    h = hidden.detach().requires_grad_()
    nll = segment_nll(lambda x, t: logits_nll(head(x), t), h, targets, mask,
                      chunk_rows(head.out_features), fused)
    grads = torch.autograd.grad(nll.sum() / mask.sum(), [h, head.weight])
    return [t.detach().float() for t in (nll, *grads)]


def _rel(ours, ref) -> dict:
    names = ("nll", "grad_hidden", "grad_weight")
    return {n: float((x - r).abs().max() / r.abs().max().clamp(min=1e-30))
            for n, x, r in zip(names, ours, ref, strict=True)}


def compare(head, hidden, targets, mask, fused) -> dict:
    """Max relative differences: the fused path against the chunked one, and each against
    the chunked path in float32 (the reference for bf16, where both round)."""
    chunked = _nll_and_grads(head, hidden, targets, mask)
    ours = _nll_and_grads(head, hidden, targets, mask, fused)
    head32 = torch.nn.Linear(head.in_features, head.out_features, bias=False).to(
        hidden.device, torch.float32)
    with torch.no_grad():
        head32.weight.copy_(head.weight)
    ref = _nll_and_grads(head32, hidden.float(), targets, mask)
    return {"vs_chunked": _rel(ours, chunked), "fused_vs_fp32": _rel(ours, ref),
            "chunked_vs_fp32": _rel(chunked, ref)}


def child(a) -> None:
    spec = json.loads(a._child)
    torch.manual_seed(a.seed)
    dtype, dev = common.model_dtype(a), torch.device(a.device)
    head = torch.nn.Linear(a.d_model, a.vocab, bias=False).to(dev, dtype)
    hidden = torch.randn(1, a.rows, a.d_model, dtype=dtype, device=dev)
    targets = torch.randint(0, a.vocab, (1, a.rows))        # the host copy, as in training
    mask = torch.rand(1, a.rows) < a.answer_share
    fused = None
    if spec["variant"] in FUSED:
        try:   # the option's own dispatch: refuses a library that does not import
            fused = fused_rows(spec["variant"], linear_head(head), hidden)
        except ConfigError as e:
            status = "not installed" if "does not import" in str(e) else "not run"
            print(json.dumps({"status": status, "why": str(e)}))
            return
    loss_step(a, spec["variant"], head, hidden, targets, mask, fused)   # warm-up
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        step_s = loss_step(a, spec["variant"], head, hidden, targets, mask, fused)
        peak = (torch.cuda.max_memory_allocated(dev) - before) / 2**20
    else:
        before = common.status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        step_s = loss_step(a, spec["variant"], head, hidden, targets, mask)
        peak = (common.status_kib("VmHWM") - before) / 1024
    out = {"status": "ran", "peak_mb": peak, "step_s": step_s}
    if fused is not None:
        out.update(compare(head, hidden, targets, mask, fused))
    if spec.get("gemm"):
        out["gemm"] = gemm_times(a)
    print(json.dumps(out))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4096, help="N: tokens scored in the step")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--gemm", action="store_true",
                   help="also time the head GEMM at V and at V padded to a multiple of 128")
    p.add_argument("--answer-share", type=float, default=1.0,
                   help="share of rows with a loss (1: language modelling; a task's answer "
                        "rows are a few per cent)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a._child:
        child(a)
        return 0
    started = time.time()
    nv_mb = a.rows * a.vocab * 4 / 2**20
    print(f"loss step: N {a.rows} x V {a.vocab}, d {a.d_model}, {a.dtype}, "
          f"answer share {a.answer_share}; one float32 [N, V] buffer = {nv_mb:.0f} MiB; "
          f"chunk {chunk_rows(a.vocab)} rows")
    results = {"shape": {k: getattr(a, k) for k in SHAPE_FLAGS}, "nv_fp32_mb": nv_mb}
    if torch.device(a.device).type == "cuda":
        results["device_name"] = torch.cuda.get_device_name(torch.device(a.device))
    unit = "s" if torch.device(a.device).type == "cuda" else "CPU s"
    for variant in VARIANTS:
        spec = {"variant": variant, "gemm": a.gemm and variant == "plain"}
        results[variant] = common.run_child(__file__, a, spec, SHAPE_FLAGS)
        r = results[variant]
        print(f"  {variant:<8} peak {r['peak_mb']:7.0f} MiB ({r['peak_mb'] / nv_mb:.2f} x "
              f"[N, V] fp32)   step {r['step_s']:.3f} {unit}", flush=True)
    results["peak_ratio"] = results["chunked"]["peak_mb"] / results["plain"]["peak_mb"]
    results["time_ratio"] = results["chunked"]["step_s"] / results["plain"]["step_s"]
    print(f"chunked / plain: peak {results['peak_ratio']:.3f}, "
          f"time {results['time_ratio']:.2f}")
    for name in FUSED:
        if torch.device(a.device).type != "cuda":
            results[name] = {"status": "not run", "why": "the fused kernels run on CUDA only"}
        else:
            results[name] = common.run_child(__file__, a, {"variant": name}, SHAPE_FLAGS)
        r = results[name]
        if r["status"] != "ran":
            print(f"  {name:<8} {r['status']}: {r['why']}")
            continue
        d, ref = r["vs_chunked"], r["chunked_vs_fp32"]
        print(f"  {name:<8} peak {r['peak_mb']:7.0f} MiB   step {r['step_s']:.3f} {unit}   "
              f"{name} / chunked: time {r['step_s'] / results['chunked']['step_s']:.2f}; "
              f"max rel. diff vs chunked: nll {d['nll']:.2e}, grad hidden "
              f"{d['grad_hidden']:.2e}, grad weight {d['grad_weight']:.2e} (chunked vs fp32: "
              f"{ref['nll']:.2e}, {ref['grad_hidden']:.2e}, {ref['grad_weight']:.2e}; "
              f"{name} vs fp32: {r['fused_vs_fp32']['nll']:.2e}, "
              f"{r['fused_vs_fp32']['grad_hidden']:.2e}, "
              f"{r['fused_vs_fp32']['grad_weight']:.2e})", flush=True)
    if a.gemm:
        g = results["gemm"] = results["plain"].pop("gemm")
        print(f"head GEMMs: V {g['V']['vocab']} {g['V']['median_s'] * 1e3:.2f} ms, "
              f"V {g['V128']['vocab']} {g['V128']['median_s'] * 1e3:.2f} ms "
              f"(padded / plain {g['padded_over_plain']:.3f})")
    return common.finish(a.json, results, started)


if __name__ == "__main__":
    sys.exit(main())
