"""PretrainedMemoryLM: RMT memory tokens around a pretrained causal LM (Bulatov et al. 2022).

    H̃_τ = [H^mem_τ ∘ E(x_τ) ∘ H^mem_τ]          read block | token embeddings | write block
    [· ∘ H_τ ∘ H^write_τ] = Decoder(H̃_τ)          the base model's own decoder stack
    logits_τ = LMHead(H_τ);  H^mem_{τ+1} := H^write_τ

H^mem_1 is a learned [m, d] matrix. The memory is the native RMT state (model/memory.py
`RMTMemory`), not detached here: the caller's BPTT windows cut it, exactly as for the native
stack, so the loop, checkpoints, evaluation and generation run it unchanged. Positions and
the attention pattern (`model.rmt.pattern`: RMT §3's, or the authors' wrapper's causal one)
are in positions.py. With m = 0 the decoder gets exactly what the base
model's own forward gives it (no mask, default positions): the plain base model, the
baseline without memory.

With `model.mechanism: armt` (Rodkin et al. 2024; model/armt.py is the native forward):

    x^0 = [E(x_τ) ∘ M]                                   tokens, then m memory tokens
    per decoder layer l: x^{l-1} += read_l(A_l, z_l; x^{l-1});  x^l = Layer_l(x^{l-1});
                         (A_l, z_l) <- write_l(A_l, z_l; x^l[M rows])
    logits_τ = LMHead(x^top[tokens])

under the base model's own causal mask, positions by positions.py `armt_position_ids`; the
read and write are hooks around the base model's layers (associative.py). The state is
`AssociativeMemory` (A, z per layer, float32), not detached here either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..armt import associative_layer, memory_token_inputs
from ..associative import AssociativeMemory
from ..backbone import Learned
from ..config import ModelConfig
from ..memory import RMTMemory
from ..segment_lm import LMOutput, SegmentLM
from .associative import associative_pass, decoder_layers_name
from .checkpoint_config import position_kind
from .incremental import CachedSegment
from .loading import apply_finetune, load_base
from .logits import check_logits, lm_logits
from .positions import (
    armt_position_ids,
    check_accepts_positions,
    memory_attention_mask,
    memory_position_ids,
)


class PretrainedMemoryLM(SegmentLM):
    """`base`: an already loaded AutoModelForCausalLM (train/ loads it sharded under
    ZeRO-3); otherwise it is loaded from `cfg.hf`. `memory_scale`: the std of the initial
    memory; by default the std of the base model's input embeddings, which must then be
    materialised (the caller measures it for a sharded base)."""

    def __init__(self, cfg: ModelConfig, base=None, memory_scale: float | None = None):
        super().__init__(cfg)
        base = base if base is not None else load_base(cfg)
        self.position_kind = position_kind(base.config)
        check_accepts_positions(base.base_model)
        apply_finetune(base, cfg.hf)
        if cfg.checkpoint_layers:
            base.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        self.base = base
        m = cfg.rmt.num_mem_tokens
        self.memory_init = None
        if m:
            if memory_scale is None:
                weight = base.get_input_embeddings().weight
                if weight.numel() == 0:
                    raise ValueError("the input embeddings are not materialised (a sharded "
                                     "load): pass memory_scale")
                memory_scale = float(weight.detach().float().std())
            # Drawn at the scale of the pretrained token embeddings the memory sits among.
            self.memory_init = Learned(torch.randn(m, cfg.d_model) * memory_scale)
        self.associative = None
        if cfg.mechanism == "armt":
            # A name, not the module list itself: a second reference to the base's layers
            # would put them in the state dict twice.
            self.layers_name = decoder_layers_name(base)
            # Not in `base`, so apply_finetune leaves them trainable in every mode (memory
            # parameters, like memory_init); W_v = 0 makes them inert at initialisation.
            self.associative = nn.ModuleList(associative_layer(cfg)
                                             for _ in range(cfg.n_layer))
        check_logits(base)

    @property
    def num_mem_tokens(self) -> int:
        return self.cfg.rmt.num_mem_tokens

    def initial_state(self, batch_size: int, device=None) -> RMTMemory | AssociativeMemory:
        if self.associative is not None:   # A = 0, z = 0: every row a fresh document
            b = self.associative[0]
            return AssociativeMemory.zeros(batch_size, self.cfg.n_layer, b.d_phi, b.d_value,
                                           device=device)
        return RMTMemory(tokens=torch.zeros(batch_size, self.num_mem_tokens, self.cfg.d_model,
                                            device=device),
                         fresh=torch.ones(batch_size, dtype=torch.bool, device=device))

    def trained_parameter_names(self) -> list[str]:
        """What `model.hf.finetune` trains: what an export saves (the rest is the base)."""
        return [n for n, p in self.named_parameters() if p.requires_grad]

    def decode(self, tokens: torch.Tensor, state: RMTMemory | None):
        """tokens [B, L] -> (hidden [B, L, d] after the final norm, new RMTMemory)."""
        bsz, n_tok = tokens.shape
        m = self.num_mem_tokens
        if state is None:
            state = self.initial_state(bsz, tokens.device)
        emb = self.base.get_input_embeddings()(tokens)
        if self.associative is not None:
            return self.decode_armt(emb, state)
        if m == 0:
            hidden = self.base.base_model(inputs_embeds=emb, use_cache=False)[0]
            return hidden, RMTMemory(tokens=state.tokens, fresh=torch.zeros_like(state.fresh))
        mem_in = self.memory_inputs(state, bsz, emb.dtype)
        x = torch.cat([mem_in, emb, mem_in], dim=1)
        pattern = self.cfg.rmt.pattern
        positions = memory_position_ids(m, n_tok, self.cfg.tgt_len, tokens.device, pattern)
        mask = memory_attention_mask(m, n_tok, emb.dtype, self.base.config._attn_implementation,
                                     tokens.device, pattern)
        h = self.base.base_model(inputs_embeds=x, attention_mask=mask,
                                 position_ids=positions.expand(bsz, -1), use_cache=False)[0]
        # A copy of the write rows, not a view: a view would keep the whole [B, 2m+L, d]
        # output alive for as long as the memory lives (every segment of a BPTT window).
        write = h[:, m + n_tok:].clone()
        return h[:, m:m + n_tok], RMTMemory(tokens=write, fresh=torch.zeros_like(state.fresh))

    def memory_inputs(self, state: RMTMemory, bsz: int, dtype) -> torch.Tensor:
        """RMT's read (and write) block inputs [B, m, d]: the carried memory, the learned
        initial one in the rows that start a document (`fresh`)."""
        init = self.memory_init().to(dtype)[None].expand(bsz, -1, -1)
        return torch.where(state.fresh[:, None, None], init, state.tokens.to(dtype))

    def open_segment(self, state: RMTMemory | AssociativeMemory) -> CachedSegment:
        """The open segment of a generation read through the base model's KV cache, only
        the last position's logits computed (incremental.py)."""
        return CachedSegment(self, state)

    def decode_armt(self, emb: torch.Tensor, state: AssociativeMemory):
        """token embeddings [B, L, d] -> (hidden [B, L, d] after the final norm, the
        AssociativeMemory after this segment's writes)."""
        bsz, n_tok, _ = emb.shape
        mem = memory_token_inputs(self.memory_init(), state, bsz, self.cfg.armt.carry_tokens,
                                  emb.dtype)
        x = torch.cat([emb, mem], dim=1)
        positions = armt_position_ids(self.num_mem_tokens, n_tok, self.cfg.tgt_len, emb.device,
                                      self.cfg.armt.memory_positions,
                                      self.base.config.max_position_embeddings)
        # An all-ones padding mask: the model's own causal mask, and no packed-sequence
        # split at the positions' jump (positions.py).
        ones = torch.ones(bsz, x.shape[1], dtype=torch.long, device=emb.device)
        layers = self.base.base_model.get_submodule(self.layers_name)
        # With the layers checkpointed (HF gradient checkpointing), the hooks' read and
        # write are too (associative.py).
        ckpt = self.cfg.checkpoint_layers and self.training and torch.is_grad_enabled()
        with associative_pass(layers, self.associative, state, n_tok, ckpt) as writes:
            h = self.base.base_model(inputs_embeds=x, attention_mask=ones,
                                     position_ids=positions.expand(bsz, -1), use_cache=False)[0]
        # Carried write outputs: a copy of the m rows, not a view of the whole output.
        carried = h[:, n_tok:].clone() if self.cfg.armt.carry_tokens else None
        return h[:, :n_tok], writes.state(state, tokens=carried)

    def _forward(self, tokens, state, targets, loss_mask, return_log_probs) -> LMOutput:
        hidden, new_state = self.decode(tokens, state)
        logits = lm_logits(self.base, hidden)
        out = LMOutput(state=new_state)
        if return_log_probs:
            out.log_probs = torch.log_softmax(logits.float(), dim=-1)
        if targets is None:
            return out
        bsz, seg = tokens.shape
        # fp32 log-softmax whatever the model's dtype (bf16 logits lose the NLL's low bits).
        nll = F.cross_entropy(logits.float().reshape(bsz * seg, -1),
                              targets.to(logits.device, non_blocking=True).reshape(-1),
                              reduction="none").view(bsz, seg)
        if loss_mask is None:
            loss_mask = torch.ones_like(nll, dtype=torch.bool)
        out.nll = nll * loss_mask
        out.n_tokens = loss_mask.sum()
        out.loss = out.nll.sum() / out.n_tokens.clamp(min=1)
        return out
