"""A small, strict, typed configuration system shared by every Stalwart command.

A configuration is a tree of dataclasses. Every field is declared with :func:`option`, which carries
the help text (so ``--help`` is generated from the same place the default lives) and optional range or
choice constraints. Values come from three layers with one precedence rule, CLI > file > defaults,
and the merged result is validated once, after the merge, so every error names the dotted field.

Nothing here knows about training: the simulator, the planner and the trainer all use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from stalwart.errors import UserError

T = TypeVar("T")

_MISSING = dataclasses.MISSING


class ConfigError(UserError, ValueError):
    """A configuration problem a user can fix; the message is one readable line."""


def option(
    help: str,
    default: Any = _MISSING,
    *,
    factory: Any = _MISSING,
    choices: tuple[Any, ...] | None = None,
    min: float | None = None,
    max: float | None = None,
) -> Any:
    """Declare a config field with its documentation and constraints."""
    meta = {"help": help, "choices": choices, "min": min, "max": max}
    if factory is not _MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type[T], help: str) -> Any:
    """Declare a nested section (a dataclass field whose type is another dataclass)."""
    return dataclasses.field(default_factory=cls, metadata={"help": help, "section": True})


# --------------------------------------------------------------------------------------------
# Type handling
# --------------------------------------------------------------------------------------------

def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        (inner,) = get_args(tp)
        return f"list[{_type_name(inner)}]"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str, from_cli: bool) -> Any:
    """Convert ``value`` to ``tp`` or raise a ConfigError naming ``where``."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if type(None) in args and (value is None or (from_cli and str(value).lower() in ("none", "null", ""))):
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where, from_cli)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = get_args(tp)
        if value in allowed:
            return value
        if from_cli:
            for a in allowed:
                if str(a) == str(value):
                    return a
        hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(repr(a) for a in allowed)}{extra}")
    if origin is list:
        (inner,) = get_args(tp)
        if from_cli and isinstance(value, str) and value.strip().startswith("["):  # a JSON list, as in TOML
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConfigError(f"{where}: {value!r} is not a JSON list ({e}); or give the items "
                                  "comma-separated") from None
        elif from_cli and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()] if value.strip() else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, inner, f"{where}[{i}]", from_cli) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str):
            low = value.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if from_cli and isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif from_cli and isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is None:
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(number):  # TOML and float() both accept nan and inf; no setting means either
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if from_cli:
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported config type {tp!r}")


def _check_constraints(value: Any, f: dataclasses.Field, where: str) -> None:
    meta = f.metadata
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(repr(c) for c in choices)}")
    lo, hi = meta.get("min"), meta.get("max")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if lo is not None and value < lo:
            raise ConfigError(f"{where}: {value!r} is below the minimum {lo}")
        if hi is not None and value > hi:
            raise ConfigError(f"{where}: {value!r} is above the maximum {hi}")


# --------------------------------------------------------------------------------------------
# Building a config from nested dicts
# --------------------------------------------------------------------------------------------

