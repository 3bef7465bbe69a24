"""The row shapes users bring, read into one `Sample`: verl's, and plain prompt/answer rows.

verl's shape: `prompt` is a list of chat messages (`{role, content}`), `data_source` names the
source, `reward_model.ground_truth` holds the answer and `extra_info` anything else. The plain
shape: a prompt string (or chat messages) under `prompt_key` and an answer (a string or a number)
under `answer_key`; GSM8K's answers (`... #### 42`) go through `answer_extraction = "gsm8k"`.
Every field but the prompt is kept as the sample's `columns`, for rewards that read them (TRL's).
A row that fits neither is a `BadRow` naming the field at fault; nothing here raises on row content.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

ANSWER_EXTRACTIONS = ("none", "gsm8k")
ROLES = ("system", "user", "assistant", "tool")  # the chat format's roles; templates know no others
_GSM8K = re.compile(r"####\s*(.+?)\s*$", re.S)


@dataclass(frozen=True)
class RowShape:
    """Where a row keeps its prompt and its answer."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    answer_extraction: str = "none"  # "gsm8k": the text after the last `####`, thousands commas dropped
    text_only: bool = False  # prompts must be strings, chat messages refused (raw-text prompt files)

    def __post_init__(self) -> None:
        if self.answer_extraction not in ANSWER_EXTRACTIONS:
            raise ValueError(f"answer_extraction must be one of {ANSWER_EXTRACTIONS}, got {self.answer_extraction!r}")


@dataclass(frozen=True)
class Sample:
    """One usable row: the prompt (text, or chat messages), its ground truth, its source and extras."""

    prompt: str | tuple[dict[str, str], ...]
    ground_truth: str | None
    data_source: str
    row: int  # row number within its file (JSONL: line number), counted from 1
    file: str = ""
    extras: dict[str, Any] = field(default_factory=dict, compare=False)
    columns: dict[str, Any] = field(default_factory=dict, compare=False)  # the row's fields but its prompt

    @property
    def messages(self) -> list[dict[str, str]]:
        """The prompt as chat messages (a text prompt is one user message)."""
        if isinstance(self.prompt, str):
            return [{"role": "user", "content": self.prompt}]
        return [dict(m) for m in self.prompt]


@dataclass(frozen=True)
class BadRow:
    """A row that was skipped, and why."""

    line: int  # JSONL line number, or Parquet row number, counted from 1
    reason: str
    unit: str = "line"  # "row" for Parquet
    file: str = ""

    def __str__(self) -> str:
        where = f"{self.file} " if self.file else ""
        return f"{where}{self.unit} {self.line}: {self.reason}"


def parse_row(
    record: Any, line: int, shape: RowShape, default_source: str, unit: str, file: str = ""
) -> Sample | BadRow:
    """The Sample of one decoded row, or the BadRow saying what is wrong with it."""
    if isinstance(record, BadRow):
        return BadRow(record.line, record.reason, unit, file)

    def bad(reason: str) -> BadRow:
        return BadRow(line, reason, unit, file)

    if not isinstance(record, dict):
        return bad(f"expected an object with a {shape.prompt_key!r} field, got {type(record).__name__}")
    if shape.prompt_key not in record:
        return bad(f"missing field {shape.prompt_key!r}")
    prompt, error = _prompt(record[shape.prompt_key], shape.text_only)
    if error:
        return bad(f"field {shape.prompt_key!r} {error}")
    answer = _answer(record, shape)
    if isinstance(answer, BadRow):
        return bad(answer.reason)
    source = record.get("data_source")
    if source is not None and (not isinstance(source, str) or not source.strip()):
        return bad(f"field 'data_source' must be a non-empty string, got {_describe(source)}")
    extras = record.get("extra_info")
    extras = dict(extras) if isinstance(extras, dict) else {}
    return Sample(
        prompt=prompt,
        ground_truth=answer,
        data_source=source or default_source,
        row=line,
        file=file,
        extras=extras,
        columns={k: v for k, v in record.items() if k != shape.prompt_key},
    )


def _prompt(value: Any, text_only: bool = False) -> tuple[str | tuple[dict[str, str], ...], str]:
    """(the prompt text or messages, "") or ("", what is wrong); `text_only`: messages are wrong too."""
    wanted = "must be a non-empty string" if text_only else "must be a non-empty string or chat messages"
    if isinstance(value, str):
        return (value, "") if value.strip() else ("", f"{wanted}, got a blank string")
    if isinstance(value, list | tuple) and not text_only:
        messages = []
        for i, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return "", f"message {i} must be an object with string 'role' and 'content'"
            if m["role"] not in ROLES:
                return "", f"message {i} has role {m['role']!r}; chat templates take {', '.join(ROLES)}"
            messages.append({"role": m["role"], "content": m["content"]})
        if not any(m["content"].strip() for m in messages):
            return "", "holds no chat message with content"
        return tuple(messages), ""
    return "", f"{wanted}, got {_describe(value)}"


def _answer(record: dict, shape: RowShape) -> str | None | BadRow:
    reward_model = record.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        key, value = "reward_model.ground_truth", reward_model["ground_truth"]
    else:
        key, value = shape.answer_key, record.get(shape.answer_key)
    if value is None:
        return None
    # bool is an int subclass, and NaN/inf are no answer anyone can match
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return BadRow(0, f"field {key!r} must be a string or a number, got {_describe(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        return BadRow(0, f"field {key!r} is {value}")
    text = str(value)
    if shape.answer_extraction == "gsm8k":
        m = _GSM8K.search(text)
        if m is None:
            return BadRow(0, f"field {key!r} has no '#### answer' to extract")
        text = m.group(1).replace(",", "").strip()
    return text


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return "a blank string"
    return type(value).__name__
