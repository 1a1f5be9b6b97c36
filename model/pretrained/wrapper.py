"""PretrainedMemoryLM: a memory mechanism around a pretrained causal LM.

    emb_τ = E(x_τ)
    (H_τ, state_{τ+1}) = mechanism.pretrained_decode(emb_τ, state_τ)   the base's decoder
    logits_τ = LMHead(H_τ)

The wrapper is mechanism-agnostic: it loads the base model, applies `model.hf.finetune`,
adds the mechanism's parameters (its `pretrained_parameters`, e.g. RMT's initial memory,
ARMT's associative blocks) and hands each segment's embeddings and state to the
mechanism's `pretrained_decode` (model/mechanisms/: RMT's [read | tokens | write] rows,
ARMT's [tokens | memory] rows with hooks around the base's layers). The state is the
mechanism's `MemoryState` (model/memory.py), not detached here: the caller's BPTT windows
cut it, exactly as for the native stack, so the loop, checkpoints, evaluation and
generation run it unchanged. The head and the loss are the base model's: its logits'
post-processing (logits.py) and, for a mixture-of-experts model whose config asks for it,
its routers' load-balancing loss (router.py) as the segment's `aux_loss`, which the
training loss adds (train/bptt.py) as the base model's forward adds it to its own. What
the architecture is was checked once at load (probe.py).
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..fused_loss import fused_rows, linear_head
from ..loss import chunk_rows, cut_logits, logits_nll, padded_head, segment_nll
from ..memory import MemoryState
from ..segment_lm import LMOutput, SegmentLM, add_lm_loss
from .checkpoint_config import check_loaded
from .loading import apply_finetune, load_base
from .logits import lm_logits
from .positions import check_accepts_positions
from .probe import probe
from .regional import compile_decoder_layers
from .router import find_router
from .traits import check_rows, traits_of


class PretrainedMemoryLM(SegmentLM):
    """`base`: an already loaded AutoModelForCausalLM (train/ loads it sharded under
    ZeRO-3); otherwise it is loaded from `cfg.hf`. `memory_scale`: the std of the initial
    memory; by default the std of the base model's input embeddings, which must then be
    materialised (the caller measures it for a sharded base)."""

    def __init__(self, cfg: ModelConfig, base=None, memory_scale: float | None = None):
        super().__init__(cfg)
        base = base if base is not None else load_base(cfg)
        check_accepts_positions(base.base_model)
        apply_finetune(base, cfg.hf)
        if cfg.checkpoint_layers:
            base.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        self.base = base
        self.mechanism = cfg.mech
        # Not in `base`, so apply_finetune leaves them trainable in every mode.
        for name, value in self.mechanism.pretrained_parameters(cfg, base,
                                                                memory_scale).items():
            setattr(self, name, value)
        traits = probe(base)
        check_loaded(cfg, traits)
        self.position_kind = traits.positions
        # Not a submodule: its modules are the base's routers.
        self._router = find_router(base, traits.moe)
        self._router_loss: torch.Tensor | None = None
        if traits.sliding_window:
            # Every mechanism's decoder rows, as they run (Titans interleaves 2L + P).
            base.base_model.register_forward_pre_hook(_window_check(traits, cfg),
                                                      with_kwargs=True)

    def compile_regions(self, backend: str, compile_fn) -> int:
        """`model.compile` around a pretrained model: each decoder layer's forward compiled
        on its own with `compile_fn(fn, backend)` (regional.py; model/compiled.py
        `compile_core` calls this). Returns the number of layers compiled."""
        return compile_decoder_layers(self, backend, compile_fn)

    @property
    def num_mem_tokens(self) -> int:
        return self.mechanism.num_mem_tokens(self.cfg)

    def initial_state(self, batch_size: int, device=None) -> MemoryState:
        return self.mechanism.pretrained_initial_state(self, batch_size, device)

    def trained_parameter_names(self) -> list[str]:
        """What `model.hf.finetune` trains: what an export saves (the rest is the base)."""
        return [n for n, p in self.named_parameters() if p.requires_grad]

    def decode(self, tokens: torch.Tensor, state: MemoryState | None):
        """tokens [B, L] -> (hidden [B, L, d] after the final norm, new state)."""
        if state is None:
            state = self.initial_state(tokens.shape[0], tokens.device)
        emb = self.base.get_input_embeddings()(tokens)
        if self._router is None or not torch.is_grad_enabled():
            return self.mechanism.pretrained_decode(self, emb, state)
        with self._router.routed() as routed:
            hidden, state = self.mechanism.pretrained_decode(self, emb, state)
        # Made here, inside a checkpointed segment's recomputed region (SegmentLM.forward
        # checkpoints `decode`), and read by the `score` that follows this decode: decode
        # returns only (hidden, state).
        self._router_loss = self._router.coef * self._router.balance_loss(routed)
        return hidden, state

    def open_segment(self, state: MemoryState):
        """The open segment of a generation, as the mechanism reads it (RMT and ARMT:
        through the base model's KV cache, only the last position's logits computed,
        incremental.py)."""
        return self.mechanism.pretrained_open_segment(self, state)

    def score(self, hidden, state, targets, loss_mask, return_log_probs) -> LMOutput:
        out = LMOutput(state=state)
        router_loss, self._router_loss = self._router_loss, None
        if return_log_probs:
            out.log_probs = torch.log_softmax(lm_logits(self.base, hidden).float(), dim=-1)
        if targets is None:
            return out
        # The head module is called per chunk of rows (model/loss.py), never on the whole
        # segment at once, so its hooks (a ZeRO-3 gather, a LoRA adapter) run at each
        # chunk's re-run in backward too.
        head = self.base.get_output_embeddings()
        vocab = getattr(head, "out_features", None) or self.base.config.vocab_size
        # One padded [V', d] copy per segment, alive until backward (a step's copies are not
        # shared: an optimizer may change the weight without autograd seeing it).
        padded = padded_head(head, self.cfg.hf.vocab_multiple)
        if padded is None:
            def rows_nll(h, t):
                return logits_nll(lm_logits(self.base, h), t)
        else:   # the head GEMM over a padded vocabulary (model.hf.vocab_multiple)
            def rows_nll(h, t):
                return logits_nll(lm_logits(self.base, h, cut_logits(h, padded, vocab)), t)
        # `model.loss_backend`: on CUDA a fused library where the head is one plain linear
        # layer whose logits the architecture uses as they are; the padded GEMM is chunked.
        steps = traits_of(self.base).logits
        fused = None if padded is not None else fused_rows(
            self.cfg.loss_backend, f"the architecture post-processes its logits {steps}"
            if steps else linear_head(head), hidden)
        nll = segment_nll(rows_nll, hidden, targets, loss_mask, chunk_rows(vocab), fused)
        add_lm_loss(out, nll, loss_mask)
        # The base model's forward adds its weighted load-balancing loss to the loss of
        # every forward given labels (router.py).
        out.aux_loss = router_loss
        return out


def _window_check(traits, cfg):
    def hook(_module, args, kwargs):
        x = kwargs.get("inputs_embeds")
        if x is not None:
            check_rows(traits, x.shape[1], "model.tgt_len",
                       f"a segment of {cfg.mechanism.upper()} (memory and tokens)")
    return hook


def meta_model(cfg: ModelConfig, hf=None):
    """(the base model, the wrapper) of `cfg` built on the meta device from the
    checkpoint's config `hf` (read from `cfg.hf` when not given): shapes only, no memory,
    no weights read (the planner's and the FLOP count's model)."""
    from transformers import AutoModelForCausalLM

    from .checkpoint_config import hf_config
    hf = hf if hf is not None else hf_config(cfg.hf)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(
            hf, attn_implementation=cfg.hf.attn_implementation)
        lm = PretrainedMemoryLM(cfg, base=base, memory_scale=1.0)
    return base, lm
