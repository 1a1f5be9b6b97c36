"""Tiny random pretrained checkpoints, for rehearsing the commands and for the tests.

    python -m model.pretrained.tiny llama ckpt/tiny-llama     # or gpt2, gemma, mixtral

writes what `save_pretrained` writes for a 2-layer model with random weights and a
50-symbol character tokenizer (lower-case letters, digits, space, newline, punctuation and
the task symbols `_` and `>`; <unk> for the rest), so `memtrain prepare`, `train`, `plan`,
`submit --dry-run`, `eval`, `generate` and `export` run against it exactly as against a real
checkpoint directory. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

V = 32   # the tests' checkpoints: embedding rows (no tokenizer needed)
# The command's tokenizer: every character `memtrain tasks` renders, and plain text.
_SYMBOLS = ["<unk>", " ", "\n", *"abcdefghijklmnopqrstuvwxyz", *"0123456789",
            *".,?!'-:()_>"]


def save_char_tokenizer(path: Path) -> None:
    """A character-level tokenizer of len(_SYMBOLS) entries (lower-cased input)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({s: i for i, s in enumerate(_SYMBOLS)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)


def tiny_gpt2(path: Path, *, d: int = 64, layers: int = 2, tied: bool = True,
              n_positions: int = 64, seed: int = 0, tokenizer: bool = False,
              vocab: int = V) -> Path:
    """GPT-2 family: learned absolute positions, Conv1D projections, tied head."""
    from transformers import GPT2Config, GPT2LMHeadModel
    path = Path(path)
    if not (path / "config.json").exists():
        torch.manual_seed(seed)
        GPT2LMHeadModel(GPT2Config(
            vocab_size=vocab, n_positions=n_positions, n_embd=d, n_layer=layers, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            tie_word_embeddings=tied)).save_pretrained(path)
    if tokenizer and not (path / "tokenizer.json").exists():
        save_char_tokenizer(path)
    return path


def tiny_llama(path: Path, *, d: int = 64, layers: int = 2, tied: bool = False,
               seed: int = 0, tokenizer: bool = False, vocab: int = V) -> Path:
    """Llama family: RoPE, grouped-query attention (4 query heads over 2 KV heads),
    RMSNorm, SwiGLU."""
    from transformers import LlamaConfig, LlamaForCausalLM
    path = Path(path)
    if not (path / "config.json").exists():
        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied)).save_pretrained(path)
    if tokenizer and not (path / "tokenizer.json").exists():
        save_char_tokenizer(path)
    return path


def tiny_gemma(path: Path, *, d: int = 64, layers: int = 2, tied: bool = True,
               seed: int = 0, tokenizer: bool = False, vocab: int = V,
               sliding_window: int = 128, softcap: float = 30.0) -> Path:
    """Gemma 3 family (text): token embeddings scaled by sqrt(d_model) inside the embedding
    module, logits soft-capped (`final_logit_softcapping`, Gemma 2's 30 by default),
    sliding-window layers alternating with global ones, RMSNorm on queries and keys,
    grouped-query attention, GeGLU."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    path = Path(path)
    if not (path / "config.json").exists():
        torch.manual_seed(seed)
        Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=d // 4,
            max_position_embeddings=256, sliding_window=sliding_window,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2)
            + ["sliding_attention"] * (layers % 2),
            final_logit_softcapping=softcap, bos_token_id=0, eos_token_id=0, pad_token_id=0,
            tie_word_embeddings=tied)).save_pretrained(path)
    if tokenizer and not (path / "tokenizer.json").exists():
        save_char_tokenizer(path)
    return path


def tiny_mixtral(path: Path, *, d: int = 64, layers: int = 2, tied: bool = False,
                 seed: int = 0, tokenizer: bool = False, vocab: int = V, experts: int = 4,
                 top_k: int = 2, aux_coef: float = 0.01) -> Path:
    """Mixtral family: a mixture of `experts` SwiGLU experts per layer, `top_k` routed per
    token, whose config asks its forward for the routers' load-balancing loss
    (`output_router_logits`, weight `router_aux_loss_coef`)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    path = Path(path)
    if not (path / "config.json").exists():
        torch.manual_seed(seed)
        MixtralForCausalLM(MixtralConfig(
            vocab_size=vocab, hidden_size=d, intermediate_size=d, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            num_local_experts=experts, num_experts_per_tok=top_k, output_router_logits=True,
            router_aux_loss_coef=aux_coef, bos_token_id=0, eos_token_id=0,
            tie_word_embeddings=tied)).save_pretrained(path)
    if tokenizer and not (path / "tokenizer.json").exists():
        save_char_tokenizer(path)
    return path


TINY = {"gpt2": tiny_gpt2, "llama": tiny_llama, "gemma": tiny_gemma, "mixtral": tiny_mixtral}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model.pretrained.tiny",
                                description="write a tiny random checkpoint + tokenizer")
    p.add_argument("arch", choices=sorted(TINY))
    p.add_argument("out", type=Path)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    TINY[args.arch](args.out, d=args.d_model, layers=args.layers, tokenizer=True,
                    vocab=len(_SYMBOLS))
    print(f"wrote {args.arch} ({args.layers} layers, d_model {args.d_model}, vocabulary "
          f"{len(_SYMBOLS)}) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
