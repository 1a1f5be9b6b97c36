"""Reading the weights files and checkpoint directories people hand memtrain, refusing what
they are not in one sentence.

Every place that takes a weights file or a pretrained checkpoint directory from a user
(`memtrain import --state-dict/--base`, a model file for `export`/`generate`/`init_from`,
`model.hf.path`) reads it through here, so a text file named `.pt`, a pickled nn.Module, a
truncated safetensors file or a directory that is not there is refused the same way
everywhere: a WeightsError naming the path and what it is not. It is a ValueError, so the
commands print it as their one line on stderr with exit code 2 (memtrain/command_line.py).

A leaf: torch, safetensors and the standard library only, so model/pretrained/ and
model/io.py both import it without an import cycle.
"""

from __future__ import annotations

import importlib
import json
import pickle
import re
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

__all__ = ["WeightsError", "check_checkpoint_dir", "is_torch_file", "read_safetensors",
           "read_weights", "safetensors_metadata", "torch_load"]

_ZIP_MAGIC = b"PK\x03\x04"     # what torch.save has written since PyTorch 1.6
_PICKLE_PROTO = b"\x80"        # a legacy torch.save file starts with a pickle's PROTO
# The wrappers training scripts put around a state dict ({"state_dict": ...}); unwrapped
# when they are the dict's only key.
_WRAPPERS = ("state_dict", "model_state_dict", "model")


