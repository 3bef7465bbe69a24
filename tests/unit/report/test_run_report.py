"""The run report and the dense-vs-sparse comparison, built from metrics histories alone."""

import json
import math

import pytest

from report.compare import build_compare_report
from report.run_report import ReportError, build_report, figures, headline, with_gaps
from tests.cli_runner import sparrow

PNG = b"\x89PNG\r\n\x1a\n"


def _row(step: int, rate: float, accuracy: float, schedule: bool = True) -> dict:
    return {
        "step": step,
        "reward": accuracy / 2,
        "accuracy": accuracy,
        "response_length": 12.5,
        "p5": {"0": 0.99, "1": [0.81, 0.82, 0.83][(step - 1) % 3]},
        "alpha_tokens": {"0": 30, "1": 20},
        "p5_promql": {},
        "tau": 0.86,
        "policy_version": step,
        "published_version": step + 1,
        "schedule_version": 2 if schedule else 0,
        "schedule_budgets": [48, 64 + 16 * step] if schedule else None,
        "bin_width": 16 if schedule else None,
        "predicted_speedup": 1.7 if schedule else 1.0,
        "rollout_tokens_per_s": rate,
        "tokens_per_s": None if rate is None else rate / 2,
        "generator_policy_versions": {"gen-0": step},
    }


def _run(folder, rows, summary=None):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_the_report_shows_the_historys_figures_and_rebuilds_identically(tmp_path):
    rows = [_row(1, 100.0, 0.25), _row(2, 120.0, 0.5), _row(3, 110.0, 0.75)]
    work = {"groups_enqueued": 9, "groups_trained": 6, "groups_dropped_stale": 1, "groups_waiting": 2, "lost": []}
    run = _run(tmp_path / "run", rows, {"outcome": "completed", "work": work, "run": {"model": "tiny"}})
    path = build_report(run)
    assert path == run / "report" / "report.md"
    md = path.read_text()
    assert "| 2 | 0.250 | 0.500 | 12.5 | 0.820 | 0:0.990 1:0.820 | v3 | v2 | 120.0 | 60.0 | 1.70 |" in md
    assert "| mean rollout tokens/s (engine time) | 110.0 |" in md
    assert "| prompt groups enqueued / trained / dropped stale / waiting | 9 / 6 / 1 / 2 |" in md
    assert "outcome: completed" in md and "tiny model" in md
    figs = json.loads((run / "report" / "figures.json").read_text())
    assert figs == figures(rows)
    assert figs["p5"]["bin 1"] == [[1, 0.81], [2, 0.82], [3, 0.83]]
    assert figs["schedule"]["bin 1"] == [[1, 80], [2, 96], [3, 112]]
    assert figs["tokens_per_s"]["rollout (engine time)"] == [[1, 100.0], [2, 120.0], [3, 110.0]]
    for name in ("reward_accuracy", "p5", "schedule", "tokens_per_s"):
        assert (run / "report" / f"{name}.png").read_bytes()[:8] == PNG
        assert f"({name}.png)" in md
    head = headline(rows)
    assert head["final_min_p5"] == 0.83 and head["mean_accuracy"] == pytest.approx(0.5)
    assert build_report(run).read_text() == md


def test_a_dense_run_and_missing_figures_still_give_a_report(tmp_path):
    rows = [_row(1, None, 0.5, schedule=False), _row(2, 50.0, 0.5, schedule=False)]
    run = _run(tmp_path / "dense", rows)
    md = build_report(run).read_text()
    assert "| 1 | 0.250 | 0.500 | 12.5 | 0.810 | 0:0.990 1:0.810 | v2 | dense | - | - | 1.00 |" in md
    assert figures(rows)["schedule"] == {}
    assert (run / "report" / "schedule.png").read_bytes()[:8] == PNG


