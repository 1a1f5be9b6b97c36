"""What a pretrained checkpoint's own config says: the shape ModelConfig takes from it, and
how the architecture encodes positions (traits.py; the memory position policy is in
positions.py).

A local directory (what `save_pretrained` writes, or a GGUF file inside one) loads with no
network; any other `model.hf.path` is a hub name, which transformers resolves through its
cache and, unless HF_HUB_OFFLINE=1, the network. Reading it is a step of its own, after a
ModelConfig is built (which reads nothing): `resolve_shape`, through the backbone interface
(model/backbones/).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from memtrain.extras import missing_extra

from ..typed import ConfigError
from ..weights_file import WeightsError, check_checkpoint_dir
from .traits import Traits, check_rows, config_traits, d_inner


def position_kind(hf_config) -> str:
    """The architecture's position scheme as its config states it (traits.py; the loaded
    model's probe has the last word), or a ConfigError naming what cannot hold memory."""
    return config_traits(hf_config).positions


def _head_dim(c) -> int | None:
    try:
        return getattr(c, "head_dim", None)
    except Exception:    # noqa: BLE001 (Gemma 4: a per-layer field, refused as a global one)
        return None


# ModelConfig field -> how it is read from a transformers config (its attribute_map gives
# every supported family the Llama names: hidden_size, num_hidden_layers, ...).
_SHAPE = {
    "vocab_size": lambda c: c.vocab_size,
    "d_model": lambda c: c.hidden_size,
    "n_layer": lambda c: c.num_hidden_layers,
    "n_head": lambda c: c.num_attention_heads,
    "d_head": lambda c: _head_dim(c) or c.hidden_size // c.num_attention_heads,
    "d_inner": d_inner,
}
SHAPE_FIELDS = tuple(_SHAPE)


def require_shape(cfg, what: str) -> None:
    """A ConfigError unless the shape of `cfg` was read from its checkpoint
    (`resolve_shape`): the defaults of the shape fields (vocab_size 256, d_model 64, ...)
    are no pretrained model's, and nothing may use them silently."""
    if not cfg.hf.model_type:
        raise ConfigError("model.hf.path", f"{what} need the shape of the pretrained "
                          f"checkpoint {cfg.hf.path!r}, which was not read yet: read it first "
                          "(model.backbones.resolve_shape; load_config and build_model do)")


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
        # A path, not a hub name: say whether it is missing or a file.
        checked_dir(opts)
    if opts.revision:
        kwargs["revision"] = opts.revision
    if opts.gguf_file:
        problem = missing_extra("gguf")
        if problem:
            raise ConfigError("model.hf.gguf_file", problem)
        kwargs["gguf_file"] = opts.gguf_file
    return kwargs


def checked_dir(opts) -> None:
    """A local `model.hf.path` as the directory save_pretrained writes: there, with a
    config.json that is JSON (or the GGUF file `model.hf.gguf_file`), its safetensors
    headers readable; a ConfigError naming what it is not (model/weights_file.py). A hub
    name is left to transformers."""
    try:
        check_checkpoint_dir(opts.path, opts.gguf_file)
    except WeightsError as err:
        raise ConfigError("model.hf.path", str(err)) from None


@functools.lru_cache(maxsize=8)
def _hf_config(path: str, revision: str, gguf_file: str):
    from transformers import AutoConfig
    opts = type("Opts", (), {"path": path, "revision": revision, "gguf_file": gguf_file})
    source = _source(opts)   # its ConfigError names its own field
    if source.get("local_files_only"):
        checked_dir(opts)
    try:
        return AutoConfig.from_pretrained(**source)
    except (OSError, ValueError) as err:
        raise ConfigError("model.hf.path", f"cannot read the config of {path!r}: "
                          f"{str(err).splitlines()[0]}") from err


def hf_config(opts):
    """The transformers config of `model.hf` (read once per process)."""
    return _hf_config(opts.path, opts.revision, opts.gguf_file)


def resolve_shape(cfg):
    """Fill ModelConfig's shape fields (and `model.hf.model_type`, which marks them read)
    from the checkpoint's config, and validate the config again with them. A field the user
    set to another value than the checkpoint's is refused by name (nothing is overridden
    silently); a segment that would run past a learned position table is refused too.
    Returns `cfg`, changed in place; reading an already read config again checks it."""
    hf = hf_config(cfg.hf)
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    read = {name: int(how(hf)) for name, how in _SHAPE.items()}
    for name, value in read.items():
        given = getattr(cfg, name)
        if given not in (defaults[name], value):
            raise ConfigError(f"model.{name}", f"is read from the pretrained config "
                              f"({value}); remove it from the config (got {given})")
    if cfg.hf.model_type not in ("", hf.model_type):
        raise ConfigError("model.hf.model_type", f"is read from the pretrained config "
                          f"({hf.model_type!r}); remove it from the config (got "
                          f"{cfg.hf.model_type!r})")
    _check_table(hf, cfg, cfg.tgt_len, "model.tgt_len")
    for name, value in read.items():
        setattr(cfg, name, value)
    cfg.hf.model_type = hf.model_type
    cfg.validate()
    return cfg


def check_segment_positions(cfg, seg_len: int, option: str) -> None:
    """Refuse a segment length that runs past a learned position table, with a ConfigError
    naming `option` (where the length came from: "seg_len", "eval.tgt_len", "--seg-len").
    Every tool that reads a model at another segment length than `cfg.tgt_len` asks its
    backbone first (model/backbones/: a table indexed past its end is an IndexError deep in
    the base model). Rotary positions have no table: nothing to check."""
    _check_table(hf_config(cfg.hf), cfg, seg_len, option)


def check_loaded(cfg, traits) -> None:
    """`resolve_shape`'s position checks again with what the loaded model's probe found
    (probe.py), which may correct the config's guess."""
    _check_table(traits, cfg, cfg.tgt_len, "model.tgt_len")


def _check_table(hf, cfg, seg_len: int, option: str) -> None:
    """`hf`: the checkpoint's config, or the loaded model's probed traits."""
    traits = hf if isinstance(hf, Traits) else config_traits(hf)
    kind = traits.positions
    if kind == "sequence":
        from .traits import refuse_sequence_positions
        raise refuse_sequence_positions(traits.model_type, "its config names ALiBi")
    limit = traits.table or None
    mech = cfg.mech
    blocks, m = mech.memory_blocks, mech.num_mem_tokens(cfg)
    need = max_position(m, seg_len, blocks)
    mech.check_positions(cfg, kind, traits.model_type)
    # Rows through the decoder: at least the positions' span (Titans interleaves more;
    # the wrapper checks the rows it runs, wrapper.py).
    what = "tgt_len" if option.endswith("tgt_len") else "segment length"
    check_rows(traits, need, option, f"{blocks} x num_mem_tokens + {what}")
    # With ARMT's 'table_end' the memory owns the table's last m rows; the tokens stay
    # below them.
    if kind == "absolute" and limit is not None and need > limit:
        raise ConfigError(option, f"{blocks} x num_mem_tokens + {what} = {need} positions "
                          f"({blocks} x {m} + {seg_len}), beyond the "
                          f"model's learned table of {limit}")


def max_position(m: int, tgt_len: int, blocks: int = 2) -> int:
    """Highest position id a segment of `tgt_len` tokens uses, plus one: RMT's read and
    write blocks (2 x m) or ARMT's memory tokens after the segment (1 x m). A segment
    shorter than the trained length uses no more (positions.py: the memory's positions are
    fixed by the trained length)."""
    return blocks * m + tgt_len
