"""`sparrow bench heldout`: held-out accuracy of each kept policy version of a run folder.

The run folders are laid out as the trainer writes them (trainer/policy/vNNNNNNNN), filled with the
committed `tiny` model and a copy of it with scrambled weights, so the curve has a known shape.
"""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from bench.heldout import HeldoutError, pick, policy_versions, runs_in
from tests.cli_runner import sparrow

TINY = Path(__file__).resolve().parents[3] / "models" / "tiny"


def _policy(run: Path, version: int, scrambled: bool = False) -> None:
    dest = run / "trainer" / "policy" / f"v{version:08d}"
    shutil.copytree(TINY, dest)
    if scrambled:
        import torch

        g = torch.Generator().manual_seed(0)
        tensors = load_file(dest / "model.safetensors")
        save_file({k: torch.randn(v.shape, generator=g) for k, v in tensors.items()}, dest / "model.safetensors")
    (run / "trainer" / "policy" / f"v{version:08d}.json").write_text("{}")  # the manifest beside it


def test_versions_runs_and_picking(tmp_path):
    run = tmp_path / "up"
    for v in (3, 4, 5, 6):
        _policy(run, v)
    (run / "trainer" / "policy" / "v00000007").mkdir()  # being written: no config.json yet
    assert list(policy_versions(run)) == [3, 4, 5, 6]
    assert runs_in(run) == {"up": run}
    assert pick([3, 4, 5, 6], 2) == [3, 5, 6] and pick([3, 4, 5], 2) == [3, 5] and pick([1], 5) == [1]
    with pytest.raises(HeldoutError, match="no trainer/policy"):
        runs_in(tmp_path / "nothing")
    with pytest.raises(HeldoutError, match="every"):
        pick([1, 2], 0)


@pytest.mark.slow
def test_a_compare_folder_gives_a_curve_per_arm_on_the_same_prompts(tmp_path):
    folder = tmp_path / "compare"
    for v in (1, 2, 3):
        _policy(folder / "dense", v)
        _policy(folder / "sparse", v, scrambled=v == 3)
    out, png = tmp_path / "curve.json", tmp_path / "curve.png"
    r = sparrow(
        "bench", "heldout", str(folder), "--difficulty", "16:4", "--every", "2", "--samples", "16",
        "--out", str(out), "--plot", str(png), "--json", timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result == json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dense, sparse = result["runs"]["dense"], result["runs"]["sparse"]
    assert [p["version"] for p in dense["points"]] == [1, 3] and [p["after_step"] for p in dense["points"]] == [0, 2]
    # The same weights on the same held-out prompts with the same sampling seed: the same accuracy.
    start = dense["points"][0]["accuracy"]["p16-h4"]
    assert start > 0.5 and dense["change"] == {"p16-h4": 0.0}
    assert sparse["points"][0]["accuracy"]["p16-h4"] == start
    # Scrambled weights solve nothing: each version is really loaded.
    assert sparse["points"][-1]["accuracy"]["p16-h4"] == 0.0 and sparse["change"]["p16-h4"] == -start
    assert 0 < dense["points"][0]["stderr"]["p16-h4"] < 0.2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--every", "0"), "--every must be positive"),
        (("--difficulty", "64-200"), "--difficulty"),
        (("--difficulty", "500:4"), "pairs"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    _policy(tmp_path / "up", 1)
    r = sparrow("bench", "heldout", str(tmp_path / "up"), *args, timeout=120)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", ["--out", "--plot"])
def test_an_output_that_is_a_folder_is_one_line_before_the_run(tmp_path, flag):
    _policy(tmp_path / "up", 1)
    args = ("--difficulty", "4:2", "--samples", "1", flag, tmp_path)
    r = sparrow("bench", "heldout", str(tmp_path / "up"), *args, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{flag} {tmp_path}: is a folder" in lines[0], r.stderr


def test_a_folder_that_is_not_a_run_is_one_line(tmp_path):
    r = sparrow("bench", "heldout", str(tmp_path), timeout=120)
    assert r.returncode == 2 and "not a `sparrow up` run folder" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
