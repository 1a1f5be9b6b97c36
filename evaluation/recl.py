"""Relative Effective Context Length (Transformer-XL §4.3 and Appendix C).

RECL belongs to a GROUP of models. With l_i(c, t) the loss of model i on token t given a
context of c tokens:

    b(c, t)      = min_i l_i(c, t)                               best short-context loss
    T            = the fraction r of positions with the largest b(c, t)   (hardest tokens)
    f_i(c, c')   = mean_{t in T} min(b(c, t), l_i(c', t))        only gains over b count
    g_i(c, c')   = (exp f_i(c, c) - exp f_i(c, c')) / exp f_i(c, c)      relative gain

Starting at c = start, while g_i(c, c + step) >= threshold, c grows by step; RECL_i is the
first c where the gain falls below the threshold. If the largest context evaluated still
gains, RECL_i is reported as at least that context ("lower bound").

What the paper leaves open (Appendix C does not fix it) is an option here: the start
length, the step (the paper's values are multiples of 100, which suggests 100) and how a
context of c tokens is imposed on a recurrent model. We evaluate with mem_len = c; for
Transformer-XL and LaMemo same_length makes every query attend to exactly c keys. Cached
states may still hold information from further back (each layer extends the reach), which
is the "effective" context the paper measures. RMT's and ARMT's memory (tokens, and ARMT's
associative matrices) is not limited by c, and they take no same_length: for them c is the
mem_len of their XL cache alone (0 when they have none).

Every c scores the same tokens: the first tokens of each row, up to the largest context,
are left out, so each scored token has a full context at every c.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data_pipeline.streams import TokenStream

DEFAULT_RATIOS = (0.1, 0.5, 1.0)


# ---------------------------------------------------------------------------- the statistic
def _hardest(losses: dict, c: int, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(b(c, t) on T, the positions T): the top-r positions by the group's best loss."""
    base = losses[c].min(dim=0).values                 # b(c, t)
    k = max(1, int(round(ratio * base.numel())))
    hardest = torch.topk(base, k).indices
    return base[hardest], hardest


def relative_gain(losses: dict, c: int, c_next: int, ratio: float) -> torch.Tensor:
    """g_i(c, c_next) for every model i. losses: {context: [n_models, n_tokens]};
    returns [n_models]."""
    b, hardest = _hardest(losses, c, ratio)
    f_same = b.mean()                                  # f_i(c, c) = mean b: b <= l_i(c, t)
    f_next = torch.minimum(b, losses[c_next][:, hardest]).mean(dim=1)
    return (f_same.exp() - f_next.exp()) / f_same.exp()


def gain_curve(losses: dict, contexts: list[int], ratio: float) -> torch.Tensor:
    """Unnormalised gains exp f(c, c) - exp f(c, c + step), [n_models, len(contexts) - 1]
    (what Transformer-XL's Fig. 3 plots, there for r = 0.1)."""
    cols = []
    for c, c_next in zip(contexts, contexts[1:], strict=False):
        b, hardest = _hardest(losses, c, ratio)
        f_next = torch.minimum(b, losses[c_next][:, hardest]).mean(dim=1)
        cols.append(b.mean().exp() - f_next.exp())
    return torch.stack(cols, dim=1)


def recl(losses: dict, contexts: list[int], ratio: float,
         threshold: float = 0.01) -> list[tuple[int, bool]]:
    """(RECL, reached) per model; reached=False: the largest context still gained."""
    steps = list(zip(contexts, contexts[1:], strict=False))
    gains = [relative_gain(losses, c, c_next, ratio) for c, c_next in steps]  # each [models]
    out = []
    for i in range(gains[0].shape[0]):
        first_flat = next((c for (c, _), g in zip(steps, gains, strict=True)
                           if float(g[i]) < threshold), None)
        out.append((contexts[-1], False) if first_flat is None else (first_flat, True))
    return out


