"""LaMemo: look-ahead memory (Ji et al. 2022), on the Transformer-XL backbone.

Only the embedding-level memory is a FIFO cache; the memory states of every higher layer are
recomputed each step from it (LaMemo Eq. 7-11). In layer l, with Z = [m^{l-1} ∘ h^{l-1}]:

  (a) causal branch, current rows (paper Eq. 2): C→ = softmax(S→) V,  log s→ = logsumexp S→
  (b) look-ahead branch, memory rows (Eq. 7-9): each memory row attends to the newest N
      positions right of it (the last N-1 memory rows and the first current token):
      C← = softmax_◹(S←) V_win,  log s← = logsumexp S←
  (c) interpolation (Eq. 10-11), in log space so fp16/bf16 exponentials never overflow:
      α = s→ / (s→ + s← + ε) = exp(log s→ − logsumexp(log s→, log s←, log ε))
      C↔ = α · SG(C_mem) + (1 − α) · C←
  (d) state: C_mem ← SG([C↔ ∘ C→])[-M:],  log S_mem ← SG([logaddexp(log S_mem, log s←) ∘
      log s→])[-M:], i.e. every refresh accumulates its window into one softmax over all keys
      seen so far (Appendix A).
Positions (Eq. 12, "disentangled"): the sinusoid always sees |i − j|; direction is carried by
v+ (causal) and v− (look-ahead). pos_enc="xl" uses R_{i−j} with negative distances instead.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...attention import AttnLayout
from ...backbone import Learned, Lengths, RelativeBackbone, causal_allowed
from ...config import ModelConfig
from ...memory import LaMemoMemory, _fifo, _last
from ...positional import distance_list
from ...shapes import AttentionShape, LayerShape, SegmentShapes, TensorShape


class LaMemo(RelativeBackbone):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        # v− of Eq. 12: the only parameter LaMemo adds to Transformer-XL.
        self.rel_v_future = Learned(torch.zeros_like(self.v_bias))
        self.opts = cfg.lamemo
        # Set to a list to record α [B, M, H] per layer and step (LaMemo Fig. 6 analysis).
        self.alpha_log: list[torch.Tensor] | None = None

    @classmethod
    def segment_shapes(cls, cfg: ModelConfig, rows: int, mem_len: int) -> SegmentShapes:
        """Every layer: the causal branch (L queries, K = M + L keys and distances) and the
        look-ahead (M memory queries over min(M, L) keys, M distances; its K, V views of the
        causal call's), whose log-normalisers, α and C← the interpolation saves (Eq. 7-11);
        W_o and the FFN over all M + L rows. The top layer's refresh runs without a graph
        and only its L rows go on. Layer 0 reads the cached embeddings; above, the layer
        below's [memory ∘ segment] output. State: the embeddings, per layer C_mem and fp32
        log S_mem."""
        b, m, n, h, dh = rows, mem_len, cfg.tgt_len, cfg.n_head, cfg.d_head
        k = m + n
        causal = AttentionShape(n, k, k, q_input=n, kv_input=k, mask_per_row=True,
                                need_lse=True)
        log_norm, context = TensorShape((b, m, h), "fp32"), TensorShape((b, m, h, dh))
        mixed = (log_norm, log_norm, log_norm, context, TensorShape((b, m, h), "cast"))
        layers = []
        for i in range(cfg.n_layer):
            top = i == cfg.n_layer - 1
            ahead = AttentionShape(m, min(m, n), m, q_input=m, kv_input=m, mask_per_row=False,
                                   need_lse=True, shares_kv=True, graph=not top,
                                   q_input_is_state=i == 0)
            layers.append(LayerShape(
                (causal, ahead), out_rows=n if top else k, input_rows=n if i == 0 else k,
                input_saved=i == 0, saved=() if top else mixed,
                state_read=() if top else (context, log_norm)))
        state, text = (), "none (mem_len 0)"
        if m:
            state = (TensorShape((b, m, cfg.d_model)),
                     TensorShape((b, m, h, dh), count=cfg.n_layer),
                     TensorShape((b, m, h), "fp32", count=cfg.n_layer))
            text = (f"LaMemo embeddings [{b}, {m}, {cfg.d_model}], {cfg.n_layer} x contexts "
                    f"[{b}, {m}, {h}, {dh}] + fp32 log-normalisers [{b}, {m}, {h}]")
        return SegmentShapes(tuple(layers), distances=2 * m + n, output_rows=n, state=state,
                             state_text=text,
                             saved_label="LaMemo look-ahead log-normalisers, alpha, contexts")

    @property
    def v_bias_future(self) -> nn.Parameter:
        return self.rel_v_future.value

    def bias_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.rel_u(), self.rel_v(), self.rel_v_future()

    def empty_state(self, batch_size: int, device=None) -> LaMemoMemory:
        # Batch-first even when empty: [B, 0, d], so row operations work before step one.
        emb = torch.zeros(batch_size, 0, self.cfg.d_model, device=device)
        return LaMemoMemory(emb=emb, length=torch.zeros(batch_size, dtype=torch.long,
                                                        device=device))

    def forward(self, h0: torch.Tensor, state: LaMemoMemory | None, lengths: Lengths):
        bsz, n_q, _ = h0.shape
        if state is None:
            state = self.empty_state(bsz, h0.device)
        m_now = state.mem_len_now
        dev = h0.device
        allowed = causal_allowed(n_q, m_now, state.length, lengths, dev)
        r_causal = self.r_emb(distance_list(m_now, n_q, 0, m_now + n_q, n_dist=m_now + n_q,
                                            device=dev), lengths, dtype=h0.dtype)
        ahead = self._lookahead_plan(m_now, n_q, lengths, h0.dtype, dev) if m_now else None

        mem = state.emb if m_now else None  # m^0: cached embeddings, already detached
        h = h0
        contexts, log_norms = [], []
        top = len(self.layers) - 1
        bias = self.bias_tensors()
        for i, layer in enumerate(self.layers):
            # Each call takes the layer and its biases, not its index: the same method serves
            # every layer, as one compiled graph when model.compile compiles layer calls.
            u, v_plus = self.biases(i, bias)
            if not m_now:
                # First segment: no memory to refresh, only the causal branch runs; its C→
                # and log s→ initialise the state.
                h, c_all, ln_all = self.run_layer(self._causal_only, layer, u, v_plus, h,
                                                  r_causal, allowed)
            else:
                branch_args = (layer, u, v_plus, self._v_minus(i, bias, v_plus), mem, h,
                               state.context[i], state.log_norm[i], r_causal, allowed, *ahead)
                if i == top:
                    # Nothing reads the top layer's refreshed memory rows, only the state:
                    # skip their output and FFN, and refresh without building a graph.
                    h, c_all, ln_all = self.run_layer(self._top_layer, *branch_args)
                else:
                    mem, h, c_all, ln_all = self.run_layer(self._layer, *branch_args)
            contexts.append(c_all)
            log_norms.append(ln_all)

        keep = lengths.mem_len
        new_state = LaMemoMemory(
            emb=_fifo(state.emb if m_now else None, h0, keep),
            context=[_last(c, keep) for c in contexts],
            log_norm=[_last(s, keep).float() for s in log_norms],
            length=(state.length + n_q).clamp(max=keep),
        )
        return self.drop(h), new_state

    def _lookahead_plan(self, m_now, n_q, lengths, dtype, dev):
        """Window, mask and positions of the look-ahead branch (Eq. 7-9).

        On the key axis [memory ∘ segment] the window is [max(1, M−N+1), M]: the last N−1
        memory rows and the first current token, min(M, N) keys. Every allowed pair has its
        key right of its query (distance i − p < 0), so the distance list skips the
        non-negative distances (skew_start) and the matmul is half as wide.
        """
        win_start = max(1, m_now - n_q + 1)
        n_win = m_now + 1 - win_start
        q_pos = torch.arange(m_now, device=dev)[:, None]
        k_pos = win_start + torch.arange(n_win, device=dev)[None]
        la_allowed = (k_pos > q_pos)[None]
        skew_start = m_now - win_start  # index of distance −1 in the full list
        dist = distance_list(0, m_now, win_start, n_win, device=dev)[skew_start:]
        r_ahead = self.r_emb(dist, lengths, absolute=self.opts.pos_enc == "disentangled",
                             dtype=dtype)
        # For attention recording: memory rows as queries, the window as keys.
        layout = AttnLayout((("memory", m_now), ("segment", n_q)), 0, win_start, "look_ahead")
        return r_ahead, la_allowed, win_start, skew_start, layout

    # ------------------------------------------------------------------ one layer
    def _v_minus(self, i, bias, v_plus):
        """The look-ahead branch's positional bias v− (Eq. 8); the XL RPE ablation uses one
        v for both branches, with signed distances."""
        if self.opts.pos_enc != "disentangled":
            return v_plus
        return self.biases(i, bias, future=True)[1]

    def _causal_only(self, layer, u, v_plus, h, r_causal, allowed):
        k, v = layer.attn.project_kv(h)
        c_fwd, lse_fwd = layer.attn.attend(layer.attn.project_q(h), k, v,
                                           layer.attn.project_r(r_causal), u, v_plus, allowed,
                                           need_lse=True)
        return layer.ff(layer.attn.output(h, c_fwd)), c_fwd, lse_fwd

    def _branches(self, layer, u, v_plus, v_minus, mem, h, c_mem, ln_mem, r_causal, allowed,
                  r_ahead, la_allowed, win_start, skew_start, la_layout, *, top: bool):
        """Causal branch for the current rows, look-ahead + interpolation for the memory rows.
        Returns z = [mem ∘ h], C = [C↔ ∘ C→] and log S = [log S_mem ⊕ log s← ∘ log s→]."""
        m_now = mem.shape[1]
        z = torch.cat([mem, h], dim=1)
        k, v = layer.attn.project_kv(z)
        c_fwd, lse_fwd = layer.attn.attend(layer.attn.project_q(h), k, v,
                                           layer.attn.project_r(r_causal), u, v_plus, allowed,
                                           need_lse=True)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not top):
            win = slice(win_start, m_now + 1)
            c_ahead, lse_ahead = layer.attn.attend(layer.attn.project_q(mem), k[:, win],
                                                   v[:, win], layer.attn.project_r(r_ahead), u,
                                                   v_minus, la_allowed, need_lse=True,
                                                   skew_start=skew_start, layout=la_layout)
            ln_old = ln_mem.float()
            ln_mix = torch.logaddexp(ln_old, lse_ahead)
            if self.opts.interpolate:
                # Eq. 11 in log space: α = s→ / (s→ + s← + ε).
                # A fill on the device (torch.tensor(x, device=) copies from the host and
                # waits for the copy: a sync per layer and step on a GPU; tests/test_sync_free.py).
                log_eps = torch.full((), math.log(self.opts.eps), device=ln_old.device)
                alpha = torch.exp(ln_old - torch.logaddexp(ln_mix, log_eps))
            else:
                alpha = torch.zeros_like(ln_old)
            if self.alpha_log is not None:
                self.alpha_log.append(alpha)
            alpha = alpha.to(c_ahead.dtype)[..., None]
            # Eq. 10: C↔ = α ⊙ sg(C→_old) + (1 − α) ⊙ C←
            c_mix = torch.lerp(c_ahead, c_mem.detach().to(c_ahead.dtype), alpha)
        c_all = torch.cat([c_mix, c_fwd], dim=1)
        return z, c_all, torch.cat([ln_mix, lse_fwd], dim=1)

    def _layer(self, layer, u, v_plus, v_minus, mem, *rest):
        z, c_all, ln_all = self._branches(layer, u, v_plus, v_minus, mem, *rest, top=False)
        # Memory and current rows share W_o, LayerNorm and the FFN: one pass over [mem ∘ h].
        out = layer.ff(layer.attn.output(z, c_all))
        m_now = mem.shape[1]
        return out[:, :m_now], out[:, m_now:], c_all, ln_all

    def _top_layer(self, layer, u, v_plus, v_minus, mem, h, *rest):
        z, c_all, ln_all = self._branches(layer, u, v_plus, v_minus, mem, h, *rest, top=True)
        return layer.ff(layer.attn.output(h, c_all[:, mem.shape[1]:])), c_all, ln_all
