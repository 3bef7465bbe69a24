import json

import pytest

from tests.cli_runner import sparrow


def assert_one_line_error(result, fragment):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert fragment in lines[0]
    assert result.stdout == ""


def test_list():
    r = sparrow("schedule", "list")
    assert r.returncode == 0, r.stderr
    assert "qwen3-14b-0.86" in r.stdout and "512, 768, 1280, 2048, 4096, 6144 x10" in r.stdout
    data = json.loads(sparrow("schedule", "list", "--json").stdout)
    assert len(data) == 20 and all(len(d["budgets"]) == 20 for d in data)


def test_show_preset():
    r = sparrow("schedule", "show", "qwen3-4b-0.86")
    assert r.returncode == 0, r.stderr
    assert "sink 1 / local 2 blocks, dense layers 0, 1" in r.stdout
    assert "[38000, ...)" in r.stdout and "8192" in r.stdout
    data = json.loads(sparrow("schedule", "show", "qwen3-4b-0.86", "--json").stdout)
    assert data["name"] == "qwen3-4b-0.86" and data["budgets"][-1] == 8192 and data["page_size"] == 16


def test_show_and_validate_a_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "budgets": [512, 1024], "version": 3}))
    r = sparrow("schedule", "show", path)
    assert r.returncode == 0 and "mine v3" in r.stdout
    r = sparrow("schedule", "validate", path)
    assert r.returncode == 0 and r.stdout.startswith("ok: mine v3") and "512, 1024" in r.stdout
    assert json.loads(sparrow("schedule", "validate", path, "--json").stdout)["ok"] is True


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{oops", "malformed JSON"),
        ('{"budgets": [512, 1000]}', "budget of bin 1 (1000 tokens) is not a multiple of the page size 16"),
        ('{"budgets": [1024, 512]}', "non-decreasing"),
        ('{"budgets": [512], "extra": 1}', "unknown field(s) 'extra'"),
        ('{"version": 1}', "missing field 'budgets'"),
        ('{"budgets": [512], "version": "one"}', "field 'version' must be an integer"),
    ],
)
def test_validate_bad_files(tmp_path, content, fragment):
    path = tmp_path / "bad.json"
    path.write_text(content)
    r = sparrow("schedule", "validate", path)
    assert_one_line_error(r, fragment)
    assert "bad.json" in r.stderr


def test_missing_file_and_unknown_preset():
    assert_one_line_error(sparrow("schedule", "validate", "/nonexistent.json"), "cannot read schedule file")
    assert_one_line_error(sparrow("schedule", "show", "qwen3-4b-0.87"), "unknown schedule preset 'qwen3-4b-0.87'")


def test_validate_a_file_nested_too_deeply(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    r = sparrow("schedule", "validate", path)
    assert_one_line_error(r, "malformed JSON")
    assert "deep.json" in r.stderr
