"""The LM loss through a fused linear + cross-entropy library on CUDA (`model.loss_backend`).

model/loss.py computes the per-row NLL of a head and a cross-entropy in chunks of rows,
recomputed in backward, in plain PyTorch. Two libraries do the same in fused GPU kernels,
never holding the [rows, V] logits at all:

- "cce": Apple's Cut Cross-Entropy (Wijmans et al. 2024, "Cut Your Losses in
  Large-Vocabulary Language Models", arXiv:2411.09009), `cut_cross_entropy.
  linear_cross_entropy(e, c, targets, reduction="none")`. Called with `filter_eps=None`: the
  paper's gradient filtering (skipping the softmax entries below a threshold in backward)
  would change the gradients, so it is off and the gradients are the exact ones. It takes no
  head bias.
- "liger": Liger Kernel's fused linear cross-entropy (Hsu et al. 2024, arXiv:2410.10989),
  `liger_kernel.transformers.functional.liger_fused_linear_cross_entropy(..., reduction=
  "none")`. Only from 0.8.2: before it, the per-row loss's backward scaled every row's
  gradient by the first row's upstream gradient (the library's changelog for 0.8.2, "Fix
  wrong grad_weight/grad_bias for fused linear cross entropy with reduction='none'"), so an
  older version is refused as if it were not installed.

Each library's forward makes the host wait for the device once per call (it counts the rows
that are not `ignore_index`: CCE with a `nonzero`, Liger with an `.item()`); the chunked
path never waits (tests/test_sync_free.py), so on CUDA that wait is the price of the fused
kernels, one per segment scored.

Both return the float32 NLL of every row they are given; model/loss.py gives them only the
supervised rows and scatters the result, exactly as its chunks do, so what is computed (the
per-row NLL, then memtrain's own sum and mean) does not change with the backend, only the
kernels and their rounding (the GEMM's accumulation order, and CCE's logits never rounded to
the model's dtype before the softmax).

`auto` takes a library when the hidden states are on CUDA, the head is one plain,
materialised linear layer (`linear_head`, `softmax_head`) in the hidden states' dtype, and
the library imports: CCE first where the head has no bias, then Liger; otherwise the chunked
path. An explicit "liger" or "cce" is refused (a ConfigError naming the option, in one line,
with the pip line to run) where it cannot run: off CUDA (evaluating such a run on the CPU
needs `model.loss_backend=auto`), not importable, or a head it cannot take.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .config import LOSS_BACKENDS
from .typed import ConfigError, check_choice

FIELD = "model.loss_backend"
# The first Liger Kernel release whose reduction="none" backward is per row (module docstring).
LIGER_MIN = (0, 8, 2)

RowsNLL = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LinearHead:
    """The head as one linear layer: logits = hidden @ weight.T + bias."""

    weight: torch.Tensor   # [V, d]
    bias: torch.Tensor | None


def _plain(module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None
           ) -> LinearHead | str:
    if module._forward_hooks or module._forward_pre_hooks:
        return ("the head module has forward hooks (e.g. a ZeRO-3 gather), which a fused call "
                "would not run")
    for p in (weight, bias):
        if p is not None and (p.is_meta or hasattr(p, "ds_id") or type(p.data) is not
                              torch.Tensor):
            return "the head's weight is not materialised here (meta, a ZeRO-3 shard, a DTensor)"
    if weight.dim() != 2:
        return f"the head's weight is not a matrix (shape {tuple(weight.shape)})"
    return LinearHead(weight, bias)


def linear_head(module: nn.Module) -> LinearHead | str:
    """A pretrained model's output head as a `LinearHead`, or why it is not one: it must be
    exactly an nn.Linear (not a LoRA-wrapped one) with a materialised weight (tied to the
    input embeddings or not)."""
    if type(module) is not nn.Linear:
        return f"the head is a {type(module).__name__}, not a plain nn.Linear"
    return _plain(module, module.weight, module.bias)


def softmax_head(softmax) -> LinearHead | str:
    """The native stack's AdaptiveSoftmax (model/adaptive.py) as a `LinearHead`, or why it is
    not one: without clusters (`model.cutoffs`) and without an input projection it is one
    [vocab, d] weight and its bias."""
    if softmax.n_clusters > 1:
        return "the adaptive softmax has clusters (model.cutoffs)"
    if len(softmax.out_projs):
        return "the softmax projects its input first"
    return _plain(softmax, softmax.out_weights[0], softmax.out_biases[0])


def device_type(t: torch.Tensor) -> str:
    """Where `t` lives ("cuda", "cpu", ...): the one device check of the dispatch (a seam the
    tests replace to run the CUDA branch on the CPU)."""
    return t.device.type


@functools.cache
def installed_version(dist: str) -> tuple[int, ...] | None:
    """The installed distribution's version as numbers, None where its metadata is absent."""
    try:
        text = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def _load_cce():
    # Imported here, not at the top: Cut Cross-Entropy is an optional CUDA-only dependency
    # (Triton kernels) that the CPU install and the chunked path never need.
    from cut_cross_entropy import linear_cross_entropy

    def rows(hidden, weight, bias, targets):
        return linear_cross_entropy(hidden, weight, targets, reduction="none",
                                    filter_eps=None).float()
    return rows


