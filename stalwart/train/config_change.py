"""A run directory's config, rewritten by every session: what changed since the previous one.

Each session writes the fully resolved config to ``<run>/config.toml`` (so ``--config <run>/config.toml``
relaunches the same job). A session that resumes with different settings replaces it: the previous
file is kept as ``<run>/config.toml.prev`` (the one just replaced; an older one is overwritten), and the
settings that differ are returned, for one printed line and a ``config_changed`` event.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from stalwart.atomic import write_text_atomic

PREVIOUS_SUFFIX = ".prev"
UNSET = "(unset)"  # a setting one of the two configs does not have (written by another version)


def previous_config(config: Path) -> Path:
    """Where the config a changed session replaced is kept: ``config.toml.prev`` beside it."""
    return config.with_name(config.name + PREVIOUS_SUFFIX)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_settings(old: str, new: str) -> dict[str, list[Any]]:
    """``{"section.key": [old value, new value]}`` for every setting that differs between two config
    files' texts (``UNSET`` where one lacks it); ``{"config.toml": ["unreadable", "rewritten"]}`` when
    the old text is not TOML."""
    try:
        a = _flatten(tomllib.loads(old))
    except tomllib.TOMLDecodeError:
        return {"config.toml": ["unreadable", "rewritten"]}
    b = _flatten(tomllib.loads(new))
    return {k: [a.get(k, UNSET), b.get(k, UNSET)] for k in sorted(a.keys() | b.keys())
            if a.get(k, UNSET) != b.get(k, UNSET)}


def replace_config(config: Path, text: str) -> dict[str, list[Any]]:
    """Write ``text`` as the run's config. When a previous config differs in any setting, keep it as
    :func:`previous_config` first and return the changes (:func:`changed_settings`); else ``{}``."""
    try:
        old = config.read_text(encoding="utf-8")
    except FileNotFoundError:
        old = None
    changes = changed_settings(old, text) if old is not None and old != text else {}
    if changes:
        write_text_atomic(previous_config(config), old)
    write_text_atomic(config, text)
    return changes


def describe_changes(changes: dict[str, list[Any]], config: Path) -> str:
    """One line naming each changed setting, old -> new, and where the previous config was kept."""
    def show(v: Any) -> str:
        return v if v == UNSET else repr(v)

    listed = ", ".join(f"{k} {show(old)} -> {show(new)}" for k, (old, new) in changes.items())
    return (f"config changed since the previous session of this run: {listed} (previous config kept as "
            f"{previous_config(config)})")
