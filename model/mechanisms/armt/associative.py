"""Associative memory of ARMT (Rodkin, Kuratov, Bulatov, Burtsev 2024, arXiv 2407.04841).

ARMT keeps RMT's memory tokens, but what crosses the segment boundary is not the tokens:
every layer l owns an associative matrix A_l [d_phi, d_v] and a normaliser z_l [d_phi].
At segment s (the paper's associative block, its Fig. 1c; the paper's text was not
reachable from here, so its equation numbers are not cited: the equations below are
written out in words and follow the authors' code, modeling_amt/language_modeling.py of
RodkinIvan/associative-recurrent-memory-transformer, and the figure img/armt.png there):

  read, before layer l, for every position t of the segment (memory tokens included):
      q_t = W_q h_t,   o_t = phi(q_t)^T A / (phi(q_t)^T z + eps),   h_t <- h_t + o_t
  write, from layer l's OUTPUT at the m memory tokens m_1..m_m of the segment:
      k_i = W_k m_i,  v_i = W_v m_i,  beta_i = sigmoid(w_b^T m_i + b)        (importance)
      vbar_i  = phi(k_i)^T A / (phi(k_i)^T z + eps)       value already stored under k_i
      gamma_i = clip(1 - phi(k_i)^T z / (|phi(k_i)|^2 + eps), 0, 1), stop-gradient
      A <- A + sum_i beta_i phi(k_i) (v_i - vbar_i)^T                      (delta rule)
      z <- z + sum_i gamma_i phi(k_i)
  eps = 1e-5 in every denominator (authors' code).

All m memory tokens of a segment are written at once against the state before the
segment (vbar and gamma use the old A and z), as the authors' code does: it is one
parallel update per segment, not m sequential ones. gamma is the authors' "correction":
a key already counted in z (|phi(k)|^2 = phi(k)^T z for a key orthogonal to the others)
does not grow z again, so rewriting a stored key keeps reading back one value, not a
mean. With A = 0 and z = 0 these formulas give vbar = 0 and gamma = 1, exactly the
authors' special case for the first segment, so a zeroed row IS a fresh document and
no "first segment" flag is needed.

phi is DPFP (Schlag, Irie, Schmidhuber 2021, "Linear Transformers Are Secretly Fast Weight
Programmers", the deterministic parameter-free projection), nu = 3 in the authors' code:
r = [relu(x), relu(-x)] (2d entries), phi(x) = [r * roll(r, 1), ..., r * roll(r, nu)],
2 nu d entries, all >= 0. The identity map is the alternative left commented out in the
authors' code; elu(x) + 1 (Katharopoulos et al. 2020) is the usual linear-attention map,
offered for comparison (not from the ARMT code). With the identity map phi^T z can be
negative or zero and the normaliser is unsafe; it is there for ablations only.

Dtypes. A and z are float32 whatever the model's dtype (AssociativeMemory.fp32_fields;
read/write compute in float32, or float64 if that is what comes in). Why: z is a running
sum over every segment of a document; in bfloat16 (8 significant bits) adding a term of
size 1 to a sum of 256 is lost, so after a few hundred segments z stops growing while A
keeps changing, and every read's normaliser is wrong. The delta rule subtracts vbar from
v, a cancellation that half precision turns into noise, and DPFP squares its inputs
(fp16 overflows at |k| > 256). The projections run in the module's dtype (bf16 under
mixed precision); only phi, the einsums and the divisions are float32. Measured in
tests/test_associative_core.py: a bf16 module with this float32 state is within 0.5% of
float32; a state rounded to bf16 after every write drifts to ~5% over 512 segments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ...memory import MemoryState, XLMemory, _register, _zero_rows
from .associative_grad import (
    StateGradient,
    delta_write,
    innermost_checkpoint_hooks,
    read_numerator,
    unbind_layers,
)

EPS = 1e-5  # the authors' code adds 1e-5 to every denominator
FEATURE_MAPS = ("dpfp", "identity", "elu")
# The read's operands (AssociativeLayer.retrieve): "fp32" as the module docstring says;
# "bf16": phi(q), A and z rounded to bf16 and one bf16 matmul (fp32 accumulation) for
# phi^T [A | z]; the write and the state stay float32 (docs/armt-costs.md, "The read in bf16").
READ_PRECISIONS = ("fp32", "bf16")


def dpfp(x: torch.Tensor, nu: int = 3) -> torch.Tensor:
    """DPFP feature map over the last dim: [..., d] -> [..., 2 nu d], non-negative."""
    r = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
    rolled = torch.cat([r.roll(shifts=j, dims=-1) for j in range(1, nu + 1)], dim=-1)
    return r.repeat(*([1] * (r.dim() - 1)), nu) * rolled


class FeatureMap(nn.Module):
    """phi: 'dpfp' (nu), 'identity' or 'elu' (elu + 1). No parameters."""

    def __init__(self, kind: str = "dpfp", nu: int = 3):
        super().__init__()
        if kind not in FEATURE_MAPS:
            raise ValueError(f"feature map {kind!r}; expected one of {FEATURE_MAPS}")
        if kind == "dpfp" and nu < 1:
            raise ValueError(f"dpfp needs nu >= 1, got {nu}")
        self.kind, self.nu = kind, nu

    def out_dim(self, d: int) -> int:
        return 2 * self.nu * d if self.kind == "dpfp" else d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "dpfp":
            return dpfp(x, self.nu)
        if self.kind == "elu":
            return F.elu(x) + 1
        return x

    def extra_repr(self) -> str:
        return f"{self.kind}, nu={self.nu}" if self.kind == "dpfp" else self.kind


@_register
@dataclass
class AssociativeMemory(MemoryState):
    """ARMT state: per layer the association matrix A [B, n_layer, d_phi, d_v] and the
    normaliser z [B, n_layer, d_phi] (float32, see the module docstring), `writes` [B]
    (segments written since the row's document started; 0 = fresh), optionally the
    memory tokens' write outputs [B, m, d] when they are carried too (`armt.carry_tokens`;
    None otherwise), and optionally the XL cache of the previous segment (the authors'
    sliding-window mode attends to the previous segment's keys and values; None when
    unused).

    Not detached by the write: gradients flow through A and z into earlier segments until
    the caller detaches the state (the BPTT depth, as for RMTMemory)."""

    kind: ClassVar[str] = "armt"
    fp32_fields: ClassVar[tuple[str, ...]] = ("A", "z")
    A: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, 0, 0))
    z: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, 0))
    writes: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    tokens: torch.Tensor | None = None
    cache: XLMemory | None = None

    @property
    def length(self) -> torch.Tensor:  # rows, for the generic batch_size / select_rows
        return self.writes

    @property
    def n_layer(self) -> int:
        return int(self.A.shape[1])

    @classmethod
    def zeros(cls, batch: int, n_layer: int, d_phi: int, d_value: int, device=None,
              dtype: torch.dtype = torch.float32) -> AssociativeMemory:
        """The empty memory (every row a fresh document)."""
        return cls(A=torch.zeros(batch, n_layer, d_phi, d_value, device=device, dtype=dtype),
                   z=torch.zeros(batch, n_layer, d_phi, device=device, dtype=dtype),
                   writes=torch.zeros(batch, dtype=torch.long, device=device))

    def layer(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_l [B, d_phi, d_v], z_l [B, d_phi]) of layer l. A segment that reads every
        layer takes `layers()` instead: each `A[:, l]` here is a select whose backward
        zero-fills a whole [B, n_layer, d_phi, d_v] gradient."""
        return self.A[:, l], self.z[:, l]

    def layers(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...],
                              StateGradient | None]:
        """Every layer's A_l and z_l, as views from one `unbind` of A and of z, and the
        buffer that every layer's read writes its slice of dL/dA into (None outside
        training): backward then writes the state's gradient once, with neither a stack of
        per-layer gradients nor, as a select per read and per write (`layer`) would,
        2 n_layer zero-filled |A|-sized gradients and their sum (docs/armt-costs.md,
        "State traffic in backward")."""
        A_layers, grad = unbind_layers(self.A)
        return A_layers, self.z.unbind(1), grad

    def written(self, A_layers: list[torch.Tensor], z_layers: list[torch.Tensor],
                cache: XLMemory | None = None,
                tokens: torch.Tensor | None = None) -> AssociativeMemory:
        """New state after one segment: each layer's written (A_l', z_l'), one more write."""
        if len(A_layers) != len(z_layers):
            raise ValueError(f"{len(A_layers)} matrices but {len(z_layers)} normalisers")
        return AssociativeMemory(A=torch.stack(A_layers, dim=1), z=torch.stack(z_layers, dim=1),
                                 writes=self.writes + 1, tokens=tokens, cache=cache)

    # -- kept off the device while a checkpointed segment waits for its backward ---------
    # A segment checkpointed with torch.utils.checkpoint keeps its arguments for the re-run
    # in backward, this state among them: |A| per segment of a BPTT window, where RMT keeps
    # m x d (docs/armt-costs.md, "Peak under segment checkpointing"). With
    # `model.armt.offload_state` the segment's forward ends by moving its incoming A and z
    # to host memory (`offload`); the re-run starts by moving them back (`resident`).
    # Copies both ways, so the re-run reads the same bits. In place: the checkpoint holds
    # this object, not its tensors.
    _home: ClassVar[tuple | None] = None

    def offload(self) -> None:
        """Move A and z to host memory, in place (no-op if they are there already)."""
        if self._home is None:
            self._home = (self.A.device, self.A.requires_grad, self.z.requires_grad)
            self.A, self.z = to_host(self.A), to_host(self.z)

    def resident(self) -> AssociativeMemory:
        """A and z back on their device after `offload` (in place; returns self). They come
        back as leaves with the requires_grad they had: the re-run must save for backward
        what the first run saved, and its gradients go through the first run's graph."""
        if self._home is not None:
            device, grad_a, grad_z = self._home
            self.A = from_host(self.A, device).requires_grad_(grad_a)
            self.z = from_host(self.z, device).requires_grad_(grad_z)
            self._home = None
        return self

    def reset_rows(self, mask: torch.Tensor) -> AssociativeMemory:
        # Zeroed with torch.where, so a NaN/Inf in a reset row (an overflow) is replaced, not
        # multiplied; A = 0, z = 0 is exactly a fresh document (module docstring). Carried
        # tokens stay: writes = 0 makes the next segment start from the learned ones.
        m = mask.to(self.writes.device)
        cache = self.cache.reset_rows(mask) if self.cache is not None else None
        return AssociativeMemory(A=_zero_rows(self.A, mask), z=_zero_rows(self.z, mask),
                                 writes=torch.where(m, torch.zeros_like(self.writes),
                                                    self.writes),
                                 tokens=self.tokens, cache=cache)


