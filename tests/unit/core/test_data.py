"""Prompt files: JSONL and Parquet rows, bad rows skipped or fatal by choice, nothing dropped silently."""

import json
import sys

import pytest

from sparrow.data import DataError, load_prompts


def _jsonl(tmp_path, lines, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"prompt": "what is 2 + 2?", "answer": 4})
BAD_LINES = [
    GOOD,
    "{not json",
    json.dumps({"question": "no prompt field"}),
    "",
    json.dumps({"prompt": "   "}),
    json.dumps(["a", "list"]),
    json.dumps({"prompt": "fine", "answer": {"nested": 1}}),
    json.dumps({"prompt": "last", "answer": "x", "extra": True}),
]


def test_good_rows_with_and_without_answers(tmp_path):
    path = _jsonl(tmp_path, [GOOD, json.dumps({"prompt": "no answer"}), json.dumps({"prompt": "f", "answer": 0.5})])
    result = load_prompts(path)
    assert result.prompts == ["what is 2 + 2?", "no answer", "f"]
    assert [r.answer for r in result.rows] == ["4", None, "0.5"]
    assert [r.line for r in result.rows] == [1, 2, 3] and result.skipped == []


def test_bad_rows_are_skipped_and_reported_with_their_line_numbers(tmp_path):
    result = load_prompts(_jsonl(tmp_path, BAD_LINES), on_bad_row="skip")
    assert [r.line for r in result.rows] == [1, 8]
    reports = {bad.line: bad.reason for bad in result.skipped}
    assert sorted(reports) == [2, 3, 4, 5, 6, 7]
    assert "not valid JSON" in reports[2]
    assert reports[3] == "missing field 'prompt'"
    assert reports[4] == "empty line"
    assert "non-empty string" in reports[5]
    assert "expected an object" in reports[6]
    assert "string or a number" in reports[7]
    assert str(result.skipped[0]).startswith("line 2: ")


def test_stop_raises_at_the_first_bad_row(tmp_path):
    path = _jsonl(tmp_path, BAD_LINES)
    with pytest.raises(DataError, match=r"prompts.jsonl line 2: not valid JSON") as info:
        load_prompts(path)
    assert "\n" not in str(info.value)


def test_an_empty_prompt_set_is_an_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="no prompts in the file"):
        load_prompts(empty)
    all_bad = _jsonl(tmp_path, ["{oops", json.dumps({"prompt": ""})], name="bad.jsonl")
    with pytest.raises(DataError, match=r"no prompts in the file \(2 bad rows skipped, the first at line 1"):
        load_prompts(all_bad, on_bad_row="skip")


def test_unusable_files_and_arguments(tmp_path):
    with pytest.raises(DataError, match="no such prompt file"):
        load_prompts(tmp_path / "missing.jsonl")
    other = tmp_path / "prompts.csv"
    other.write_text("prompt\nhi\n")
    with pytest.raises(DataError, match="expected .jsonl or .parquet"):
        load_prompts(other)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DataError, match="cannot read the file"):
        load_prompts(binary)
    with pytest.raises(ValueError, match="on_bad_row"):
        load_prompts(_jsonl(tmp_path, [GOOD]), on_bad_row="ignore")


def test_other_field_names(tmp_path):
    path = _jsonl(tmp_path, [json.dumps({"question": "q1", "solution": "s1"})])
    result = load_prompts(path, prompt_field="question", answer_field="solution")
    assert result.rows[0].prompt == "q1" and result.rows[0].answer == "s1"


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    # pyarrow is a dependency; a broken or missing install must still fail clearly.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "prompts.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(DataError, match="reading Parquet needs pyarrow"):
        load_prompts(path)


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["a", None, "c"], "answer": ["1", "2", None]}), path)
    with pytest.raises(DataError, match="prompts.parquet row 2: field 'prompt' must be a non-empty string, got null"):
        load_prompts(path)
    result = load_prompts(path, on_bad_row="skip")
    assert result.prompts == ["a", "c"] and [b.line for b in result.skipped] == [2]
    pq.write_table(pa.table({"text": ["a"]}), path)
    with pytest.raises(DataError, match="no 'prompt' column"):
        load_prompts(path)
