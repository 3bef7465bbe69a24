"""`sparrow model build|eval`: input checked before any training starts."""

import json
from pathlib import Path

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


def test_a_continued_build_refuses_another_size_or_hops_out_of_range_in_one_line(tmp_path):
    small = Path(__file__).resolve().parents[3] / "models" / "small"
    r = sparrow("model", "build", "--size", "long", "--out", tmp_path / "x", "--init-from", small, "--steps", "1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "not a build of this size: num_hidden_layers 4 != 8" in r.stderr
    r = sparrow("model", "build", "--size", "tiny", "--out", tmp_path / "y", "--min-hops", "17")
    assert r.returncode == 2 and "--min-hops must be in [1, 16]" in r.stderr
    r = sparrow("model", "build", "--size", "tiny", "--out", tmp_path / "z", "--init-from", tmp_path)
    assert r.returncode == 2 and "no config.json there" in r.stderr
    r = sparrow("model", "build", "--size", "tiny", "--out", tmp_path / "w", "--head-share", "1")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "sparrow model: error: --head-share must be in [0, 1), got 1.0"
