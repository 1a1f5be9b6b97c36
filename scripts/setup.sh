#!/usr/bin/env bash
# Creates ./.venv and installs memtrain with everything it needs, every optional extra
# included (the tests use them all), CPU build of torch.
# Idempotent: a stamp file keyed on this script and pyproject.toml skips the pip step
# when nothing changed. Override the torch wheel with TORCH_SPEC (e.g. for a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=.venv

"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 10):
    sys.exit(f"memtrain needs Python >= 3.10, found {sys.version.split()[0]}")
PY

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"

stamp="$VENV/.memtrain-installed"
want=$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -d' ' -f1)-$TORCH_SPEC
PACKAGES=(deepspeed==0.19.8 webdataset==1.0.2 mlflow==3.17.2 huggingface_hub
          transformers==5.24.0 peft==0.21.2 accelerate==1.15.0 lm-eval==0.4.13
          -e ".[dev,all]")
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # torch first, by pip: pip alone reads this machine's pip configuration (a local CPU
    # build of torch, its version cap); with torch installed, nothing below replaces it.
    "$VENV/bin/python" -m pip install --quiet "$TORCH_SPEC"
    # The rest by uv where PyPI has it: it resolves and unpacks these ~200 packages in
    # ~35 s where pip took ~2 minutes (measured on the 2-core machine, cold caches); pip
    # if uv cannot be had. torch stays on the same line for pip: otherwise pip resolves
    # deepspeed's torch requirement to the newest CUDA build (several GB).
    if "$VENV/bin/python" -m pip install --quiet uv 2> /dev/null; then
        "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" "$TORCH_SPEC" \
            "${PACKAGES[@]}"
    else
        "$VENV/bin/python" -m pip install --quiet "$TORCH_SPEC" "${PACKAGES[@]}"
    fi
    echo "$want" > "$stamp"
fi

# System packages some tests need: the cluster tests run a real single-node SLURM (Debian's
# slurm-wlm and munge); the `memtrain compare` report test renders its HTML in headless
# Chromium. Installed when this runs as root on Debian/Ubuntu and they are missing; elsewhere
# those tests skip (with the reason).
missing=()
command -v slurmd > /dev/null || missing+=(slurm-wlm munge)
command -v chromium > /dev/null || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        "${missing[@]}" > /dev/null) || echo "setup: could not install ${missing[*]}" >&2
fi

# DeepSpeed JIT-compiles its shared-memory communication op on first use (~30 s);
# keep the build in the checkout so every later process reuses it.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_ext}
# Built by the environment's own ninja, the one training uses (train/deepspeed_setup.py,
# use_environments_ninja): another ninja's build would be rebuilt by the first run.
if [ ! -d "$TORCH_EXTENSIONS_DIR/deepspeed_shm_comm" ]; then
    PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -c "from deepspeed.accelerator import get_accelerator as g; \
g().create_op_builder('ShareMemCommBuilder').load()" > /dev/null 2>&1 || true
fi
