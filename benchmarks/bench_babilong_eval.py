"""`memtrain eval --babilong` cost against context length: tokens/s and peak memory.

    python benchmarks/bench_babilong_eval.py --json benchmarks/results/babilong_eval.json
    python benchmarks/bench_babilong_eval.py --quick            # smoke check, < 1 min

For a tiny RMT (memory tokens only) and a Transformer-XL with a fixed mem_len, both with
random weights, evaluation/babilong.py score_folder scores BABILong-format folders at
1k, 4k, 16k and 64k tokens (rows written here: random background words, a two-fact story,
the question, the answer field), the answers generated greedily with the memory carried and
scored with BABILong's rule. The goals: tokens/s at 64k >= 0.8x that at 1k, peak memory at
64k <= 1.2x that at 1k, because each segment costs the same whatever came before it (a
fixed memory) and rows are read a batch at a time.

Every (model, length) runs in a fresh subprocess (benchmarks/common.py run_child) over the
same number of ids (--tokens, whole batches of --batch rows): it makes a warm-up pass over
one batch, reads VmRSS, resets VmHWM (/proc/self/clear_refs), scores the folder, and reports

  peak_mb        VmHWM of the process (the whole process: Python, torch, model, data),
  eval_peak_mb   VmHWM - VmRSS before the scoring (what the scoring itself adds),
  maxrss_mb      resource.getrusage's ru_maxrss (the kernel's high-water mark, which Linux
                 carries across fork + exec: shown beside, not used for the goal),
  ids_per_cpu_s  prompt + generated ids per CPU-second of the process (robust to the
                 shared machine's steal; benchmarks/common.py step_clock).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from data_pipeline.shard_writer import write_episode_split, write_manifest  # noqa: E402
from data_pipeline.shards import Manifest, id_dtype  # noqa: E402
from data_pipeline.vocab import WordVocab  # noqa: E402

ROOMS = ["kitchen", "garden", "hallway", "office", "bathroom", "bedroom"]
PEOPLE = ["mary", "john", "sandra", "daniel"]
BACKGROUND = [f"w{i}" for i in range(200)]
WORDS = ["<eos>", ".", "where", "is", "?", "moved", "to", "the", "answer", ":", *ROOMS,
         *PEOPLE, *BACKGROUND]
A = 2   # answer field: the room and its stop
MODELS = ("rmt", "xl")


def write_folder(root: Path, length: int, rows: int, seed: int = 0) -> Path:
    """One length folder in `memtrain tasks babilong`'s format (test split only)."""
    vocab = WordVocab(WORDS)
    rng = np.random.default_rng(seed)
    out = root / f"{length // 1024}k"
    out.mkdir(parents=True)
    tokens = rng.integers(WORDS.index("w0"), len(WORDS), (rows, length + 1))
    recs = []
    for i in range(rows):
        who = rng.choice(PEOPLE, 2, replace=False)
        where = rng.choice(ROOMS, 2, replace=False)
        facts = [f"{p} moved to the {r} ." for p, r in zip(who, where, strict=True)]
        question = f"where is {who[0]} ?"
        tail = vocab.encode(f"{question} answer :")[:-1].tolist() + \
            [vocab.index[where[0]], vocab.eos_id]
        tokens[i, -len(tail):] = tail
        for f, at in zip(facts, sorted(rng.integers(0, length // 2, 2)), strict=True):
            ids = vocab.encode(f)[:-1]
            tokens[i, at:at + ids.size] = ids
        recs.append({"task": "qa1", "question": question, "target": str(where[0]),
                     "length": length, "facts": facts})
    mask = np.zeros((rows, length), dtype=bool)
    mask[:, length - A:] = True
    dtype = id_dtype(len(vocab))
    split = write_episode_split(out, "test", tokens.astype(dtype), mask, mask.copy(), 64)
    (out / "test.samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    extra = {"n_segments": 1, "babilong": {"tasks": ["qa1"], "length": length,
                                           "seg_len": length, "answer_tokens": A,
                                           "labels": {"qa1": ROOMS}, "source": "generated"}}
    write_manifest(out, Manifest(kind="episodes", source="babilong", vocab=vocab.to_dict(),
                                 vocab_fingerprint=vocab.fingerprint(), vocab_size=len(vocab),
                                 dtype=str(dtype), chunk_tokens=length + 1,
                                 splits={"test": split}, extra=extra))
    return out


def build(a, kind: str):
    from model import build_model
    from model.config import ModelConfig

    cfg = ModelConfig(mechanism=kind, vocab_size=len(WORDS), n_layer=a.n_layer,
                      d_model=a.d_model, n_head=a.n_head, d_inner=a.d_inner, dropout=0.0,
                      dropatt=0.0, tgt_len=a.seg_len,
                      mem_len=0 if kind == "rmt" else a.mem_len,
                      rmt={"num_mem_tokens": a.num_mem_tokens})
    torch.manual_seed(0)
    return build_model(cfg).eval()


def child(a) -> None:
    from evaluation.babilong import find_folders, iter_batches, score_folder

    spec = json.loads(a._child)
    model = build(a, spec["model"])
    folders, tasks = find_folders(spec["root"], "test")
    folder = folders[0]
    cpu = torch.device("cpu")
    toks, _ = next(iter_batches(folder, "test", a.batch, tasks))  # warm-up: one batch
    with torch.no_grad():
        model(torch.from_numpy(toks[:, :a.seg_len]), model.initial_state(len(toks)))
    before = common.status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    start = time.process_time()
    cells, ids = score_folder(model, folder, "test", tasks, seg_len=a.seg_len, batch=a.batch,
                              device=cpu)
    cpu_s = time.process_time() - start
    hwm = common.status_kib("VmHWM")
    print(json.dumps({"peak_mb": hwm / 1024, "eval_peak_mb": (hwm - before) / 1024,
                      "base_rss_mb": before / 1024,
                      "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "ids": ids, "cpu_s": cpu_s, "ids_per_cpu_s": ids / cpu_s,
                      "rows": cells["qa1"].n, "accuracy": cells["qa1"].accuracy}))


FLAGS = ("n_layer", "d_model", "n_head", "d_inner", "seg_len", "mem_len", "num_mem_tokens",
         "batch", "threads")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--d-inner", type=int, default=256)
    p.add_argument("--seg-len", type=int, default=256, help="evaluation segment length")
    p.add_argument("--mem-len", type=int, default=256, help="the XL model's memory")
    p.add_argument("--num-mem-tokens", type=int, default=8, help="the RMT model's memory")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lengths", default="1024,4096,16384,65536")
    p.add_argument("--tokens", type=int, default=262144, help="ids per length (whole "
                   "batches, at least one)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--quick", action="store_true", help="small lengths and budget (smoke)")
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a._child:
        child(a)
        return 0
    if a.quick:
        a.lengths, a.tokens, a.seg_len, a.mem_len = "1024,4096", 16384, 128, 128
    lengths = [int(x) for x in a.lengths.split(",")]
    started = time.time()
    results = {"args": {k: v for k, v in vars(a).items() if k != "_child"}, "models": {}}
    with tempfile.TemporaryDirectory(prefix="bench-babilong-") as tmp:
        roots = {}
        for n in lengths:
            rows = max(1, a.tokens // (n * a.batch)) * a.batch
            roots[n] = Path(tmp) / str(n)
            write_folder(roots[n], n, rows)
        for kind in a.models.split(","):
            series = {}
            for n in lengths:
                series[n] = common.run_child(__file__, a, {"model": kind,
                                                           "root": str(roots[n])}, FLAGS)
                r = series[n]
                print(f"{kind:>4} {n:>6} tokens: {r['ids_per_cpu_s']:>9.0f} ids/CPU-s, peak "
                      f"{r['peak_mb']:.0f} MB (scoring adds {r['eval_peak_mb']:.1f} MB; "
                      f"ru_maxrss {r['maxrss_mb']:.0f} MB), {r['rows']} rows", flush=True)
            lo, hi = series[lengths[0]], series[lengths[-1]]
            speed = hi["ids_per_cpu_s"] / lo["ids_per_cpu_s"]
            peak = hi["peak_mb"] / lo["peak_mb"]
            extra = hi["eval_peak_mb"] / max(lo["eval_peak_mb"], 1e-9)
            results["models"][kind] = {"lengths": series, "speed_ratio": speed,
                                       "peak_ratio": peak, "eval_peak_ratio": extra}
            print(f"GOAL {kind}: tokens/s {lengths[-1]}/{lengths[0]} = {speed:.2f}x (>= 0.8: "
                  f"{'met' if speed >= 0.8 else 'NOT met'}); peak memory {peak:.2f}x (<= 1.2: "
                  f"{'met' if peak <= 1.2 else 'NOT met'}; the scoring's own peak "
                  f"{extra:.2f}x)", flush=True)
    return common.finish(a.json, results, started)


if __name__ == "__main__":
    raise SystemExit(main())
