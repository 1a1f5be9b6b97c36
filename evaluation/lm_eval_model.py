"""A trained memtrain run as an lm-evaluation-harness model ("memtrain", lm-eval 0.4.13).

    python -m evaluation.lm_eval_model run --model memtrain \\
        --model_args run_dir=runs/quickstart --batch_size 8 --tasks <tasks> [--include_path DIR]

Importing this module registers the model with lm-eval; `python -m evaluation.lm_eval_model`
is lm-eval's own command line with the model registered (docs/lm-eval.md). From Python:
`import evaluation.lm_eval_model` before `lm_eval.simple_evaluate(model="memtrain", ...)`.

model_args: run_dir (a run directory, one checkpoint folder of a run, or an exported
.safetensors: evaluation/generation.py `load_for_generation`), data (the data manifest folder
whose vocabulary turns text into ids; defaults to the run's), batch_size, device, seg_len
(default: the model's tgt_len), mem_len (default: as trained), memory ("carry", or "reset": a
fresh memory at every segment, the no-memory baseline), prefix_token_id (default, as in
lm-eval's HF model: the tokenizer's BOS token, else its EOS; none for data without a
transformers tokenizer), max_gen_toks (default 256).

Every request is read the way memtrain trains and scores a stream (model/generate.py): from a
fresh memory at the request's first token, cut into segments of seg_len counted from that
token, each segment run on the memory the segments before it committed; the open last
segment is run on that memory as it stands. The memory therefore carries the whole request,
however long, at the cost of one model call per segment. As in training, the inputs are the
tokens and the targets the next ones: a scored token is never an input of its own segment
(this matters where a segment's outputs depend on its length, e.g. LaMemo's look-ahead
window), so `is_greedy` says exactly what generate_until would produce.

- loglikelihood: context and continuation are one sequence; the continuation's tokens are
  scored where they fall, in whatever segment, on the memory of everything before them.
- loglikelihood_rolling: the text alone, after prefix_token_id, so its first token is
  scored too. Without a prefix token (data without a tokenizer, and none given) the first
  token has nothing to be predicted from: it is read but not scored.
- generate_until: greedy (model/generate.py `stream_generate`, top_k=1): the prompt's whole
  segments are committed to memory, generation continues the open segment and commits it
  whenever it fills, until an `until` string or the tokenizer's EOS token appears (lm-eval's
  HF model adds the EOS to the stop strings), or max_gen_toks tokens.

Data without a text vocabulary (the quickstart's synthetic stream) read and write text as
token ids in decimal separated by spaces ("3 1 4"), as `memtrain generate --prompt-ids`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from memtrain.extras import missing_extra

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as err:   # an optional part: pip install 'memtrain[lm-eval]'
    raise ImportError(missing_extra("lm-eval") or str(err), name=err.name) from err

from evaluation.generation import load_for_generation
from model import stream_generate
from model.backbones import check_segment_positions
from model.open_segment import open_segment

MEMORY_MODES = ("carry", "reset")
log = logging.getLogger(__name__)


class IdText:
    """Text for data that have no text vocabulary: ids as decimal numbers split by
    whitespace, the form `memtrain generate --prompt-ids` takes."""

    def encode(self, text: str) -> np.ndarray:
        try:
            return np.array([int(t) for t in text.split()], dtype=np.int64)
        except ValueError:
            raise ValueError(f"this run's data have no text vocabulary: requests must be token "
                             f"ids separated by spaces, got {text[:60]!r}") from None

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


class FreshMemory(torch.nn.Module):
    """`model` reading every segment from a fresh memory, whatever state it is handed:
    the no-memory baseline, through the same calls as the carried reading."""

    def __init__(self, model):
        super().__init__()
        self.model, self.cfg = model, model.cfg

    def initial_state(self, batch_size: int, device=None):
        return self.model.initial_state(batch_size, device)

    def forward(self, tokens, state=None, **kwargs):
        return self.model(tokens, self.model.initial_state(tokens.shape[0], tokens.device),
                          **kwargs)

    def open_segment(self, state):
        """The model's own open segment of a generation (model/open_segment.py; KV-cached
        for a pretrained backbone), on a fresh memory."""
        fresh = self.model.initial_state(state.batch_size, state.length.device)
        return open_segment(self.model, fresh)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@register_model("memtrain")
class MemtrainLM(LM):
    """lm-eval's three request types through a memtrain model, memory carried (module
    docstring). Works through the model's state protocol (model/memory.py) alone, so every
    mechanism and backbone is read the same way."""

    def __init__(self, run_dir: str, data: str | None = None, batch_size: int | str = 1,
                 max_batch_size: int | None = None, device: str | None = None,
                 seg_len: int | None = None, mem_len: int | None = None, memory: str = "carry",
                 prefix_token_id: int | None = None, max_gen_toks: int = 256):
        super().__init__()
        del max_batch_size  # lm-eval's limit for batch_size=auto, which is not offered here
        if str(batch_size).startswith("auto"):
            raise ValueError("memtrain: batch_size=auto is not supported; give a number")
        if memory not in MEMORY_MODES:
            raise ValueError(f"memtrain: memory={memory!r}; one of {', '.join(MEMORY_MODES)}")
        # DeepSpeed's checkpoint consolidation prints progress; lm-eval may print results.
        with contextlib.redirect_stdout(sys.stderr):
            model, vocab = load_for_generation(Path(run_dir), data)
        if mem_len is not None:
            model.set_lengths(mem_len=int(mem_len))
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self._device.type == "cuda" and not torch.cuda.is_available():
            # lm-eval's command line asks for cuda:0 unless told otherwise.
            log.warning("memtrain: device %s asked for but CUDA is not available: using the "
                        "CPU", device)
            self._device = torch.device("cpu")
        self.model = model.to(self._device).eval()
        self.runner = self.model if memory == "carry" else FreshMemory(self.model)
        self.vocab = vocab if vocab is not None else IdText()
        self.batch_size = int(batch_size)
        self.seg_len = int(seg_len) if seg_len else int(model.cfg.tgt_len)
        # lm-eval's HF model (lm_eval/models/huggingface.py, prefix_token_id and
        # generate_until): the tokenizer's BOS, else its EOS, is the prefix, and its EOS ends
        # every generation. Vocabularies without a tokenizer have neither.
        bos, eos = _special_id(self.vocab, "bos_token_id"), _special_id(self.vocab,
                                                                        "eos_token_id")
        self.eos_text = self.decode([eos]) if eos is not None else None
        self.prefix_token_id = (int(prefix_token_id) if prefix_token_id not in (None, "")
                                else bos if bos is not None else eos)
        self.max_gen_toks = int(max_gen_toks)
        if self.batch_size < 1 or self.seg_len < 1 or self.max_gen_toks < 0:
            raise ValueError("memtrain: batch_size and seg_len must be >= 1, max_gen_toks >= 0")
        check_segment_positions(model.cfg, self.seg_len, "seg_len")

    # -- text <-> ids -----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.vocab.encode(text)]

    def decode(self, ids: list[int]) -> str:
        return self.vocab.decode(ids)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) of one loglikelihood request. Trailing blanks of
        the context move to the continuation (lm-eval's convention: the continuation carries
        its word boundary). The continuation is what encoding the joined text adds after the
        ids it shares with the context alone, so a subword merged across the join, or a line
        end a word-level vocabulary appends to the context's last line, is not scored as
        context."""
        blanks = len(context) - len(context.rstrip())
        if blanks:
            context, continuation = context[:-blanks], context[-blanks:] + continuation
        whole = self.encode(context + continuation)
        shared = _common_prefix(self.encode(context), whole)
        return whole[:shared], whole[shared:]

    def _with_prefix(self, ids: list[int], what: str) -> list[int]:
        """ids preceded by prefix_token_id; without one an empty context cannot be read."""
        if self.prefix_token_id is None:
            raise ValueError(f"memtrain: {what} has an empty context and a memtrain stream has "
                             "no begin-of-text token; give model_args prefix_token_id=<id> "
                             "(the token the model should read first)")
        return [self.prefix_token_id, *ids]

    # -- the one reading of a batch of sequences ---------------------------------------------
    @torch.no_grad()
    def token_log_probs(self, rows: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each row of ids: (log-probability of tokens 1.. given the tokens before them,
        whether each is the model's argmax), both [len - 1], read segment by segment with the
        memory carried (or reset, memory=reset).

        Rows are batched longest first. No row is ever padded: in each segment the rows that
        fill it run together, and a row whose last, open segment is shorter runs with the
        rows of that same length on its own memory rows (`select_rows`). A segment's outputs
        may depend on its length (LaMemo's look-ahead window spans min(M, N) keys), so each
        row is read exactly as alone."""
        out: list = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            n_in = [max(len(rows[i]) - 1, 0) for i in idx]      # inputs per row, descending
            tokens = torch.zeros(len(idx), n_in[0] + 1, dtype=torch.long)
            for r, i in enumerate(idx):
                tokens[r, :len(rows[i])] = torch.tensor(rows[i], dtype=torch.long)
            tokens = tokens.to(self._device)
            log_p = torch.zeros(len(idx), n_in[0])
            hit = torch.zeros(len(idx), n_in[0], dtype=torch.bool)
            active = sum(n > 0 for n in n_in)                   # rows 0 .. active-1 go on
            state = self.runner.initial_state(active, self._device)
            for s in range(0, n_in[0], self.seg_len):
                # Rows of one length in this segment are contiguous (lengths descend).
                width = [min(self.seg_len, n - s) for n in n_in[:active]]
                carried = None
                for a in range(active):
                    if a and width[a] == width[a - 1]:
                        continue
                    b = a + width[a:].count(width[a])
                    rows_state = state if (a, b) == (0, active) else state.select_rows(
                        torch.arange(a, b, device=self._device))
                    inputs = tokens[a:b, s:s + width[a]]
                    targets = tokens[a:b, s + 1:s + 1 + width[a]]
                    res = self.runner(inputs, rows_state, return_log_probs=True)
                    lp = res.log_probs.float()
                    log_p[a:b, s:s + width[a]] = lp.gather(-1, targets[..., None])[..., 0].cpu()
                    hit[a:b, s:s + width[a]] = (lp.argmax(-1) == targets).cpu()
                    if a == 0:
                        carried = res.state.detach()
                go_on = sum(n > s + self.seg_len for n in n_in[:active])
                if go_on:
                    state = carried if go_on == carried.batch_size else carried.select_rows(
                        torch.arange(go_on, device=self._device))
                active = go_on
            for r, i in enumerate(idx):
                out[i] = (log_p[r, :n_in[r]], hit[r, :n_in[r]])
        return out

    # -- lm-eval's request types ---------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        rows, firsts = [], []
        for req in requests:
            ctx, cont = self._encode_pair(*req.args)
            if not ctx:
                ctx = self._with_prefix([], "a loglikelihood request")
            rows.append(ctx + cont)
            firsts.append(len(ctx))
        results = []
        for req, first, (log_p, hit) in zip(requests, firsts, self.token_log_probs(rows),
                                            strict=True):
            # Token j (j >= 1) is predicted at position j - 1.
            res = (float(log_p[first - 1:].sum()), bool(hit[first - 1:].all()))
            self.cache_hook.add_partial("loglikelihood", req.args, res)
            results.append(res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        rows = []
        for req in requests:
            ids = self.encode(req.args[0])
            rows.append(ids if self.prefix_token_id is None else [self.prefix_token_id, *ids])
        results = []
        for req, (log_p, _) in zip(requests, self.token_log_probs(rows), strict=True):
            res = float(log_p.sum())  # every token after the row's first one
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
            results.append(res)
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        jobs = []
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = dict(gen_kwargs or {})
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0:
                raise ValueError("memtrain: generate_until is greedy only (do_sample false, "
                                 f"temperature 0); got {gen_kwargs}")
            until = kwargs.get("until") or []
            until = (until,) if isinstance(until, str) else tuple(until)
            if self.eos_text and self.eos_text not in until:
                until += (self.eos_text,)
            ids = self.encode(context) or self._with_prefix([], "a generate_until request")
            jobs.append((ids, until, int(kwargs.get("max_gen_toks", self.max_gen_toks))))
        # Prompts of one length with the same settings share a batch (stream_generate reads a
        # [B, T] prompt; its segment boundaries must fall at the same places in every row).
        groups = defaultdict(list)
        for i, (ids, until, n_new) in enumerate(jobs):
            groups[(len(ids), until, n_new)].append(i)
        results: list = [None] * len(jobs)
        for (_, until, n_new), members in groups.items():
            for start in range(0, len(members), self.batch_size):
                idx = members[start:start + self.batch_size]
                texts = self._greedy([jobs[i][0] for i in idx], until, n_new)
                for i, text in zip(idx, texts, strict=True):
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    results[i] = text
        return results

    @torch.no_grad()
    def _greedy(self, prompts: list[list[int]], until: tuple[str, ...], n_new: int) -> list[str]:
        prompt = torch.tensor(prompts, dtype=torch.long, device=self._device)
        new: list[list[int]] = [[] for _ in prompts]
        texts = [""] * len(prompts)
        done = [n_new == 0] * len(prompts)
        if not all(done):
            for token in stream_generate(self.runner, prompt, n_new, top_k=1,
                                         seg_len=self.seg_len):
                for r, t in enumerate(token.tolist()):
                    if not done[r]:
                        new[r].append(t)
                        texts[r] = self.decode(new[r])
                        done[r] = any(u in texts[r] for u in until)
                if all(done):
                    break
        return [_cut(text, until) for text in texts]


def _special_id(vocab, name: str) -> int | None:
    """The id of a special token ("bos_token_id", "eos_token_id") of the vocabulary's
    transformers tokenizer, or None (no tokenizer, or no such token)."""
    value = getattr(getattr(vocab, "tokenizer", None), name, None)
    return int(value) if value is not None else None


def _cut(text: str, until: tuple[str, ...]) -> str:
    """text up to the first occurrence of any stop string."""
    for u in until:
        if u:
            text = text.split(u, 1)[0]
    return text


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line, with the "memtrain" model registered (this module)."""
    from lm_eval.__main__ import cli_evaluate
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
