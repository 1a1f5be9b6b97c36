"""ARMT's hot-path costs counted on the CPU, device-independent (docs/armt.md, "Costs
counted on the CPU"; BENCHMARKS.md, "ARMT: state traffic, host syncs, live bytes"):

1. bytes the backward moves on state-shaped tensors per segment, in |A| (the associative
   state's bytes), with A_l taken by a select per use (before) and by one unbind;
2. host syncs in the forward and backward of a 4-segment window around a pretrained model
   (RMT, RMT with the authors' causal pattern, ARMT, Titans; segment checkpointing);
3. bytes alive after the forward of a checkpointed window, per extra segment (ARMT with
   and without `model.armt.offload_state`);
4. drift of the bf16 read against the fp32 read over 512 segments.

Tiny random checkpoints (GPT-2 family; 12 layers for 1, as GPT-2-124M), run in this process.

    .venv/bin/python benchmarks/armt_costs.py [--only traffic syncs live drift]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from test_armt_costs import (  # noqa: E402
    host_store,
    live_after_forward,
    native_armt,
    per_segment,
    per_use_select,
    state_traffic,
)
from test_sync_free_pretrained import model, window_syncs  # noqa: E402

from model.mechanisms.armt import associative_grad  # noqa: E402
from model.mechanisms.armt.associative import AssociativeMemory  # noqa: E402
from model.pretrained.tiny import tiny_gpt2, tiny_llama  # noqa: E402


def traffic(tmp: Path) -> None:
    path = tiny_gpt2(tmp / "gpt2-12", tied=False, layers=12, d=32)
    print("| access to A_l | backward, per segment (of it written) | backward incl. the "
          "checkpointed segment's re-run (written) | largest ops (backward) |\n"
          "|---|---|---|---|")
    layers, fast = AssociativeMemory.layers, associative_grad.fast_path
    plain = lambda *t: False  # noqa: E731
    for name, access, path_kind in (
            ("plain autograd, a select per use", per_use_select, plain),
            ("plain autograd, one unbind", layers, plain),
            ("hand-written backward (model/mechanisms/armt/associative_grad.py)", layers, fast)):
        AssociativeMemory.layers, associative_grad.fast_path = access, path_kind
        try:
            plain_seg, _, plain_w = per_segment(path, False)
            ckpt, _, ckpt_w = per_segment(path, True)
            _, by_op, _, _ = state_traffic(path, 3, False)
        finally:
            AssociativeMemory.layers, associative_grad.fast_path = layers, fast
        top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:3])
        print(f"| {name} | {plain_seg:.1f} ({plain_w:.1f}) x \\|A\\| | {ckpt:.1f} ({ckpt_w:.1f}) "
              f"x \\|A\\| | {top} (3 segments) |")


def syncs(tmp: Path) -> None:
    paths = {"gpt2": tiny_gpt2(tmp / "gpt2", tied=False), "llama": tiny_llama(tmp / "llama")}
    print("| mechanism | GPT-2 sdpa | Llama sdpa | GPT-2 eager |\n|---|---|---|---|")
    for mech in ("rmt", "rmt-causal", "armt", "titans"):
        cells = []
        for arch, attn in (("gpt2", "sdpa"), ("llama", "sdpa"), ("gpt2", "eager")):
            counts = window_syncs(model(paths[arch], mech, attn), checkpoint=True)
            cells.append(f"{sum(counts.values())} {counts or ''}".strip())
        print(f"| {mech} | " + " | ".join(cells) + " |")


def live(tmp: Path) -> None:
    """With `offload_state`, host memory is stood in by numpy arrays (test_armt_costs.py
    `host_store`: on the CPU the host is the device)."""
    import pytest
    path = tiny_gpt2(tmp / "gpt2", tied=False)
    print("| mechanism | alive after the forward, 2 segments | 8 segments | per extra "
          "segment | the state handed on |\n|---|---|---|---|---|")
    with pytest.MonkeyPatch.context() as mp:
        host_store(mp)
        for mech, armt in (("rmt", {}), ("armt", {}), ("armt", {"offload_state": True})):
            (a2, state), (a8, _) = (live_after_forward(path, mech, n, **armt) for n in (2, 8))
            name = mech + (" offload_state" if armt else "")
            print(f"| {name} | {a2} B | {a8} B | {(a8 - a2) / 6:.0f} B | {state} B |")


def drift() -> None:
    print("| seed | segments | A: bf16 vs fp32 read | A: fp32 vs fp64 | max \\|Δp\\| so far |\n"
          "|---|---|---|---|---|")
    for seed in (0, 1):
        fp32, bf16 = native_armt("fp32", seed), native_armt("bf16", seed)
        fp64 = native_armt("fp32", seed).double()
        g = torch.Generator().manual_seed(seed)
        s32 = s16 = s64 = None
        worst = 0.0
        with torch.no_grad():
            for s in range(1, 513):
                tokens = torch.randint(0, 19, (2, 8), generator=g)
                a = fp32(tokens, s32, return_log_probs=True)
                b = bf16(tokens, s16, return_log_probs=True)
                s64 = fp64(tokens, s64).state
                s32, s16 = a.state, b.state
                worst = max(worst, float((a.log_probs.exp() - b.log_probs.exp()).abs().max()))
                if s in (8, 64, 512):
                    rel = float((s16.A - s32.A).norm() / s32.A.norm())
                    ref = float((s32.A.double() - s64.A).norm() / s64.A.norm())
                    print(f"| {seed} | {s} | {rel:.1e} | {ref:.1e} | {worst:.1e} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", default=["traffic", "syncs", "live", "drift"],
                    choices=["traffic", "syncs", "live", "drift"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.only:
            print(f"\n### {part}\n")
            {"traffic": lambda: traffic(Path(tmp)), "syncs": lambda: syncs(Path(tmp)),
             "live": lambda: live(Path(tmp)), "drift": drift}[part]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
