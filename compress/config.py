"""Validation of plain dicts (parsed YAML) into typed dataclass configs.

Every method config is a dataclass; ``from_dict`` checks unknown keys, types and the
dataclass's own ``validate()`` hook, raising :class:`ConfigError` with the location
(file, step, key) so the user knows exactly what to fix.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any
from compress.errors import UserError


class ConfigError(UserError):
    """A recipe or config problem; the message names the file, the step and the key."""

    def __init__(self, message: str, where: str = ""):
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}" if where else message)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp, where: str) -> Any:
    """Check ``value`` against annotation ``tp`` (a small subset of typing)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        alternatives = [a for a in args if a is not type(None)]
        if len(alternatives) == 1:  # Optional[X]: X's own error, which names the inner key
            return _coerce(value, alternatives[0], where)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"expected {' or '.join(_type_name(a) for a in args)}, got {value!r}", where)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"must be one of {list(allowed)}, got {value!r}", where)
        return value
    if origin in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected a list, got {value!r}", where)
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"expected a mapping, got {value!r}", where)
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"expected true/false, got {value!r}", where)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"expected an integer, got {value!r}", where)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"expected a number, got {value!r}", where)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"expected a string, got {value!r}", where)
        return value
    return value


def from_dict(cls, data: Any, where: str = ""):
    """Build dataclass ``cls`` from ``data``; unknown keys and bad values are ConfigErrors."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping for {cls.__name__}, got {type(data).__name__}", where)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r} for {cls.__name__}; "
                          f"valid keys: {', '.join(sorted(fields))}", f"{where}.{unknown[0]}" if where else unknown[0])
    kwargs = {}
    for name, f in fields.items():
        key_where = f"{where}.{name}" if where else name
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], key_where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required key {name!r} for {cls.__name__}", key_where)
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as exc:
            raise ConfigError(exc.message, f"{where}.{exc.where}" if where and exc.where else (exc.where or where)) from None
        except ValueError as exc:
            raise ConfigError(str(exc), where) from None
    return obj


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def check(condition: bool, key: str, message: str) -> None:
    """For ``validate()`` hooks: raise a ConfigError located at ``key`` unless ``condition``."""
    if not condition:
        raise ConfigError(message, key)
