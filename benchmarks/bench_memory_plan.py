"""The memory planner's activation model (planner/activations.py) against measured bytes.

    .venv/bin/python benchmarks/bench_memory_plan.py            # the table of BENCHMARKS.md
    .venv/bin/python benchmarks/bench_memory_plan.py --quick    # three small rows
    .venv/bin/python benchmarks/bench_memory_plan.py --compile  # + the compiled model's peak
    .venv/bin/python benchmarks/bench_memory_plan.py --only "hf "   # pretrained backbones
    python benchmarks/bench_memory_plan.py --cuda               # on a GPU (the CUDA rows)

Each row runs one BPTT window as the trainer does and counts two exact byte counts, no RSS
(train/memory_probe.py `measure`): saved (the storages autograd saves during the forward;
checkpointed segments and layers save through their own hooks, so this column is only
shown without checkpointing) and peak (the CPU allocator's high-water mark over forward and
backward).

Predicted: planner/window.py `predict_window` with kernel "cpu" (dropout noise in the model
dtype, SDPA's math path), the same config, rows and window.
Error = (predicted - measured) / measured.

The `hf` rows plan a pretrained backbone (model/pretrained/shapes.py) with random weights
drawn from a config alone. --cuda runs the CUDA rows on a GPU instead: the growth of
torch.cuda.max_memory_allocated over the same window against the plan's CUDA kernels.

--compile also measures the peak of the same window with the decoder stack compiled as
`model.compile: true` compiles it (model/compiled.py), for the rows that can compile (not
the selective recompute policies, which the config refuses with compile). The planner
counts eager's activations; this column says how far a compiled step is from them.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model import ModelConfig, resolve_shape  # noqa: E402
from planner.window import predict_window  # noqa: E402
from train.memory_probe import measure, measure_cuda  # noqa: E402


def _small(**kw) -> dict:
    base = dict(vocab_size=256, n_layer=4, d_model=128, n_head=4, d_inner=512, tgt_len=64,
                mem_len=64, dropout=0.1)
    base.update(kw)
    return base


# (label, model config, rows, depth k, segment checkpointing, precision)
CASES = [
    ("xl M=64 k=0", _small(mechanism="xl"), 4, 0, False, "fp32"),
    ("xl M=64 k=2", _small(mechanism="xl"), 4, 2, False, "fp32"),
    ("xl M=64 k=2 ckpt-seg", _small(mechanism="xl"), 4, 2, True, "fp32"),
    ("xl M=192 k=1", _small(mechanism="xl", mem_len=192), 4, 1, False, "fp32"),
    ("xl M=128 k=3 ckpt-seg", _small(mechanism="xl", mem_len=128), 4, 3, True, "fp32"),
    ("xl M=64 k=1 ckpt-layers", _small(mechanism="xl", checkpoint_layers=True), 4, 1, False,
     "fp32"),
    ("xl M=64 k=1 bf16", _small(mechanism="xl"), 4, 1, False, "bf16"),
    ("xl adaptive V=2000 k=1", _small(mechanism="xl", vocab_size=2000,
                                      cutoffs=[200, 600, 1200],
                                      tie_projs=[False, True, True, True]), 4, 1, False, "fp32"),
    ("lamemo M=64 k=0", _small(mechanism="lamemo"), 4, 0, False, "fp32"),
    ("lamemo M=128 k=1", _small(mechanism="lamemo", mem_len=128), 4, 1, False, "fp32"),
    ("lamemo M=64 k=2 ckpt-seg", _small(mechanism="lamemo"), 4, 2, True, "fp32"),
    ("lamemo M=64 k=0 ckpt-layers", _small(mechanism="lamemo", checkpoint_layers=True), 4, 0,
     False, "fp32"),
    ("rmt m=16 k=0", _small(mechanism="rmt", mem_len=0, rmt={"num_mem_tokens": 16}), 4, 0,
     False, "fp32"),
    ("rmt m=16 k=3", _small(mechanism="rmt", mem_len=0, rmt={"num_mem_tokens": 16}), 4, 3,
     False, "fp32"),
    ("rmt m=16 k=3 ckpt-seg", _small(mechanism="rmt", mem_len=0, rmt={"num_mem_tokens": 16}),
     4, 3, True, "fp32"),
    ("rmt pre-LN m=16 M=64 k=2", _small(mechanism="rmt", mem_len=64, pre_lnorm=True,
                                        rmt={"num_mem_tokens": 16}), 4, 2, False, "fp32"),
]
# WikiText-103 shapes (configs/wt103-*.yaml) with 4 of the 16 layers and 2 rows per rank
# (data.global_batch 64 on 32 ranks): the full 267,735-word adaptive softmax and embedding.
WT103 = dict(vocab_size=267735, n_layer=4, d_model=410, n_head=10, d_head=41, d_inner=2100,
             tgt_len=150, mem_len=150, dropout=0.1, cutoffs=[20000, 40000, 200000],
             tie_projs=[False, True, True, True])
CASES += [
    ("wt103-shape xl k=1", dict(WT103, mechanism="xl"), 2, 1, False, "fp32"),
    ("wt103-shape rmt k=2 ckpt-seg", dict(WT103, mechanism="rmt", mem_len=0,
                                          rmt={"num_mem_tokens": 10}), 2, 2, True, "fp32"),
]
# Selective recompute (bptt.recompute, keep_last_segments; planner/recompute.py): the
# checkpointed segments keep op outputs too. (label, ..., {recompute, keep_last}).
RMT16 = _small(mechanism="rmt", mem_len=0, rmt={"num_mem_tokens": 16})
CASES += [
    ("rmt k=3 save-masks", RMT16, 4, 3, True, "fp32", {"recompute": "save-masks"}),
    ("rmt k=3 masks+ffn-out:2 last1", RMT16, 4, 3, True, "fp32",
     {"recompute": "save-masks+ffn-out:2", "keep_last": 1}),
    ("rmt k=3 save-linear", RMT16, 4, 3, True, "fp32", {"recompute": "save-linear"}),
    ("rmt k=3 save-matmul last1", RMT16, 4, 3, True, "fp32",
     {"recompute": "save-matmul", "keep_last": 1}),
    ("xl M=128 k=3 ffn-out last2", _small(mechanism="xl", mem_len=128), 4, 3, True, "fp32",
     {"recompute": "save-ffn-out", "keep_last": 2}),
    ("xl adaptive k=2 save-linear", _small(mechanism="xl", vocab_size=2000, div_val=2,
                                           cutoffs=[200, 600, 1200]), 4, 2, True, "fp32",
     {"recompute": "save-linear"}),
    ("lamemo M=64 k=2 save-matmul", _small(mechanism="lamemo"), 4, 2, True, "fp32",
     {"recompute": "save-matmul"}),
    ("lamemo M=64 k=2 masks+ffn-out", _small(mechanism="lamemo", dropatt=0.1), 4, 2, True,
     "fp32", {"recompute": "save-masks+ffn-out"}),
]


def hf_checkpoint(family: str, **shape) -> str:
    """A directory holding only the config.json of a `family` ("llama" or "gpt2") model of
    `shape` (config fields); the rows build random weights from it (train/memory_probe.py
    `build_for_probe`)."""
    from transformers import GPT2Config, LlamaConfig
    name = family + "-" + "-".join(f"{k}{v}" for k, v in sorted(shape.items()))
    path = os.path.join(tempfile.gettempdir(), "memtrain-bench-hf", name)
    if not os.path.exists(os.path.join(path, "config.json")):
        config = LlamaConfig if family == "llama" else GPT2Config
        config(bos_token_id=0, eos_token_id=0, **shape).save_pretrained(path)
    return path


def hf_model(family: str, m: int, tgt_len: int, finetune: str = "full", shape=None,
             checkpoint_layers: bool = False, **hf) -> dict:
    """A run config's `model:` section around a random checkpoint (module docstring)."""
    shape = shape or (HF_LLAMA if family == "llama" else HF_GPT2)
    return {"mechanism": "rmt", "backbone": "hf", "tgt_len": tgt_len, "mem_len": 0,
            "rmt": {"num_mem_tokens": m}, "checkpoint_layers": checkpoint_layers,
            "hf": {"path": hf_checkpoint(family, **shape), "finetune": finetune, **hf}}


