"""Printing results: JSON for machines, aligned text for people."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit_json(payload: Any) -> None:
    """Print `payload` as one JSON document on stdout."""
    json.dump(payload, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def table(rows: list[list[str]], header: list[str]) -> str:
    """A plain text table with columns padded to their widest cell."""
    cells = [header] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
