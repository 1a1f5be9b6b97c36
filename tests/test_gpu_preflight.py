"""GPU preflight: what the hot training step promises on a GPU, checked by the GPU itself.

Run this file on one GPU node before a long job (docs/cluster.md, checklist):

    .venv/bin/python -m pytest tests/test_gpu_preflight.py -v

Every test runs once per device present. On this project's CPU machine only the "cpu" cases
run (they check the tests' own harness on the same code path); the "cuda" cases are skipped
with a reason and check, on a GPU, what no CPU run can (docs/cluster.md, checklist item 9):

1. XL's training attention with a head that no fused kernel takes as is (d_head 41, the
   WikiText-103 configs' 410 / 10) runs in the memory-efficient SDPA kernel (training's own
   backend pin, model/attention_kernels.py `sdpa_backends`, with its math fallback removed),
   in fp32, bf16 and fp16, and equals the plain reference path.
2. A training loop's micro-steps (XL, LaMemo, RMT; ARMT and Titans on the GPU only) wait
   for the device only where tests/test_sync_free.py allows it (one read per optimizer
   step), counted by CUDA itself with
   `torch.cuda.set_sync_debug_mode("warn")`: it also sees waits that the wrappers of that
   file cannot (blocking copies, kernels that read a device value on the host).
3. `model.compile` on the GPU (Triton kernels) trains with eager's losses and compiles no
   graph once the memory is full (tests/test_compile.py's training, on the device; its CPU
   case is that file's own test).
4. Titans' chunked update (model/mechanisms/titans/neural_memory.py) on the device equals the
float64
   token-by-token reference of tests/test_neural_memory.py (float64, float32 without TF32,
   and a bf16 module's float32 state).

A first GPU session runs, in order (docs/cluster.md, "A first GPU session";
`BENCH=1 bash scripts/gpu_session.sh` does 1-4): 1. device facts; 2. this file; 3. the
quickstart through the engine in fp32 (TF32 and full), bf16 and fp16, bf16 and fp16 stopped
by SIGTERM and resumed; 4. the "On a GPU" benchmarks of BENCHMARKS.md; 5. on several GPUs,
the 2-rank engine tests under nccl. All 12 cases passed on one H200 (2026-11-26); with
the ARMT and Titans cases added, 16 of 16 (2026-11-27).
"""

from __future__ import annotations

import traceback
import warnings
from contextlib import contextmanager, nullcontext

import pytest
import torch
from reference import tiny_config
from test_sync_free import COUNTS, counting_syncs, make_loop

from model import build_model
from model.attention import RelativeSelfAttention
from model.attention_kernels import choose_kernel

HAS_CUDA = torch.cuda.is_available()
NO_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device: run this file on a GPU "
                                                   "node (docs/cluster.md, checklist)")
DEVICES = ["cpu", pytest.param("cuda", marks=NO_CUDA)]


@contextmanager
def _fused_kernel_only(device: str):
    """Training's own SDPA pin (model/attention_kernels.py, `sdpa_backends`: the
    memory-efficient kernel, then math) with the math fallback removed: if the padded head or
    the positional bias rules the kernel out, SDPA raises instead of silently running math.
    On the CPU the bias always takes the math path (nothing to restrict)."""
    if device != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend

    from model import attention_kernels
    pinned = attention_kernels.sdpa_backends
    assert pinned("cuda")[0] == SDPBackend.EFFICIENT_ATTENTION   # what training prefers
    attention_kernels.sdpa_backends = lambda device_type: pinned(device_type)[:1]
    try:
        yield
    finally:
        attention_kernels.sdpa_backends = pinned


def _xl_head_41():
    """XL with 2 heads of 41, parameters drawn at std 0.1 (not the default 0.02, under which
    attention is near-uniform and a wrong score barely moves a gradient; not the 0.3 of
    tiny_model, under which bf16 gradients are off by 60% on either path)."""
    torch.manual_seed(0)
    model = build_model(tiny_config("xl", d_model=82, n_head=2, d_inner=64, tgt_len=5,
                                    mem_len=5))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" not in name:
                p.normal_(0.0, 0.1 if p.dim() >= 2 else 0.03)
    return model


