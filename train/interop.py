"""Weights in and out in the formats the field shares (docs/coming-from-authors.md).

    memtrain import --state-dict rmt.pt --base ckpt/gpt2 --segment-size 128 --out imported/
    memtrain export --model imported/model.safetensors --format authors --out rmt.pt
    memtrain export --run-dir runs/lora-run --format peft --out adapter/

In: a state dict saved by the RMT authors' Hugging Face wrapper (RecurrentWrapper or
MemoryCell, model/pretrained/authors_format.py states the layout) becomes a model
directory: `base/`, the base checkpoint with the authors' fine-tuned weights
(`save_pretrained`, tokenizer copied from --base), and `model.safetensors`, a memtrain model
file (RMT, `pattern: causal`, the memory) that `memtrain generate`, `export` and a run's
`init_from` read. Out: the authors' layout (their code loads a memtrain-trained model), or a
peft adapter directory (`PeftModel.from_pretrained(base, dir)`) with the memory and a small
config beside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import secrets
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from model import ModelConfig, backbone_of, build_model
from model.io import save_model
from model.pretrained.authors_format import lora_state
from model.registry import by_authors_format
from model.weights_file import WeightsError, check_checkpoint_dir, read_weights

# Buffers older transformers saved in state dicts and current ones rebuild (GPT-2's causal
# mask `attn.bias` / `attn.masked_bias`, RoPE's `inv_freq`): skipped on import, by name.
_REBUILT_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
MEMORY_CONFIG = "memtrain_memory.json"
MEMORY_FILE = "memtrain_memory.safetensors"


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from .safetensors or a torch file (loaded with weights_only: a pickle
    that is not plain tensors is refused rather than executed); a WeightsError, one
    sentence naming the file, for anything else (model/weights_file.py)."""
    return read_weights(path)


def _load_base(base_dir: Path):
    """The --base checkpoint in fp32; what cannot be loaded is refused naming --base."""
    from transformers import AutoModelForCausalLM
    try:
        return AutoModelForCausalLM.from_pretrained(str(base_dir), local_files_only=True,
                                                    dtype=torch.float32)
    except (OSError, ValueError, KeyError, SafetensorError, pickle.UnpicklingError,
            EOFError) as err:
        # transformers' own words, first line: e.g. a model type it does not know, or no
        # weights file in the directory.
        raise WeightsError(f"--base {base_dir}: cannot load it as a causal LM "
                           f"({str(err).splitlines()[0] if str(err) else type(err).__name__})"
                           ) from None


def _written_into(out: Path):
    """A staging directory beside `out` that the import writes into, and the function that
    moves what it holds to `out` once everything is written: a failure part way (a segment
    size the base's positions cannot hold, a full disk) leaves no --out behind. The
    directories above `out` that had to be made are removed again on failure too."""
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    # mkdir, not mkdtemp: the directory gets the user's usual permissions, not 0700.
    staging = out.parent / f".{out.name}.importing-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()

    def publish() -> None:
        if not out.exists():
            os.replace(staging, out)
            return
        # An existing --out is written over, as before: its base/ and model file replaced.
        for item in staging.iterdir():
            target = out / item.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(item, target)
        staging.rmdir()

    def discard() -> None:
        shutil.rmtree(made[-1] if made else staging, ignore_errors=True)

    return staging, publish, discard


def import_authors(state_path: str | Path, base_dir: str | Path, segment_size: int,
                   out: str | Path, fmt: str = "rmt-authors", correction: bool = True) -> dict:
    """A checkpoint of the RMT authors' wrapper (`fmt` "rmt-authors") or of the ARMT
    authors' ("armt-authors") -> a model directory (module docstring). Every base weight
    must be the base model's, of its shape; nothing is left behind silently."""
    out, base_dir = Path(out), Path(base_dir).expanduser()
    if segment_size <= 0:
        raise ValueError(f"--segment-size must be > 0, got {segment_size}")
    mechanism = by_authors_format(fmt)
    try:
        check_checkpoint_dir(base_dir)      # before the state dict: the cheaper look
    except WeightsError as err:
        raise WeightsError(f"--base {err}") from None
    ckpt = mechanism.authors_split(read_state_dict(state_path))
    base_state, memory = ckpt.base_state, ckpt.memory
    base = _load_base(base_dir)
    placement = "follow"
    if ckpt.may_widen_positions:
        placement = _widen_position_table(base, base_state, memory.shape[0])
    skipped = sorted(k for k in base_state if k.endswith(_REBUILT_BUFFERS)
                     and k not in base.state_dict())
    for key in skipped:
        del base_state[key]
    result = base.load_state_dict(base_state, strict=False)
    tied = set(getattr(base, "_tied_weights_keys", None) or ())   # e.g. GPT-2's lm_head
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"{state_path} does not fit the base model at {base_dir}: missing "
                         f"{missing[:8]}, unexpected {result.unexpected_keys[:8]}")
    if memory.shape[1] != base.config.hidden_size:
        raise ValueError(f"the memory is {tuple(memory.shape)} but the base model's width is "
                         f"{base.config.hidden_size}")
    staging, publish, discard = _written_into(out)
    try:
        model = _write_import(base, base_dir, staging, out, segment_size, mechanism, ckpt,
                              correction, placement, extra={"imported_from": str(state_path),
                                                            "imported_format": fmt})
        publish()
    except BaseException:
        discard()
        raise
    return {"imported": str(out / "model.safetensors"), "base": str(out / "base"),
            "format": fmt, "mechanism": model.cfg.mechanism,
            "num_mem_tokens": memory.shape[0], "segment_size": segment_size,
            "base_tensors": len(base_state), "skipped_buffers": skipped,
            **ckpt.facts,
            **({"memory_positions": placement} if ckpt.may_widen_positions else {})}