def _load_liger():
    # Imported here, not at the top: Liger Kernel is an optional CUDA-only dependency (Triton
    # kernels) that the CPU install and the chunked path never need.
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    version = installed_version("liger-kernel")
    if version is None or version < LIGER_MIN:
        found = "unknown" if version is None else ".".join(map(str, version))
        raise ImportError(f"liger-kernel {found} is older than 0.8.2, the first whose per-row "
                          "loss has per-row gradients")

    def rows(hidden, weight, bias, targets):
        return liger_fused_linear_cross_entropy(hidden, weight, targets, bias=bias,
                                                reduction="none").float()
    return rows


@dataclass(frozen=True)
class Library:
    title: str
    extra: str            # memtrain's pip extra (pyproject.toml)
    takes_bias: bool
    load: Callable[[], Callable]   # the per-row function; ImportError where it cannot run


LIBRARIES = {
    "cce": Library("Cut Cross-Entropy", "cce", False, _load_cce),
    "liger": Library("Liger Kernel", "liger", True, _load_liger),
}
AUTO_ORDER = ("cce", "liger")


def _refuse(backend: str, why: str) -> ConfigError:
    lib = LIBRARIES[backend]
    return ConfigError(FIELD, f"{backend!r} ({lib.title}) cannot run here: {why} "
                       f"(pip install 'memtrain[{lib.extra}]' on a CUDA machine, or set "
                       f"{FIELD} to auto or chunked)")


def fused_rows(backend: str, head: LinearHead | str, hidden: torch.Tensor) -> RowsNLL | None:
    """The fused (hidden rows [n, d], target rows [n]) -> float32 NLL [n] that `backend`
    chooses for this head and these hidden states, or None for model/loss.py's chunks.
    `head`: the head as a `LinearHead`, or a sentence saying why it is not one."""
    check_choice(FIELD, backend, LOSS_BACKENDS)
    if backend == "chunked":
        return None
    explicit = backend != "auto"
    if device_type(hidden) != "cuda":
        if explicit:
            raise _refuse(backend, f"its kernels run on CUDA only and the hidden states are "
                          f"on {hidden.device.type}")
        return None
    if isinstance(head, LinearHead) and head.weight.dtype != hidden.dtype:
        head = (f"the head's weight is {head.weight.dtype} and the hidden states "
                f"{hidden.dtype}")
    if isinstance(head, str):
        if explicit:
            raise _refuse(backend, head)
        return None
    for name in (backend,) if explicit else AUTO_ORDER:
        lib = LIBRARIES[name]
        if head.bias is not None and not lib.takes_bias:
            if explicit:
                raise _refuse(name, "it takes no head bias and this head has one")
            continue
        try:
            rows = lib.load()
        except ImportError as e:
            if explicit:
                raise _refuse(name, f"it does not import ({e})") from e
            continue
        return functools.partial(_call, rows, head)
    return None


def _call(rows, head: LinearHead, hidden: torch.Tensor, targets: torch.Tensor
          ) -> torch.Tensor:
    targets = targets.to(hidden.device, torch.long, non_blocking=True)
    return rows(hidden.contiguous(), head.weight, head.bias, targets)
