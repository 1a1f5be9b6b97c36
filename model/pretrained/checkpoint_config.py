"""What a pretrained checkpoint's own config says: the shape ModelConfig takes from it, and
how the architecture encodes positions (the memory position policy is in positions.py).

A local directory (what `save_pretrained` writes, or a GGUF file inside one) loads with no
network; any other `model.hf.path` is a hub name, which transformers resolves through its
cache and, unless HF_HUB_OFFLINE=1, the network. Imports nothing of model/ but the typed
config error: ModelConfig calls `resolve_shape` while it is being built.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from ..typed import ConfigError

# How each supported architecture encodes positions ("absolute": a learned table indexed
# by position id; "rotary": RoPE on queries and keys). Both accept explicit position ids.
POSITION_KINDS = {
    "gpt2": "absolute", "gpt_neo": "absolute", "gpt_bigcode": "absolute",
    "llama": "rotary", "mistral": "rotary", "qwen2": "rotary", "qwen3": "rotary",
    "smollm3": "rotary", "gpt_neox": "rotary", "olmo": "rotary", "olmo2": "rotary",
    "granite": "rotary", "phi3": "rotary",
}


def position_kind(hf_config) -> str:
    """The architecture's position scheme, or a ConfigError naming what is supported."""
    kind = POSITION_KINDS.get(hf_config.model_type)
    if kind is None:
        raise ConfigError("model.hf.path", f"architecture {hf_config.model_type!r} is not "
                          f"supported for memory tokens (its position policy is unstated); "
                          f"supported: {', '.join(sorted(POSITION_KINDS))}")
    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(hf_config, name, None):
            raise ConfigError("model.hf.path", f"{hf_config.model_type!r} post-processes its "
                              f"logits ({name}), which the wrapper does not reproduce")
    return kind


# ModelConfig field -> how it is read from a transformers config.
_SHAPE = {
    "vocab_size": lambda c: c.vocab_size,
    "d_model": lambda c: c.hidden_size,
    "n_layer": lambda c: c.num_hidden_layers,
    "n_head": lambda c: c.num_attention_heads,
    "d_head": lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
    "d_inner": lambda c: (getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None)
                          or 4 * c.hidden_size),
}


def _source(opts) -> dict:
    """from_pretrained arguments naming the checkpoint (ConfigError if it cannot exist)."""
    if not opts.path:
        raise ConfigError("model.hf.path", "a pretrained backbone needs the path of a "
                          "checkpoint directory or a hub name")
    local = Path(opts.path).expanduser()
    kwargs: dict = {"pretrained_model_name_or_path": opts.path}
    if local.is_dir():
        kwargs.update(pretrained_model_name_or_path=str(local), local_files_only=True)
    elif opts.path.startswith((".", "/", "~")) or local.exists():
        raise ConfigError("model.hf.path", f"{opts.path} is not a directory (a local "
                          "checkpoint is the directory save_pretrained writes)")
    if opts.revision:
        kwargs["revision"] = opts.revision
    if opts.gguf_file:
        kwargs["gguf_file"] = opts.gguf_file
    return kwargs


@functools.lru_cache(maxsize=8)
def _hf_config(path: str, revision: str, gguf_file: str):
    from transformers import AutoConfig
    opts = type("Opts", (), {"path": path, "revision": revision, "gguf_file": gguf_file})
    try:
        return AutoConfig.from_pretrained(**_source(opts))
    except (OSError, ValueError) as err:
        raise ConfigError("model.hf.path", f"cannot read the config of {path!r}: "
                          f"{str(err).splitlines()[0]}") from err


def hf_config(opts):
    """The transformers config of `model.hf` (read once per process)."""
    return _hf_config(opts.path, opts.revision, opts.gguf_file)


def resolve_shape(cfg) -> None:
    """Fill ModelConfig's shape fields from the checkpoint's config. A field the user set to
    another value than the checkpoint's is refused by name (nothing is overridden silently);
    a segment that would run past a learned position table is refused too."""
    hf = hf_config(cfg.hf)
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for name, read in _SHAPE.items():
        value = int(read(hf))
        given = getattr(cfg, name)
        if given not in (defaults[name], value):
            raise ConfigError(f"model.{name}", f"is read from the pretrained config "
                              f"({value}); remove it from the config (got {given})")
        setattr(cfg, name, value)
    _check_table(hf, cfg, cfg.tgt_len, "model.tgt_len")


def check_segment_positions(cfg, seg_len: int, option: str) -> None:
    """Refuse a segment length that runs past a learned position table, with a ConfigError
    naming `option` (where the length came from: "seg_len", "eval.tgt_len", "--seg-len").
    Every tool that reads a model at another segment length than `cfg.tgt_len` calls this
    first (a table indexed past its end is an IndexError deep in the base model). Native
    models and rotary positions have no table: nothing to check."""
    if cfg.backbone != "hf":
        return
    _check_table(hf_config(cfg.hf), cfg, seg_len, option)


def _check_table(hf, cfg, seg_len: int, option: str) -> None:
    kind = position_kind(hf)
    limit = getattr(hf, "max_position_embeddings", None)
    mech = cfg.mech
    blocks, m = mech.memory_blocks, mech.num_mem_tokens(cfg)
    need = max_position(m, seg_len, blocks)
    mech.check_positions(cfg, kind, hf.model_type)
    # With ARMT's 'table_end' the memory owns the table's last m rows; the tokens stay
    # below them.
    if kind == "absolute" and limit is not None and need > limit:
        what = "tgt_len" if option.endswith("tgt_len") else "segment length"
        raise ConfigError(option, f"{blocks} x num_mem_tokens + {what} = {need} positions "
                          f"({blocks} x {m} + {seg_len}), beyond the "
                          f"model's learned table of {limit}")


def max_position(m: int, tgt_len: int, blocks: int = 2) -> int:
    """Highest position id a segment of `tgt_len` tokens uses, plus one: RMT's read and
    write blocks (2 x m) or ARMT's memory tokens after the segment (1 x m). A segment
    shorter than the trained length uses no more (positions.py: the memory's positions are
    fixed by the trained length)."""
    return blocks * m + tgt_len
