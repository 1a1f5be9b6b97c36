"""Adaptive input embeddings and projected adaptive softmax, as used by Transformer-XL.

The vocabulary is split into frequency-sorted clusters by `cutoffs`: cluster i holds token ids
[ends[i], ends[i+1]) with ends = [0] + cutoffs + [vocab_size].

* Adaptive input (Baevski & Auli 2018, §3): rarer clusters get smaller embeddings,
  d_embed // div_val**i, each projected up to the model width d_proj. With div_val == 1 every
  cluster has the full width, so the embedding is one ordinary table.
* Adaptive softmax (Grave et al. 2016, §3.3): a "head" softmax over the shortlist (cluster 0)
  plus one logit per tail cluster; a tail token's probability is p(cluster) * p(token | cluster).
  Only the rows that actually belong to a tail cluster pay for that cluster's logits.
* Tying (Press & Wolf 2017; Baevski & Auli 2018 §4.1): output weights and projections are shared
  with the input ones. Transformer-XL ties every weight and the tail projections (tie_projs
  F,T,T,T on WikiText-103).

With no cutoffs both modules reduce to a plain embedding / full softmax (enwik8, text8).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def _cluster_layout(vocab_size: int, d_embed: int, d_proj: int, cutoffs: list[int],
                    div_val: int) -> tuple[list[int], list[int]]:
    """Validate the arguments; return (cluster boundaries, per-cluster embedding dims)."""
    cutoffs = list(cutoffs)
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
    if d_embed <= 0 or d_proj <= 0:
        raise ValueError(f"d_embed and d_proj must be > 0, got d_embed={d_embed}, "
                         f"d_proj={d_proj}")
    if cutoffs and (cutoffs != sorted(set(cutoffs)) or cutoffs[0] <= 0):
        raise ValueError(f"cutoffs must be strictly increasing positive ids, got {cutoffs}")
    if cutoffs and cutoffs[-1] >= vocab_size:
        raise ValueError(f"cutoffs: last cutoff {cutoffs[-1]} must be < vocab_size="
                         f"{vocab_size}")
    if div_val < 1:
        raise ValueError(f"div_val must be >= 1, got {div_val}")
    ends = [0] + cutoffs + [vocab_size]
    dims = [d_embed // div_val**i for i in range(len(ends) - 1)]
    if dims[-1] == 0:
        raise ValueError(f"d_embed={d_embed} is too small for div_val={div_val}: cluster "
                         f"{dims.index(0)} would get d_embed // div_val**i == 0 dims")
    return ends, dims


def _host_cluster_rows(ids: torch.Tensor, ends: list[int],
                       device: torch.device) -> list[torch.Tensor]:
    """Per cluster, the ascending flat positions of `ids` (a HOST tensor) that fall in it,
    copied to `device` without blocking.

    The number of rows per cluster is data-dependent, so whoever computes it from a device
    tensor makes the host wait (`nonzero`). The training step hands the targets over from
    the host, where the data loader made them: numpy does the routing there (`.numpy()`
    raises on a device tensor, so this can never become a hidden device sync) and only the
    index lists travel. Same open-ended first/last clusters as `_cluster_mask`.
    """
    cluster = np.searchsorted(np.asarray(ends[1:-1], dtype=np.int64),
                              ids.detach().reshape(-1).numpy(), side="right")
    return [torch.from_numpy(np.flatnonzero(cluster == i)).to(device, non_blocking=True)
            for i in range(len(ends) - 1)]


def _cluster_mask(ids: torch.Tensor, ends: list[int], i: int) -> torch.Tensor:
    # The first and last clusters are open-ended so that an out-of-range id is routed to a
    # table lookup / gather that raises, instead of silently matching no cluster.
    lo, hi = ends[i], ends[i + 1]
    if i == 0:
        return ids < hi
    if i == len(ends) - 2:
        return ids >= lo
    return (ids >= lo) & (ids < hi)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    # log-softmax over up to 267k logits in bf16/fp16 loses the tail's mass; do it in (at
    # least) float32 even under autocast. float64 stays float64 (useful for exact checks).
    return x.to(torch.promote_types(x.dtype, torch.float32))


class AdaptiveEmbedding(nn.Module):
    """Adaptive input representations (Baevski & Auli 2018), scaled by sqrt(d_proj)."""

    def __init__(self, vocab_size: int, d_embed: int, d_proj: int, cutoffs: list[int],
                 div_val: int = 1, init_std: float = 0.02, proj_init_std: float = 0.01):
        super().__init__()
        self.ends, self.dims = _cluster_layout(vocab_size, d_embed, d_proj, cutoffs, div_val)
        self.vocab_size, self.d_embed, self.d_proj = vocab_size, d_embed, d_proj
        self.cutoffs, self.div_val = list(cutoffs), div_val
        self.n_clusters = len(self.ends) - 1
        # Transformer-XL (following Vaswani et al. 2017) multiplies embeddings by sqrt(d_model).
        self.emb_scale = d_proj**0.5

        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ParameterList()  # each [d_proj, d_emb_i], applied as emb @ proj.T
        if div_val == 1:
            # All clusters have the same width: one table, one optional projection.
            self.emb_layers.append(nn.Embedding(vocab_size, d_embed))
            if d_proj != d_embed:
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, d_embed)))
        else:
            for i, d_i in enumerate(self.dims):
                self.emb_layers.append(nn.Embedding(self.ends[i + 1] - self.ends[i], d_i))
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, d_i)))

        for layer in self.emb_layers:
            nn.init.normal_(layer.weight, 0.0, init_std)
        for proj in self.emb_projs:
            nn.init.normal_(proj, 0.0, proj_init_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [...] -> [..., d_proj], already multiplied by sqrt(d_proj)."""
        if self.div_val == 1:
            embed = self.emb_layers[0](tokens)
            if len(self.emb_projs):
                embed = F.linear(embed, self.emb_projs[0])
            return embed * self.emb_scale

        flat = tokens.reshape(-1)
        out = None
        for i in range(self.n_clusters):
            # Masked, fixed shapes (no host sync, tests/test_sync_free.py): every position looks up
            # every cluster (the others read entry 0) and torch.where keeps its own cluster's row.
            # Costs N x sum(d_i x d_proj) MACs instead of sum(N_i x d_i x d_proj), small beside one
            # layer. Out-of-range ids still reach a lookup and raise. Every parameter stays in the
            # graph (zero gradient for an empty cluster), so DDP needs no find_unused_parameters.
            mask = _cluster_mask(flat, self.ends, i)
            local = torch.where(mask, flat - self.ends[i], torch.zeros_like(flat))
            emb_i = F.linear(self.emb_layers[i](local), self.emb_projs[i])
            out = emb_i if out is None else torch.where(mask[:, None], emb_i.to(out.dtype), out)
        return out.view(*tokens.shape, self.d_proj) * self.emb_scale


