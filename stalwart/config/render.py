"""Rendering a config: TOML that loads back to an equal object, and the text of ``--help``."""

from __future__ import annotations

import dataclasses
from typing import Any

from stalwart.config.core import _field_types, _is_section, _type_name, to_dict

# --------------------------------------------------------------------------------------------

def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(obj: Any) -> str:
    """Write a config as TOML that :func:`load` reads back to an equal object."""
    lines: list[str] = []

    def emit(d: dict[str, Any], name: str) -> None:
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict)}
        tables = {k: v for k, v in d.items() if isinstance(v, dict)}
        if name and scalars:
            lines.append(f"[{name}]")
        for k, v in scalars.items():
            lines.append(f"{k} = {_toml_value(v)}")
        if scalars:
            lines.append("")
        for k, v in tables.items():
            emit(v, f"{name}.{k}" if name else k)

    emit(to_dict(obj), "")
    return "\n".join(lines).rstrip() + "\n"


def help_text(cls: type, prefix: str = "") -> str:
    """Every field, its type, default and documentation: the body of ``--help``."""
    lines: list[str] = []
    hints = _field_types(cls)
    inst = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            lines.append("")
            lines.append(f"[{prefix}{f.name}]  {f.metadata.get('help', '')}")
            lines.append(help_text(tp, f"{prefix}{f.name}."))
            continue
        default = getattr(inst, f.name)
        extra = []
        if f.metadata.get("min") is not None:
            extra.append(f">= {f.metadata['min']}")
        if f.metadata.get("max") is not None:
            extra.append(f"<= {f.metadata['max']}")
        if f.metadata.get("choices"):
            extra.append("one of " + ", ".join(repr(c) for c in f.metadata["choices"]))
        cons = f"; {', '.join(extra)}" if extra else ""
        lines.append(f"  --{prefix}{f.name} ({_type_name(tp)}, default {default!r}{cons})")
        lines.append(f"      {f.metadata.get('help', '(undocumented)')}")
    return "\n".join(lines)


def undocumented_fields(cls: type, prefix: str = "") -> list[str]:
    """Fields without help text; a test keeps this list empty."""
    missing = []
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("help"):
            missing.append(f"{prefix}{f.name}")
        if _is_section(hints[f.name]):
            missing += undocumented_fields(hints[f.name], f"{prefix}{f.name}.")
    return missing
