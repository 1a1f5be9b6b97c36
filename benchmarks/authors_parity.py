"""memtrain against the RMT and ARMT authors' own code (docs/coming-from-authors.md): their
checkpoint imported by `memtrain import`, memtrain's export loaded by their code, log-probs
compared. Their modules are not in this repository: give the path of a checkout's file
(`git show HEAD:modeling_rmt/language_modeling.py > /tmp/rmt_authors.py`).

    # RMT (their MemoryCell runs on transformers 5)
    .venv/bin/python benchmarks/authors_parity.py rmt --module /tmp/rmt_authors.py
    # ARMT: their layer wrapper needs transformers 4.x, so their side runs in another venv
    /tmp/oldtf/bin/python benchmarks/authors_parity.py armt-theirs \\
        --module /tmp/armt_authors.py --work /tmp/armt-parity
    .venv/bin/python benchmarks/authors_parity.py armt-ours --work /tmp/armt-parity
    /tmp/oldtf/bin/python benchmarks/authors_parity.py armt-back \\
        --module /tmp/armt_authors.py --work /tmp/armt-parity

Tiny random GPT-2 and Llama bases (vocab 1000, d 64, 2 layers), every weight perturbed
(W_mv too, which starts at 0), m = 4, 4 segments of 16 tokens, batch 2, fp32 on the CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MEMTRAIN = str(ROOT / ".venv" / "bin" / "memtrain")
M, D_MEM, L, N_SEG, VOCAB = 4, 8, 16, 4, 1000
ARCHS = {"gpt2": ("transformer.h", True), "llama": ("model.layers", False)}


def load_module(path: str):
    if "import wandb" in Path(path).read_text():   # the ARMT module imports it, never uses it
        sys.modules.setdefault("wandb", types.ModuleType("wandb"))
    spec = importlib.util.spec_from_file_location("authors_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_base(arch: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64,
                                          n_layer=2, n_head=4, resid_pdrop=0, embd_pdrop=0,
                                          attn_pdrop=0)).eval()
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2,
                                        max_position_embeddings=256)).eval()


def perturb(module, armt_layers=None) -> None:
    with torch.no_grad():   # as after fine-tuning: every weight moved
        for p in module.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for layer in armt_layers or []:
            layer.W_mv.weight.normal_(0, 0.3)


def ours(imported: Path, x: torch.Tensor) -> torch.Tensor:
    sys.path.insert(0, str(ROOT))
    from model.io import load_model
    model, state, out = load_model(imported / "model.safetensors").eval(), None, []
    with torch.no_grad():
        for s in range(x.shape[1] // L):
            res = model(x[:, s * L:(s + 1) * L], state, return_log_probs=True)
            state = res.state
            out.append(res.log_probs)
    return torch.cat(out, 1)


def memtrain(*args: str) -> None:
    subprocess.run([MEMTRAIN, *args], check=True, capture_output=True)


def rmt(args) -> dict:
    mod, res = load_module(args.module), {}
    for arch in ARCHS:
        work = args.work / f"rmt-{arch}"
        base = tiny_base(arch)
        base.save_pretrained(work / "base")
        wrapper = mod.RecurrentWrapper(mod.MemoryCell(base, M), segment_size=L).eval()
        perturb(wrapper)
        torch.save(wrapper.state_dict(), work / "theirs.pt")
        memtrain("import", "--state-dict", str(work / "theirs.pt"), "--base",
                 str(work / "base"), "--segment-size", str(L), "--out", str(work / "imp"))
        x = torch.randint(0, VOCAB, (2, N_SEG * L))
        with torch.no_grad():
            theirs = torch.log_softmax(wrapper(input_ids=x).logits.float(), -1)
        memtrain("export", "--model", str(work / "imp/model.safetensors"), "--format",
                 "authors", "--out", str(work / "back.pt"))
        fresh = mod.RecurrentWrapper(mod.MemoryCell(tiny_base(arch), M), segment_size=L)
        fresh.load_state_dict(torch.load(work / "back.pt"), strict=True)
        with torch.no_grad():
            back = torch.log_softmax(fresh.eval()(input_ids=x).logits.float(), -1)
        ours_lp = ours(work / "imp", x)
        res[arch] = {"import_max_abs_logprob_diff": float((ours_lp - theirs).abs().max()),
                     "export_max_abs_logprob_diff": float((back - theirs).abs().max())}
    return res


def _armt_wrapper(mod, arch):
    layers, wrap = ARCHS[arch]
    cell = mod.AssociativeMemoryCell(tiny_base(arch), M, D_MEM, layers_attr=layers,
                                     wrap_pos=wrap)
    return mod.AssociativeRecurrentWrapper(cell, segment_size=L).eval(), cell


def _armt_run(wrapper, x):
    with torch.no_grad():   # their cell needs an attention mask (it pops prev_attn_mask)
        out = wrapper(input_ids=x, attention_mask=torch.ones_like(x))
    return torch.log_softmax(out.logits.float(), -1)


def armt_theirs(args) -> dict:
    mod = load_module(args.module)
    for arch in ARCHS:
        work = args.work / f"armt-{arch}"
        tiny_base(arch).save_pretrained(work / "base")
        wrapper, cell = _armt_wrapper(mod, arch)
        perturb(wrapper, cell.layers)
        x = torch.randint(0, VOCAB, (2, N_SEG * L))
        torch.save(wrapper.state_dict(), work / "theirs.pt")
        torch.save({"x": x, "log_probs": _armt_run(wrapper, x)}, work / "reference.pt")
    return {"saved": str(args.work)}


def armt_ours(args) -> dict:
    res = {}
    for arch in ARCHS:
        work = args.work / f"armt-{arch}"
        memtrain("import", "--format", "armt-authors", "--state-dict", str(work / "theirs.pt"),
                 "--base", str(work / "base"), "--segment-size", str(L), "--out",
                 str(work / "imp"))
        ref = torch.load(work / "reference.pt")
        diff = (ours(work / "imp", ref["x"]) - ref["log_probs"]).abs()
        res[arch] = {"import_max_abs_logprob_diff": float(diff.max()),
                     "per_segment": [float(diff[:, s * L:(s + 1) * L].max())
                                     for s in range(N_SEG)]}
        memtrain("export", "--model", str(work / "imp/model.safetensors"), "--format",
                 "authors", "--out", str(work / "back.pt"))
    return res


def armt_back(args) -> dict:
    mod, res = load_module(args.module), {}
    for arch in ARCHS:
        work = args.work / f"armt-{arch}"
        wrapper, _ = _armt_wrapper(mod, arch)
        wrapper.load_state_dict(torch.load(work / "back.pt"), strict=True)
        ref = torch.load(work / "reference.pt")
        res[arch] = {"export_max_abs_logprob_diff":
                     float((_armt_run(wrapper, ref["x"]) - ref["log_probs"]).abs().max())}
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=["rmt", "armt-theirs", "armt-ours", "armt-back"])
    p.add_argument("--module", help="the authors' language_modeling.py")
    p.add_argument("--work", type=Path, default=Path("/tmp/authors-parity"))
    args = p.parse_args(argv)
    if args.step != "armt-ours" and not args.module:
        p.error(f"{args.step} needs --module")
    steps = {"rmt": rmt, "armt-theirs": armt_theirs, "armt-ours": armt_ours,
             "armt-back": armt_back}
    print(json.dumps(steps[args.step](args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