def test_a_step_without_generation_is_a_gap_and_a_dash_never_a_zero(tmp_path):
    # Step 2 trained groups generated before step 1's scrape: nothing was measured in between. Histories before
    # this fix wrote its wall rate as 0.0; the report reads that as no measurement too.
    rows = [_row(1, 100.0, 0.25), _row(2, None, 0.5), _row(3, 110.0, 0.75)]
    for r in rows:
        r["generated_tokens"] = 0 if r["step"] == 2 else 500
    rows[1]["tokens_per_s"] = 0.0
    run = _run(tmp_path / "run", rows)
    md = build_report(run).read_text()
    assert "| 2 | 0.250 | 0.500 | 12.5 | 0.820 | 0:0.990 1:0.820 | v3 | v2 | - | - | 1.70 |" in md
    figs = figures(rows)
    assert figs["tokens_per_s"]["wall"] == [[1, 50.0], [3, 55.0]]
    assert figs["tokens_per_s"]["rollout (engine time)"] == [[1, 100.0], [3, 110.0]]
    xs, ys = with_gaps(figs["tokens_per_s"]["wall"], [1, 2, 3])
    assert xs == [1, 2, 3] and ys[0] == 50.0 and math.isnan(ys[1]) and ys[2] == 55.0  # the line breaks at 2
    assert headline(rows)["mean_rollout_tokens_per_s"] == pytest.approx(105.0)


def test_no_report_without_a_run_or_without_steps(tmp_path):
    with pytest.raises(ReportError, match="no such folder"):
        build_report(tmp_path / "nothing")
    with pytest.raises(ReportError, match="holds no steps"):
        build_report(_run(tmp_path / "empty", []))


def _eval_round(n: int, step: int, avg: float) -> dict:
    return {"round": n, "mode": "dense", "step": step, "policy_version": step + 1, "k": 1, "prompts": 8,
            "complete": True, "dense": True, "sources": {"chain": {"avg@1": avg, "pass@1": avg}},
            "seconds": 3.0}  # fmt: skip


def test_the_comparison_reports_the_measured_speedup_and_both_accuracies(tmp_path):
    dense = [_row(1, 100.0, 0.5, False), _row(2, 100.0, 0.75, False), _row(3, 100.0, 0.75, False)]
    sparse = [_row(1, 250.0, 0.5), _row(2, 230.0, 0.5), _row(3, 230.0, 0.5)]
    for rows, walls in ((dense, (300.0, 100.0, 120.0)), (sparse, (200.0, 80.0, 70.0))):
        for r, wall in zip(rows, walls, strict=True):
            r["step_wall_seconds"] = wall
    _run(tmp_path / "cmp" / "dense", dense)
    _run(tmp_path / "cmp" / "sparse", sparse)
    for mode, avgs in (("dense", (0.5, 0.625)), ("sparse", (0.5, 0.375))):
        evals = [_eval_round(i, 2 * i, a) for i, a in enumerate(avgs)]
        (tmp_path / "cmp" / mode / "trainer").mkdir()
        (tmp_path / "cmp" / mode / "trainer" / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    path, figs = build_compare_report(tmp_path / "cmp")
    assert figs["measured_rollout_speedup"] == pytest.approx(710 / 300)
    assert figs["accuracy_difference"] == pytest.approx(-1 / 6)
    # the step-time ratio leaves out the first step, which waits for the first rollouts
    assert (
        figs["measured_step_speedup"] == pytest.approx(110.0 / 75.0)
        and figs["step_speedup_of"] == "steps after the first"
    )
    assert figs["dense"]["mean_step_seconds"] == pytest.approx(520 / 3)
    assert [r["sources"]["chain"]["avg@1"] for r in figs["sparse"]["heldout"]] == [0.5, 0.375]
    md = path.read_text()
    assert "Measured rollout speedup of sparse over dense: **2.37x**" in md
    assert "RL step time, dense over sparse: **1.47x** (steps after the first)" in md
    assert "| mean RL step seconds (after the first) | 110.0 | 75.0 |" in md
    assert "| 1 (2, dense) | chain avg@1 0.625 | chain avg@1 0.375 |" in md
    assert "| mean accuracy | 0.667 | 0.500 |" in md
    for png in ("compare_tokens_per_s.png", "compare_accuracy.png"):
        assert (tmp_path / "cmp" / png).read_bytes()[:8] == PNG
    assert (tmp_path / "cmp" / "dense" / "report" / "report.md").is_file()
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text()) == figs


