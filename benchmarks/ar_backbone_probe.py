"""Can a backbone learn associative retrieval *without* any memory? (docs/rmt.md, "Associative
retrieval: what was tried").

The whole sample is one segment (`k1 v1 ... kn vn q S`, answer = the value of q), so no
memory or recurrence is involved; the loss is on the answer position only, as in the task
(RMT paper §4, App. A.2). Two backbones of the paper's AR size (6 layers, d_model 64, 4
heads, d_inner 128, pre-LN, dropout 0), plain PyTorch loop, Adam lr 1e-3, clip 0.25, batch 32:

- `vanilla`: torch.nn.TransformerEncoder with learned absolute positions;
- `memtrain`: this project's Transformer-XL backbone with no cache (`mem_len` 0).

    .venv/bin/python benchmarks/ar_backbone_probe.py --model vanilla --steps 3000
    .venv/bin/python benchmarks/ar_backbone_probe.py --model memtrain --steps 3000

Prints the test accuracy every 250 steps. Chance is 1/10; knowing only which values the
sample holds gives 1/n_pairs.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn

from data_pipeline import tasks
from model import ModelConfig, build_model

D_MODEL, N_LAYER, N_HEAD, D_INNER = 64, 6, 4, 128


class VanillaLM(nn.Module):
    def __init__(self, vocab: int, length: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, D_MODEL)
        self.pos = nn.Parameter(torch.randn(length, D_MODEL) * 0.02)
        layer = nn.TransformerEncoderLayer(D_MODEL, N_HEAD, D_INNER, 0.0, batch_first=True,
                                           norm_first=True)
        self.enc = nn.TransformerEncoder(layer, N_LAYER, enable_nested_tensor=False)
        self.norm, self.out = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.out(self.norm(self.enc(self.emb(x) + self.pos, mask=mask, is_causal=True)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("vanilla", "memtrain"), required=True)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--n-pairs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = tasks.make_task("associative_retrieval", n_pairs=args.n_pairs, n_segments=1)
    train, test = tasks.generate(spec, 100_000, 0), tasks.generate(spec, 2000, 1)
    x, y = torch.tensor(train.inputs), torch.tensor(train.targets)
    xt, yt = torch.tensor(test.inputs), torch.tensor(test.targets)
    vocab, length = tasks.AR_VOCAB, x.shape[1]
    torch.manual_seed(0)
    if args.model == "vanilla":
        model = VanillaLM(vocab, length)
        logits = model
    else:
        model = build_model(ModelConfig(
            mechanism="xl", vocab_size=vocab, n_layer=N_LAYER, d_model=D_MODEL, n_head=N_HEAD,
            d_head=32, d_inner=D_INNER, dropout=0.0, tgt_len=length, mem_len=0,
            pre_lnorm=True))

        def logits(tokens):
            return model(tokens, return_log_probs=True).log_probs
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = time.time()
    for step in range(1, args.steps + 1):
        rows = torch.randint(0, x.shape[0], (32,))
        loss = nn.functional.cross_entropy(logits(x[rows])[:, -1], y[rows, -1])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        if step % 250 == 0:
            with torch.no_grad():
                acc = (logits(xt)[:, -1].argmax(-1) == yt[:, -1]).float().mean().item()
            print(f"{args.model} step {step} loss {loss.item():.3f} test accuracy {acc:.3f} "
                  f"({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
