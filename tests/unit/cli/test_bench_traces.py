"""`python -m bench.traces`: runs' histories side by side in one figure; a folder that is not a run is exit 2."""

import json

from bench.traces import load_rows, main, populated_bins


def _run(path, budgets_per_step):
    path.mkdir()
    rows = [
        {"step": i + 1, "tau": 0.86, "accuracy": 0.5, "p5": {"1": 0.9, "2": 0.1}, "schedule_budgets": budgets}
        for i, budgets in enumerate(budgets_per_step)
    ]
    rows.append({"event": "not a step"})  # other lines are skipped
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_two_runs_make_one_figure(tmp_path):
    a = _run(tmp_path / "aggressive", [[48, 48, 48], [48, 96, 96]])
    b = _run(tmp_path / "lenient", [[512, 512, 512]])
    assert [r["step"] for r in load_rows(a)] == [1, 2] and populated_bins(load_rows(a)) == [1, 2]
    out = tmp_path / "traces.png"
    assert main([str(a), str(b), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_folder_without_a_history_is_an_error(tmp_path, capsys):
    assert main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
