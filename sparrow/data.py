"""Loading user prompt sets from JSONL or Parquet files (pure Python; pyarrow only for Parquet).

Every row needs a prompt (a non-empty string) and may carry an answer (a string or a number). A
row that breaks this is reported with its line number (JSONL) or row number (Parquet, from 1) and,
by the caller's choice, skipped or made fatal; skipped rows come back with the prompts, so nothing
is dropped silently. A set left without prompts is an error.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
BAD_ROW_POLICIES = ("skip", "stop")


class DataError(ValueError):
    """A prompt file that cannot be used; one line naming the file (and the row, where one is at fault)."""


@dataclass(frozen=True)
class PromptRow:
    """One usable row: its prompt, its answer if any, and where it came from."""

    prompt: str
    answer: str | None
    line: int  # JSONL line number, or Parquet row number, counted from 1


@dataclass(frozen=True)
class BadRow:
    """A row that was skipped, and why."""

    line: int  # JSONL line number, or Parquet row number, counted from 1
    reason: str
    unit: str = "line"  # "row" for Parquet

    def __str__(self) -> str:
        return f"{self.unit} {self.line}: {self.reason}"


@dataclass
class PromptSet:
    """The usable rows of a prompt file and the report of every row skipped."""

    path: Path
    rows: list[PromptRow]
    skipped: list[BadRow] = field(default_factory=list)

    @property
    def prompts(self) -> list[str]:
        """The prompts, in file order."""
        return [r.prompt for r in self.rows]


def load_prompts(
    path: str | Path,
    on_bad_row: str = "stop",
    prompt_field: str = "prompt",
    answer_field: str = "answer",
) -> PromptSet:
    """Read a `.jsonl` or `.parquet` prompt file.

    `on_bad_row`: "stop" raises DataError at the first bad row; "skip" leaves it out and reports it
    in `PromptSet.skipped`. An unreadable file, an unknown format or no usable row at all is a
    DataError either way.
    """
    if on_bad_row not in BAD_ROW_POLICIES:
        raise ValueError(f"on_bad_row must be one of {BAD_ROW_POLICIES}, got {on_bad_row!r}")
    file = Path(path)
    if not file.is_file():
        raise DataError(f"{file}: no such prompt file")
    suffix = file.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        records, unit = _jsonl_records(file), "line"
    elif suffix in PARQUET_SUFFIXES:
        records, unit = _parquet_records(file, prompt_field), "row"
    else:
        raise DataError(f"{file}: unknown prompt file type {suffix!r}; expected .jsonl or .parquet")
    result = PromptSet(path=file, rows=[])
    for line, record in records:
        row = _parse_row(line, record, prompt_field, answer_field, unit)
        if isinstance(row, PromptRow):
            result.rows.append(row)
        elif on_bad_row == "stop":
            raise DataError(f"{file} {row} (pass on_bad_row='skip' / --on-bad-row skip to skip bad rows)")
        else:
            result.skipped.append(row)
    if not result.rows:
        note = f" ({len(result.skipped)} bad rows skipped, the first at {result.skipped[0]})" if result.skipped else ""
        raise DataError(f"{file}: no prompts in the file{note}")
    return result


# A record is what a row holds before checking: a decoded JSON value, or a BadRow when decoding failed.
Record = Any


def _jsonl_records(file: Path) -> list[tuple[int, Record]]:
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{file}: cannot read the file: {getattr(exc, 'strerror', None) or exc}") from None
    records: list[tuple[int, Record]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            records.append((number, BadRow(number, "empty line")))
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            records.append((number, BadRow(number, f"not valid JSON ({exc.msg} at column {exc.colno})")))
    return records


def _parquet_records(file: Path, prompt_field: str) -> list[tuple[int, Record]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{file}: reading Parquet needs pyarrow, which is not installed (pip install pyarrow), "
            "or convert the file to JSONL"
        ) from None
    try:
        table = pq.read_table(file)
    except Exception as exc:  # pyarrow raises several types for broken files
        raise DataError(f"{file}: not a readable Parquet file ({exc})") from None
    if prompt_field not in table.column_names:
        raise DataError(f"{file}: no {prompt_field!r} column (columns: {', '.join(table.column_names)})")
    return list(enumerate(table.to_pylist(), start=1))


def _parse_row(line: int, record: Record, prompt_field: str, answer_field: str, unit: str) -> PromptRow | BadRow:
    if isinstance(record, BadRow):
        return record
    bad = functools.partial(BadRow, line, unit=unit)
    if not isinstance(record, dict):
        return bad(f"expected an object with a {prompt_field!r} field, got {type(record).__name__}")
    if prompt_field not in record:
        return bad(f"missing field {prompt_field!r}")
    prompt = record[prompt_field]
    if not isinstance(prompt, str) or not prompt.strip():
        return bad(f"field {prompt_field!r} must be a non-empty string, got {_describe(prompt)}")
    answer = record.get(answer_field)
    if answer is not None:
        # bool is an int subclass, and NaN/inf are no answer anyone can match
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            return bad(f"field {answer_field!r} must be a string or a number, got {_describe(answer)}")
        if isinstance(answer, float) and not math.isfinite(answer):
            return bad(f"field {answer_field!r} is {answer}")
        answer = str(answer)
    return PromptRow(prompt=prompt, answer=answer, line=line)


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return "a blank string"
    return type(value).__name__
