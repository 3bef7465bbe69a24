"""Writing config dicts as TOML (tomllib only reads): scalars, lists of scalars, nested tables.

TOML has no null: a None value is left out, and the caller checks by reading the text back that
nothing changed meaning (a field whose default is not None cannot be set to None through a file).
"""

from __future__ import annotations

import json
import math
from typing import Any


def to_toml(data: dict[str, Any], header: str = "") -> str:
    """TOML text of `data` (top-level keys first, then one table per nested dict); `header` as # comments."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    _table(data, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _table(data: dict[str, Any], path: list[str], lines: list[str]) -> None:
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict) and v is not None}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    if path and (scalars or not tables):
        lines += ["", f"[{'.'.join(_key(p) for p in path)}]"]
    lines += [f"{_key(k)} = {_value(v)}" for k, v in scalars.items()]
    for key, sub in tables.items():
        _table(sub, [*path, key], lines)


def _key(key: str) -> str:
    bare = key and all(c.isalnum() or c in "-_" for c in key) and key.isascii()
    return key if bare else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # JSON's escapes are valid in TOML basic strings; TOML also wants DEL escaped.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")