class WeightsError(ValueError):
    """A file or directory handed to memtrain as weights that cannot be read as such; the
    message names the path and what it is not."""


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split("\n", 1)[0].split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _head(path: Path, n: int = 16) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _existing_file(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise WeightsError(f"{path}: no such file")
    if path.is_dir():
        raise WeightsError(f"{path} is a directory, not a weights file")
    if path.stat().st_size == 0:
        raise WeightsError(f"{path} is empty, not a weights file")
    return path


def is_torch_file(path: str | Path) -> bool:
    """Whether the file starts as torch.save writes (a zip archive or a legacy pickle)."""
    try:
        head = _head(Path(path).expanduser())
    except OSError:
        return False
    if head[8:9] == b"{":
        return False    # a safetensors file: an 8-byte header length, then the JSON header
    return head.startswith(_ZIP_MAGIC) or head[:1] == _PICKLE_PROTO and head[1:2] in (
        b"\x02", b"\x03", b"\x04", b"\x05")


def _not_a_checkpoint(path: Path, err: BaseException) -> WeightsError:
    head = _head(path)
    if is_torch_file(path):
        why = _first_line(err)
    else:
        # torch.load's own error for these is a bare KeyError or IndexError from deep in
        # its legacy reader; what the file starts with says more.
        why = f"it starts with {head[:8]!r}, neither a zip archive nor a pickle"
    return WeightsError(f"{path} is not a PyTorch checkpoint (torch.load could not read it: "
                        f"{why})")


def _is_module_class(name: str) -> bool:
    """Whether the global `name` (module.Class) a pickle refers to is an nn.Module class.
    Only modules already imported or of the libraries a model comes from are looked at:
    importing a module a file names is running its code."""
    module, _, attr = name.rpartition(".")
    if module not in sys.modules and module.split(".")[0] not in ("torch", "transformers"):
        return False
    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception:  # noqa: BLE001 (any failure: not known to be a module class)
        return False
    return isinstance(cls, type) and issubclass(cls, torch.nn.Module)


def _pickled_objects(path: Path, err: pickle.UnpicklingError) -> WeightsError | None:
    """The refusal of a torch file whose pickle holds objects beyond tensors (torch.load
    with weights_only refuses to build them, rather than run code from the file), or None
    when `err` is not that."""
    names = re.findall(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
    if not names:
        return None
    if _is_module_class(names[0]):
        return WeightsError(f"{path} is a pickled nn.Module ({names[0]}), not a state dict: "
                            "save model.state_dict()")
    return WeightsError(f"{path} holds pickled objects ({names[0]}), not a state dict of "
                        "tensors: save model.state_dict() (memtrain does not run code from "
                        "a weights file)")


def torch_load(path: str | Path, weights_only: bool = True):
    """torch.load on the CPU, its failures as WeightsError. weights_only (the default)
    refuses a pickle that is not plain tensors and containers instead of running it."""
    path = _existing_file(path)
    try:
        return torch.load(str(path), map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as err:
        raise (_pickled_objects(path, err) or _not_a_checkpoint(path, err)) from None
    except (OSError, RuntimeError, EOFError, KeyError, IndexError, ValueError,
            TypeError, AttributeError) as err:
        # What a file that is not a torch checkpoint makes torch.load raise, by what its
        # bytes happen to be (a pickle of something else, a truncated zip, plain text).
        if isinstance(err, OSError) and err.filename:
            raise                          # the file cannot be opened at all: permissions
        raise _not_a_checkpoint(path, err) from None


def _not_safetensors(path: Path, err: BaseException) -> WeightsError:
    hint = ""
    if is_torch_file(path):
        hint = "; it is a PyTorch checkpoint (torch.save): name it .pt"
    return WeightsError(f"{path} is not a safetensors file ({_first_line(err)}{hint})")


def safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The metadata of a safetensors file's header (its tensors are not read)."""
    path = _existing_file(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as err:
        raise _not_safetensors(path, err) from None


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    path = _existing_file(path)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise _not_safetensors(path, err) from None


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A flat state dict {name: tensor} from a .safetensors file (by its suffix) or a torch
    file (.pt/.bin/.pth: torch.save's zip or legacy pickle, loaded with weights_only). A
    dict whose one key is "state_dict", "model_state_dict" or "model" is unwrapped."""
    path = Path(path).expanduser()
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    state = torch_load(path)
    for wrapper in _WRAPPERS:
        if isinstance(state, dict) and set(state) == {wrapper}:
            state = state[wrapper]
    if not isinstance(state, dict):
        raise WeightsError(f"{path} holds a {type(state).__name__}, not a state dict of "
                           "tensors: save model.state_dict()")
    other = [k for k, v in state.items() if not torch.is_tensor(v)]
    if other or not state:
        what = (f"its entries {[str(k) for k in other[:4]]} are not tensors" if other
                else "it is an empty dict")
        raise WeightsError(f"{path} holds no flat state dict of tensors ({what}): save "
                           "model.state_dict()")
    return state


def check_checkpoint_dir(path: str | Path, gguf_file: str = "") -> Path:
    """`path` as the directory a pretrained checkpoint's save_pretrained wrote: it exists,
    holds config.json that is a JSON object (or the GGUF file `gguf_file`, which carries
    its config), its safetensors weights have readable headers and its torch weights
    (pytorch_model*.bin) start as torch.save writes (the tensors are not read: a large
    model's would take minutes)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise WeightsError(f"{path}: no such directory")
    if not path.is_dir():
        raise WeightsError(f"{path} is not a directory (a pretrained checkpoint is the "
                           "directory save_pretrained writes)")
    if gguf_file:
        if not (path / gguf_file).is_file():
            raise WeightsError(f"{path} holds no GGUF file {gguf_file!r}")
        return path
    config = path / "config.json"
    if not config.is_file():
        raise WeightsError(f"{path} holds no config.json: not a checkpoint directory "
                           "save_pretrained wrote")
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise WeightsError(f"{config} is not JSON ({_first_line(err)})") from None
    if not isinstance(parsed, dict):
        raise WeightsError(f"{config} holds a JSON {type(parsed).__name__}, not a model "
                           "config (a JSON object)")
    for weights in sorted(path.glob("*.safetensors")):
        safetensors_metadata(weights)
    for weights in sorted(path.glob("pytorch_model*.bin")):
        if not is_torch_file(weights):   # what torch.load would fail on, from its start
            raise _not_a_checkpoint(weights, ValueError("not read"))
    return path
