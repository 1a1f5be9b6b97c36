"""Which SDPA kernel each mechanism and attention pattern can take: the fast-path check.

    python benchmarks/gpu_kernels.py                       # CPU: what each call passes
    python benchmarks/gpu_kernels.py --device cuda --dtype bf16 --json k.json

FlashAttention (Dao et al. 2022) computes softmax(QK^T / sqrt(d) + causal) V without an
arbitrary mask: torch's `scaled_dot_product_attention` takes its flash backend only when
`attn_mask` is None (with or without `is_causal`); a boolean or float `attn_mask` leaves the
memory-efficient or the math kernel (torch.nn.functional.scaled_dot_product_attention's
documentation, "backends"). So whether a mechanism can run flash is decided by what it
passes to that call, which is what this module records, by wrapping the function for one
forward + backward at tiny shapes:

    mask        "none", "bool" or "float" (the attn_mask argument)
    is_causal   the flag (transformers sets it when it drops an all-causal mask)
    flash_eligible  mask "none": no arbitrary mask stands in flash's way

On CUDA each call also gets torch's own verdict, `torch.backends.cuda.can_use_flash_attention`
and `can_use_efficient_attention` on the call's arguments, and the attention kernels the
profiler saw (their names: flash / fmha / efficient / cudnn).

Cases: the pretrained wrapper (backbone hf, a tiny random Llama of benchmarks/bench_pretrained.py)
with no memory (the base model), RMT `pattern: paper` (RMT §3's rule: by default three
maskless calls, `model.hf.paper_attention: split`; with "mask" one [2m+L]^2 boolean mask),
RMT `pattern: causal` (the RMT authors' MemoryCell: the base model's own causal mask),
ARMT (the base model's causal mask over [tokens | memory]); and the native stack's xl,
lamemo, rmt and armt, whose relative positional term is a float bias on every call
(model/attention_kernels.py, "sdpa"): never flash, by construction. On the CPU the native
stack trains with its own one-pass kernel, so the kernel choice is made as on CUDA
(`choose_kernel` told the device is "cuda") to record what the GPU would be passed.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_pretrained as bp  # noqa: E402
from benchmarks.common import write_json  # noqa: E402
from model import ModelConfig, build_model  # noqa: E402

# name -> (backbone, mechanism, num_mem_tokens, pattern[, model.hf.paper_attention])
CASES = {
    "hf base (no memory)": ("hf", "rmt", 0, "paper"),
    "hf rmt paper": ("hf", "rmt", 4, "paper"),
    "hf rmt paper (mask)": ("hf", "rmt", 4, "paper", "mask"),
    "hf rmt causal": ("hf", "rmt", 4, "causal"),
    "hf armt": ("hf", "armt", 4, "paper"),
    "native xl": ("native", "xl", 0, "paper"),
    "native lamemo": ("native", "lamemo", 0, "paper"),
    "native rmt": ("native", "rmt", 4, "paper"),
    "native armt": ("native", "armt", 4, "paper"),
}
KERNEL_WORDS = ("flash", "fmha", "efficient", "cudnn", "attention")


def _mask_kind(mask) -> str:
    if mask is None:
        return "none"
    return "bool" if mask.dtype == torch.bool else "float"


def _cuda_verdict(q, k, v, mask, dropout_p, is_causal, enable_gqa) -> dict:
    """torch's own answer for these arguments (no warnings printed): flash, efficient."""
    try:
        params = torch.backends.cuda.SDPAParams(q, k, v, mask, dropout_p, is_causal,
                                                enable_gqa)
        return {"can_use_flash": bool(torch.backends.cuda.can_use_flash_attention(params)),
                "can_use_efficient": bool(
                    torch.backends.cuda.can_use_efficient_attention(params))}
    except (AttributeError, TypeError, RuntimeError) as e:   # another torch's signature
        return {"verdict_error": repr(e)[:200]}


@contextmanager
def kernels_chosen_as_on_cuda():
    """The native stack's kernel choice (model/attention.py `choose_kernel`) made as on CUDA
    whatever the device: on the CPU it would take its own one-pass kernel instead of SDPA."""
    from model import attention
    real = attention.choose_kernel
    attention.choose_kernel = lambda impl, device_type, **kw: real(impl, "cuda", **kw)
    try:
        yield
    finally:
        attention.choose_kernel = real


