"""Bytes autograd keeps per token in one decoder layer of a pretrained shape, as the planner
states them (model/pretrained/shapes.py, validated against autograd's saved tensors on the
CPU by tests/test_pretrained_plan.py): the same count on any device.

    python benchmarks/count_layer_bytes.py --json benchmarks/results/layer_bytes.json

Shapes: GPT-2-124M (12 layers, d 768, I 3,072, V 50,257; its dropout off, as the GPU
benchmarks run it) and SmolLM2-135M (30 layers, d 576, I 1,536, 9 heads, 3 KV heads), one
segment of 1,024 tokens, batch 1, bf16, CUDA kernels (1-byte dropout masks, fp32 norm
statistics), full fine-tuning, the base model alone (no memory tokens). Each row with
`model.hf.recompute_activation` off and on.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_json  # noqa: E402

TOKENS = 1024


def _checkpoints(root: Path) -> dict[str, Path]:
    from transformers import GPT2Config, LlamaConfig
    gpt2, smol = root / "gpt2-124m", root / "smollm2-135m"
    GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).save_pretrained(gpt2)
    LlamaConfig(num_hidden_layers=30, hidden_size=576, intermediate_size=1536,
                num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                tie_word_embeddings=True).save_pretrained(smol)
    return {"gpt2-124m": gpt2, "smollm2-135m": smol}


def layer_bytes(path: Path, recompute: bool) -> dict:
    from model import ModelConfig, resolve_shape
    from planner.activations import Dims, count_params, segment_blocks
    cfg = resolve_shape(ModelConfig.from_dict({
        "mechanism": "rmt", "backbone": "hf", "mem_len": 0, "tgt_len": TOKENS,
        "rmt": {"num_mem_tokens": 0},
        "hf": {"path": str(path), "recompute_activation": recompute}}))
    dm = Dims(cfg, rows=1, mem_len=0, precision="bf16", kernel="cuda")
    _, layers, _ = segment_blocks(dm, count_params(cfg))
    blocks = {b.name: b.saved / TOKENS for b in layers[0]}
    return {"blocks": blocks, "layer": sum(blocks.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the counts here")
    a = p.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape, path in _checkpoints(Path(tmp)).items():
            out[shape] = {("recompute" if r else "kept"): layer_bytes(path, r)
                          for r in (False, True)}
            kept, rec = out[shape]["kept"]["layer"], out[shape]["recompute"]["layer"]
            print(f"{shape}: {kept:,.0f} -> {rec:,.0f} bytes per token per layer "
                  f"({rec / kept:.3f}x)")
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
