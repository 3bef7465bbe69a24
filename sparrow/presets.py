"""The published schedules (Sparrow paper, DESIGN.md section 1), loadable by name.

Each preset is named `<model>-<tau>`: the schedule calibrated offline so that the 5th percentile of
acceptance stays near tau in every 2000-token bin. Values are total kept KV tokens per bin, written
run-length as in the paper's table.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from sparrow.schedule import Schedule, ScheduleError, parse_compact

PRESET_BINS = 20

_PUBLISHED: dict[str, str] = {
    "qwen3-1.7b-0.75": "512 x2, 768 x2, 1024 x2, 1280 x2, 1536 x12",
    "qwen3-1.7b-0.80": "512, 768, 1024, 1280, 1536 x2, 2048 x3, 2560 x11",
    "qwen3-1.7b-0.83": "512, 1024, 1280, 1536, 2048 x2, 2560 x2, 3072 x12",
    "qwen3-1.7b-0.86": "512, 1024, 1536 x2, 2048, 2560, 3072, 3584 x2, 4096 x11",
    "qwen3-1.7b-0.88": "768, 1280, 2048, 2560 x2, 3072, 3584, 4096 x2, 5120 x11",
    "qwen3-1.7b-0.90": "768, 1536, 2560, 3072, 3584, 4096, 5120 x2, 6144 x12",
    "qwen3-1.7b-0.92": "1024, 2048, 3072, 3584, 4096, 5120, 6144 x2, 7168, 8192 x11",
    "qwen3-1.7b-0.94": "1280, 2560, 3584, 5120, 6144, 7168, 8192 x2, 10240, 12288 x11",
    "qwen3-4b-0.75": "512 x4, 768, 1024, 1280, 1536, 2048 x4, 2560 x6, 3072 x2",
    "qwen3-4b-0.80": "512 x2, 768, 1024, 1280, 1536, 2048, 2560 x3, 3072, 3584 x9",
    "qwen3-4b-0.86": "512, 768, 1024, 1280, 1536, 2048, 2560, 3584, 4096 x2, 5120 x4, 6144 x4, 8192 x2",
    "qwen3-4b-0.88": "512, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 7168 x2, 8192 x3, 10240 x6",
    "qwen3-4b-0.90": "768, 1280, 2048, 2560, 3072, 4096, 5120, 7168, 10240, 12288 x6, 14336 x5",
    "qwen3-4b-0.92": "768, 1536, 2560, 3072, 4096, 6144, 7168, 12288, 14336, 16384 x2, 18432 x9",
    "qwen3-8b-0.75": "512 x3, 768 x2, 1280 x3, 1536 x4, 2048 x6, 2560 x2",
    "qwen3-8b-0.80": "512 x2, 768, 1024, 1280, 1536, 2048 x2, 2560 x2, 3072 x3, 3584 x4, 4096 x3",
    # 6208 is as published (388 pages); it breaks the table's pattern of round values but every rule holds.
    "qwen3-8b-0.86": "512, 768, 1024, 1280, 2048, 2560, 3072, 4096 x4, 5120 x6, 6208, 7168 x2",
    "qwen3-8b-0.87": "512, 1024, 1280, 1536, 2560, 3072, 3584, 5120 x4, 6144 x5, 7168 x2, 8192 x2",
    "qwen3-8b-0.92": "768, 1536, 2048, 3072, 4096, 7168, 8192, 10240, 12288 x3, 14336 x5, 16384 x4",
    "qwen3-14b-0.86": "512, 768, 1280, 2048, 4096, 6144 x10, 8192, 10240 x2, 14336 x2",
}


class UnknownPresetError(ScheduleError):
    """No preset has the requested name."""


def list_presets() -> list[str]:
    """Names of all published presets, in table order."""
    return list(_PUBLISHED)


def get_preset(name: str) -> Schedule:
    """The published schedule `name` (version 1, 2000-token bins, page 16, 1 sink, 2 local, dense layers 0-1)."""
    text = _PUBLISHED.get(name)
    if text is None:
        close = difflib.get_close_matches(name, _PUBLISHED, n=4, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see `sparrow schedule list`"
        raise UnknownPresetError(f"unknown schedule preset {name!r}{hint}")
    return Schedule(budgets=tuple(parse_compact(text)), name=name)


def resolve_schedule(spec: str) -> Schedule:
    """A schedule from a preset name or a JSON file (a spec that exists, ends in .json or holds a `/`)."""
    path = Path(spec)
    if path.suffix == ".json" or "/" in spec or path.exists():
        return Schedule.load(path)
    return get_preset(spec)