class AdaptiveSoftmax(nn.Module):
    """Projected adaptive log-softmax (Grave et al. 2016) with Transformer-XL's projections.

    Parameters mirror AdaptiveEmbedding so they can be tied (see `tie_embeddings`):
    out_weights / out_biases (one [vocab] pair for div_val == 1, else one per cluster),
    out_projs (one [d_proj, d_emb_i] per cluster; none when div_val == 1 and d_proj == d_embed),
    cluster_weight [n_clusters - 1, d_embed] and cluster_bias (the head's tail-cluster logits).
    """

    def __init__(self, vocab_size: int, d_embed: int, d_proj: int, cutoffs: list[int],
                 div_val: int = 1, init_std: float = 0.02, proj_init_std: float = 0.01):
        super().__init__()
        self.ends, self.dims = _cluster_layout(vocab_size, d_embed, d_proj, cutoffs, div_val)
        self.vocab_size, self.d_embed, self.d_proj = vocab_size, d_embed, d_proj
        self.cutoffs, self.div_val = list(cutoffs), div_val
        self.n_clusters = len(self.ends) - 1
        self.shortlist = self.ends[1]  # head = shortlist tokens + one logit per tail cluster

        self.out_weights = nn.ParameterList()
        self.out_biases = nn.ParameterList()
        if div_val == 1:
            # Clusters only split the softmax; their weights are row slices of one matrix.
            self.out_weights.append(nn.Parameter(torch.empty(vocab_size, d_embed)))
            self.out_biases.append(nn.Parameter(torch.zeros(vocab_size)))
        else:
            for i, d_i in enumerate(self.dims):
                size = self.ends[i + 1] - self.ends[i]
                self.out_weights.append(nn.Parameter(torch.empty(size, d_i)))
                self.out_biases.append(nn.Parameter(torch.zeros(size)))
        # As in Transformer-XL, each cluster has its own projection slot even when div_val == 1,
        # so tie_projs can tie the tail projections and leave the head's untied.
        self.out_projs = nn.ParameterList()
        if div_val > 1 or d_proj != d_embed:
            for d_i in self.dims:
                self.out_projs.append(nn.Parameter(torch.empty(d_proj, d_i)))
        if self.n_clusters > 1:
            self.cluster_weight = nn.Parameter(torch.empty(self.n_clusters - 1, d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters - 1))
            nn.init.normal_(self.cluster_weight, 0.0, init_std)
        else:
            self.cluster_weight = self.cluster_bias = None

        for w in self.out_weights:
            nn.init.normal_(w, 0.0, init_std)
        for proj in self.out_projs:
            nn.init.normal_(proj, 0.0, proj_init_std)

    @property
    def head_width(self) -> int:
        """Logits of the head softmax per row: the shortlist and one per tail cluster (the
        whole vocabulary without clusters); what a chunk of rows costs (model/loss.py)."""
        return self.shortlist + self.n_clusters - 1

    def _cluster_params(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(weight, bias) of every cluster. With div_val == 1 they are row blocks of one
        matrix, cut by ONE split: its backward writes the whole [vocab, d] gradient once
        (a cat of the blocks' gradients). Slicing each cluster separately made one
        zero-filled [vocab, d] gradient per cluster, summed afterwards: at WikiText-103's
        267,735 x 410 four fresh 440 MB buffers per step, 21% of a CPU training step at
        batch 2 (benchmarks/bench_lamemo_cost.py --profile), and as many transient
        [vocab, d] buffers on a GPU."""
        if self.div_val != 1 or self.n_clusters == 1:   # whole parameters: no cut at all
            return list(zip(self.out_weights, self.out_biases, strict=True))
        sizes = [hi - lo for lo, hi in zip(self.ends[:-1], self.ends[1:], strict=True)]
        return list(zip(self.out_weights[0].split(sizes), self.out_biases[0].split(sizes),
                        strict=True))

    def _logits(self, hidden: torch.Tensor, i: int,
                params: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Logits of cluster i (for i == 0: shortlist tokens, then one per tail cluster);
        params: `_cluster_params()`, made once per call of the module."""
        weight, bias = params[i]
        if i == 0 and self.n_clusters > 1:
            weight = torch.cat([weight, self.cluster_weight], dim=0)
            bias = torch.cat([bias, self.cluster_bias], dim=0)
        if len(self.out_projs):
            # The (tied) projection maps d_emb_i -> d_proj on the input side, so the output
            # side uses its transpose: hidden [N, d_proj] @ proj [d_proj, d_emb_i].
            hidden = hidden @ self.out_projs[i]
        return F.linear(hidden, weight, bias)

    def _check(self, hidden: torch.Tensor) -> None:
        if hidden.shape[-1] != self.d_proj:
            raise ValueError(f"hidden: last dim must be d_proj={self.d_proj}, got "
                             f"{tuple(hidden.shape)}")

    def nll(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """hidden [N, d_proj], target [N] -> per-token negative log-likelihood [N] (nats).

        Any leading shape works as long as hidden.shape[:-1] == target.shape.
        """
        self._check(hidden)
        if hidden.shape[:-1] != target.shape:
            raise ValueError(f"target: shape {tuple(target.shape)} does not match hidden "
                             f"{tuple(hidden.shape)}")
        shape = target.shape
        hidden, target = hidden.reshape(-1, self.d_proj), target.reshape(-1)
        rows = None
        if self.n_clusters > 1 and target.device.type == "cpu":
            # Targets from the host (the training step passes them so, train/bptt.py):
            # routed there, no device sync (tests/test_sync_free.py).
            rows = _host_cluster_rows(target, self.ends, hidden.device)
        # Targets may come from the host: the gathers read a non-blocking device copy.
        target = target.to(hidden.device, non_blocking=True)
        params = self._cluster_params()
        head_logprob = F.log_softmax(_fp32(self._logits(hidden, 0, params)), dim=-1)
        if self.n_clusters == 1:
            return -head_logprob.gather(1, target[:, None]).squeeze(1).view(shape)

        nll = torch.zeros(target.shape, dtype=head_logprob.dtype, device=head_logprob.device)
        if rows is None:
            # Targets already on a device: `nonzero` makes the host wait once per cluster
            # (callers outside the training step; the same numerics as the host routing).
            rows = [_cluster_mask(target, self.ends, i).nonzero().squeeze(1)
                    for i in range(self.n_clusters)]
        for i, idx in enumerate(rows):
            # Vectorised per cluster: gather the rows whose target lies in cluster i, and only
            # those rows pay for that cluster's logits (the point of Grave et al. 2016).
            # Empty clusters are not skipped, so every parameter gets a (zero) gradient.
            target_i = target[idx] - self.ends[i]
            if i == 0:
                logprob = head_logprob[idx].gather(1, target_i[:, None]).squeeze(1)
            else:
                tail_logprob = F.log_softmax(_fp32(self._logits(hidden[idx], i, params)), dim=-1)
                # log p(token) = log p(cluster i | head) + log p(token | cluster i)
                logprob = (head_logprob[idx, self.shortlist + i - 1]
                           + tail_logprob.gather(1, target_i[:, None]).squeeze(1))
            nll.index_copy_(0, idx, -logprob)
        return nll.view(shape)

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, d_proj] -> full log-distribution [N, vocab_size] (float32 or wider)."""
        self._check(hidden)
        params = self._cluster_params()
        head_logprob = F.log_softmax(_fp32(self._logits(hidden, 0, params)), dim=-1)
        parts = [head_logprob[..., : self.shortlist]]
        for i in range(1, self.n_clusters):
            tail_logprob = F.log_softmax(_fp32(self._logits(hidden, i, params)), dim=-1)
            cluster_logprob = head_logprob[..., self.shortlist + i - 1, None]
            parts.append(cluster_logprob + tail_logprob)
        return torch.cat(parts, dim=-1)


    def forward(self, hidden: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        """nll(hidden, target) if a target is given, else log_probs(hidden).

        Calling the module (rather than the methods) keeps module hooks running.
        """
        return self.log_probs(hidden) if target is None else self.nll(hidden, target)


def tie_embeddings(embedding: AdaptiveEmbedding, softmax: AdaptiveSoftmax,
                   tie_weight: bool, tie_projs: list[bool]) -> None:
    """Share weights (and the projections named by tie_projs; empty list = tie none).

    The softmax's Parameters become the SAME objects as the embedding's, so model.parameters()
    yields them once and the optimizer updates a single copy. Biases stay the softmax's own.
    """
    layout = ("vocab_size", "d_embed", "d_proj", "cutoffs", "div_val")
    for name in layout:
        if getattr(embedding, name) != getattr(softmax, name):
            raise ValueError(f"{name} differs between embedding ({getattr(embedding, name)}) "
                             f"and softmax ({getattr(softmax, name)}); cannot tie")
    tie_projs = list(tie_projs)
    if tie_projs and len(tie_projs) != softmax.n_clusters:
        raise ValueError(f"tie_projs needs one entry per cluster ({softmax.n_clusters}) or "
                         f"none, got {len(tie_projs)}")

    if tie_weight:
        # With div_val == 1 this is the single [vocab, d_embed] matrix; else one per cluster.
        for i, layer in enumerate(embedding.emb_layers):
            softmax.out_weights[i] = layer.weight
    for i, tie in enumerate(tie_projs):
        if not tie or not len(softmax.out_projs):
            continue  # d_proj == d_embed with div_val == 1: there is no projection to tie
        # div_val == 1: the embedding's one projection serves every tied softmax cluster.
        softmax.out_projs[i] = embedding.emb_projs[0 if embedding.div_val == 1 else i]