def _unknown_key(cls: type, key: str, prefix: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    full = [f"{prefix}{n}" for n in names]
    guess = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    where = f"{prefix}{key}"
    if guess:
        return ConfigError(f"unknown config key '{where}': did you mean '{prefix}{guess[0]}'?")
    return ConfigError(f"unknown config key '{where}'; valid keys here: {', '.join(full)}")


def build(cls: type[T], data: dict[str, Any] | None = None, *, prefix: str = "", from_cli: bool = False) -> T:
    """Build ``cls`` from a nested dict, strictly: unknown keys and wrong types are errors."""
    data = dict(data or {})
    hints = _field_types(cls)
    kwargs: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise _unknown_key(cls, key, prefix)
    for f in dataclasses.fields(cls):
        where = f"{prefix}{f.name}"
        tp = hints[f.name]
        if f.name not in data:
            continue
        value = data[f.name]
        if _is_section(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a section (table), got {value!r}")
            kwargs[f.name] = build(tp, value, prefix=f"{where}.", from_cli=from_cli)
        else:
            value = _coerce(value, tp, where, from_cli)
            _check_constraints(value, f, where)
            kwargs[f.name] = value
    try:
        obj = cls(**kwargs)
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(prefix) or not prefix else f"{prefix.rstrip('.')}: {msg}") from None
    # Defaults are validated too, so a bad default can never slip through.
    for f in dataclasses.fields(cls):
        if not _is_section(hints[f.name]) and f.name not in kwargs:
            _check_constraints(getattr(obj, f.name), f, f"{prefix}{f.name}")
    return obj


def to_dict(obj: Any) -> dict[str, Any]:
    """Nested plain-dict view of a config (None values are dropped: TOML has no null)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        elif value is not None:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


# --------------------------------------------------------------------------------------------
# Layers: file, then dotted CLI overrides
# --------------------------------------------------------------------------------------------

def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Turn ``['--a.b', '1', '--c.d=x']`` into ``[('a.b', '1'), ('c.d', 'x')]``."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"--{key} needs a value")
            value = args[i + 1]
            i += 2
        pairs.append((key.replace("-", "_"), value))
    return pairs


def _set_dotted(tree: dict[str, Any], cls: type, key: str, value: str) -> None:
    parts = key.split(".")
    node, node_cls, prefix = tree, cls, ""
    for i, part in enumerate(parts):
        names = {f.name: f for f in dataclasses.fields(node_cls)}
        if part not in names:
            raise _unknown_key(node_cls, part, prefix)
        tp = _field_types(node_cls)[part]
        last = i == len(parts) - 1
        if _is_section(tp):
            if last:
                raise ConfigError(f"'{prefix}{part}' is a section; set one of its keys, e.g. --{prefix}{part}.<key>")
            node = node.setdefault(part, {})
            node_cls, prefix = tp, f"{prefix}{part}."
        else:
            if not last:
                raise ConfigError(f"'{prefix}{part}' is not a section")
            node[part] = value


def _mark_cli(tree: dict[str, Any], cli: dict[str, Any]) -> dict[str, Any]:
    merged = dict(tree)
    for k, v in cli.items():
        if isinstance(v, dict):
            merged[k] = _mark_cli(merged.get(k, {}) if isinstance(merged.get(k), dict) else {}, v)
        else:
            merged[k] = _CliValue(v)
    return merged


class _CliValue(str):
    """A string that came from the command line (so it may be parsed, e.g. '3' -> 3)."""


def _build_mixed(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    # Values from the CLI are strings to parse; values from TOML are already typed.
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise _unknown_key(cls, key, prefix)
    plain: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp, value, where = hints[f.name], data[f.name], f"{prefix}{f.name}"
        if _is_section(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a section (table), got {value!r}")
            plain[f.name] = _build_mixed(tp, value, f"{where}.")
        else:
            plain[f.name] = _coerce(str(value), tp, where, True) if isinstance(value, _CliValue) else value
    return plain  # type: ignore[return-value]


def load(cls: type[T], file: str | Path | None = None, overrides: list[str] | None = None,
         base: dict[str, Any] | None = None) -> T:
    """Defaults < ``base`` dict < TOML ``file`` < CLI ``overrides``; validated once after merging."""
    tree: dict[str, Any] = _deep_merge({}, base or {})
    if file is not None:
        path = Path(file)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            with path.open("rb") as fh:
                tree = _deep_merge(tree, tomllib.load(fh))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML (not UTF-8 text at byte {e.start})") from None
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read ({e.strerror})") from None
    cli: dict[str, Any] = {}
    for key, value in parse_overrides(overrides or []):
        _set_dotted(cli, cls, key, value)
    tree = _mark_cli(tree, cli)
    plain = _build_mixed(cls, tree)
    return build(cls, plain)


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


__all__ = ["ConfigError", "option", "section", "build", "load", "to_dict", "parse_overrides"]