def test_a_speculative_comparison_is_named_so_and_shows_the_mismatch_the_trainer_saw(tmp_path):
    dense = [_row(1, 100.0, 0.5, False), _row(2, 100.0, 0.5, False)]
    spec = [_row(1, 90.0, 0.5), _row(2, 95.0, 0.5)]
    for rows, clips, kls in ((dense, (0.0, 0.0), (0.0, 0.0)), (spec, (0.0, 0.0), (2e-8, -3e-8))):
        for r, clip, kl in zip(rows, clips, kls, strict=True):
            r["tis_clip_fraction"], r["kl_rollout_dense"] = clip, kl
    _run(tmp_path / "cmp" / "dense", dense, {"run": {"mode": "dense"}})
    _run(tmp_path / "cmp" / "sparse", spec, {"run": {"mode": "speculative"}})
    for mode in ("dense", "sparse"):
        (tmp_path / "cmp" / mode / "trainer").mkdir()
        (tmp_path / "cmp" / mode / "trainer" / "evals.jsonl").write_text(json.dumps(_eval_round(0, 0, 0.5)) + "\n")
    path, figs = build_compare_report(tmp_path / "cmp")
    assert figs["second_mode"] == "speculative"
    assert figs["sparse"]["max_abs_kl_rollout_dense"] == pytest.approx(3e-8)
    assert figs["sparse"]["max_tis_clip_fraction"] == 0.0
    md = path.read_text()
    assert md.startswith("# Sparrow: dense vs speculative rollouts")
    assert "Measured rollout speedup of speculative over dense: **0.93x**" in md
    assert "| figure | dense | speculative |" in md
    assert "| max abs kl_rollout_dense of a step | 0.00e+00 | 3.00e-08 |" in md
    assert "| held-out round (at step, decoded) | dense run | speculative run |" in md
    assert "[speculative](sparse/report/report.md)" in md
    # a comparison without summaries (an older run folder) reads as dense vs sparse
    _run(tmp_path / "old" / "dense", dense)
    _run(tmp_path / "old" / "sparse", spec)
    assert build_compare_report(tmp_path / "old")[1]["second_mode"] == "sparse"


