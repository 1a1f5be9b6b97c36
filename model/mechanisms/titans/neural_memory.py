"""The neural long-term memory of Titans (Behrouz, Zhong, Mirrokni 2025, arXiv 2501.00663,
§3): an MLP whose weights are the memory, trained inside the forward pass by gradient
descent with momentum and forgetting on an associative loss.

Per token t (the paper's equations; §3.1):

    k_t = x_t W_K,  v_t = x_t W_V                                  (Eq. 11)
    l(M_{t-1}; x_t) = || M_{t-1}(k_t) - v_t ||_2^2                  (Eq. 12)
    S_t = eta_t S_{t-1} - theta_t grad l(M_{t-1}; x_t)              (Eq. 10, 14: surprise)
    M_t = (1 - alpha_t) M_{t-1} + S_t                               (Eq. 13: forgetting)
    y_t = M*(q_t),  q_t = x_t W_Q                                   (Eq. 15: retrieval)

theta_t (inner learning rate), eta_t (momentum) and alpha_t (forgetting) are data-dependent:
each a sigmoid of a linear function of x_t, scaled by its bound (`max_lr`, `max_momentum`,
`max_forget`; model/mechanisms/titans/mechanism.py validates them). q_t and k_t are l2-normalised
(§4.4); with `conv_size` c > 0, each of x W_Q, x W_K, x W_V first passes a causal
depthwise convolution of kernel c (§4.4), which reads the c - 1 rows of the stream before
the segment (the state's `tails`). M is an MLP of `depth` >= 1 matrices without biases,
SiLU between them (§3.1 "deep memory"); depth 1 is the linear memory M(k) = k W.

The chunked parallel form (§3.2, Eq. 16-18): inside a chunk of b tokens every gradient is
taken at the weights of the chunk's start, M_{t'} with t' = t - mod(t, b), so the b
gradients are independent and the linear recurrences for S and M collapse to weighted sums.
With E_t = prod_{j<=t} eta_j and A_t = prod_{j<=t} (1 - alpha_j) inside the chunk,

    S_t   = E_t S_0 - sum_{i<=t} theta_i (E_t / E_i) g_i
    M_end = A_end M_0 + sum_t (A_end / A_t) S_t
          = A_end M_0 + (sum_t (A_end / A_t) E_t) S_0 - sum_i w_i g_i,
    w_i   = theta_i sum_{t>=i} (A_end / A_t)(E_t / E_i)

and a gradient g_i of one matrix is an outer product a_i^T delta_i (the matrix's input and
the back-propagated error at token i), so sum_i w_i g_i = (w * a)^T delta is one matmul per
matrix: no per-token weights or gradients are materialised (the paper's Eq. 17 is this for
the linear memory). The ratios are formed in log space, each an exp of a sum of log
factors <= 0, so they never overflow. With b = 1 this is exactly the token recurrence
above; tests/test_neural_memory.py checks both against a token-by-token float64 loop.

Each token's gradient of each matrix is clipped to Frobenius norm `max_grad_norm` (its
factor a_t^T delta_t has norm |a_t| |delta_t|, so the clip scales the token's coefficient
w_t): the paper does not clip, and without it the memory overflows within a few segments
at the gates' bounds (depth >= 2: in the first segment; tests/test_neural_memory.py).

A sequence shorter than a chunk (or the tail of one) is a last, shorter chunk: it updates the
memory like any other.

Dtypes: the weights and the momentum are float32 whatever the model's dtype (the inner
update is a small difference of large sums, as ARMT's delta rule;
model/mechanisms/armt/associative.py), or float64 if that is what comes in; the projections run in
the module's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ...backbone import Learned
from ...compiled import compiled_chunk_step
from ...memory import MemoryState, _register, _zero_rows

LOG_FLOOR = -60.0   # log of a decay factor below exp(-60) ~ 1e-26 is that: gone


@_register
@dataclass
class NeuralMemoryState(MemoryState):
    """Titans state: per memory matrix i the per-row weights M [B, n_layer, d_in_i, d_out_i]
    and momentum S of the same shape (float32), and `fresh` [B] (True: the row's document
    starts now; its next segment reads the learned initial weights M_0 and S = 0).

    Not detached by the update: gradients flow through M and S into earlier segments until
    the caller detaches the state (the BPTT depth, as for RMT and ARMT)."""

    kind: ClassVar[str] = "titans"
    fp32_fields: ClassVar[tuple[str, ...]] = ("weights", "momentum")
    # A checkpoint written before the convolutions (§4.4) existed has no `tails`: none.
    optional_fields: ClassVar[tuple[str, ...]] = ("tails",)
    weights: list[torch.Tensor] = field(default_factory=list)
    momentum: list[torch.Tensor] = field(default_factory=list)
    fresh: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    # With the convolutions (`conv_size` c > 0): per input stream of the memory the last
    # c - 1 rows it saw, [B, n_layer, c - 1, d_model] in the model's dtype, so that the
    # causal convolution runs across segment boundaries as over one sequence. Stream 0 is
    # the update's input (MAC: the attention output y; MAG, MAL: the layer input x), stream
    # 1 MAC's retrieval input x. Empty without convolutions.
    tails: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> torch.Tensor:  # rows, for the generic batch_size / select_rows
        return self.fresh

    @classmethod
    def empty(cls, batch: int, n_layer: int, shapes: list[tuple[int, int]],
              device=None, tails: tuple[int, int, int] = (0, 0, 0)) -> NeuralMemoryState:
        """`tails` = (streams, c - 1, d_model) of the convolutions' tails (0 streams: none)."""
        zeros = [torch.zeros(batch, n_layer, *s, device=device) for s in shapes]
        streams, rows, width = tails
        return cls(weights=zeros, momentum=[z.clone() for z in zeros],
                   fresh=torch.ones(batch, dtype=torch.bool, device=device),
                   tails=[torch.zeros(batch, n_layer, rows, width, device=device)
                          for _ in range(streams if rows else 0)])

    def layer(self, l: int, init: list[torch.Tensor]) -> tuple[list, list]:
        """(weights, momentum) of layer l, [B, d_in, d_out] each, the learned initial
        weights `init` (and S = 0) in the fresh rows."""
        f = self.fresh[:, None, None]
        weights = [torch.where(f, w0.to(w.dtype)[None], w[:, l])
                   for w0, w in zip(init, self.weights, strict=True)]
        momentum = [torch.where(f, torch.zeros((), dtype=s.dtype, device=s.device), s[:, l])
                    for s in self.momentum]
        return weights, momentum

    def tail(self, stream: int, l: int) -> torch.Tensor | None:
        """Layer l's tail of `stream` [B, c - 1, d_model], or None without convolutions.
        A fresh row's tail is zeros already (`empty` and `reset_rows` write them): a
        document's first rows have nothing before them."""
        return self.tails[stream][:, l] if self.tails else None

    def written(self, weights: list[list[torch.Tensor]], momentum: list[list[torch.Tensor]],
                tails: list[list[torch.Tensor]] | None = None) -> NeuralMemoryState:
        """The state after a segment from each layer's (weights, momentum) lists and, with
        convolutions, each layer's list of stream tails."""
        def stack(per_layer):
            return [torch.stack(ws, dim=1) for ws in zip(*per_layer, strict=True)]
        return NeuralMemoryState(weights=stack(weights), momentum=stack(momentum),
                                 fresh=torch.zeros_like(self.fresh),
                                 tails=stack(tails) if self.tails else [])

    def reset_rows(self, mask: torch.Tensor) -> NeuralMemoryState:
        # Zeroed with torch.where (a NaN/Inf in a reset row is replaced, not multiplied), and
        # flagged fresh: the next segment reads M_0 there.
        return NeuralMemoryState(weights=[_zero_rows(w, mask) for w in self.weights],
                                 momentum=[_zero_rows(s, mask) for s in self.momentum],
                                 fresh=self.fresh | mask.to(self.fresh.device),
                                 tails=[_zero_rows(t, mask) for t in self.tails])