@contextmanager
def sdpa_calls():
    """A list that collects, for every `F.scaled_dot_product_attention` call made inside
    the body, what it was passed (module docstring); the call itself runs unchanged."""
    calls: list[dict] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
        call = {"mask": _mask_kind(attn_mask), "is_causal": bool(is_causal),
                "q": list(q.shape), "k": list(k.shape), "dtype": str(q.dtype).split(".")[-1],
                "gqa": bool(kwargs.get("enable_gqa", False))}
        call["flash_eligible"] = call["mask"] == "none"
        if q.is_cuda:
            call.update(_cuda_verdict(q, k, v, attn_mask, dropout_p, bool(is_causal),
                                      call["gqa"]))
        calls.append(call)
        return real(q, k, v, attn_mask, dropout_p, is_causal, *args, **kwargs)
    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        yield calls
    finally:
        torch.nn.functional.scaled_dot_product_attention = real


def build_case(case: str, device, dtype, folder: str, seg_len: int = 16):
    """The model of one case at tiny shapes, on `device` in `dtype`, and its vocabulary."""
    backbone, mechanism, m, pattern, *paper_attention = CASES[case]
    torch.manual_seed(0)
    if backbone == "hf":
        a = bp.parse_args(["--quick", f"--seg-len={seg_len}", f"--mechanism={mechanism}",
                           f"--pattern={pattern}", f"--num-mem-tokens={m}"])
        path = os.path.join(folder, "llama")
        if not os.path.exists(path):
            bp.save_backbone(a, path)
        cfg = bp.model_config(a, path, m)
        if paper_attention:
            cfg.hf.paper_attention = paper_attention[0]
        model = build_model(cfg)
        vocab = a.vocab
    else:
        cfg = ModelConfig(mechanism=mechanism, vocab_size=64, n_layer=2, d_model=64, n_head=2,
                          d_inner=128, dropout=0.0, tgt_len=seg_len, mem_len=seg_len,
                          rmt={"num_mem_tokens": m or 4})
        model = build_model(cfg)
        vocab = 64
    return model.train().to(device, dtype), vocab


def profile_kernels(fn, device) -> list[str]:
    """Names of the attention kernels the profiler saw while `fn` ran on CUDA."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    names = {e.key for e in prof.key_averages()}
    return sorted(n for n in names if any(w in n.lower() for w in KERNEL_WORDS))


def check_case(case: str, device="cpu", dtype=torch.float32, folder: str | None = None,
               seg_len: int = 16, batch: int = 2) -> dict:
    """One case: its model's SDPA calls over two segments (memory carried), forward and
    backward, summarised; on CUDA also torch's verdicts and the kernels profiled."""
    with tempfile.TemporaryDirectory() as tmp:
        model, vocab = build_case(case, device, dtype, folder or tmp, seg_len)
        tokens = torch.randint(0, vocab, (batch, 2 * seg_len + 1),
                               generator=torch.Generator().manual_seed(0)).to(device)

        def step():
            state, loss = None, 0.0
            for s in range(2):
                seg = tokens[:, s * seg_len:(s + 1) * seg_len + 1]
                out = model(seg[:, :-1], state, targets=seg[:, 1:])
                loss, state = loss + out.loss, out.state
            loss.backward()
        with sdpa_calls() as calls, kernels_chosen_as_on_cuda():
            step()
        kernels = profile_kernels(step, device) if torch.device(device).type == "cuda" \
            else None
    kinds = collections.Counter(f"mask={c['mask']},is_causal={c['is_causal']}"
                                for c in calls)
    out = {"case": case, "sdpa_calls": len(calls), "patterns": dict(kinds),
           "flash_eligible": bool(calls) and all(c["flash_eligible"] for c in calls),
           "first_call": calls[0] if calls else None}
    if not calls:   # LaMemo's branches need the log-normaliser: its one-pass kernel
        out["path"] = "no SDPA call (the project's own attention kernel)"
    if calls and "can_use_flash" in calls[0]:
        out["can_use_flash"] = all(c["can_use_flash"] for c in calls)
        out["can_use_efficient"] = all(c.get("can_use_efficient") for c in calls)
    if kernels is not None:
        out["kernels_profiled"] = kernels
    return out


def kernel_report(device="cpu", dtype=torch.float32, cases=None, seg_len: int = 16) -> dict:
    """Every case of CASES (or `cases`); a case that fails is reported, not raised."""
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        for case in cases or CASES:
            try:
                rows[case] = check_case(case, device, dtype, folder, seg_len)
            except Exception as e:   # one broken case must not hide the others' rows
                rows[case] = {"case": case, "error": f"{type(e).__name__}: {e}"[:500]}
    return {"device": str(device), "dtype": str(dtype).split(".")[-1], "cases": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--json")
    a = p.parse_args(argv)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    report = kernel_report(a.device, dtype)
    for case, r in report["cases"].items():
        print(f"{case:<22} " + (r.get("error") or f"{r['sdpa_calls']} calls {r['patterns']} "
                                f"flash eligible: {r['flash_eligible']}"))
    write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
