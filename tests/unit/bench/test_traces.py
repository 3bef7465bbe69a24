"""bench.traces: the end-of-run summary is computed from the history rows, and bad input is one line."""

import json

from bench import traces


def write_run(path, p5s, budgets):
    path.mkdir()
    rows = [
        {"step": i + 1, "tau": 0.86, "p5": p5, "schedule_budgets": b, "schedule_version": i + 1}
        | {"attended_kv_fraction": 0.5}
        for i, (p5, b) in enumerate(zip(p5s, budgets, strict=True))
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_summary_of_the_last_steps_per_bin(tmp_path, capsys):
    p5s = [{"1": 0.5}, {"1": 0.85, "2": 0.95}, {"1": 0.88, "2": 0.92}, {"1": 0.90, "2": 0.90}]
    budgets = [[48, 48, 48]] + [[48, 192, 256]] * 3
    run = write_run(tmp_path / "run-a", p5s, budgets)
    assert traces.main([str(run), "--last", "3"]) == 0
    s = json.loads(capsys.readouterr().out)["run-a"]
    assert s["steps"] == 4 and s["last_steps"] == 3 and s["final_budgets"] == [48, 192, 256]
    one, two = s["bins"]["1"], s["bins"]["2"]
    assert one["readings"] == 3 and one["mean_p5"] == round((0.85 + 0.88 + 0.90) / 3, 4)
    assert one["share_at_or_above_tau"] == round(2 / 3, 3) and one["share_in_band"] == round(2 / 3, 3)
    assert two["share_at_or_above_tau"] == 1.0 and two["share_in_band"] == round(1 / 3, 3) and two["min_p5"] == 0.9
    assert one["final_budget"] == 192 and s["schedule_version"] == 4 and s["attended_kv_fraction"] == 0.5


def test_a_folder_without_history_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert traces.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl" in err[0]
    run = write_run(tmp_path / "run", [{"1": 0.9}], [[48, 64]])
    assert traces.main([str(run), "--last", "0"]) == 2