def hf(family: str, m: int, tgt_len: int, finetune: str, **kw):
    """A row's model config, made when the row runs (its config.json is written then)."""
    return functools.partial(hf_model, family, m, tgt_len, finetune, **kw)


# Pretrained backbones (`backbone: hf`, model/pretrained/shapes.py): a Llama-shaped decoder
# (RMSNorm, RoPE, 4 query heads over 2 KV heads, SwiGLU) and a GPT-2-shaped one (LayerNorm,
# fused qkv, Python tanh GELU, dropout 0.1 after c_proj, the MLP and the embeddings; SDPA's
# attention dropout 0, since the CPU's flash kernel takes none), random weights, 16 memory
# tokens around 64-token segments, full / frozen / LoRA fine-tuning.
HF_LLAMA = dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
HF_GPT2 = dict(vocab_size=512, n_embd=128, n_layer=4, n_head=4, n_positions=256,
               resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.0)
CASES += [
    (f"hf {fam} {mode} m=16 k={k}{' ckpt-seg' if ckpt else ''}",
     hf(fam, 16, 64, mode), 4, k, ckpt, "fp32")
    for fam in ("llama", "gpt2") for mode, k, ckpt in (
        ("full", 0, False), ("full", 2, False), ("frozen", 2, False), ("lora", 2, False),
        ("lora", 3, True))]