def test_sparrow_report_rebuilds_a_run_or_a_comparison_and_refuses_a_missing_folder(tmp_path):
    run = _run(tmp_path / "run", [_row(1, 10.0, 0.5)])
    r = sparrow("report", run, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["report"] == str(run / "report" / "report.md") and out["steps_done"] == 1
    _run(tmp_path / "cmp" / "dense", [_row(1, 10.0, 0.5, False)])
    _run(tmp_path / "cmp" / "sparse", [_row(1, 20.0, 0.5)])
    r = sparrow("report", tmp_path / "cmp")
    assert r.returncode == 0 and r.stdout.strip() == str(tmp_path / "cmp" / "report.md")
    r = sparrow("report", tmp_path / "missing")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no such folder" in r.stderr


def test_sparrow_report_skips_history_lines_that_are_not_step_records(tmp_path):
    run = _run(tmp_path / "run", [_row(1, 10.0, 0.5)])
    with (run / "metrics.jsonl").open("ab") as f:
        f.write(b'5\n["step"]\n{"note": "no step"}\n{"step": "two"}\n\xff\xfe{"step": 3}\n')
    r = sparrow("report", run, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["steps_done"] == 1


@pytest.mark.parametrize("blocker", ["report", "metrics.jsonl"])
def test_sparrow_report_on_a_folder_it_cannot_read_or_write_is_one_line(tmp_path, blocker):
    run = _run(tmp_path / "run", [_row(1, 10.0, 0.5)])
    if blocker == "report":
        (run / "report").write_text("not a folder\n")
    else:
        (run / "metrics.jsonl").unlink()
        (run / "metrics.jsonl").mkdir()
    r = sparrow("report", run)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and str(run / blocker) in r.stderr
    if blocker == "report":
        assert (run / "report").read_text() == "not a folder\n"


def _timed(row: dict, wait: float, score: float, update: float, other: float) -> dict:
    split = {"wait_groups": wait, "reward": 0.0, "score": score, "exact_alpha": 0.0, "update": update,
             "distill": 0.0, "publish": 0.125, "checkpoint": 0.0, "other": other}  # fmt: skip
    return {**row, **{f"timing/{k}": v for k, v in split.items()}, "step_wall_seconds": sum(split.values())}


def test_the_report_shows_each_steps_time_split_as_a_stacked_bar_and_a_table(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from report.time_split import PHASES, draw

    rows = [_timed(_row(1, 100.0, 0.25), 2.0, 0.5, 0.75, 0.125), _timed(_row(2, 120.0, 0.5), 0.25, 0.5, 1.0, 0.0)]
    rows[1]["generator_timing"] = {"prefill": 0.5, "decode": 3.0, "sampling": 0.0, "weight_sync": 0.25,
                                   "idle": 0.125, "other": 0.0}  # fmt: skip
    run = _run(tmp_path / "run", rows)
    md = build_report(run).read_text()
    assert "## Where each step's time went (trainer)" in md and "(time_split.png)" in md
    assert "| step | wall s | wait_groups | reward | score | exact_alpha | update | distill | publish | checkpoint " \
           "| other |" in md  # fmt: skip
    assert "| 1 | 3.500 | 2.000 | 0.000 | 0.500 | 0.000 | 0.750 | 0.000 | 0.125 | 0.000 | 0.125 |" in md
    assert "| 2 | 1.875 | 0.250 | 0.000 | 0.500 | 0.000 | 1.000 | 0.000 | 0.125 | 0.000 | 0.000 |" in md
    assert "| 2 | 0.500 | 3.000 | 0.000 | 0.250 | 0.125 | 0.000 |" in md  # the generators' split
    assert (run / "report" / "time_split.png").read_bytes()[:8] == PNG
    figs = json.loads((run / "report" / "figures.json").read_text())
    assert figs["time_split"]["wait_groups"] == [[1, 2.0], [2, 0.25]] and figs["time_split"]["update"][1] == [2, 1.0]
    # The bars stack: each phase's bar starts where the one below ends, and the stack reaches the wall time.
    fig, ax = plt.subplots()
    draw(ax, rows, "t")
    tops: dict[float, float] = {}
    for bar in sorted(ax.patches, key=lambda p: (p.get_x(), p.get_y())):
        x = bar.get_x() + bar.get_width() / 2
        assert bar.get_y() == pytest.approx(tops.get(x, 0.0))
        tops[x] = bar.get_y() + bar.get_height()
    plt.close(fig)
    assert tops == {1.0: pytest.approx(3.5), 2.0: pytest.approx(1.875)}
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"wait_groups", "score", "update", "publish", "other"}
    assert set(PHASES) >= {"wait_groups", "other"}


def test_a_history_without_a_time_split_says_so():
    from report.time_split import section, split_figures

    rows = [_row(1, 100.0, 0.25)]
    assert "No step of this history has a time split." in "\n".join(section(rows))
    assert all(v == [] for v in split_figures(rows).values())


def test_the_comparison_sets_dense_and_sparse_time_splits_side_by_side(tmp_path):
    _run(tmp_path / "cmp" / "dense", [_timed(_row(1, 100.0, 0.5, False), 4.0, 1.0, 1.0, 0.0),
                                      _timed(_row(2, 100.0, 0.5, False), 2.0, 1.0, 1.0, 0.0)])  # fmt: skip
    _run(tmp_path / "cmp" / "sparse", [_timed(_row(1, 250.0, 0.5), 1.0, 1.0, 1.0, 0.0)])
    path, _ = build_compare_report(tmp_path / "cmp")
    md = path.read_text()
    assert "(compare_time_split.png)" in md and "| mean seconds per step | dense | sparse |" in md
    assert "| wait_groups | 3.000 | 1.000 |" in md and "| wall | 5.125 | 3.125 |" in md
    assert (tmp_path / "cmp" / "compare_time_split.png").read_bytes()[:8] == PNG