# -- the memory MLP and its per-token gradients --------------------------------------------
NORM_EPS = 1e-5     # the layer norm of `residual` (F.layer_norm's default)


def mlp(weights: list[torch.Tensor], x: torch.Tensor, residual: bool = False) -> torch.Tensor:
    """M(x): x [B, n, d_in] through the per-row matrices [B, d_in_i, d_out_i], SiLU between.
    `residual`: x + LayerNorm(M(x)) (the layer norm without learned scale; TTT's form,
    titans-pytorch's default memory), d_in = d_out."""
    out = x
    for i, w in enumerate(weights):
        out = torch.bmm(out, w)
        if i < len(weights) - 1:
            out = F.silu(out)
    return x + F.layer_norm(out, out.shape[-1:], eps=NORM_EPS) if residual else out


def _silu_grad(z: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def surprise_factors(weights: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                     q: torch.Tensor | None = None, residual: bool = False):
    """The gradient of Eq. 12 at `weights`, for every token at once, as factors: for matrix
    i, (a [B, n, d_in_i], delta [B, n, d_out_i]) with grad_i(token t) = a_t^T delta_t (the
    backward of the MLP written out, so the outer training differentiates through it).
    Also returns the per-token loss [B, n], and the reads M(q) [B, m, d_out] of the rows q
    [B, m, d_in] (None without q): at the same weights, so through the same matmuls (the
    rows of q before those of k, one matmul per matrix for both). `residual`: M is
    x + LayerNorm(MLP(x)) (`mlp`), the error passed back through the layer norm."""
    m = 0 if q is None else q.shape[1]
    tokens = (lambda t: t) if q is None else (lambda t: t[:, m:])    # the rows of k
    rows = x = k if q is None else torch.cat([q, k], dim=1)
    inputs, pre = [], []
    for i, w in enumerate(weights):
        inputs.append(tokens(x))
        z = torch.bmm(x, w)
        pre.append(tokens(z))
        x = F.silu(z) if i < len(weights) - 1 else z
    if residual:
        normed = F.layer_norm(x, x.shape[-1:], eps=NORM_EPS)
        x = rows + normed
    err = tokens(x) - v
    delta = 2 * err                                   # d ||M(k) - v||^2 / d M(k)
    if residual:    # back through y = (z - mean z) / std z: (g - mean g - y mean(g y)) / std
        y = tokens(normed)
        inv_std = torch.rsqrt(pre[-1].var(-1, unbiased=False, keepdim=True) + NORM_EPS)
        delta = inv_std * (delta - delta.mean(-1, keepdim=True)
                           - y * (delta * y).mean(-1, keepdim=True))
    factors = [None] * len(weights)
    for i in range(len(weights) - 1, -1, -1):
        factors[i] = (inputs[i], delta)
        if i:
            delta = torch.bmm(delta, weights[i].transpose(1, 2)) * _silu_grad(pre[i - 1])
    return factors, err.square().sum(-1), (x[:, :m] if q is not None else None)


def chunk_weights(theta: torch.Tensor, log_eta: torch.Tensor, log_keep: torch.Tensor):
    """A chunk's coefficients (module docstring), each [..., b] or [...] for the gates
    [..., b] of one chunk (or of many at once, one per leading index): w_S (of g_i in
    S_end), w_M (of g_i in M_end), E_end (of S_0 in S_end), c_S0 (of S_0 in M_end), A_end
    (of M_0 in M_end). log_eta = log eta_t, log_keep = log(1 - alpha_t)."""
    le, la = log_eta.cumsum(-1), log_keep.cumsum(-1)                 # log E_t, log A_t
    b = le.shape[-1]
    lower = torch.ones(b, b, dtype=torch.bool, device=le.device).tril()   # [t, i]: i <= t
    # E_t / E_i for i <= t (0 above the diagonal), [..., t, i]
    decay_s = torch.exp((le[..., :, None] - le[..., None, :]).masked_fill(~lower,
                                                                         float("-inf")))
    keep_to_end = torch.exp(la[..., -1:] - la)                        # A_end / A_t, [..., t]
    w_s = theta * decay_s[..., -1, :]                                 # theta_i E_end / E_i
    w_m = theta * torch.einsum("...t,...ti->...i", keep_to_end, decay_s)
    c_s0 = (keep_to_end * le.exp()).sum(-1)
    return w_s, w_m, le[..., -1].exp(), c_s0, la[..., -1].exp()


def chunks_weights(theta: torch.Tensor, log_eta: torch.Tensor, log_keep: torch.Tensor,
                   b: int) -> list[tuple[torch.Tensor, ...]]:
    """chunk_weights of every chunk of b tokens of the gates [B, n] (a shorter last one),
    the full chunks in one call: per chunk its tuple."""
    n_full = theta.shape[1] // b * b
    out = []
    if n_full:
        full = chunk_weights(*(t[:, :n_full].unflatten(1, (-1, b))
                               for t in (theta, log_eta, log_keep)))
        out = list(zip(*(t.unbind(1) for t in full), strict=True))
    if n_full < theta.shape[1]:
        out.append(chunk_weights(theta[:, n_full:], log_eta[:, n_full:], log_keep[:, n_full:]))
    return out


def update_chunk(weights: list[torch.Tensor], momentum: list[torch.Tensor],
                 q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, coeffs,
                 max_grad_norm: float | None = None, fused: bool = False,
                 at: list[torch.Tensor] | None = None, residual: bool = False):
    """(M_end, S_end, reads) after one chunk of the tokens k, v [B, b, d] (Eq. 13-14,
    chunked §3.2) with the chunk's `coeffs` (chunk_weights): every gradient at `weights`,
    the chunk's start, and the reads M*(q) of the rows q at those weights (None without q).
    `max_grad_norm`: each token's gradient of each matrix scaled to at most that Frobenius
    norm (|a_t^T delta_t| = |a_t| |delta_t|, so the clip is a factor on the token's
    coefficient). `fused`: the reads share the surprise's matmuls and the two sums of
    gradients one matmul per matrix (fewer kernels, for the compiled step; eager, the extra
    concatenations and slices cost more ops than the matmuls they save). `at`: the weights
    the gradients are taken at, if not the chunk's start (`surprise_at: initial`, the
    learned M_0; the reads stay at `weights`). `residual`: the memory x + LayerNorm(MLP(x))
    (`mlp`)."""
    if fused and at is None:
        factors, _, read = surprise_factors(weights, k, v, q, residual)
    else:
        read = mlp(weights, q, residual) if q is not None else None
        factors, _, _ = surprise_factors(weights if at is None else at, k, v,
                                         residual=residual)
    w_s, w_m, e_end, c_s0, a_end = coeffs
    new_w, new_s = [], []
    for w0, s0, (a, delta) in zip(weights, momentum, factors, strict=True):
        at = a.transpose(1, 2)
        clip = 1.0
        if max_grad_norm is not None:
            norm = a.norm(dim=-1) * delta.norm(dim=-1)                # [B, b]
            clip = (max_grad_norm / norm.clamp(min=1e-12)).clamp(max=1.0)
        if fused:   # both sums in one matmul: a^T [w_S delta | w_M delta]
            coef = [(w * clip)[..., None] * delta for w in (w_s, w_m)]
            g_s, g_m = torch.bmm(at, torch.cat(coef, dim=-1)).split(delta.shape[-1], dim=-1)
        else:
            g_s = torch.bmm(at * (w_s * clip)[:, None], delta)        # sum_i w_S,i g_i
            g_m = torch.bmm(at * (w_m * clip)[:, None], delta)
        new_s.append(e_end[:, None, None] * s0 - g_s)
        new_w.append(a_end[:, None, None] * w0 + c_s0[:, None, None] * s0 - g_m)
    return new_w, new_s, read


def chunk_step(weights: list[torch.Tensor], momentum: list[torch.Tensor],
               q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, coeffs,
               max_grad_norm: float | None = None, at: list[torch.Tensor] | None = None,
               residual: bool = False):
    """One chunk of the loop (§3.2) as `model.titans.compiled_chunks` compiles it:
    `update_chunk`, fused. Every full chunk calls it with the same shapes, so it is compiled
    once and reused for every chunk of every layer (model/compiled.py
    `compiled_chunk_step`)."""
    return update_chunk(weights, momentum, q, k, v, coeffs, max_grad_norm, fused=True, at=at,
                        residual=residual)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class NeuralMemory(nn.Module):
    """One layer's neural memory: the learned initial weights M_0, the projections W_Q,
    W_K, W_V (Eq. 11, 15), and the gates of theta, eta, alpha (§3.1), with their bounds."""

    def __init__(self, d_model: int, d_mem: int, depth: int = 2, hidden: int | None = None,
                 chunk_size: int = 16, max_lr: float = 0.5, max_momentum: float = 0.9,
                 max_forget: float = 1.0, forget_bias: float = -4.0,
                 lr_bias: float = 0.0, momentum_bias: float = 0.0,
                 max_grad_norm: float | None = None, conv_size: int = 0,
                 compile_backend: str | None = None, surprise_at: str = "chunk",
                 residual_norm: bool = False, qk_norm: str = "l2"):
        super().__init__()
        if depth < 1:
            raise ValueError(f"memory depth must be >= 1, got {depth}")
        hidden = hidden or 2 * d_mem
        dims = [d_mem] + [hidden] * (depth - 1) + [d_mem]
        self.shapes = list(zip(dims[:-1], dims[1:], strict=True))
        # M_0 ~ N(0, 1/d_in): each matrix keeps the scale of its input (unit keys give
        # outputs of the order of 1 through any depth).
        self.init = nn.ModuleList(Learned(torch.randn(i, o) / i ** 0.5) for i, o in self.shapes)
        self.q_proj = nn.Linear(d_model, d_mem, bias=False)
        self.k_proj = nn.Linear(d_model, d_mem, bias=False)
        self.v_proj = nn.Linear(d_model, d_mem, bias=False)
        # §4.4: a 1-D depthwise convolution after each of the projections W_Q, W_K, W_V,
        # causal (kernel c over a row and the c - 1 before it); with the projection before
        # it, a depthwise-separable convolution (pointwise first). 0: none.
        self.conv_size = conv_size
        self.convs = (nn.ModuleDict({n: nn.Conv1d(d_mem, d_mem, conv_size, groups=d_mem)
                                     for n in ("q", "k", "v")}) if conv_size else None)
        self.gates = nn.Linear(d_model, 3)             # theta, eta, alpha (pre-sigmoid)
        with torch.no_grad():
            self.gates.bias.copy_(torch.tensor([lr_bias, momentum_bias, forget_bias]))
        self.chunk_size = chunk_size
        self.max_lr, self.max_momentum, self.max_forget = max_lr, max_momentum, max_forget
        self.max_grad_norm = max_grad_norm
        # Where Eq. 12's gradient is taken: "chunk", at the weights of each chunk's start
        # (§3.2, Eq. 16); "initial", at the learned initial weights M_0 for every token of
        # every segment (what titans-pytorch's NeuralMemory does over a whole sequence when
        # its `batch_size` is unset), so the memory is M_0's gradients summed under the
        # momentum and forgetting, and the reads stay at the current weights.
        self.surprise_at = surprise_at
        # M(x) = x + LayerNorm(MLP(x)) (TTT's memory, titans-pytorch's default; the paper's
        # §3.1 memory is the plain MLP): the memory starts near the identity on its keys.
        if residual_norm and dims[0] != dims[-1]:
            raise ValueError("a residual memory needs d_in = d_out")
        self.residual_norm = residual_norm
        # "l2": q and k l2-normalised (§4.4). "rms_input": the memory's input x RMS-normalised
        # (a learned scale, 1 at init) before W_Q, W_K, W_V and the gates, q and k not
        # normalised (titans-pytorch's NeuralMemory: `pre_rmsnorm`, no q/k norm).
        self.in_norm = nn.RMSNorm(d_model) if qk_norm == "rms_input" else None
        # `model.titans.compiled_chunks`: the torch.compile backend of the chunk step
        # (`chunk_step`) in training, None: eager (model/compiled.py).
        self.compile_backend = compile_backend

    def initial_weights(self) -> list[torch.Tensor]:
        return [w() for w in self.init]

    def project(self, names: str, x: torch.Tensor, tail: torch.Tensor | None
                ) -> list[torch.Tensor]:
        """[x W_n for n in names] ("q", "k", "v") for the rows of x [B, n, d_model]; with
        convolutions, each convolved over them and the `tail` rows before them ([B, c - 1,
        d_model], the stream's last rows of the previous segment: `carry`), which are
        joined to x once for all the projections."""
        if self.convs is None:
            x = self.in_norm(x) if self.in_norm is not None else x
            return [getattr(self, f"{n}_proj")(x) for n in names]
        if tail is None:
            raise ValueError("a memory with convolutions needs the stream's tail rows")
        rows = torch.cat([tail.to(x.dtype), x], dim=1)
        rows = self.in_norm(rows) if self.in_norm is not None else rows
        return [self.convs[n](getattr(self, f"{n}_proj")(rows).transpose(1, 2)).transpose(1, 2)
                for n in names]

    def carry(self, tail: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
        """The stream's tail after the rows x: its last c - 1 rows (None without
        convolutions)."""
        if self.convs is None:
            return None
        keep, n = tail.shape[1], x.shape[1]
        if n >= keep:   # a copy of the last rows, not a view that keeps all of x alive
            return x[:, n - keep:].clone()
        return torch.cat([tail.to(x.dtype), x], dim=1)[:, n:]

    def query(self, x: torch.Tensor, dtype: torch.dtype, tail=None) -> torch.Tensor:
        """q = normalise(x W_Q) (Eq. 15, §4.4), in the memory's dtype (not normalised with
        `qk_norm: rms_input`, whose input is)."""
        return self._qk(self.project("q", x, tail)[0].to(dtype))

    def _qk(self, t: torch.Tensor) -> torch.Tensor:
        return F.normalize(t, dim=-1) if self.in_norm is None else t

    def retrieve(self, weights: list[torch.Tensor], x: torch.Tensor,
                 tail: torch.Tensor | None = None) -> torch.Tensor:
        """M*(q) for the rows of x [B, n, d_model] (Eq. 15; no update): [B, n, d_mem] in
        float32 (float64 if the weights are). `tail`: x's stream before it (`project`)."""
        ct = _compute_dtype(weights[0], x)
        return mlp([w.to(ct) for w in weights], self.query(x, ct, tail), self.residual_norm)

    def gate_values(self, x: torch.Tensor, ct: torch.dtype):
        """(theta, log eta, log(1 - alpha)), each [B, n], from x (§3.1, data-dependent)."""
        z = self.gates(self.in_norm(x) if self.in_norm is not None else x).to(ct)
        theta = self.max_lr * torch.sigmoid(z[..., 0])
        if self.max_momentum > 0:
            log_eta = (math.log(self.max_momentum) + F.logsigmoid(z[..., 1])).clamp(min=LOG_FLOOR)
        else:                                          # no momentum: S_t = -theta_t g_t
            log_eta = torch.full_like(z[..., 1], LOG_FLOOR)
        # log(1 - m sigmoid(z)) = log(1 - m + e^-z) - log(1 + e^-z), never formed as
        # log1p(-alpha): once sigmoid(z) rounds to 1 (z > ~17 in float32) with m = 1 that is
        # log(0), and its gradient inf * 0 = NaN (measured: NaN after 1000 steps of
        # associative retrieval, when the forget gate learned to saturate).
        m = self.max_forget
        floor = torch.full_like(z[..., 2], math.log1p(-m) if m < 1 else float("-inf"))
        log_keep = (torch.logaddexp(floor, -z[..., 2]) - F.softplus(-z[..., 2])
                    ).clamp(min=LOG_FLOOR)
        return theta, log_eta, log_keep

    def update(self, weights: list[torch.Tensor], momentum: list[torch.Tensor],
               x: torch.Tensor, read: torch.Tensor | None = None,
               tail: torch.Tensor | None = None):
        """Write the tokens x [B, n, d_model] into the memory, chunk by chunk (Eq. 11-14 in
        the chunked form of §3.2): (weights, momentum) after them, and, for the rows of
        `read` [B, n, d_model] if given, M*(q) with the weights of each row's chunk start
        (what each token may see of the segment: the chunks before its own). `tail`: x's
        stream before it (`project`); with convolutions `read` must be x itself, the
        same stream."""
        if self.convs is not None and read is not None and read is not x:
            raise ValueError("with convolutions the memory reads the rows it is written "
                             "with (one stream, one tail)")
        ct = _compute_dtype(weights[0], x)
        weights = [w.to(ct) for w in weights]
        momentum = [s.to(ct) for s in momentum]
        same = read is x             # the reads' queries from the same joined rows
        k, v, *q = self.project("kvq" if same else "kv", x, tail)
        k = self._qk(k.to(ct))
        v = v.to(ct)
        theta, log_eta, log_keep = self.gate_values(x, ct)
        # the reads' queries: of the same joined rows, or of `read` (no convolutions there)
        q = self._qk(q[0].to(ct)) if same else self.query(read, ct) if read is not None else None
        # Split once, not sliced per chunk: a slice's backward writes its gradient into a
        # zero tensor of the whole sequence, once per chunk (quadratic in the chunks).
        # The gates' coefficients of all chunks at once: they do not depend on the memory.
        b = self.chunk_size
        coeffs = chunks_weights(theta, log_eta, log_keep, b)
        qs = q.split(b, dim=1) if q is not None else None
        full = last = update_chunk
        if self.compile_backend is not None and torch.is_grad_enabled():
            full, last = compiled_chunk_step(chunk_step, self.compile_backend), chunk_step
        at = None
        if self.surprise_at == "initial":
            at = [w.to(ct)[None].expand(k.shape[0], -1, -1) for w in self.initial_weights()]
        reads = []
        for c, (kc, vc) in enumerate(zip(k.split(b, dim=1), v.split(b, dim=1), strict=True)):
            # A shorter last chunk (once per segment) runs eager: no graph of its own.
            step = full if kc.shape[1] == b else last
            qc = qs[c] if qs is not None else None
            weights, momentum, r = step(weights, momentum, qc, kc, vc, coeffs[c],
                                        self.max_grad_norm, at=at,
                                        residual=self.residual_norm)
            reads.append(r)
        return weights, momentum, (torch.cat(reads, dim=1) if qs is not None else None)
