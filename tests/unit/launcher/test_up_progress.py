"""What `sparrow up` prints: one JSON object per line with --json, readable blocks otherwise."""

import io
import json

from rich.console import Console

from services.launcher.progress import JsonProgress, LiveProgress, summary_lines

ROW = {
    "step": 3,
    "reward": 0.5,
    "accuracy": 0.25,
    "response_length": 12.0,
    "alpha_mean": 0.97,
    "p5": {"0": 0.995, "1": 0.61},
    "alpha_tokens": {"0": 30, "1": 12},
    "p5_promql": {"0": 0.99},
    "tau": 0.86,
    "published_version": 4,
    "generator_policy_versions": {"gen-0": 4, "gen-1": 3},
    "schedule_version": 2,
    "schedule_budgets": [48, 96],
    "bin_width": 16,
    "predicted_speedup": 1.8,
    "rollout_tokens_per_s": 321.0,
    "tokens_per_s": 100.0,
    "sparse_token_fraction": 0.5,
    "attended_kv_fraction": 0.25,
}
SUMMARY = {
    "outcome": "completed",
    "steps_done": 3,
    "elapsed_s": 42.0,
    "final_reward": 0.5,
    "final_accuracy": 0.25,
    "mean_rollout_tokens_per_s": 300.0,
    "final_min_p5": 0.61,
    "tau": 0.86,
    "work": {"groups_enqueued": 8, "groups_trained": 6, "groups_dropped_stale": 0, "groups_waiting": 2, "lost": []},
    "report": "runs/x/report/report.md",
}


def test_json_mode_prints_one_object_per_line_and_nothing_else():
    out = io.StringIO()
    progress = JsonProgress(out)
    progress.event("gen-1 exited")  # not on stdout: it must stay machine-readable
    progress.step(ROW)
    progress.finished(SUMMARY)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines == [{"type": "step", **ROW}, {"type": "summary", **SUMMARY}]


def test_plain_output_shows_the_step_its_bins_against_tau_and_the_summary():
    out = io.StringIO()
    # A pipe's console is 80 columns wide or less: the lines must still come out whole, not wrapped.
    progress = LiveProgress(10, "runs/x", Console(file=out, width=60, force_terminal=False, color_system=None))
    progress.event("every service is healthy; training")
    progress.step(ROW)
    progress.finished(SUMMARY)
    text = out.getvalue()
    assert "step 3/10  reward 0.500  accuracy 0.25" in text
    assert "rollout 321 tok/s while generating, 100 tok/s wall  sparse tokens 50%  attended KV 25%" in text
    assert "predicted speedup 1.80x" in text
    assert "policy v4 published, generators gen-0 v4, gen-1 v3, schedule v2, adapter none" in text
    bins = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()[:1] in ("0", "1")}
    assert bins["0"] == ["0", "0+", "48", "0.995", "0.990", "30", "holds"]
    assert bins["1"] == ["1", "16+", "96", "0.610", "-", "12", "below"]
    assert "every service is healthy; training" in text
    assert "report: runs/x/report/report.md" in text
    assert "groups: 8 enqueued, 6 trained, 0 dropped stale, 2 waiting, 0 lost" in text


def test_summary_lines_of_a_failed_run_without_steps():
    lines = summary_lines({"outcome": "failed", "steps_done": 0, "elapsed_s": 3.0, "tau": 0.86})
    assert lines[0] == "run failed: 0 steps in 3 s"


def test_on_a_terminal_the_live_view_renders_the_step_and_ends_with_the_summary():
    out = io.StringIO()
    console = Console(file=out, width=160, force_terminal=True, color_system=None)
    progress = LiveProgress(10, "runs/x", console)
    assert progress.live is not None
    progress.event("gen-1 exited (signal SIGKILL); 1 generator(s) go on")
    progress.step(ROW)
    progress.finished(SUMMARY)
    assert progress.live is None
    text = out.getvalue()
    assert "step 3/10" in text and "below" in text and "gen-1 exited (signal SIGKILL)" in text
    assert text.rstrip().endswith("report: runs/x/report/report.md")