def to_host(t: torch.Tensor):
    """A copy of t in (pinned) host memory, queued on the current stream: no host wait, and
    the caching allocator reuses t's block only for work queued after the copy. A tensor
    already on the host stays as it is (nothing to free)."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t.detach(), non_blocking=True)


def from_host(t, device) -> torch.Tensor:
    """`to_host`'s copy back on `device` (from pinned memory: no host wait)."""
    return t.detach().to(device, non_blocking=True)


def checkpoint_first_run() -> bool:
    """Inside the first forward of a non-reentrant torch.utils.checkpoint region (its saved-
    tensor hooks are the innermost ones), where the arguments are kept for a re-run; False
    in the re-run, outside checkpointing, or if torch no longer exposes the hooks."""
    return innermost_checkpoint_hooks("_checkpoint_hook")


class AssociativeLayer(nn.Module):
    """One layer's associative block: `read` before the layer, `write` after it.

    d_key is the width of q and k before phi (the authors' d_mem); d_phi = phi's output
    width; d_value defaults to d_model as in the authors' code (values are added to the
    hidden states); a different d_value adds an output projection d_value -> d_model.
    W_v starts at zero (authors' code), so at initialisation every read returns 0 and the
    block leaves the backbone unchanged. use_gate=False fixes beta = 1; correction=False
    fixes gamma = 1 (the authors' --no_correction).
    """

    def __init__(self, d_model: int, d_key: int, d_value: int | None = None,
                 feature_map: str = "dpfp", nu: int = 3, use_gate: bool = True,
                 correction: bool = True, eps: float = EPS, authors_gamma: bool = False,
                 read_precision: str = "fp32", denominator_floor: float = 0.0):
        super().__init__()
        if read_precision not in READ_PRECISIONS:
            raise ValueError(f"read precision {read_precision!r}; expected one of "
                             f"{READ_PRECISIONS}")
        self.read_precision = read_precision
        self.phi = FeatureMap(feature_map, nu)
        self.d_model, self.d_key = d_model, d_key
        self.d_phi = self.phi.out_dim(d_key)
        self.d_value = d_value or d_model
        self.q_proj = nn.Linear(d_model, d_key, bias=False)
        self.k_proj = nn.Linear(d_model, d_key, bias=False)
        self.v_proj = nn.Linear(d_model, self.d_value, bias=False)
        nn.init.zeros_(self.v_proj.weight)
        self.gate = nn.Linear(d_model, 1) if use_gate else None
        self.out_proj = (None if self.d_value == d_model
                         else nn.Linear(self.d_value, d_model, bias=False))
        self.correction, self.eps = correction, eps
        # gamma exactly as the authors' code computes it: eps in the numerator too, and 1 on
        # a row's first write (their first-segment flag; a row is fresh while z = 0, since
        # phi >= 0 and the first write adds every phi(k)). It differs from the formula above
        # by eps / (|phi(k)|^2 + eps): nothing for large keys, a lot for keys near eps
        # (docs/coming-from-authors.md has the measurement). For imported checkpoints.
        self.authors_gamma = authors_gamma
        # A floor under every lookup's denominator, phi^T z >= floor * |phi|^2 (0: the
        # authors' equations as they are). Why (docs/armt.md, "Loss spikes"): gamma keeps a
        # key whose features z already counts out of z, while the delta rule still writes
        # it into A; a later query on features only such keys hold meets phi^T z ~ 0 with
        # phi^T A != 0, and the read (and a write's vbar, which feeds A) returns a vector
        # thousands of times any stored value. floor = 1 asks z to hold at least one key's
        # worth of the query's own features: an exact match (phi(q)^T z = |phi(q)|^2 for a
        # stored, orthogonal key) is unchanged, a query on uncounted features is damped.
        self.denominator_floor = denominator_floor
        # The smallest relative denominator phi^T z / |phi|^2 of this layer's training reads
        # since it was last taken (a device scalar, no host read): the quantity whose
        # collapse makes a spike (above); the training log reads it per layer
        # (`take_read_minimum`, train/loop.py). Rows with an empty z (fresh memory, nothing
        # to read) do not count. A plain attribute: not in the state dict.
        self.read_den_min: torch.Tensor | None = None

    def _track(self, den: torch.Tensor, f: torch.Tensor, z: torch.Tensor) -> None:
        if not self.training or torch.compiler.is_compiling():
            return
        with torch.no_grad():
            ratio = den.float() / (f.float().square().sum(-1) + self.eps)     # [B, n]
            fresh = (z == 0).all(-1)                                          # [B]
            low = ratio.masked_fill(fresh[:, None], float("inf")).min()
            self.read_den_min = (low if self.read_den_min is None
                                 else torch.minimum(self.read_den_min, low))

    def take_read_minimum(self) -> torch.Tensor | None:
        """The smallest relative read denominator since the last call (None: no training
        read), and start again."""
        low, self.read_den_min = self.read_den_min, None
        return low

    def empty_state(self, batch: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, z) of one layer for `batch` fresh rows, float32."""
        return (torch.zeros(batch, self.d_phi, self.d_value, device=device),
                torch.zeros(batch, self.d_phi, device=device))

    @staticmethod
    def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
        dtype = torch.float32
        for t in tensors:
            dtype = torch.promote_types(dtype, t.dtype)
        return dtype

    def _floored(self, den: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """phi^T z as a divisor: at least `denominator_floor` * |phi|^2 when a floor is set
        (gamma reads the raw phi^T z)."""
        if not self.denominator_floor:
            return den
        return torch.maximum(den, self.denominator_floor * f.square().sum(-1).to(den.dtype))

    def retrieve(self, A: torch.Tensor, z: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """o_t = phi(W_q h_t)^T A / (phi(W_q h_t)^T z + eps): [B, T, d_v], float32 (or
        float64 when A or hidden are)."""
        return self._retrieve(A, z, hidden)[0]

    def _retrieve(self, A, z, hidden, grad: StateGradient | None = None, l: int = 0):
        """(the read o, A as this layer's write takes it: `read_passing`)."""
        ct = self._compute_dtype(A, hidden)
        if self.read_precision == "bf16" and ct == torch.float32:
            return self._retrieve_bf16(A, z, hidden), A
        f = self.phi(self.q_proj(hidden).to(ct))
        num, A = read_numerator(A.to(ct), f, grad, l)
        den = torch.einsum("bnf,bf->bn", f, z.to(ct))
        self._track(den, f, z)
        return num / (self._floored(den, f) + self.eps)[..., None], A

    def _retrieve_bf16(self, A: torch.Tensor, z: torch.Tensor, hidden: torch.Tensor
                       ) -> torch.Tensor:
        """The read with bf16 operands (`read_precision="bf16"`): phi in bf16, then phi^T A
        and phi^T z as one bmm against [A | z] [B, d_phi, d_v + 1] rounded to bf16, whose
        products accumulate in fp32 on a GPU; the quotient in float32. Each operand is
        rounded once (relative 2^-9), nothing is summed across segments in bf16: the state
        A, z and the write stay float32. Drift against the fp32 read over 512 segments:
        tests/test_armt_costs.py."""
        bf = torch.bfloat16
        f = self.phi(self.q_proj(hidden).to(bf))                        # [B, n, d_phi]
        Az = torch.cat([A.to(bf), z.to(bf)[..., None]], dim=-1)         # [B, d_phi, d_v+1]
        out = torch.bmm(f, Az).float()
        self._track(out[..., -1], f, z)
        den = self._floored(out[..., -1], f.float())
        return out[..., :-1] / (den + self.eps)[..., None]

    def read(self, A: torch.Tensor, z: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden + o (through the output projection if d_value != d_model), in hidden's
        dtype: the layer's input with what the memory associates to each position."""
        return self.read_passing(A, z, hidden)[0]

    def read_passing(self, A: torch.Tensor, z: torch.Tensor, hidden: torch.Tensor,
                     grad: StateGradient | None = None, l: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`read`, and A as this layer's `write` must take it: in training the read
        then assembles the gradient of A_l from its own and the write's in one baddbmm,
        into layer l's slot of the segment's `grad` buffer (`AssociativeMemory.layers`;
        model/mechanisms/armt/associative_grad.py). Outside training A comes back as it went in."""
        out, A = self._retrieve(A, z, hidden, grad, l)
        if self.out_proj is not None:
            out = self.out_proj(out.to(self.out_proj.weight.dtype))
        return hidden + out.to(hidden.dtype), A

    def write(self, A: torch.Tensor, z: torch.Tensor,
              mem_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(A', z') after writing the m memory tokens' hidden states [B, m, d_model] (the
        delta rule of the module docstring). Returned in float32 (float64 if A or the
        input are), whatever the module's dtype."""
        ct = self._compute_dtype(A, mem_hidden)
        A, z = A.to(ct), z.to(ct)
        f = self.phi(self.k_proj(mem_hidden).to(ct))                  # [B, m, d_phi]
        v = self.v_proj(mem_hidden).to(ct)                            # [B, m, d_v]
        if self.gate is not None:
            beta = torch.sigmoid(self.gate(mem_hidden).to(ct))[..., 0]  # [B, m]
        else:
            beta = torch.ones(f.shape[:2], dtype=ct, device=f.device)
        den = torch.einsum("bmf,bf->bm", f, z)
        if self.correction and self.authors_gamma:
            gamma = (1 - (den + self.eps) / (f.square().sum(-1) + self.eps)).clamp(0, 1)
            first = (z == 0).all(-1)[:, None]
            gamma = torch.where(first, torch.ones_like(gamma), gamma).detach()
        elif self.correction:
            gamma = (1 - den / (f.square().sum(-1) + self.eps)).clamp(0, 1).detach()
        else:
            gamma = torch.ones_like(den)
        # A + sum_i phi(k_i) (beta_i (v_i - vbar_i))^T, vbar_i = (phi(k_i)^T A) r_i, as one
        # baddbmm whose backward is written by hand (model/mechanisms/armt/associative_grad.py).
        A_new = delta_write(A, f, v, beta, self._floored(den, f) + self.eps)
        z_new = z + torch.einsum("bmf,bm->bf", f, gamma)
        return A_new, z_new