CASES += [
    ("hf llama lora m=16 k=1 bf16", hf("llama", 16, 64, "lora"), 4, 1, False, "bf16"),
    ("hf llama lora m=16 k=3 save-linear", hf("llama", 16, 64, "lora"), 4, 3, True, "fp32",
     {"recompute": "save-linear"}),
    ("hf gpt2 full m=16 k=3 masks+ffn-out:2 last1", hf("gpt2", 16, 64, "full"), 4, 3, True,
     "fp32", {"recompute": "save-masks+ffn-out:2", "keep_last": 1}),
    ("hf gpt2 lora m=16 k=3 save-matmul", hf("gpt2", 16, 64, "lora", lora_dropout=0.1), 4, 3,
     True, "fp32", {"recompute": "save-matmul"}),
    ("hf llama frozen m=16 k=1 ckpt-layers",
     hf("llama", 16, 64, "frozen", checkpoint_layers=True), 4, 1, False, "fp32")]
QUICK = ("xl M=64 k=0", "lamemo M=64 k=0", "rmt m=16 k=0")
# --cuda: the planner's GPU kernels (SDPA's memory-efficient kernel with the mask as a bias,
# 1-byte dropout masks, fp32 norm statistics) against torch.cuda's allocator, bf16, on
# Llama-2-7B-shaped layers (2 of its 32) with a 1,024-token segment and GPT-2-small-shaped
# ones with every dropout on.
LLAMA7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
               num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=32,
               max_position_embeddings=4096)
