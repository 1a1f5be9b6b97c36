"""Typed construction of dataclass trees from plain dicts, and the error every config raises.

    build_dataclass(RunConfig, yaml.safe_load(text), "")
    build_dataclass(ModelConfig, {"mechanism": "rmt", "rmt": {"num_mem_tokens": 4}}, "model")

One function for every config tree of the project (the model's, the run's): each value is
checked against its field's annotation, nested dataclasses are built recursively, and a bad
value raises `ConfigError` naming the full dotted field, e.g.
`model.rmt.num_mem_tokens: expected an integer, got 'x'`. The dataclasses' own checks
(`__post_init__`) run as they are constructed, innermost first.

It lives in model/, the lowest layer, so that `model.ModelConfig` can use it without
importing train/; train/config.py imports it from here.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the reason."""

    def __init__(self, field_name: str, reason: str):
        self.field, self.reason = field_name, reason
        super().__init__(f"{field_name}: {reason}")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def coerce(value: Any, tp: Any, name: str) -> Any:
    """Check `value` against the annotation `tp` and return it typed (YAML gives ints for
    floats: accepted). `name` is the dotted field, for the error."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, name)
            except ConfigError:
                continue
        raise ConfigError(name, f"expected {' or '.join(_type_name(a) for a in args)}, got "
                          f"{value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if value is None:  # a YAML section with every line commented out: its defaults
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(name, f"expected a mapping of fields, got {value!r}")
        return build_dataclass(tp, value, name)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(name, f"expected a list, got {value!r}")
        (item,) = typing.get_args(tp) or (Any,)
        return [coerce(v, item, f"{name}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(name, f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(name, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # PyYAML (YAML 1.1) reads 1e-4 as a string: it needs "1.0e-4". Accept both.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(name, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(name, f"expected a string, got {value!r}")
        return value
    return value


def build_dataclass(cls, values: dict, prefix: str = ""):
    """`cls(**values)` with every value typed by `coerce`, nested dataclasses included.
    `prefix` is the dotted name of the tree ("" for a root), so errors name the full path."""
    if not isinstance(values, dict):
        raise ConfigError(prefix or cls.__name__, f"expected a mapping of fields, got "
                          f"{values!r}")
    if hasattr(cls, "config_fields"):
        # A tree whose fields depend on what is registered (ModelConfig: one section per
        # registered mechanism) states them itself, from the values given.
        hints = cls.config_fields(values)
        known = set(hints)
    else:
        hints = typing.get_type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in values:
        if key not in known:
            raise ConfigError(_join(prefix, key), f"unknown field; known fields: "
                              f"{', '.join(sorted(known))}")
    return cls(**{k: coerce(v, hints[k], _join(prefix, k)) for k, v in values.items()})


def check_choice(field: str, value, choices) -> None:
    """Refuse `value` of the option `field` (e.g. "model.titans.read_as") unless it is one of
    `choices`, naming them."""
    if value not in choices:
        raise ConfigError(field, f"unknown {value!r}; choose one of {', '.join(choices)}")
