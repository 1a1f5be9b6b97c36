"""Does the memory learn? Associative retrieval shrunk to a few CPU minutes: 2 key-value
pairs, one per segment of 2 positions, the query in a third segment; a 2-layer d_model 32
model; the answer's accuracy over the training batches (each batch new samples, so it is
a held-out score until it is trained on). Chance: 1/10 (the values). docs/titans.md
reports Titans beside ARMT on the same budget.

    .venv/bin/python benchmarks/titans_ar_small.py --mechanism titans --steps 1500
    .venv/bin/python benchmarks/titans_ar_small.py --mechanism armt --steps 1500
"""

from __future__ import annotations

import argparse
import time

import torch

from data_pipeline.tasks import generate, make_task
from model import ModelConfig, build_model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mechanism", choices=["titans", "armt", "rmt"], required=True)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    spec = make_task("associative_retrieval", n_pairs=2, n_segments=3)
    seg = spec.segment_len
    torch.manual_seed(args.seed)
    extra = ({"titans": {"d_mem": 16, "chunk_size": 16}} if args.mechanism == "titans" else
             {"rmt": {"num_mem_tokens": 2, "memory_norm": "none"}, "armt": {"d_key": 16}})
    model = build_model(ModelConfig(
        mechanism=args.mechanism, vocab_size=spec.vocab_size, n_layer=2, d_model=32, n_head=2,
        d_inner=64, tgt_len=seg, mem_len=0, dropout=0.0, pre_lnorm=True, **extra)).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    start, accs = time.process_time(), []
    for step in range(args.steps):
        data = generate(spec, args.batch, args.seed * 1_000_003 + step)
        x, y, m = (torch.from_numpy(a) for a in (data.inputs, data.targets, data.loss_mask))
        state = None
        for s in range(spec.n_segments):       # full BPTT: the loss is the last segment's
            cut = slice(s * seg, (s + 1) * seg)
            out = model(x[:, cut], state, targets=y[:, cut], loss_mask=m[:, cut],
                        return_log_probs=True)
            state = out.state
        accs.append(float((out.log_probs.argmax(-1) == y[:, cut])[m[:, cut]].float().mean()))
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 99:
            print(f"{args.mechanism} step {step + 1}: loss {float(out.loss):.3f} accuracy "
                  f"(last 100) {sum(accs[-100:]) / 100:.3f} cpu {time.process_time() - start:.1f}"
                  " s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