def _write_import(base, base_dir: Path, staging: Path, out: Path, segment_size: int,
                  mechanism, ckpt, correction: bool, placement: str, extra: dict):
    """`base/` and `model.safetensors` into `staging`; the model file's config names the
    base where it will be, `out`/base."""
    from transformers import AutoTokenizer
    base.save_pretrained(staging / "base")
    with contextlib.suppress(OSError, ValueError, TypeError):   # no tokenizer: ids only
        AutoTokenizer.from_pretrained(str(base_dir), local_files_only=True).save_pretrained(
            staging / "base")
    section = {"backbone": "hf", "tgt_len": segment_size, "mem_len": 0, "dropout": 0.0,
               **mechanism.authors_section(ckpt.memory.shape[0], segment_size,
                                           correction=correction, placement=placement,
                                           **ckpt.facts),
               "hf": {"path": str((staging / "base").resolve()), "finetune": "frozen"}}
    model = build_model(ModelConfig.from_dict(section))
    with torch.no_grad():
        mechanism.authors_load(model, ckpt)
    # Built from the staged base; the file names the base where the import leaves it.
    model.cfg.hf.path = str((out / "base").resolve())
    save_model(model, staging / "model.safetensors", extra=extra)
    return model


def _widen_position_table(base, base_state: dict, m: int) -> str:
    """The ARMT authors' wrap_pos appended m rows to GPT-2's learned position table for the
    memory: give the base that table ("table_end"); otherwise their memory sits at the
    default positions right after the segment ("follow")."""
    emb = getattr(base.base_model, "wpe", None)
    key = next((k for k in base_state if k.endswith("wpe.weight")), None)
    if emb is None or key is None or base_state[key].shape[0] == emb.weight.shape[0]:
        return "follow"
    rows = base_state[key].shape[0]
    if rows != emb.weight.shape[0] + m:
        raise ValueError(f"{key} has {rows} rows; the base has {emb.weight.shape[0]} and "
                         f"wrap_pos adds m = {m}")
    base.base_model.wpe = torch.nn.Embedding(rows, emb.weight.shape[1])
    base.config.n_positions = rows
    return "table_end"


def export_authors(model, out: str | Path) -> Path:
    """The authors' wrapper's state dict (RMT: RecurrentWrapper; ARMT:
    AssociativeRecurrentWrapper; LoRA merged), as a torch file or .safetensors by the name's
    suffix."""
    out = Path(out)
    state = model.cfg.mech.authors_state(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        # Tied weights are one tensor: safetensors wants them stored apart.
        save_file({k: v.contiguous().clone() for k, v in state.items()}, str(out))
    else:
        torch.save(state, str(out))
    return out


def memory_config(model) -> dict:
    cfg = model.cfg
    return {"mechanism": cfg.mechanism, "pattern": cfg.rmt.pattern,
            "num_mem_tokens": cfg.mech.num_mem_tokens(cfg), "segment_length": cfg.tgt_len,
            "base": cfg.hf.path, "base_revision": cfg.hf.revision,
            "memtrain_model_config": cfg.to_dict()}


def export_peft(model, out: str | Path) -> Path:
    """A peft adapter directory (adapter_config.json + adapter_model.safetensors) and, beside
    the adapter, the memory parameters and their config (MEMORY_FILE, MEMORY_CONFIG)."""
    cfg = model.cfg
    if backbone_of(cfg).finetune(cfg) != "lora":
        raise ValueError(f"a peft adapter holds LoRA weights: this model's model.hf.finetune "
                         f"is {cfg.hf.finetune!r} (use --format memtrain or authors)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lora = model.base.peft_config["default"]
    lora.base_model_name_or_path = cfg.hf.path
    lora.save_pretrained(str(out))
    save_file(lora_state(model), str(out / "adapter_model.safetensors"))
    memory = {n: p.detach().float().cpu().contiguous().clone()
              for n, p in model.named_parameters() if not n.startswith("base.")}
    save_file(memory, str(out / MEMORY_FILE))
    (out / MEMORY_CONFIG).write_text(json.dumps(memory_config(model), indent=1) + "\n")
    return out
