"""Loading user datasets and prompt sets from JSONL or Parquet files, or folders of their shards.

`load_samples` reads a training or evaluation source through the HF `datasets` library (local
files only), in the row shapes of `sparrow/rows.py` (verl's, or plain prompt/answer rows).
`load_prompts` reads a plain prompt file (a prompt string and an optional answer per row): the
same row parsing (`parse_row`, text prompts only) and the same bad-row loop (`_parse_rows`), over
the file as it is (JSON values as written: an answer `4` stays "4", which a typed dataset column
would turn into "4.0"). Either way a row that does not fit is reported with its line number (JSONL)
or row number (Parquet, from 1) and, by the caller's choice, skipped or made fatal; skipped rows
come back with the rest, so nothing is dropped silently. A set left without rows is an error.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparrow.rows import BadRow, RowShape, Sample, parse_row

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
    shape = RowShape(prompt_key=prompt_field, answer_key=answer_field, text_only=True)
    hint = "pass on_bad_row='skip' / --on-bad-row skip to skip bad rows"
    samples, skipped = _parse_rows(records, shape, file.stem, unit, on_bad_row, hint, where=f"{file} ")
    if not samples:
        raise DataError(f"{file}: no prompts in the file{_skipped_note(skipped)}")
    return PromptSet(file, [PromptRow(s.prompt, s.ground_truth, s.row) for s in samples], skipped)


def _parse_rows(
    records: Iterable[tuple[int, Record]],
    shape: RowShape,
    default_source: str,
    unit: str,
    on_bad_row: str,
    hint: str,
    file: str = "",
    where: str = "",
) -> tuple[list[Sample], list[BadRow]]:
    """Each record as a Sample (`parse_row`); a bad one raises DataError ("{where}{bad row} ({hint})") under
    on_bad_row "stop", else is reported in the list of skipped rows."""
    samples: list[Sample] = []
    skipped: list[BadRow] = []
    for line, record in records:
        row = parse_row(record, line, shape, default_source, unit, file)
        if isinstance(row, Sample):
            samples.append(row)
        elif on_bad_row == "stop":
            raise DataError(f"{where}{row} ({hint})")
        else:
            skipped.append(row)
    return samples, skipped


def _skipped_note(skipped: list[BadRow]) -> str:
    return f" ({len(skipped)} bad rows skipped, the first at {skipped[0]})" if skipped else ""


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


@dataclass
class SampleSet:
    """The usable rows of one source (a file or a folder of shards) and the report of every row skipped."""

    path: Path
    samples: list[Sample]
    skipped: list[BadRow] = field(default_factory=list)


def source_files(path: str | Path) -> list[Path]:
    """The data files of a source: the file itself, or a folder's JSONL or Parquet shards in name order."""
    src = Path(path)
    if src.is_dir():
        known = JSONL_SUFFIXES + PARQUET_SUFFIXES
        files = sorted(p for p in src.rglob("*") if p.is_file() and p.suffix.lower() in known)
        if not files:
            raise DataError(f"{src}: the folder holds no .jsonl or .parquet files")
        kinds = {p.suffix.lower() in PARQUET_SUFFIXES for p in files}
        if len(kinds) > 1:
            raise DataError(f"{src}: the folder mixes JSONL and Parquet shards; keep one format per source")
        return files
    if not src.is_file():
        raise DataError(f"{src}: no such data file or folder")
    if src.suffix.lower() not in JSONL_SUFFIXES + PARQUET_SUFFIXES:
        raise DataError(f"{src}: unknown data file type {src.suffix!r}; expected .jsonl or .parquet")
    return [src]


def load_samples(
    path: str | Path, shape: RowShape | None = None, on_bad_row: str = "stop", data_source: str | None = None
) -> SampleSet:
    """Read one source (a `.jsonl`/`.parquet` file or a folder of shards) into Samples.

    `data_source` names rows that carry none (default: the file or folder name without suffix).
    `on_bad_row`: "stop" raises DataError at the first bad row, "skip" reports it in `skipped`. A
    missing file, an unknown format, no prompt column or no usable row at all is a DataError either way.
    """
    if on_bad_row not in BAD_ROW_POLICIES:
        raise ValueError(f"on_bad_row must be one of {BAD_ROW_POLICIES}, got {on_bad_row!r}")
    shape = shape or RowShape()
    src = Path(path)
    default_source = data_source or src.stem
    result = SampleSet(path=src, samples=[])
    for file in source_files(src):
        parquet = file.suffix.lower() in PARQUET_SUFFIXES
        records, unit = (_hf_records(file, "parquet"), "row") if parquet else (_jsonl_dataset(file), "line")
        columns = _columns(records)
        if columns is not None and shape.prompt_key not in columns:
            raise DataError(
                f"{file}: no prompt column {shape.prompt_key!r} (columns: {', '.join(columns)}); set prompt_key"
            )
        samples, skipped = _parse_rows(
            records, shape, default_source, unit, on_bad_row, "on_bad_row = 'skip' skips bad rows", str(file)
        )
        result.samples += samples
        result.skipped += skipped
    if not result.samples:
        raise DataError(f"{src}: no usable rows{_skipped_note(result.skipped)}")
    return result


def _columns(records: list[tuple[int, Record]]) -> list[str] | None:
    """Every field any row of a file has, in first-seen order; None when no row is an object."""
    seen: dict[str, None] = {}
    for _, r in records:
        if isinstance(r, dict):
            seen.update(dict.fromkeys(r))
    return list(seen) if seen else None


def _hf_records(file: Path, builder: str) -> list[tuple[int, Record]]:
    """Rows read by the HF `datasets` library (local files only: no hub access)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{file}: reading datasets needs the `datasets` package (pip install datasets)") from None
    datasets.disable_progress_bars()
    # A file it refuses is reported here in one line (JSONL is then read line by line), not logged by it too.
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    try:
        ds = datasets.load_dataset(builder, data_files=[str(file)], split="train", keep_in_memory=True)
    except Exception as exc:  # pyarrow and datasets raise many types for broken files
        raise DataError(f"{file}: not a readable {builder} file ({_first_line(exc)})") from None
    return list(enumerate(ds.to_list(), start=1))


def _jsonl_dataset(file: Path) -> list[tuple[int, Record]]:
    # The datasets loader takes a whole file or nothing: a file it refuses (a broken line, rows of
    # different shapes) is read line by line, so each bad line is reported with its number.
    try:
        return _hf_records(file, "json")
    except DataError:
        return _jsonl_records(file)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
