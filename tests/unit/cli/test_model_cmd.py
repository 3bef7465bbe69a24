"""`sparrow model build|eval`: input checked before any training starts."""

import json

import pytest

from tests.cli_runner import sparrow


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_build_out_that_cannot_be_a_folder_is_one_line_before_training(tmp_path, where):
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me\n")
    out = existing if where == "file" else existing / "model"
    r = sparrow("model", "build", "--size", "tiny", "--out", out, "--steps", "1", "--eval-samples", "1", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--out" in lines[0] and "not a folder" in lines[0], r.stderr
    assert r.stdout == "" and existing.read_text() == "keep me\n"


def test_build_json_prints_the_build_record_and_logs_progress_to_stderr(tmp_path):
    out = tmp_path / "model"
    r = sparrow("model", "build", "--size", "tiny", "--out", out, "--steps", "2", "--eval-samples", "1", "--json",
                timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(r.stdout)
    assert data["model"] == str(out) and data["steps_done"] == 2 and data["config"]["size"] == "tiny"
    assert data == {"model": str(out), **json.loads((out / "build.json").read_text())}
    assert "greedy" in r.stderr  # the held-out evaluation's progress lines
