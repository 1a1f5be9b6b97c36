"""Relative positions: the sinusoid R, the distance grid, and the skew ("shift trick").

Transformer-XL (Dai et al. 2019, §3.3 and Appendix B) scores a query at position i against a
key at position j with R_{i-j}, a fixed sinusoid of the distance. For a block of Q query rows
and K key columns laid out contiguously, all distances come from one decreasing list
d_max, d_max-1, ..., so one matmul against that list gives every term, and entry (i, j) is
found at column j + (Q-1-i) of row i: each row is the row above shifted left by one. The skew
below reads that shifted matrix as a strided view, without copying.
"""

from __future__ import annotations

import torch


def sinusoid(distances: torch.Tensor, d_model: int) -> torch.Tensor:
    """R for each distance: [D] -> [D, d_model], concatenated [sin(Δ f) | cos(Δ f)].

    f_k = 10000^(-2k/d) (Vaswani et al. 2017). The XL code concatenates sin and cos instead of
    interleaving them; the learnable W_{k,R} that follows makes the order irrelevant.
    """
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d_model, 2, device=distances.device,
                                             dtype=torch.float32) / d_model))
    angles = distances.float()[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def distance_list(q_start: int, n_q: int, k_start: int, n_k: int, n_dist: int | None = None,
                  device: torch.device | None = None) -> torch.Tensor:
    """Signed distances d_max, d_max-1, ... (n_dist of them) for the skew of `skew`.

    Queries sit at positions q_start .. q_start+n_q-1 and keys at k_start .. k_start+n_k-1 on
    one time axis; d_max = (last query) - (first key). All Q*K pairs need n_q + n_k - 1
    distances; a causal caller whose keys never lie right of a query may pass n_dist = n_k
    (the entries above the diagonal are then garbage that the mask removes).
    """
    d_max = q_start + n_q - 1 - k_start
    n = n_q + n_k - 1 if n_dist is None else n_dist
    return torch.arange(d_max, d_max - n, -1, device=device)


def clamp_distances(distances: torch.Tensor, clamp_len: int) -> torch.Tensor:
    """Distances beyond clamp_len reuse R_clamp_len (XL code, `pos_seq.clamp_(max=...)`)."""
    if clamp_len > 0:
        return distances.clamp(-clamp_len, clamp_len)
    return distances


def skew(scores: torch.Tensor, n_k: int, start: int = 0) -> torch.Tensor:
    """[..., Q, D] scores against the distance list -> [..., Q, n_k] scores against keys.

    out[..., i, j] = scores[..., i, j + Q-1-i - start]. This is XL's `_rel_shift` written as
    one strided view: on the flat row-major buffer that element sits at
    (Q-1-start) + i*(D-1) + j, i.e. a view with row stride D-1 (no copy when the scores
    are contiguous, as a matmul's output is).

    `start` > 0 means the caller dropped the first `start` distances of the full list (the
    largest ones), e.g. a look-ahead branch whose keys all lie right of their query. Needs
    D + start >= n_k and start <= Q-1. Entries whose distance was dropped or lies past the
    end of the list are read from a neighbouring row (garbage): the caller's mask removes them.
    """
    *batch, n_q, n_d = scores.shape
    if n_d + start < n_k:
        raise ValueError(f"skew needs at least n_k={n_k} distances, got {n_d} + {start}")
    if not 0 <= start <= n_q - 1:
        raise ValueError(f"skew start must be in [0, {n_q - 1}], got {start}")
    # Row i of the result starts (n_d - 1) elements after row i-1 on the flat [Q * D] row
    # buffer: `unfold` with step n_d - 1 is exactly that view. (An `as_strided` needs the
    # tensor's storage offset, which torch.compile cannot trace without a graph break.)
    flat = scores.reshape(*batch, n_q * n_d)[..., n_q - 1 - start:]
    if n_d == 1:  # row stride 0 (one distance for every pair): every row reads the same keys
        return flat[..., None, :n_k].expand(*batch, n_q, n_k)
    return flat.unfold(-1, n_k, n_d - 1)[..., :n_q, :]