# ---------------------------------------------------------------------------- losses
@torch.no_grad()
def per_token_losses(model, manifest, split: str, rows: int, tgt_len: int, context: int,
                     skip: int, end: int, device, url_template: str | None = None
                     ) -> torch.Tensor:
    """NLL of tokens skip..end of every row with evaluation memory `context`, [rows * n]."""
    was_training = model.training
    # same_length is Transformer-XL's and LaMemo's; where the mechanism does not define it
    # (RMT, ARMT: memory rows see their blocks whole) the context is mem_len alone.
    same = model.cfg.mech.same_length and context > 0
    model.eval()
    stream = TokenStream(manifest, split, rows, tgt_len, 0, 1, url_template=url_template)
    state, parts = None, []
    try:
        with model.using_lengths(mem_len=context, same_length=same):
            for _, seg in zip(range(end // tgt_len), stream, strict=False):
                tokens = seg.tokens.to(device)
                out = model(tokens[:, :-1], state, targets=tokens[:, 1:])
                state = out.state
                parts.append(out.nll.float().cpu())
    finally:
        model.train(was_training)
    return torch.cat(parts, dim=1)[:, skip:end].reshape(-1)


@dataclass
class ReclResult:
    names: list[str]
    contexts: list[int]
    ratios: list[float]
    threshold: float
    recl: dict = field(default_factory=dict)         # ratio -> [(value, reached)]
    mean_loss: dict = field(default_factory=dict)    # context -> [per model]
    gains: dict = field(default_factory=dict)        # ratio -> [[per step] per model]
    tokens: int = 0

    def table(self) -> str:
        head = f"{'model':<24}" + "".join(f"{'r=' + str(r):>12}" for r in self.ratios)
        lines = [f"RECL (threshold {self.threshold}, contexts {self.contexts[0]}.."
                 f"{self.contexts[-1]} step {self.contexts[1] - self.contexts[0]}, "
                 f"{self.tokens} tokens per model)", head]
        for i, name in enumerate(self.names):
            cells = []
            for r in self.ratios:
                value, reached = self.recl[r][i]
                cells.append(f"{value if reached else '>=' + str(value):>12}")
            lines.append(f"{name[:24]:<24}" + "".join(cells))
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"models": self.names, "contexts": self.contexts, "ratios": self.ratios,
                "threshold": self.threshold, "tokens": self.tokens,
                "recl": {str(r): [{"recl": v, "reached": ok} for v, ok in self.recl[r]]
                         for r in self.ratios},
                "mean_loss": {str(c): v for c, v in self.mean_loss.items()},
                "gains": {str(r): g for r, g in self.gains.items()}}


def compute(losses: dict, names: list[str], contexts: list[int], ratios: list[float],
            threshold: float) -> ReclResult:
    res = ReclResult(names, contexts, list(ratios), threshold,
                     tokens=int(next(iter(losses.values())).shape[1]))
    for r in ratios:
        res.recl[r] = recl(losses, contexts, r, threshold)
        res.gains[r] = gain_curve(losses, contexts, r).tolist()
    res.mean_loss = {c: losses[c].mean(dim=1).tolist() for c in contexts}
    return res


def plot(res: ReclResult, out_png: Path) -> Path:
    """Left: unnormalised gain vs context (XL Fig. 3, smallest r); right: loss vs context
    (XL Fig. 4 plots perplexity)."""
    # matplotlib (~0.4 s to import) only when the plot is drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    r = min(res.ratios)
    for i, name in enumerate(res.names):
        left.plot(res.contexts[:-1], res.gains[r][i], "o-", label=name)
        right.plot(res.contexts, [res.mean_loss[c][i] for c in res.contexts], "o-", label=name)
    left.set(xlabel="context c", ylabel=f"gain exp f(c,c) - exp f(c,c+step), r={r}",
             title="RECL gains")
    right.set(xlabel="context c", ylabel="mean loss (nats)", title="loss vs context")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100, bbox_inches="tight")
    return out_png


def write(res: ReclResult, out_dir: Path) -> tuple[Path, Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "recl.json"
    js.write_text(json.dumps(res.to_json(), indent=1))
    md = out_dir / "recl.md"
    md.write_text("```\n" + res.table() + "\n```\n")
    return js, md, plot(res, out_dir / "recl.png")


def context_grid(start: int, step: int, max_context: int) -> list[int]:
    if start < 0 or step <= 0 or max_context < start + step:
        raise ValueError(f"RECL contexts: need start >= 0, step > 0 and max_context >= "
                         f"start + step (got start {start}, step {step}, max {max_context})")
    return list(range(start, max_context + 1, step))
