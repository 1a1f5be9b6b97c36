"""The files that ship inside the package, found the same way in a checkout and in an
installed wheel (pyproject.toml, `[tool.setuptools.package-data]`):

    train/configs/*.yaml         the run configs `--config NAME` names (quickstart, ...)
    train/configs/*-shape/       shape-only checkpoint configs some of them point at
    train/ds_config.json         the base DeepSpeed JSON (`deepspeed.config` default)

A checkout keeps `configs/` and `ds_config.json` at its root as links to these, so the
paths the README, docs/ and cluster scripts use (`--config configs/quickstart.yaml`) name
the same files. A relative path in a run config resolves against the working directory
first, then the checkout's root, then the package: `configs/tiny-llama-shape` and
`ds_config.json` are found from any directory, with or without a repository.
"""

from __future__ import annotations

from pathlib import Path

from model.typed import ConfigError

PACKAGE_DIR = Path(__file__).resolve().parent
PROJECT_ROOT = PACKAGE_DIR.parent      # the checkout (in a wheel: site-packages)
SHIPPED_CONFIGS = PACKAGE_DIR / "configs"


def shipped_config_names() -> list[str]:
    """The names `--config` accepts without a path: the YAML files of train/configs/."""
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml"))


def config_file(path: str | Path) -> Path:
    """The YAML file `--config` names: a path (resolved as `resolve_path` does, so
    `configs/quickstart.yaml` works from any directory), or the bare name of a shipped
    config (`quickstart`). ConfigError on `--config` otherwise, listing the shipped names."""
    p = Path(path)
    found = resolve_path(p)
    if found.is_file():
        return found
    shipped = SHIPPED_CONFIGS / f"{p.name.removesuffix('.yaml')}.yaml"
    if p.parent == Path(".") and shipped.is_file():
        return shipped
    raise ConfigError("--config", f"no such file: {path}, nor the name of a shipped config "
                      f"({', '.join(shipped_config_names())})")


def resolve_path(path: str | Path) -> Path:
    """A run config's relative path: against the working directory, then the checkout's
    root, then the package (module docstring). Unfound: the checkout-root path, for the
    error message."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    for root in (PROJECT_ROOT, PACKAGE_DIR):
        if (root / p).exists():
            return root / p
    return PROJECT_ROOT / p


def locate_model_path(tree: dict) -> None:
    """A relative `model.hf.path` that names no directory from here but a shipped one (the
    shape-only folders under configs/) becomes that folder's absolute path: a hub name or
    a directory the working directory holds stays as written."""
    hf = (tree.get("model") or {}).get("hf") if isinstance(tree.get("model"), dict) else None
    path = hf.get("path") if isinstance(hf, dict) else None
    if isinstance(path, str) and path and not Path(path).expanduser().exists():
        found = resolve_path(path)
        if found.is_dir():
            hf["path"] = str(found)
