"""Host synchronisations per training step through `memtrain train` (BENCHMARKS.md,
"Host synchronisations per micro-step").

Runs `train.trainer.train` in this process (a world of one, the real DeepSpeed engine on CPU,
XL / LaMemo / RMT, a 2-layer word-level model with an adaptive softmax; or RMT, ARMT and
Titans around a tiny GPT-2 checkpoint, `hf-*`) with the counters of tests/test_sync_free.py,
and attributes every would-be sync of a step to our code or to DeepSpeed's
`engine.backward` / `engine.step`. Logging steps are reported apart.

    .venv/bin/python benchmarks/count_syncs.py [--zero 0 2] [--steps 8] [--log-every 4]
    .venv/bin/python benchmarks/count_syncs.py --zero 0 --mechanisms hf-rmt hf-rmt-causal \
        hf-armt hf-titans
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import yaml  # noqa: E402
from test_sync_free import COUNTS, counting_syncs  # noqa: E402
from train_helpers import tiny_config  # noqa: E402

from train import loop, trainer  # noqa: E402
from train.config import from_dict  # noqa: E402

# Around a tiny random GPT-2 checkpoint (model/pretrained/tiny.py): `hf-<mechanism>`, with
# segment checkpointing, so that every segment's forward runs twice.
PRETRAINED = {"hf-rmt": {"mechanism": "rmt", "rmt": {"num_mem_tokens": 2}},
              "hf-rmt-causal": {"mechanism": "rmt",
                                "rmt": {"num_mem_tokens": 2, "pattern": "causal"}},
              "hf-armt": {"mechanism": "armt", "armt": {"num_mem_tokens": 2, "d_key": 8}},
              "hf-titans": {"mechanism": "titans",
                            "titans": {"d_mem": 8, "chunk_size": 2, "num_persistent": 2}}}


def model_section(mechanism: str, tmp: Path) -> tuple[dict, dict]:
    """(model section, bptt section) of a run of `mechanism` (PRETRAINED's names included)."""
    if mechanism in PRETRAINED:
        from train_helpers import V

        from model.pretrained.tiny import tiny_gpt2
        path = tiny_gpt2(tmp / "gpt2", tied=False, vocab=V)
        return ({"backbone": "hf", "tgt_len": 8, "mem_len": 0, "hf": {"path": str(path)},
                 **PRETRAINED[mechanism]}, {"depth": 1, "checkpoint_segments": True})
    model = {"mechanism": mechanism, "cutoffs": [4, 10], "div_val": 2}
    if mechanism == "rmt":
        model["rmt"] = {"num_mem_tokens": 2, "mem_loss_weight": 0.01, "mem_loss_token": 1}
    return model, {"depth": 1}


def measure(mechanism: str, zero: int, steps: int, log_every: int, tmp: Path) -> dict:
    model, bptt = model_section(mechanism, tmp)
    path = tiny_config(tmp, f"{mechanism}{zero}", max_steps=steps, log_every=log_every,
                       model=model, bptt=bptt, deepspeed={"zero_stage": zero},
                       eval={"max_segments": 2})
    raw = yaml.safe_load(path.read_text())
    if mechanism in PRETRAINED:     # the shape is the checkpoint's
        for key in ("vocab_size", "n_layer", "d_model", "n_head", "d_inner", "dropout"):
            raw["model"].pop(key, None)
    cfg = from_dict(raw)
    parts: list[Counter] = []            # per micro-step: ours / deepspeed
    current: dict = {}

    def total():
        return sum(COUNTS.values())

    micro, engine_calls, ds_kinds = loop.TrainingLoop._micro_step, {}, Counter()

    def wrapped_micro(self, batches):
        if not engine_calls:   # wrap the engine's backward and step once
            for name in ("backward", "step"):
                fn = getattr(self.engine, name)

                def timed(*a, _fn=fn, **k):
                    before, kinds = total(), Counter(COUNTS)
                    out = _fn(*a, **k)
                    current["deepspeed"] += total() - before
                    ds_kinds.update(Counter(COUNTS) - kinds)
                    return out
                setattr(self.engine, name, timed)
                engine_calls[name] = fn
        current.update(deepspeed=0, start=total())
        out = micro(self, batches)
        ours = total() - current["start"] - current["deepspeed"]
        parts.append(Counter(ours=ours, deepspeed=current["deepspeed"],
                             step=self.state.step + 1))
        return out

    loop.TrainingLoop._micro_step = wrapped_micro
    try:
        with counting_syncs(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loop.TrainingLoop.final_reports = lambda self: None
            trainer.train(cfg, resume=False)
    finally:
        loop.TrainingLoop._micro_step = micro
    quiet = [p for p in parts if p["step"] % log_every and p["step"] != steps]
    logged = [p for p in parts if not p["step"] % log_every]
    return {"ours": sorted({p["ours"] for p in quiet}),
            "deepspeed": sorted({p["deepspeed"] for p in quiet}),
            "ours_logging": sorted({p["ours"] for p in logged}),
            "deepspeed_kinds": {k: round(v / len(parts), 1) for k, v in ds_kinds.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zero", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--log-every", type=int, default=4)
    ap.add_argument("--mechanisms", nargs="+", default=["xl", "lamemo", "rmt"],
                    choices=["xl", "lamemo", "rmt", *PRETRAINED])
    ap.add_argument("--one", nargs=2, metavar=("MECHANISM", "ZERO"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # one run per process: train() leaves the process group at its end
        with tempfile.TemporaryDirectory() as tmp:
            r = measure(args.one[0], int(args.one[1]), args.steps, args.log_every, Path(tmp))
        print("ROW", json.dumps(r))
        return 0
    print("| mechanism | ZeRO | ours per step (non-logging) | inside DeepSpeed backward+step "
          "(per micro-step, by kind) | ours in a logging step's micro-step |\n"
          "|---|---|---|---|---|")
    for zero in args.zero:
        for mech in args.mechanisms:
            out = subprocess.run([sys.executable, __file__, "--one", mech, str(zero),
                                  "--steps", str(args.steps), "--log-every",
                                  str(args.log_every)], capture_output=True, text=True)
            rows = [ln for ln in out.stdout.splitlines() if ln.startswith("ROW ")]
            if not rows:
                print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                return 1
            r = json.loads(rows[-1][4:])
            print(f"| {mech} | {zero} | {r['ours']} | {r['deepspeed']} "
                  f"{r['deepspeed_kinds']} | {r['ours_logging']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