GPT2S = dict(vocab_size=50257, n_embd=768, n_layer=2, n_head=12, n_positions=1024,
             resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
CUDA_CASES = [
    (f"cuda llama-7b-shape {mode} k={k}{' ckpt-seg' if ckpt else ''}",
     hf("llama", 16, 1024, mode, shape=LLAMA7B), 1, k, ckpt, "bf16")
    for mode, k, ckpt in (("frozen", 0, False), ("frozen", 2, False), ("lora", 2, False),
                          ("full", 1, False), ("lora", 3, True))]
CUDA_CASES += [
    (f"cuda gpt2-small-shape {mode} k={k}", hf("gpt2", 16, 512, mode, shape=GPT2S), 2, k,
     False, "bf16")
    for mode, k in (("full", 1), ("frozen", 2))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="three small rows only")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--only", help="only the rows whose label contains this text")
    ap.add_argument("--compile", action="store_true",
                    help="also measure each row's peak with the decoder stack compiled")
    ap.add_argument("--cuda", action="store_true",
                    help="the GPU rows (pretrained backbones in bf16) on the GPU instead")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.cuda:
        print(_sdpa_kernel())
    rows_out = []
    print(f"{'config':<44} {'pred saved MB':>13} {'meas saved MB':>13} {'err':>7} "
          f"{'pred peak MB':>12} {'meas peak MB':>12} {'err':>7}"
          + (f" {'compiled MB':>12} {'vs eager':>7}" if args.compile else ""), flush=True)
    for label, kw, rows, depth, ckpt, prec, *window in CUDA_CASES if args.cuda else CASES:
        if (args.quick and label not in QUICK) or (args.only and args.only not in label):
            continue
        window = window[0] if window else {}
        cfg = resolve_shape(ModelConfig(**(kw() if callable(kw) else kw)))
        t0 = time.process_time()
        got = (measure_cuda(cfg, rows, depth, ckpt, prec) if args.cuda else
               measure(cfg, rows, depth, ckpt, prec, **window))
        want = predict_window(cfg, rows, depth, ckpt, prec, **window,
                       kernel="cuda" if args.cuda else "cpu")
        r = {"config": label, "rows": rows, "depth": depth, "checkpoint_segments": ckpt,
             "precision": prec, **window, **{f"pred_{k}": v for k, v in want.items()},
             **{f"meas_{k}": v for k, v in got.items()}, "cpu_s": time.process_time() - t0}
        r["err_peak"] = (want["peak"] - got["peak"]) / got["peak"]
        compiled = ""
        if args.compile and window.get("recompute", "full") == "full":
            comp = measure(cfg, rows, depth, ckpt, prec, **window, compiled=True)
            r["meas_peak_compiled"], r["compiled_graphs"] = comp["peak"], comp["graphs"]
            r["compiled_vs_eager"] = r["meas_peak_compiled"] / got["peak"]
            compiled = (f" {r['meas_peak_compiled'] / 1e6:>12.2f} "
                        f"{100 * (r['compiled_vs_eager'] - 1):>+6.1f}%")
        # Checkpointed regions save through their own hooks: the saved column would not
        # see them (the kept inputs are not saved tensors), so it is left empty.
        hidden = ckpt or cfg.checkpoint_layers or args.cuda   # (on a GPU: the peak only)
        r["err_saved"] = None if hidden else (want["saved"] - got["saved"]) / got["saved"]
        rows_out.append(r)
        saved = ("" if hidden else
                 f"{want['saved'] / 1e6:>13.2f} {got['saved'] / 1e6:>13.2f} "
                 f"{100 * r['err_saved']:>+6.1f}%")
        print(f"{label:<44} {saved:<35} {want['peak'] / 1e6:>12.2f} "
              f"{got['peak'] / 1e6:>12.2f} {100 * r['err_peak']:>+6.1f}%{compiled}",
              flush=True)
    worst = max(abs(r["err_peak"]) for r in rows_out)
    print(f"worst peak error {100 * worst:.1f}% over {len(rows_out)} configurations "
          f"(goal: within 15%)")
    ratios = [r["compiled_vs_eager"] for r in rows_out if "compiled_vs_eager" in r]
    if ratios:
        print(f"compiled peak / eager peak: {min(ratios):.2f}-{max(ratios):.2f} over "
              f"{len(ratios)} configurations (the plan counts eager's)")
    if args.json:
        with open(args.json, "w") as f:
            device = {"device": torch.cuda.get_device_name()} if args.cuda else {}
            json.dump({"date": datetime.date.today().isoformat(),
                       "torch": torch.__version__, **device, "rows": rows_out}, f, indent=2)
    return 0


def _sdpa_kernel() -> str:
    """Which SDPA kernel this GPU runs for a masked bf16 call like a decoder layer's."""
    q = torch.randn(1, 32, 1056, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(1, 1, 1056, 1056, dtype=torch.bool, device="cuda").tril()
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    return (f"{torch.cuda.get_device_name()}, torch {torch.__version__}: a masked bf16 SDPA "
            f"call runs {type(out.grad_fn).__name__}")


if __name__ == "__main__":
    sys.exit(main())
