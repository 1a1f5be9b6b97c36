"""Does the torch the nodes will run have kernels for the job's GPUs? Checked at submit time.

`scripts/setup.sh` installs the CPU build of torch unless TORCH_SPEC names another wheel; a
GPU job on that venv would fail at start (train/gpu_binding.py refuses to fall back to the
CPU), and a CUDA wheel without the GPU generation's kernels fails at the first CUDA op ("no
kernel image is available"). `memtrain submit` asks the job's python (--python, the venv the
nodes share) which torch it has: its CUDA version and the architectures it was built for,
which a CUDA build reports without a GPU.

Which CUDA wheels have which architectures (PyTorch's RELEASE.md, "PyTorch CUDA Support
Matrix", for releases 2.12 to 2.14; pytorch/pytorch pull requests #182849 and #197555):

    CUDA 12.6 wheels    sm 5.0, 6.0, 7.0 (V100), 7.5, 8.0 (A100), 8.6, 9.0 (H100)
    CUDA 13.0 / 13.2    sm 7.5, 8.0, 8.6, 9.0, 10.0, 12.0 (+PTX): no V100

Volta left the CUDA 12.8 wheels in release 2.11 (pytorch/pytorch pull request #175253), so
from 2.11 on a V100 needs the CUDA 12.6 wheel from https://download.pytorch.org/whl/cu126.
"""

from __future__ import annotations

import json
import subprocess

from .layout import gpu_capability

_PROBE = ("import json, torch\n"
          "flags = getattr(torch._C, '_cuda_getArchFlags', lambda: None)()\n"
          "print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda,\n"
          "                  'archs': flags.split() if flags else None}))\n")
CU126_INDEX = "https://download.pytorch.org/whl/cu126"


def probe(python: str) -> dict | None:
    """{"version", "cuda" (None: a CPU build), "archs" (e.g. ["sm_70", ...], None: unknown)}
    of the torch in `python`; None when that python cannot be run here."""
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                              timeout=300)
        return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 \
            else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def install_hint(gpu_type: str) -> str:
    cap = gpu_capability(gpu_type) if gpu_type else None
    spec = (f"PIP_EXTRA_INDEX_URL={CU126_INDEX} TORCH_SPEC=torch==2.13.0+cu126 "
            "bash scripts/setup.sh")
    if cap is not None and cap < (7, 5):
        return f"{spec} (CUDA 12.6: the wheels that still have {gpu_type} kernels)"
    return f"{spec} (or the CUDA 13.0 wheel from download.pytorch.org/whl/cu130)"


def _has_kernels(archs: list[str], cap: tuple[int, int]) -> bool:
    """Binary code for the same major version and an equal or lower minor runs; PTX of an
    equal or lower version is compiled for the GPU at load time."""
    for arch in archs:
        kind, _, num = arch.partition("_")
        if not num.isdigit():
            continue
        version = (int(num[:-1]), int(num[-1]))
        if kind == "sm" and version[0] == cap[0] and version[1] <= cap[1]:
            return True
        if kind == "compute" and version <= cap:
            return True
    return False


def torch_problem(info: dict | None, python: str, gpus_per_node: int, gpu_type: str
                  ) -> str | None:
    """Why the torch in `python` cannot train this job on its GPUs, with the fix; None if it
    can, or if it cannot be told (a CPU job, a python not runnable here, an unknown type)."""
    if not gpus_per_node or info is None:
        return None
    if not info.get("cuda"):
        return (f"{python} has torch {info['version']}, a CPU-only build, and the job asks for "
                f"GPUs: the ranks would refuse to start. Install a CUDA wheel into that venv: "
                f"{install_hint(gpu_type)}")
    cap = gpu_capability(gpu_type) if gpu_type else None
    archs = info.get("archs")
    if cap is None or not archs or _has_kernels(archs, cap):
        return None
    return (f"{python} has torch {info['version']} (CUDA {info['cuda']}, built for "
            f"{' '.join(archs)}), which has no kernels for {gpu_type} (sm_{cap[0]}{cap[1]}): "
            f"{install_hint(gpu_type)}")
