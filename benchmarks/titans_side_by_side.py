"""memtrain's Titans beside titans-pytorch's MemoryAsContextTransformer on one stream.

The stream is the quickstart's (configs/quickstart.yaml, data_pipeline/synthetic.py
`repeat_block_stream`: blocks [A | filler | A] of 12 random symbols, 4 of filler, 16
symbols, so every A repeats exactly one 16-token segment later). Each training sample is
`--segments` segments of 16 tokens (+1 target) cut from it, a fresh batch each step, the
memory fresh at each sample's start and the gradient through all its segments, as
titans-pytorch trains (it takes the whole sequence and cuts it into segments inside).

Four runs on the same batches (generated once here and handed to every run):

    memtrain            memtrain's MAC (§4.1), the state carried from segment to segment
    memtrain-reset      the same model with the state reset to M_0 at every segment start
                        (the memory cannot carry anything: the no-memory control)
    titans-pytorch      MemoryAsContextTransformer, neural memory in every layer
    titans-pytorch-off  the same, neural memory off (neural_memory_layers=())

Matched: width 64, depth 2, 4 heads of 16, feed-forward 4 x 64, segment 16, 4 persistent
tokens per layer, AdamW at `--lr`, batch `--batch`, the same seed for the initialisation.
What cannot be matched: titans-pytorch also has `--longterm` learned long-term memory
tokens per segment (memtrain reads the memory once per token, Eq. 21), its memory reads
and writes each layer's input (memtrain: retrieve, attend, write the attention's output,
Eq. 21-24), and its own defaults elsewhere (docs/titans.md "What differs from
titans-pytorch"). titans-pytorch is used only through its public constructor and forward,
as a black box, in its own interpreter (`--titans-python`): it is not a dependency of
memtrain.

Reported every `--log-every` steps, averaged over those steps' training batches (each
batch new, so scored before it is trained on): the loss on the repeated symbols (the
second copies of A) and on all targets of segments 2 onward. Chance is ln 16 = 2.773; a
perfect memory gives 0 on the repeats and 16/28 * 2.773 = 1.585 over segments 2 onward
(the fillers and first copies stay random).

    .venv/bin/python benchmarks/titans_side_by_side.py --steps 1000 \
        --titans-python /work/titans-venv/bin/python \
        --json benchmarks/results/titans_side_by_side.json

memtrain's model can be changed one factor at a time (docs/titans.md, "Why it did not
learn, by difference"): `--titans KEY=VALUE` sets a `model.titans` field (repeatable, e.g.
`--titans read_as=residual --titans update_input=input`), `--bptt N` cuts the gradient N
segments back (default: through all of them), and two screening knobs that are not model
options: `--read-std` redraws W_H at another std, `--abs-pos` adds absolute positions in
the segment to memtrain's embeddings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

SEG, VOCAB, BLOCK, FILLER = 16, 16, 12, 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_batches(steps: int, batch: int, segments: int, seed: int):
    """(tokens [steps, batch, n + 1], target_is_repeat [steps, batch, n]), n = segments * 16:
    per step `batch` rows of the quickstart stream, each starting at a block boundary."""
    from data_pipeline.synthetic import repeat_block_stream
    n = segments * SEG
    per_row = -(-(n + 1) // (2 * BLOCK + FILLER))
    toks, reps = [], []
    for step in range(steps):
        t, r = repeat_block_stream(batch * per_row, block=BLOCK, filler=FILLER,
                                   n_symbols=VOCAB, seed=seed * 1_000_003 + step)
        t, r = t.view(batch, -1)[:, :n + 1], r.view(batch, -1)[:, :n + 1]
        toks.append(t)
        reps.append(r[:, 1:])          # the flag of each target
    return torch.stack(toks), torch.stack(reps)


class Curve:
    """Per logging interval: mean loss on the repeats and on segments 2 onward."""

    def __init__(self, log_every: int, name: str):
        self.log_every, self.name, self.points = log_every, name, []
        self.rep, self.later, self.start = [], [], time.process_time()

    def add(self, step: int, nll: torch.Tensor, repeat: torch.Tensor):
        later = nll[:, SEG:]
        self.rep.append(float(nll[repeat].mean()))
        self.later.append(float(later.mean()))
        if (step + 1) % self.log_every == 0:
            p = {"step": step + 1, "loss_repeats": sum(self.rep) / len(self.rep),
                 "loss_segments_2_on": sum(self.later) / len(self.later),
                 "cpu_s": round(time.process_time() - self.start, 1)}
            self.points.append(p)
            self.rep, self.later = [], []
            print(f"  {self.name} step {p['step']}: repeats {p['loss_repeats']:.3f} "
                  f"segments 2+ {p['loss_segments_2_on']:.3f} cpu {p['cpu_s']} s", flush=True)


def run_memtrain(tokens, repeats, args, reset: bool) -> dict:
    from model import ModelConfig, build_model
    torch.manual_seed(args.seed)
    cfg = ModelConfig(mechanism="titans", vocab_size=VOCAB, n_layer=args.depth,
                      d_model=args.dim, n_head=args.heads, d_head=args.dim // args.heads,
                      d_inner=4 * args.dim, tgt_len=SEG, mem_len=0, dropout=0.0,
                      pre_lnorm=True,
                      titans={"num_persistent": args.persistent, "d_mem": args.d_mem,
                              "chunk_size": args.chunk, "variant": args.variant,
                              **titans_overrides(args.titans)})
    model = build_model(cfg).train()
    if args.read_std is not None:   # screening only: W_H's initial std (the read's scale)
        with torch.no_grad():
            for w in model.core.memory_out or ():
                w.weight.normal_(0.0, args.read_std)
    if args.memory_init == "xavier":   # screening only: M_0 as titans-pytorch's MemoryMLP
        with torch.no_grad():
            for mem in model.core.memory:
                for w in mem.init:
                    torch.nn.init.xavier_uniform_(w.value)
    if args.abs_pos:   # screening only: titans-pytorch's inputs carry absolute positions
        pos = torch.arange(SEG, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, args.dim, 2) * (-math.log(100.0) / args.dim))
        table = torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=-1)
        model.embedding.register_forward_hook(
            lambda mod, inp, out: out + table[:out.shape[1]].to(out.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    name = ("memtrain-reset" if reset else "memtrain") + (
        f"-{args.variant}" if args.variant != "mac" else "")
    curve = Curve(args.log_every, name)
    for step in range(tokens.shape[0]):
        x, y = tokens[step, :, :-1], tokens[step, :, 1:]
        state, nll = None, []
        for s in range(args.segments):
            cut = slice(s * SEG, (s + 1) * SEG)
            out = model(x[:, cut], None if reset else state, targets=y[:, cut])
            nll.append(out.nll)
            state = out.state
            if args.bptt is not None and (s + 1) % (args.bptt + 1) == 0:
                state = state.detach()     # the gradient reaches `--bptt` segments back
        nll = torch.cat(nll, dim=1)
        _update(model, opt, nll, args)
        curve.add(step, nll.detach(), repeats[step])
    return {"name": name, "params": sum(p.numel() for p in model.parameters()),
            "curve": curve.points}


def titans_overrides(items: list[str]) -> dict:
    """`--titans KEY=VALUE` items as `model.titans` fields (VALUE read as YAML)."""
    import yaml
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = yaml.safe_load(value)
    return out


def _update(model, opt, nll: torch.Tensor, args) -> None:
    """One optimizer step on the mean NLL, the same for every run (clipped if asked)."""
    opt.zero_grad(set_to_none=True)
    nll.mean().backward()
    if args.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()


def run_titans_pytorch(tokens, repeats, args, memory: bool) -> dict:
    """Runs inside titans-pytorch's interpreter: its public API only."""
    from titans_pytorch import MemoryAsContextTransformer
    torch.manual_seed(args.seed)
    model = MemoryAsContextTransformer(
        num_tokens=VOCAB, dim=args.dim, depth=args.depth, segment_len=SEG,
        num_persist_mem_tokens=args.persistent, num_longterm_mem_tokens=args.longterm,
        neural_memory_layers=tuple(range(1, args.depth + 1)) if memory else (),
        heads=args.heads, dim_head=args.dim // args.heads, ff_mult=4).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    name = "titans-pytorch" if memory else "titans-pytorch-off"
    curve = Curve(args.log_every, name)
    for step in range(tokens.shape[0]):
        x, y = tokens[step, :, :-1], tokens[step, :, 1:]
        logits = model(x)
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")
        _update(model, opt, nll, args)
        curve.add(step, nll.detach(), repeats[step])
    return {"name": name, "params": sum(p.numel() for p in model.parameters()),
            "curve": curve.points}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--segments", type=int, default=8, help="segments of 16 per sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=0.0, help="gradient clip; 0: none")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--persistent", type=int, default=4)
    p.add_argument("--longterm", type=int, default=4, help="titans-pytorch only")
    p.add_argument("--d-mem", type=int, default=64, help="memtrain's d_mem")
    p.add_argument("--chunk", type=int, default=16, help="memtrain's chunk_size")
    p.add_argument("--variant", default="mac", choices=["mac", "mag", "mal"],
                   help="memtrain's model.titans.variant: mal and mag write (and read) the "
                        "memory from each layer's input, as titans-pytorch does")
    p.add_argument("--titans", action="append", default=[], metavar="KEY=VALUE",
                   help="memtrain's model.titans field (repeatable), e.g. update_input=input")
    p.add_argument("--bptt", type=int, default=None,
                   help="memtrain: the gradient reaches this many segments back (the state "
                        "detached after every bptt + 1 segments); default: all 8")
    p.add_argument("--read-std", type=float, default=None,
                   help="memtrain: redraw W_H (the read's projection) at this std after "
                        "the build (a screening knob; default: model.init_std)")
    p.add_argument("--memory-init", default="normal", choices=["normal", "xavier"],
                   help="memtrain: the memory's initial weights M_0 as built (N(0, 1/d_in)) or "
                        "redrawn Xavier-uniform after the build, as titans-pytorch's "
                        "MemoryMLP draws them (a screening knob)")
    p.add_argument("--abs-pos", action="store_true",
                   help="memtrain: add a sinusoid of each token's position in its segment to "
                        "the embeddings (a screening knob: titans-pytorch's inputs carry "
                        "absolute positions, memtrain's stack only relative ones)")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--runs", default="memtrain,memtrain-reset,titans-pytorch,titans-pytorch-off")
    p.add_argument("--titans-python", default="",
                   help="the interpreter of a venv with titans-pytorch installed")
    p.add_argument("--json", default="")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)   # titans-pytorch side
    p.add_argument("--data", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    if args.worker:        # in titans-pytorch's interpreter: train, write the result
        tokens, repeats = torch.load(args.data)
        result = run_titans_pytorch(tokens, repeats, args, args.worker == "titans-pytorch")
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0
    tokens, repeats = make_batches(args.steps, args.batch, args.segments, args.seed)
    runs, results = args.runs.split(","), []

    def save():   # after every run: a run cut short keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d"), "args": vars(args),
                           "chance": math.log(VOCAB), "runs": results}, f, indent=1)

    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "batches.pt")
        torch.save((tokens, repeats), data)
        for name in runs:
            print(f"{name}:", flush=True)
            if name.startswith("memtrain"):
                results.append(run_memtrain(tokens, repeats, args, name == "memtrain-reset"))
            else:
                if not args.titans_python:
                    print("  skipped: no --titans-python", flush=True)
                    continue
                out = os.path.join(tmp, f"{name}.json")
                argv_worker = [a for a in (argv if argv is not None else sys.argv[1:])]
                subprocess.run([args.titans_python, os.path.abspath(__file__), *argv_worker,
                                "--worker", name, "--data", data, "--out", out],
                               check=True, cwd=tmp)
                with open(out) as f:
                    results.append(json.load(f))
            save()
    for r in results:
        last = r["curve"][-1] if r["curve"] else {}
        print(f"{r['name']}: {r['params']} parameters, last interval repeats "
              f"{last.get('loss_repeats', float('nan')):.3f} segments 2+ "
              f"{last.get('loss_segments_2_on', float('nan')):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
