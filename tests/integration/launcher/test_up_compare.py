"""`sparrow up --compare`: a dense run, then a sparse one (the tiny model, a schedule that makes every decode
step of layers 1-3 sparse), and the comparison report built from both histories."""

import json

import pytest

from report.compare import compare_figures
from tests.integration.launcher.helpers import UpProcess, alive, processes, tiny_config

pytestmark = pytest.mark.slow

SCHEDULE = {"name": "test", "version": 1, "bin_width": 16, "budgets": [48] * 6, "dense_layers": [0]}


def test_compare_runs_dense_then_sparse_and_reports_both(tmp_path):
    root = tmp_path / "cmp"
    config = tiny_config(tmp_path / "up.toml", schedule=SCHEDULE, pairs=16)
    up = UpProcess("--config", str(config), "--model-size", "tiny", "--steps", "2", "--no-controller", "--compare",
                   "--run-dir", str(root), "--json")  # fmt: skip
    try:
        code = up.wait(600)
    finally:
        up.kill()
    assert code == 0, up.proc.stderr.read()[-3000:]
    summaries = [o for o in up.lines if o["type"] == "summary"]
    assert [s["mode"] for s in summaries] == ["dense", "sparse"]
    assert [s["outcome"] for s in summaries] == ["completed", "completed"]
    steps = [o for o in up.lines if o["type"] == "step"]
    assert [(s["mode"], s["step"]) for s in steps] == [("dense", 1), ("dense", 2), ("sparse", 1), ("sparse", 2)]
    assert all(s["schedule_budgets"] is None for s in steps[:2]) and all(s["schedule_budgets"] for s in steps[2:])
    assert all((s["sparse_token_fraction"] or 0) == 0 for s in steps[:2])
    assert any((s["sparse_token_fraction"] or 0) > 0 for s in steps[2:])

    final = up.lines[-1]
    assert final["type"] == "compare" and final["report"] == str(root / "report.md")
    figs = compare_figures(root)
    assert final["measured_rollout_speedup"] == figs["measured_rollout_speedup"] > 0
    d, s = (json.loads((root / m / "summary.json").read_text()) for m in ("dense", "sparse"))
    assert figs["measured_rollout_speedup"] == s["mean_rollout_tokens_per_s"] / d["mean_rollout_tokens_per_s"]
    md = (root / "report.md").read_text()
    assert f"**{figs['measured_rollout_speedup']:.2f}x**" in md
    for mode in ("dense", "sparse"):
        assert (root / mode / "report" / "report.md").is_file()
        assert not [c["name"] for c in processes(root / mode).values() if alive(c["pid"])]
