"""`sparrow model build|eval`: input checked before any training starts."""

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