def _loss_and_grads(model, tokens, device):
    """Two segments (the second attends to the first through the memory), one backward."""
    state, loss = None, 0.0
    for s in range(2):
        seg = tokens[:, 5 * s:5 * s + 6].to(device)
        out = model(seg[:, :-1], state, targets=seg[:, 1:])
        loss, state = loss + out.loss, out.state
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads


@pytest.mark.parametrize("device,dtype", [
    ("cpu", torch.float32), ("cpu", torch.bfloat16),
    pytest.param("cuda", torch.float32, marks=NO_CUDA),
    pytest.param("cuda", torch.bfloat16, marks=NO_CUDA),
    pytest.param("cuda", torch.float16, marks=NO_CUDA)])
def test_xl_training_attention_with_head_41_runs_fused_and_equals_the_plain_path(
        device, dtype, monkeypatch):
    # On CUDA the model's own choice ("fused") is SDPA; on the CPU training takes the
    # one-pass kernel, so the CPU case forces SDPA to run the same path (math backend).
    impl = "fused" if device == "cuda" else "sdpa"
    assert choose_kernel(impl, device, need_lse=False, record=False) == "sdpa"
    heads_seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        heads_seen.append(q.shape[-1])
        return sdpa(q, *args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    tokens = torch.randint(0, 23, (2, 11), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name, run_dtype in ((impl, dtype), ("plain", dtype), ("reference", torch.float32)):
        model = _xl_head_41().train().to(device=device, dtype=run_dtype)
        for attn in (m for m in model.modules() if isinstance(m, RelativeSelfAttention)):
            attn.impl = "plain" if name == "reference" else name  # as benchmarks force one
        with _fused_kernel_only(device) if name == impl else nullcontext():
            runs[name] = _loss_and_grads(model, tokens, device)
    # Two layers x two segments through SDPA, the head padded to 48 on CUDA only.
    assert heads_seen == [48 if device == "cuda" else 41] * 4

    def error(name):   # against fp32's plain path: the loss, then the worst gradient
        (loss, grads), (loss_ref, grads_ref) = runs[name], runs["reference"]
        assert grads.keys() == grads_ref.keys()
        return [(loss - loss_ref).abs() / loss_ref.abs()] + [
            (g - grads_ref[n]).norm() / grads_ref[n].norm().clamp_min(1e-12)
            for n, g in grads.items()]
    fused, plain = error(impl), error("plain")
    if dtype == torch.float32:
        # CUDA: other reduction orders (and no TF32: torch leaves it off for matmuls)
        assert max(fused) <= (1e-5 if device == "cpu" else 1e-4), fused
    else:   # rounding to 8 or 11 bits: the fused kernel as accurate as the plain path
        assert max(fused) <= 0.25 and all(
            f <= 1.5 * p + 1e-3 for f, p in zip(fused, plain, strict=True)), (fused, plain)


@contextmanager
def cuda_sync_reports():
    """A list that, after the body, holds where each host wait CUDA reported was called
    (file:line of the warning, then the innermost frames of the project or torch that led
    there, so that a failure names the caller and not only torch's line)."""
    seen: list[str] = []
    torch.cuda.synchronize()
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        # The waits CUDA reports ("called a synchronizing CUDA operation"), not the one-time
        # notice torch 2.11 gives when the mode is switched on (set_sync_debug_mode's own
        # warning, which also speaks of synchronization: seen on an H200, 2026-11-26).
        if "synchronizing CUDA operation" in str(message):
            frames = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                      for f in traceback.extract_stack()[:-1]][-8:]
            seen.append(f"{filename}:{lineno} <- " + " <- ".join(reversed(frames)))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown


# ARMT and Titans on the GPU only: their CPU counts are the same wrappers' (tests/
# test_sync_free.py), and what only CUDA sees is the delta rule's and the neural memory's
# device code (a read of a gate or a norm on the host would show here).
SYNC_CASES = [*[pytest.param(d, m, marks=NO_CUDA if d == "cuda" else ())
                for m in ("xl", "lamemo", "rmt") for d in ("cpu", "cuda")],
              *[pytest.param("cuda", m, marks=NO_CUDA) for m in ("armt", "titans")]]


@pytest.mark.parametrize("device,mechanism", SYNC_CASES)
def test_training_micro_steps_wait_for_the_device_only_at_the_step_decision(device,
                                                                           mechanism):
    steps = 3
    loop = make_loop(mechanism, steps=steps, log_every=100, grad_accum=2, depth=1)
    loop.device = torch.device(device)
    loop.engine.module.to(loop.device)
    with counting_syncs(), (cuda_sync_reports() if device == "cuda" else nullcontext([])) \
            as reported:
        assert loop.run() == "finished"
        counted = sum(COUNTS.values())
    marks = [0] + loop.engine.at_step
    per_step = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    assert per_step == [1] * steps, (per_step, dict(COUNTS))
    if device == "cuda":
        # Every wait CUDA reports is one the wrappers counted (and allowed): no blocking
        # copy or hidden read besides them.
        assert len(reported) == counted, (f"CUDA reported {len(reported)} waits, the "
                                          f"wrappers counted {counted}: {reported}")


@NO_CUDA
def test_compiled_training_on_the_gpu_has_the_eager_losses_and_stops_compiling():
    from test_compile import _train
    eager, _, _ = _train("xl", False, device="cuda")
    compiled, graphs, _ = _train("xl", True, device="cuda")
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5), (
        "compiled losses differ from eager's on this GPU: if only slightly, other kernels' "
        "rounding; if from the first step on, the compiled step draws other dropout masks "
        f"than eager (model/compiled.py, fallback_random): {compiled} vs {eager}")
    assert graphs[-1] == graphs[-2] > 0, graphs   # the memory is full: no new graph


