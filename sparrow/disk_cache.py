"""Figures worth keeping between the processes of one machine: one small JSON file per key.

The folder is `SPARROW_CACHE_DIR`, else `$XDG_CACHE_HOME/sparrow`, else `~/.cache/sparrow`;
`SPARROW_CACHE_DIR=none` turns it off. A file that does not read, holds another key or is older
than the caller allows is a miss; a write that fails is skipped. A cache never stops a run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "SPARROW_CACHE_DIR"


def cache_folder() -> Path | None:
    """Where the cache lives, or None when it is turned off."""
    chosen = os.environ.get(ENV)
    if chosen:
        return None if chosen.lower() == "none" else Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sparrow"


def _path(kind: str, key: dict) -> Path | None:
    folder = cache_folder()
    if folder is None:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return folder / kind / f"{digest}.json"


def load(kind: str, key: dict, max_age_s: float) -> dict | None:
    """The value stored under (`kind`, `key`) at most `max_age_s` ago, or None."""
    path = _path(kind, key)
    if path is None:
        return None
    try:
        entry = json.loads(path.read_text())
        fresh = time.time() - float(entry["written"]) <= max_age_s
        return entry["value"] if fresh and entry["key"] == json.loads(json.dumps(key)) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(kind: str, key: dict, value: dict) -> None:
    """Keep `value` under (`kind`, `key`), replacing what was there (atomically: readers see old or new)."""
    path = _path(kind, key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "value": value, "written": time.time()}))
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("cache %s not written: %s", path, exc)
