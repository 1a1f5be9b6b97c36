#!/usr/bin/env bash
# What a first session on one GPU runs, in order (docs/cluster.md, "First GPU session"):
#   1. device facts (nvidia-smi, torch, CUDA, bf16 support);
#   2. the GPU preflight, tests/test_gpu_preflight.py (its "cuda" cases);
#   3. the quickstart in fp32 (TF32 matmuls, and full fp32), bf16 and fp16 through the whole
#      engine (DeepSpeed, one rank),
#      and in bf16 and fp16 once more, stopped by SIGTERM at step STOP_AT and resumed by the
#      same command: the final test losses of all five and the stopped runs' losses after
#      the stop against the uninterrupted runs';
#   4. optionally (BENCH=1) the "On a GPU" benchmarks of BENCHMARKS.md.
# With SCALE=1 it runs instead only benchmarks/gpu_scale.py, the run at realistic shapes
# (below, and docs/cluster.md, "One GPU run at realistic shapes"). With TITANS_CHUNK=1 only
# Titans' chunk loop, eager against compiled (below; docs/titans.md, "The compiled chunk").
# With FUSED=1 only a pretrained GPT-2's training step, fused GELU off/on x regional compile
# off/on, and the cold compile (below; docs/pretrained.md, "Fused activation and regional
# compilation"). With ENGINE=1 only gpu_scale.py's engine part at GPT-2-124M's shape:
# memtrain's own training step beside the plain-torch step (below; BENCHMARKS.md, "On a GPU
# at realistic shapes"). With LOSS=1 only the loss step at GPT-2's head, plain against
# chunked, and the head GEMM at V 50,257 against 50,304 (below; BENCHMARKS.md, "The LM loss
# without the logits tensor"). With PAPER=1 only RMT's "paper" attention, masked against
# split (below).
# Steps 2 and 3 run side by side (16 host cores are enough; their timings are not reported).
#
#   bash scripts/gpu_session.sh [OUT_DIR]        # PY=python to use (default .venv/bin/python)
#
# OUT_DIR gets preflight.log, quickstart.log, summary.txt and runs.tar.gz (each run's
# metrics.jsonl, eval_report.json, status.json, config.yaml and ds_config.json).
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
OUT=$(mkdir -p "${1:-gpu-session}" && cd "${1:-gpu-session}" && pwd)
STOP_AT=${STOP_AT:-300}
RUN_TIMEOUT=${RUN_TIMEOUT:-400}   # seconds for one quickstart run
EXTRA=${EXTRA:-}   # more overrides for every quickstart run (a shorter CPU rehearsal)
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO" || exit 1

# SCALE=1: only the one run at realistic shapes, benchmarks/gpu_scale.py (docs/cluster.md,
# "One GPU run at realistic shapes"): what scripts/gpu_stage.sh staged in STAGE (default
# gpu-stage/) installed under /tmp/gpu-stage, the GGUF's parts kept there and joined once all
# have come (a device call carries at most 64 MiB: the parts come in two calls), then the
# run with PARTS (default all four) in BUDGET seconds (default 540) and SCALE_ARGS (more flags
# of gpu_scale.py: "--quick --device cpu" rehearses this path on a CPU). OUT_DIR gets its JSON.
# ENGINE=1: the SCALE path below (the staged wheels: DeepSpeed), its engine part only
# (benchmarks/gpu_engine.py) at GPT-2-124M: the DeepSpeed engine at ZeRO-1, bf16, gradient
# clipping and the training loop's micro-step, beside the eager bf16 + torch Adam step, base
# model and RMT over 8 checkpointed segments of 1,024 (batch 8): median step_s of 5 steps,
# forward share, peaks with and without weights beside the planner's. BUDGET default 300.
if [ "${ENGINE:-0}" = 1 ]; then
  SCALE=1 PARTS=${PARTS:-engine} BUDGET=${BUDGET:-300}
  SCALE_ARGS="--shapes gpt2-124m ${SCALE_ARGS:-}"
