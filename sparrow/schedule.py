"""The dynamic sparsity schedule: a piecewise-constant, non-decreasing map from KV length to KV budget.

Bin `i` covers KV lengths `[i * bin_width, (i + 1) * bin_width)`; the last bin is open-ended. A
bin's budget is the total number of kept KV tokens (sink and local blocks included), a multiple of
the page size. The JSON form is what services exchange and what `sparrow schedule` reads.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparrow.budget import PAGE_SIZE, in_pages, whole_pages

if TYPE_CHECKING:
    import torch

DEFAULT_BIN_WIDTH = 2000
# The wire API (proto/sparrow/v1/common.proto) carries the version as int64 and every other number as
# int32; a schedule it cannot carry would be published, then fail every generator that reports it.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


class ScheduleError(ValueError):
    """A schedule that is malformed or breaks a rule; the message is one line naming the problem."""


@dataclass(frozen=True)
class Schedule:
    """KV budget per length bin, plus the block-selection settings that go with it."""

    budgets: tuple[int, ...]
    bin_width: int = DEFAULT_BIN_WIDTH
    page_size: int = PAGE_SIZE
    sink_blocks: int = 1
    local_blocks: int = 2
    dense_layers: tuple[int, ...] = (0, 1)
    version: int = 1
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "budgets", tuple(self.budgets))
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        self._validate()

    def _validate(self) -> None:
        for name in ("bin_width", "page_size", "sink_blocks", "local_blocks", "version"):
            _require_int(getattr(self, name), name)
            _require_at_most(getattr(self, name), INT64_MAX if name == "version" else INT32_MAX, name)
        if self.bin_width <= 0:
            raise ScheduleError(f"bin_width must be positive, got {self.bin_width}")
        if self.page_size <= 0:
            raise ScheduleError(f"page_size must be positive, got {self.page_size}")
        if self.sink_blocks < 0:
            raise ScheduleError(f"sink_blocks must be >= 0, got {self.sink_blocks}")
        # The block holding the current token is always attended, so at least one local block.
        if self.local_blocks < 1:
            raise ScheduleError(f"local_blocks must be >= 1, got {self.local_blocks}")
        if self.version < 0:
            raise ScheduleError(f"version must be >= 0, got {self.version}")
        if self.name is not None and not isinstance(self.name, str):
            raise ScheduleError(f"name must be a string, got {type(self.name).__name__}")
        if not self.budgets:
            raise ScheduleError("a schedule needs at least one bin")
        floor = (self.sink_blocks + self.local_blocks) * self.page_size
        for i, b in enumerate(self.budgets):
            _require_int(b, f"budget of bin {i}")
            _require_at_most(b, INT32_MAX, f"budget of bin {i}")
            if b <= 0:
                raise ScheduleError(f"budget of bin {i} must be positive, got {b}")
            if not whole_pages(b, self.page_size):
                raise ScheduleError(
                    f"budget of bin {i} ({b} tokens) is not a multiple of the page size {self.page_size}"
                )
            if b < floor:
                raise ScheduleError(
                    f"budget of bin {i} ({b} tokens) is below the {floor} tokens of the sink and local blocks"
                )
            if i and b < self.budgets[i - 1]:
                raise ScheduleError(
                    f"budgets must be non-decreasing: bin {i} has {b} after {self.budgets[i - 1]} in bin {i - 1}"
                )
        for layer in self.dense_layers:
            _require_int(layer, "dense layer index")
            _require_at_most(layer, INT32_MAX, "dense layer indices")
            if layer < 0:
                raise ScheduleError(f"dense layer indices must be >= 0, got {layer}")
        if len(set(self.dense_layers)) != len(self.dense_layers):
            raise ScheduleError(f"dense layer indices must be unique, got {list(self.dense_layers)}")

    @property
    def num_bins(self) -> int:
        """Number of length bins."""
        return len(self.budgets)

    def bin_of(self, kv_len: int) -> int:
        """Index of the bin holding KV length `kv_len` (the last bin takes every longer length)."""
        if kv_len < 0:
            raise ValueError(f"KV length must be >= 0, got {kv_len}")
        return min(kv_len // self.bin_width, self.num_bins - 1)

    def bin_range(self, index: int) -> tuple[int, int | None]:
        """KV lengths `[start, end)` covered by bin `index`; `end` is None for the open last bin."""
        if not 0 <= index < self.num_bins:
            raise IndexError(f"bin {index} out of range 0..{self.num_bins - 1}")
        end = None if index == self.num_bins - 1 else (index + 1) * self.bin_width
        return index * self.bin_width, end

    def budget_for(self, kv_len: int) -> int:
        """Scheduled budget in tokens at KV length `kv_len`.

        Not capped by `kv_len`: a sequence shorter than its budget simply attends densely.
        """
        return self.budgets[self.bin_of(kv_len)]

    def budget_tokens(self, kv_lens: torch.Tensor) -> torch.Tensor:
        """Scheduled budget in tokens for every KV length in `kv_lens` (int64, same shape)."""
        return per_bin(self.budgets, self.bin_width, kv_lens)

    def budget_pages(self, kv_lens: torch.Tensor) -> torch.Tensor:
        """Scheduled budget in pages (blocks) for every KV length in `kv_lens`."""
        return in_pages(self.budget_tokens(kv_lens), self.page_size)

    def with_budgets(self, budgets: list[int] | tuple[int, ...], name: str | None = None) -> Schedule:
        """A new version of this schedule with other budgets (validated like any schedule)."""
        return dataclasses.replace(
            self, budgets=tuple(budgets), version=self.version + 1, name=self.name if name is None else name
        )

    def compact(self) -> str:
        """Budgets as run-length text, e.g. `512 x2, 768, 1024 x17`."""
        return format_compact(self.budgets)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict form, the content of the JSON file."""
        return {
            "name": self.name,
            "version": self.version,
            "bin_width": self.bin_width,
            "page_size": self.page_size,
            "sink_blocks": self.sink_blocks,
            "local_blocks": self.local_blocks,
            "dense_layers": list(self.dense_layers),
            "budgets": list(self.budgets),
        }

    def to_json(self) -> str:
        """JSON text of this schedule."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> Schedule:
        """Build from the dict form; missing, unknown or mistyped fields are ScheduleErrors."""
        if not isinstance(data, dict):
            raise ScheduleError(f"a schedule must be a JSON object, got {_json_type(data)}")
        unknown = sorted(set(data) - set(_FIELD_TYPES))
        if unknown:
            raise ScheduleError(f"unknown field(s) {', '.join(map(repr, unknown))}")
        if "budgets" not in data:
            raise ScheduleError("missing field 'budgets'")
        for key, value in data.items():
            _check_json_type(key, value)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """Parse the JSON form."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScheduleError(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
        except RecursionError:
            raise ScheduleError("malformed JSON: nested too deeply") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        """Read a schedule from a JSON file; errors name the file."""
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ScheduleError(f"cannot read schedule file {path}: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            return cls.from_json(text)
        except ScheduleError as exc:
            raise ScheduleError(f"{path}: {exc}") from None

    def save(self, path: str | Path) -> None:
        """Write this schedule as JSON."""
        Path(path).write_text(self.to_json())


# JSON field -> the type it must have, as named in error messages.
_FIELD_TYPES: dict[str, str] = {
    "name": "a string or null",
    "version": "an integer",
    "bin_width": "an integer",
    "page_size": "an integer",
    "sink_blocks": "an integer",
    "local_blocks": "an integer",
    "dense_layers": "a list of integers",
    "budgets": "a list of integers",
}


def per_bin(values: tuple[int, ...], bin_width: int, kv_lens: torch.Tensor) -> torch.Tensor:
    """`values[bin]` for every KV length in `kv_lens` (int64, same shape; the last bin is open-ended)."""
    import torch  # lazily, so that reading and showing schedules stays quick

    kv = torch.as_tensor(kv_lens)
    if kv.is_floating_point() or kv.dtype == torch.bool:
        raise ValueError(f"KV lengths must be an integer tensor, got {kv.dtype}")
    if kv.numel() and int(kv.min()) < 0:
        raise ValueError("KV lengths must be >= 0")
    table = torch.tensor(values, dtype=torch.int64, device=kv.device)
    index = torch.clamp(torch.div(kv.long(), bin_width, rounding_mode="floor"), max=len(values) - 1)
    return table[index]


def _is_int(value: Any) -> bool:
    # JSON true/false arrive as bool, a subclass of int; they are never a valid count.
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(value: Any, what: str) -> None:
    if not _is_int(value):
        raise ScheduleError(f"{what} must be an integer, got {_json_type(value)} {value!r}")


def _require_at_most(value: int, limit: int, what: str) -> None:
    if value > limit:
        raise ScheduleError(f"{what} must be at most {limit}, got {value}")


def _check_json_type(key: str, value: Any) -> None:
    expected = _FIELD_TYPES[key]
    if expected == "an integer":
        ok = _is_int(value)
    elif expected == "a string or null":
        ok = value is None or isinstance(value, str)
    else:
        ok = isinstance(value, list) and all(_is_int(v) for v in value)
    if not ok:
        raise ScheduleError(f"field '{key}' must be {expected}, got {_json_type(value)} {json.dumps(value)}")


def _json_type(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def format_compact(budgets: list[int] | tuple[int, ...]) -> str:
    """Run-length text of a list of budgets: `[512, 512, 768]` -> `512 x2, 768`."""
    parts: list[str] = []
    i = 0
    while i < len(budgets):
        j = i
        while j < len(budgets) and budgets[j] == budgets[i]:
            j += 1
        parts.append(f"{budgets[i]} x{j - i}" if j - i > 1 else str(budgets[i]))
        i = j
    return ", ".join(parts)


def parse_compact(text: str) -> list[int]:
    """Expand run-length text (`512 x2, 768`) into the list of budgets."""
    budgets: list[int] = []
    for part in text.split(","):
        words = part.split()
        try:
            if len(words) == 1:
                budgets.append(int(words[0]))
                continue
            if len(words) == 2 and words[1].startswith("x"):
                count = int(words[1][1:])
                if count >= 1:
                    budgets.extend([int(words[0])] * count)
                    continue
        except ValueError:
            pass
        raise ScheduleError(f"cannot read {part.strip()!r} in {text!r}: expected 'VALUE' or 'VALUE xCOUNT'")
    return budgets
