"""Generation speed and memory: memtrain's cached generation against the base model's own.

    python benchmarks/bench_generate.py --json benchmarks/results/generate.json
    python benchmarks/bench_generate.py --quick            # smoke check, < 1 min

A tiny random GPT-2 (model/pretrained/tiny.py `tiny_gpt2`: 2 layers, d_model 64, learned
positions; --vocab ids, 1024 positions) generates --new-tokens tokens greedily, batch 1,
after a --prompt-token prompt (longer than a segment), three ways:

  base     the base model's own KV-cached `generate` (transformers; do_sample False, no
           end-of-text stop), no memory: the speed to match
  memtrain model/generate.py stream_generate around `PretrainedMemoryLM` with RMT memory
           (--num-mem-tokens, segments of --seg-len): the open segment read through a KV
           cache, last-position logits only, a segment's forward at each boundary
           (model/pretrained/incremental.py)
  rerun    the algorithm before the cache, kept here as the comparison: the whole open
           segment re-run for every token with [B, L, V] float32 log-probs

The goal: memtrain >= 0.8x base in tokens/s (tokens per CPU-second of the process, one
thread: CPU time is robust to the shared machine's steal, benchmarks/common.py step_clock).
Speed: --repeats fresh processes (benchmarks/common.py run_child), each alternating base and
memtrain --pairs times on the same weights, the order flipped every round, so that the two
runs of a round share the machine's load of the moment; the ratio is the median of the
per-round ratios. Memory: base, memtrain and rerun once more, each in a fresh process that
warms up with a short generation, reads VmRSS, resets VmHWM (/proc/self/clear_refs),
generates, and reports gen_peak_mb = VmHWM - VmRSS before (what generating adds at its
peak) and its tokens/CPU-s (the rerun's speed). memtrain's and rerun's tokens are compared.
A sweep then runs memtrain and rerun over the (vocab, segment length) pairs of --sweep,
--sweep-tokens new tokens each (by default one boundary crossed, the open segment filled),
to show whether the peak follows vocab x segment length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

N_POSITIONS = 1024
KINDS = ("base", "memtrain", "rerun")


@torch.no_grad()
def rerun_generate(model, prompt, max_new_tokens, seg_len):
    """Greedy generation as model/generate.py ran before the KV cache (its code then,
    top_k = 1): yield each new token [B]."""
    from model.generate import filter_logits
    state = model.initial_state(prompt.shape[0], prompt.device)
    n_full = (prompt.shape[1] - 1) // seg_len
    for s in range(n_full):
        state = model(prompt[:, s * seg_len:(s + 1) * seg_len], state).state.detach()
    open_seg = prompt[:, n_full * seg_len:]
    for _ in range(max_new_tokens):
        out = model(open_seg, state, return_log_probs=True)
        logits = filter_logits(out.log_probs[:, -1], top_k=1)
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1)
        yield nxt[:, 0]
        if open_seg.shape[1] == seg_len:
            state = out.state.detach()
            open_seg = nxt
        else:
            open_seg = torch.cat([open_seg, nxt], dim=1)


def child(a) -> None:
    from model import ModelConfig, build_model, stream_generate

    spec = json.loads(a._child)
    kind, path, seg = spec["kind"], spec["path"], spec["seg_len"]
    model = build_model(ModelConfig.from_dict({
        "mechanism": "rmt", "backbone": "hf", "tgt_len": seg, "mem_len": 0,
        "rmt": {"num_mem_tokens": a.num_mem_tokens}, "hf": {"path": path}})).eval()
    base = model.base
    base.generation_config.eos_token_id = None     # generate exactly max_new_tokens
    base.generation_config.pad_token_id = 0
    vocab = base.config.vocab_size
    prompt = torch.randint(0, vocab, (1, a.prompt_tokens),
                           generator=torch.Generator().manual_seed(0))

    def run(kind: str, n: int) -> list[int]:
        if kind == "base":
            with torch.no_grad():
                out = base.generate(prompt, attention_mask=torch.ones_like(prompt),
                                    max_new_tokens=n, do_sample=False)
            assert out.shape[1] == prompt.shape[1] + n, out.shape
            return out[0, prompt.shape[1]:].tolist()
        gen = (stream_generate(model, prompt, n, top_k=1, seg_len=seg) if kind == "memtrain"
               else rerun_generate(model, prompt, n, seg))
        return [int(t[0]) for t in gen]

    def timed(kind: str, n: int) -> tuple[float, list[int]]:
        start = time.process_time()
        tokens = run(kind, n)
        return len(tokens) / (time.process_time() - start), tokens

    n = spec["new_tokens"]
    if kind == "pairs":
        # base and memtrain alternate in one process, the order flipped every round: two
        # runs next to each other in time share whatever load the machine has then.
        run("base", 8), run("memtrain", 8)
        rounds = []
        for i in range(spec["pairs"]):
            order = ("base", "memtrain") if i % 2 == 0 else ("memtrain", "base")
            rounds.append({k: timed(k, n)[0] for k in order})
        print(json.dumps({"rounds": rounds}))
        return
    run(kind, 8)   # warm-up: first-call allocations, lazy imports
    before = common.status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    speed, tokens = timed(kind, n)
    hwm = common.status_kib("VmHWM")
    print(json.dumps({"tokens_per_cpu_s": speed, "gen_peak_mb": (hwm - before) / 1024,
                      "base_rss_mb": before / 1024, "tokens": tokens}))


FLAGS = ("num_mem_tokens", "prompt_tokens", "threads")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seg-len", type=int, default=128)
    p.add_argument("--num-mem-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=160)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="processes of --pairs rounds")
    p.add_argument("--pairs", type=int, default=4, help="base/memtrain rounds per process")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sweep", default="32000:128,128000:128,32000:512,128000:512",
                   help="vocab:seg_len pairs of the memory sweep ('' for none)")
    p.add_argument("--sweep-tokens", type=int, default=0,
                   help="new tokens per sweep run (default: the segment length + 8)")
    p.add_argument("--quick", action="store_true", help="small budget (smoke)")
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a._child:
        child(a)
        return 0
    if a.quick:
        a.new_tokens, a.repeats, a.pairs, a.sweep = 64, 1, 2, "8000:64,32000:64"
    started = time.time()
    results = {"args": {k: v for k, v in vars(a).items() if k != "_child"},
               "machine": {"torch": torch.__version__, "threads": a.threads}}
    from model.pretrained.tiny import tiny_gpt2
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        def ckpt(vocab: int) -> str:
            return str(tiny_gpt2(Path(tmp) / f"gpt2-{vocab}", vocab=vocab,
                                 n_positions=N_POSITIONS))

        path = ckpt(a.vocab)
        spec = {"path": path, "seg_len": a.seg_len, "new_tokens": a.new_tokens}
        rounds = []
        for rep in range(a.repeats):
            r = common.run_child(__file__, a, {**spec, "kind": "pairs", "pairs": a.pairs},
                                 FLAGS)
            rounds += r["rounds"]
            print(f"process {rep}: " + "; ".join(
                f"base {x['base']:.0f}, memtrain {x['memtrain']:.0f}" for x in r["rounds"])
                + " tokens/CPU-s", flush=True)
        ratios = [x["memtrain"] / x["base"] for x in rounds]
        ratio = statistics.median(ratios)
        single = {}
        for kind in KINDS:   # one clean process each: peak memory, and the rerun's speed
            single[kind] = common.run_child(__file__, a, {**spec, "kind": kind}, FLAGS)
            print(f"{kind:>8}: {single[kind]['tokens_per_cpu_s']:7.1f} tokens/CPU-s, "
                  f"generation adds {single[kind]['gen_peak_mb']:6.1f} MB", flush=True)
        same = single["memtrain"]["tokens"] == single["rerun"]["tokens"]
        for r in single.values():
            r.pop("tokens")
        speed = {k: statistics.median(x[k] for x in rounds) for k in ("base", "memtrain")}
        results["speed"] = {"rounds": rounds, "memtrain_over_base": ratios, "ratio": ratio,
                            "tokens_per_cpu_s": speed, "single_runs": single,
                            "memtrain_tokens_equal_rerun": same}
        print(f"tokens/CPU-s (median of {len(rounds)} rounds): base {speed['base']:.1f}, "
              f"memtrain {speed['memtrain']:.1f}; rerun {single['rerun']['tokens_per_cpu_s']:.1f}"
              f" (one run); memtrain tokens == rerun tokens: {same}")
        print(f"GOAL memtrain / base = {ratio:.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}"
              f"; >= 0.8: {'met' if ratio >= 0.8 else 'NOT met'})", flush=True)

        sweep = []
        for pair in filter(None, a.sweep.split(",")):
            vocab, seg = (int(x) for x in pair.split(":"))
            n = a.sweep_tokens or seg + 8
            row = {"vocab": vocab, "seg_len": seg, "new_tokens": n}
            for kind in ("memtrain", "rerun"):
                r = common.run_child(__file__, a, {"kind": kind, "path": ckpt(vocab),
                                                   "seg_len": seg, "new_tokens": n}, FLAGS)
                row[kind] = {"gen_peak_mb": r["gen_peak_mb"],
                             "tokens_per_cpu_s": r["tokens_per_cpu_s"]}
            sweep.append(row)
            print(f"sweep vocab {vocab:>6} seg {seg:>4}: generation adds memtrain "
                  f"{row['memtrain']['gen_peak_mb']:6.1f} MB, rerun "
                  f"{row['rerun']['gen_peak_mb']:6.1f} MB (vocab x seg x 4 B = "
                  f"{vocab * seg * 4 / 2**20:.1f} MB)", flush=True)
        results["sweep"] = sweep
    return common.finish(a.json, results, started)


if __name__ == "__main__":
    raise SystemExit(main())
