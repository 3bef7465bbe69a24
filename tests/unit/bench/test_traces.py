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


def test_the_trainers_record_adds_p1_the_exact_series_and_the_exact_pass_time(tmp_path, capsys):
    run = write_run(tmp_path / "run-x", [{"1": 0.80}, {"1": 0.86}, {"1": 0.88}], [[96, 96]] * 3)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r |= {"step_seconds": 4.0, "accuracy": 0.5, "predicted_speedup": 1.7}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "trainer").mkdir()
    exact = [0.90, 0.92, float("nan")]  # the last step's bin had no reproducible tokens: no exact reading
    steps = [
        {
            "step": i + 1,
            "exact_seconds": 1.0,
            "alpha_bins": [{"bin": 1, "p5": p5, "p1": p5 - 0.1, "exact_p5": e, "exact_p1": e - 0.05}],
        }  # fmt: skip
        for i, (p5, e) in enumerate(zip([0.80, 0.86, 0.88], exact, strict=True))
    ]
    (run / "trainer" / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps) + "{torn")
    assert traces.main([str(run)]) == 0
    s = json.loads(capsys.readouterr().out)["run-x"]
    b = s["bins"]["1"]
    assert b["mean_p5"] == round((0.80 + 0.86 + 0.88) / 3, 4) and b["mean_p1"] == round((0.70 + 0.76 + 0.78) / 3, 4)
    assert b["exact_readings"] == 2 and b["exact_mean_p5"] == 0.91 and b["exact_share_in_band"] == 0.5
    assert b["exact_mean_p1"] == round((0.85 + 0.87) / 2, 4)
    assert s["step_seconds_mean"] == 4.0 and s["exact_seconds_mean"] == 1.0
    assert s["step_over_step_without_exact"] == round(4 / 3, 3)
    assert s["accuracy_mean"] == 0.5 and s["predicted_speedup"] == 1.7


def test_a_run_without_the_trainers_record_has_the_bound_only(tmp_path, capsys):
    run = write_run(tmp_path / "run-b", [{"1": 0.9}], [[48, 64]])
    assert traces.main([str(run)]) == 0
    b = json.loads(capsys.readouterr().out)["run-b"]["bins"]["1"]
    assert "exact_mean_p5" not in b and "mean_p1" not in b and b["mean_p5"] == 0.9