@NO_CUDA
@pytest.mark.parametrize("depth,chunk,n,clip", [(2, 4, 11, None), (3, 5, 10, 0.5)])
def test_titans_chunked_update_on_the_gpu_equals_the_float64_token_recurrence(depth, chunk,
                                                                              n, clip):
    """Titans' chunked update (model/mechanisms/titans/neural_memory.py) on the GPU: in float64 it
    equals the token-by-token reference of Eq. 12-14 as on the CPU; in float32 with TF32 matmuls off
    it stays within float32's rounding of it; a bf16 module keeps its state float32 and within
    2% of float32 (tests/test_neural_memory.py's bound)."""
    from test_neural_memory import _naive_inputs, _setup, naive
    mem, x, weights, momentum = _setup(depth, chunk, n, clip=clip)
    want_w, want_s = naive(weights, momentum, *_naive_inputs(mem, x), chunk, clip)
    cuda = torch.device("cuda")
    on_gpu = mem.to(cuda)
    w, s, xg = ([t.to(cuda) for t in weights], [t.to(cuda) for t in momentum], x.to(cuda))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            got64 = on_gpu.update(w, s, xg)
            got32 = on_gpu.float().update([t.float() for t in w], [t.float() for t in s],
                                          xg.float())
            got16 = on_gpu.bfloat16().update([t.float() for t in w], [t.float() for t in s],
                                             xg.bfloat16())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    want = want_w + want_s
    for got, want_t in zip(got64[0] + got64[1], want, strict=True):
        torch.testing.assert_close(got.cpu(), want_t, rtol=1e-10, atol=1e-12)
    for got, want_t in zip(got32[0] + got32[1], want, strict=True):
        torch.testing.assert_close(got.cpu().double(), want_t, rtol=1e-4, atol=1e-5)
    assert all(t.dtype == torch.float32 for t in got16[0] + got16[1])
    for got, want_t in zip(got16[0], want_w, strict=True):
        assert (got.cpu().double() - want_t).norm() / want_t.norm() < 0.02