fi
if [ "${SCALE:-0}" = 1 ]; then
  STAGE=${STAGE:-$REPO/gpu-stage}
  KEEP=${KEEP:-/tmp/gpu-stage}
  GGUF=$KEEP/SmolLM2-135M-Instruct.Q4_1.gguf
  mkdir -p "$KEEP"
  if ls "$STAGE"/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$KEEP/site" "$STAGE"/wheels/*.whl ||
      echo "gpu_session: the staged wheels did not install (gpu_scale.py says what is missing)"
  fi
  [ -d "$KEEP/site" ] && export PYTHONPATH="$PYTHONPATH:$KEEP/site"
  cp "$STAGE"/gguf/*.part-* "$STAGE"/SHA256SUMS "$KEEP"/ 2>/dev/null
  if [ ! -f "$GGUF" ] && ls "$KEEP"/*.part-* >/dev/null 2>&1; then
    cat "$KEEP"/SmolLM2-135M-Instruct.Q4_1.gguf.part-* >"$GGUF"
    (cd "$KEEP" && grep " SmolLM2" SHA256SUMS | sha256sum -c --quiet -) 2>/dev/null || {
      echo "GGUF: not all parts here yet ($(ls "$KEEP" | grep -c part-) present)"
      rm -f "$GGUF"; }
  fi
  args=()
  [ -f "$GGUF" ] && args=(--gguf "$GGUF")
  # A part in flight is not stopped by the budget: the whole run is, 60 s past it (the JSON
  # of the parts done stays).
  exec timeout $((${BUDGET:-540} + 60)) "$PY" benchmarks/gpu_scale.py --out "$OUT" \
    --parts "${PARTS:-mfu,kernels,gaps,babilong}" --budget-s "${BUDGET:-540}" \
    ${args[@]+"${args[@]}"} ${SCALE_ARGS:-}
fi

# TITANS_CHUNK=1: only Titans' chunk loop, eager against model.titans.compiled_chunks
# (benchmarks/titans_compiled_chunk.py: tokens/s of the memories' update and of the native
# MAC model at GPT-2-124M's width and depth, segment 1,024, chunk 16; docs/titans.md, "The
# compiled chunk"). TITANS_CHUNK_ARGS: more flags ("--quick" rehearses it on the CPU in
# seconds; the GPU call: "--device cuda --dtype bf16", the default here).
if [ "${TITANS_CHUNK:-0}" = 1 ]; then
  exec timeout "${BUDGET:-540}" "$PY" benchmarks/titans_compiled_chunk.py \
    --json "$OUT/titans_compiled_chunk.json" ${TITANS_CHUNK_ARGS:---device cuda --dtype bf16}
fi

# LOSS=1: only benchmarks/bench_loss.py at GPT-2's head in bf16 (N 32,768 x V 50,257, d 768:
# a batch of 32 segments of 1,024): one loss step's peak and time, the plain [N, V] path
# against model/loss.py's chunks, and the head GEMM at V 50,257 against 50,304 (the case
# for a vocabulary padded to a multiple of 128); BENCHMARKS.md, "The LM loss without the
# logits tensor". LOSS_ARGS replaces the shape flags ("--rows 256 --vocab 1000 --d-model
# 64" rehearses it on the CPU).
if [ "${LOSS:-0}" = 1 ]; then
  exec timeout "${BUDGET:-300}" "$PY" benchmarks/bench_loss.py --gemm \
    ${LOSS_ARGS:---device cuda --dtype bf16 --rows 32768} --json "$OUT/loss.json"
fi

# PAPER=1: only benchmarks/bench_paper_attention.py at GPT-2's attention shape in bf16 (12
# heads of 64, segments of 1,024 with 16 memory tokens, batch 32): RMT's "paper" pattern as
# one masked SDPA call against the split into three maskless calls (forward + backward,
# median of 10 rounds), and the tiles each visits; docs/pretrained.md, "The paper pattern
# without its masked tiles". PAPER_ARGS replaces the shape flags ("--seg 64 --heads 2"
# rehearses it on the CPU).
if [ "${PAPER:-0}" = 1 ]; then
  exec timeout "${BUDGET:-300}" "$PY" benchmarks/bench_paper_attention.py --rounds 10 \
    ${PAPER_ARGS:---device cuda --dtype bf16 --batch 32} --json "$OUT/paper_attention.json"
fi

# FUSED=1: only benchmarks/bench_pretrained_fused.py at GPT-2-small's shape (12 layers, d
# 768, segments of 1,024 tokens, batch 8, bf16, random weights from a config): the base
# model's step with model.hf.fused_gelu off/on x model.compile off/on (Inductor), the
# fused step with the activation's output kept (model.hf.recompute_activation off: what its
# recompute costs), the pointwise ops per layer, and the cold compile time of aot_eager and Inductor at that
# shape; BENCHMARKS.md, "Pretrained backbone: fused activation and regional compile".
# FUSED_ARGS replaces the shape flags ("--device cpu" rehearses it on the CPU, tiny).
if [ "${FUSED:-0}" = 1 ]; then
  shape=${FUSED_ARGS:---device cuda --dtype bf16 --d-model 768 --layers 12 --heads 12 \
    --seq 1024 --batch 8 --mem 0 --vocab 50257}
  timeout 330 "$PY" benchmarks/bench_pretrained_fused.py --parts ops,step --rounds 10 \
    $shape --json "$OUT/fused-step.json" 2>&1 | tee "$OUT/fused.log"
  timeout 200 "$PY" benchmarks/bench_pretrained_fused.py --parts compile $shape \
    --json "$OUT/fused-compile.json" 2>&1 | tee -a "$OUT/fused.log"
  exit 0
fi

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  "$PY" -c 'import torch, deepspeed; print("torch", torch.__version__, "cuda", torch.version.cuda,
"deepspeed", deepspeed.__version__, "device", torch.cuda.get_device_name(0),
"capability", torch.cuda.get_device_capability(0), "bf16", torch.cuda.is_bf16_supported())'
} 2>&1 | tee "$OUT/summary.txt"

"$PY" -m pytest tests/test_gpu_preflight.py -v -p no:cacheprovider -rA \
  >"$OUT/preflight.log" 2>&1 &
preflight=$!

train() {  # train NAME OVERRIDES...: one quickstart run in $WORK, its output in $WORK/NAME.log
  local name=$1; shift
  (cd "$WORK" && timeout "$RUN_TIMEOUT" "$PY" -m memtrain.cli train --config quickstart name="$name" \
     data.path="data/$name" tracking.enabled=false $EXTRA "$@") >>"$WORK/$name.log" 2>&1
}

stop_and_resume() {  # stop_and_resume NAME OVERRIDES...: SIGTERM at step STOP_AT, then again
  local name=$1; shift
  (cd "$WORK" && exec timeout "$RUN_TIMEOUT" "$PY" -m memtrain.cli train --config quickstart \
     name="$name" data.path="data/$name" tracking.enabled=false $EXTRA "$@") \
     >>"$WORK/$name.log" 2>&1 &
  local pid=$!
  until grep -q "\"step\": $STOP_AT, .*\"loss\"" "$WORK/runs/$name/metrics.jsonl" 2>/dev/null; do
    kill -0 $pid 2>/dev/null || break
    sleep 0.2
  done
  kill -TERM $pid 2>/dev/null
  wait $pid
  echo "=== stopped: exit $?, status $(tr -d ' \n' <"$WORK/runs/$name/status.json")" \
    >>"$WORK/$name.log"
  train "$name" "$@"
}

pids=()
train q-fp32 & pids+=($!)
train q-fp32-notf32 deepspeed.tf32=false & pids+=($!)
train q-bf16 deepspeed.precision=bf16 & pids+=($!)
train q-fp16 deepspeed.precision=fp16 & pids+=($!)
stop_and_resume q-bf16-stop deepspeed.precision=bf16 & pids+=($!)
stop_and_resume q-fp16-stop deepspeed.precision=fp16 & pids+=($!)
wait "${pids[@]}"
for f in "$WORK"/q-*.log; do echo "##### $f"; cat "$f"; done >"$OUT/quickstart.log"

"$PY" - "$WORK/runs" "$STOP_AT" <<'EOF' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
runs, stop_at = Path(sys.argv[1]), int(sys.argv[2])
def losses(name):
    p = runs / name / "metrics.jsonl"
    rows = [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
def report(name):
    p = runs / name / "eval_report.json"
    return json.loads(p.read_text()) if p.exists() else None
for name in ("q-fp32", "q-fp32-notf32", "q-bf16", "q-fp16", "q-bf16-stop", "q-fp16-stop"):
    status = (runs / name / "status.json")
    print(name, "status:", json.loads(status.read_text()) if status.exists() else None)
    print("  eval report:", json.dumps(report(name)))
for stopped, whole in (("q-bf16-stop", "q-bf16"), ("q-fp16-stop", "q-fp16")):
    a, b = losses(stopped), losses(whole)
    # The first line logged after the stop averages only the steps run since the resume.
    common = [s for s in sorted(set(a) & set(b)) if not stop_at < s <= stop_at + 100]
    diffs = [abs(a[s] - b[s]) for s in common]
    final = [(report(n) or {}).get("main", {}).get("loss") for n in (stopped, whole)]
    print(f"{stopped} vs {whole}: logged steps {common}, max |loss difference| "
          f"{max(diffs) if diffs else None}; final test loss {final[0]} vs {final[1]}")
EOF
(cd "$WORK/runs" && tar czf "$OUT/runs.tar.gz" */metrics.jsonl */eval_report.json \
   */status.json */config.yaml */ds_config.json 2>/dev/null)

wait $preflight
echo "preflight exit $?: $(tail -1 "$OUT/preflight.log")" | tee -a "$OUT/summary.txt"

if [ "${BENCH:-0}" = 1 ]; then
  {
    timeout 120 "$PY" benchmarks/bench_lamemo_cost.py --shape wt103 --batch 8 --device cuda \
      --dtype bf16
    timeout 150 "$PY" benchmarks/bench_compile.py --parts model --device cuda --dtype bf16
    timeout 150 "$PY" benchmarks/bench_recompute.py --parts recompute --device cuda \
      --dtype bf16 --policies full,save-ffn-out:2,save-ffn-out,save-linear --keep-last 1 \
      --recompute-time-depths 4,16 --recompute-memory-depths 1,16
  } >"$OUT/bench.log" 2>&1
fi
rm -rf "$WORK"
