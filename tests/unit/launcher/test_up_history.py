"""The metrics history: trainer steps joined with real generator exporters' counters, one row per step."""

import json

import pytest
from rich.console import Console

from report.history import read_eval_history, read_history
from services.generator.metrics import GeneratorMetrics
from services.launcher.history import History, HistorySources
from services.launcher.progress import p5_table

SCHEDULE = {"name": "s", "version": 3, "bin_width": 16, "budgets": [48, 64], "page_size": 16}


def _step(n: int, p5: float = 0.9) -> dict:
    return {
        "step": n,
        "policy_version": n,
        "published_version": n + 1,
        "reward_mean": 0.5,
        "accuracy": 0.25,
        "response_length": 10.0,
        "samples": 8,
        "alpha_mean": 0.97,
        "alpha_bins": [{"bin": 0, "kv_start": 0, "tokens": 40, "mean": 0.97, "p5": p5}],
        "schedule_version": 3,
        "seconds": 0.5,
    }


@pytest.fixture
def exporters():
    started = []

    def start() -> tuple[GeneratorMetrics, str]:
        m = GeneratorMetrics()
        port = m.serve("127.0.0.1", 0)
        started.append(m)
        return m, f"http://127.0.0.1:{port}/metrics"

    yield start
    for m in started:
        m.close()


def _history(tmp_path, urls: dict[str, str]) -> History:
    (tmp_path / "trainer").mkdir()
    return History(
        tmp_path,
        HistorySources(
            steps_file=tmp_path / "trainer" / "steps.jsonl",
            generator_metrics=urls,
            redis_client=None,
            prometheus_url=None,
            promql_window_s=30,
            tau=0.86,
            initial_schedule=SCHEDULE,
            follow_redis=False,
            speedup_of=lambda s: 1.5 if s else 1.0,
            evals_file=tmp_path / "trainer" / "evals.jsonl",
        ),
    )


def test_rows_join_the_trainers_step_with_the_generators_counters(tmp_path, exporters):
    gen0, url0 = exporters()
    history = _history(tmp_path, {"gen-0": url0, "gen-1": "http://127.0.0.1:1/metrics"})  # gen-1 is gone
    assert history.poll() == []  # no steps file yet

    gen0.show_schedule(None)
    gen0.record_tokens(20, [48] * 30)  # kv 20..49: only kv 49 exceeds the 48 budget -> one sparse token
    gen0.record_tokens(20, [0] * 10)  # dense
    gen0.step_seconds.observe(0.25)
    gen0.show_versions(4, 0)
    steps = history.sources.steps_file
    steps.write_text(json.dumps(_step(1)) + "\n" + json.dumps(_step(2))[:10])  # step 2 still being written
    (row,) = history.poll()
    assert row["step"] == 1 and row["reward"] == 0.5 and row["accuracy"] == 0.25
    assert row["p5"] == {"0": 0.9} and row["alpha_tokens"] == {"0": 40} and row["tau"] == 0.86
    assert row["generated_tokens"] == 40
    assert row["rollout_tokens_per_s"] == pytest.approx(40 / 0.25)  # tokens per second of engine time
    assert row["sparse_token_fraction"] == pytest.approx(1 / 40)
    assert row["generator_policy_versions"] == {"gen-0": 4}  # gen-1 does not answer: left out
    assert row["schedule_version"] == 3 and row["schedule_budgets"] == [48, 64] and row["predicted_speedup"] == 1.5

    assert row["probe_samples"] == 0 and row["probe_p5"] == {}
    probed = {**_step(2, p5=0.5), "probe_samples": 2, "alpha_probe_bins": [{"bin": 0, "tokens": 9, "p5": 0.25}]}
    steps.write_text(json.dumps(_step(1)) + "\n" + json.dumps(probed) + "\n")
    gen0.record_tokens(20, [0] * 6)
    gen0.step_seconds.observe(0.5)
    (row2,) = history.poll()
    assert row2["step"] == 2 and row2["p5"] == {"0": 0.5}
    assert row2["probe_samples"] == 2 and row2["probe_p5"] == {"0": 0.25}
    console = Console(width=160, record=True)
    console.print(p5_table(row2))
    text = console.export_text()
    assert "probe p5 (2 samples)" in text and "0.250" in text
    assert row2["generated_tokens"] == 6 and row2["rollout_tokens_per_s"] == pytest.approx(6 / 0.5)
    assert read_history(tmp_path) == [row, row2] == history.rows


def test_a_restarted_generators_counters_count_from_zero_again(tmp_path, exporters):
    gen, url = exporters()
    history = _history(tmp_path, {"gen-0": url})
    gen.record_tokens(0, [0] * 50)
    gen.step_seconds.observe(1.0)
    history.sources.steps_file.write_text(json.dumps(_step(1)) + "\n")
    assert history.poll()[0]["generated_tokens"] == 50
    gen.close()
    again, url2 = exporters()  # the same name, a new process: its counters start at 0
    history.sources.generator_metrics["gen-0"] = url2
    again.record_tokens(0, [0] * 7)
    again.step_seconds.observe(0.5)
    with history.sources.steps_file.open("a") as f:
        f.write(json.dumps(_step(2)) + "\n")
    assert history.poll()[0]["generated_tokens"] == 7


def test_dense_runs_record_no_schedule_and_no_speedup_over_dense(tmp_path):
    history = _history(tmp_path, {})
    history.sources.initial_schedule = None
    history.sources.steps_file.write_text(json.dumps(_step(1)) + "\n")
    (row,) = history.poll()
    assert row["schedule_budgets"] is None and row["schedule_version"] == 0 and row["predicted_speedup"] == 1.0
    assert row["generated_tokens"] == 0 and row["rollout_tokens_per_s"] is None


def test_a_step_with_no_generation_since_the_last_scrape_has_no_rate_not_zero(tmp_path, exporters):
    gen, url = exporters()
    history = _history(tmp_path, {"gen-0": url})
    gen.record_tokens(0, [0] * 50)
    gen.step_seconds.observe(1.0)
    history.sources.steps_file.write_text(json.dumps(_step(1)) + "\n")
    assert history.poll()[0]["tokens_per_s"] > 0
    with history.sources.steps_file.open("a") as f:  # step 2 trains groups generated before step 1's scrape
        f.write(json.dumps(_step(2)) + "\n")
    (row,) = history.poll()
    assert row["generated_tokens"] == 0
    assert row["tokens_per_s"] is None and row["rollout_tokens_per_s"] is None


def test_a_line_that_is_not_a_step_is_skipped_not_fatal(tmp_path):
    history = _history(tmp_path, {})
    history.sources.steps_file.write_text("not json\n" + '{"no": "step"}\n' + json.dumps(_step(1)) + "\n")
    assert [r["step"] for r in history.poll()] == [1]


def _round(n: int, step: int, avg: float) -> dict:
    figures = {"prompts": 3, "samples": 6, "avg@2": avg, "pass@1": avg, "pass@2": min(1.0, 2 * avg)}
    return {"round": n, "step": step, "policy_version": step + 1, "k": 2, "complete": True, "dense": True,
            "prompts": 3, "sources": {"toy/arith": figures}, "seconds": 1.5}  # fmt: skip


def test_evaluation_rounds_get_rows_of_their_own_among_the_steps(tmp_path):
    history = _history(tmp_path, {})
    evals, steps = history.sources.evals_file, history.sources.steps_file
    evals.write_text(json.dumps(_round(0, 0, 0.25)) + "\n" + json.dumps(_round(1, 2, 0.5))[:12])  # round 1 unfinished
    assert history.poll() == []  # no step yet: the round before step 1 is written all the same
    steps.write_text(json.dumps(_step(1)) + "\n" + json.dumps(_step(2)) + "\n")
    evals.write_text(json.dumps(_round(0, 0, 0.25)) + "\n" + json.dumps(_round(1, 2, 0.5)) + "\n" + "not json\n")
    assert [r["step"] for r in history.poll()] == [1, 2]  # poll returns step rows only
    assert [r["step"] for r in read_history(tmp_path)] == [1, 2]
    rows = read_eval_history(tmp_path)
    assert [(r["kind"], r["round"], r["step"], r["policy_version"], r["dense"]) for r in rows] == [
        ("eval", 0, 0, 1, True),
        ("eval", 1, 2, 3, True),
    ]
    assert rows[1]["sources"]["toy/arith"]["avg@2"] == 0.5 and history.eval_rows == rows
    kinds = [json.loads(line).get("kind") for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kinds == ["eval", "eval", None, None]  # in the order they ended: round 1 was in before these steps' rows


def test_a_round_dense_and_under_the_schedule_gets_a_row_per_mode_with_the_gap(tmp_path):
    history = _history(tmp_path, {})
    dense = {**_round(0, 0, 0.5), "mode": "dense"}
    gap = {"toy/arith": {"avg@2": 0.25, "pass@1": 0.25, "pass@2": 0.0}}
    scheduled = {**_round(0, 0, 0.25), "mode": "schedule", "dense": False, "dense_gap": gap}
    older = {**_round(1, 2, 0.5), "dense": False}  # a trainer from before eval.modes: `dense` only
    history.sources.evals_file.write_text("".join(json.dumps(r) + "\n" for r in (dense, scheduled, older)))
    history.poll()
    rows = read_eval_history(tmp_path)
    assert [(r["round"], r["mode"], r["dense"]) for r in rows] == [(0, "dense", True), (0, "schedule", False),
                                                                    (1, "schedule", False)]  # fmt: skip
    assert "dense_gap" not in rows[0] and rows[1]["dense_gap"] == gap and "dense_gap" not in rows[2]


def test_steps_trained_again_after_a_resume_replace_the_rows_they_superseded(tmp_path):
    """Steps 1-3, a crash, a resume from step 1's checkpoint: steps 2 and 3 again. Every row stays in the file; the
    history is the run as it stands (steps 1, 2, 3 once each, the second trainings')."""
    history = _history(tmp_path, {})
    lines = [_step(1), _step(2), _step(3), _step(2, p5=0.5), _step(3, p5=0.5)]
    history.sources.steps_file.write_text("".join(json.dumps(s) + "\n" for s in lines))
    history.poll()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5
    assert [r["step"] for r in history.rows] == [1, 2, 3]  # what the live view and the summary count
    rows = read_history(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["p5"] for r in rows] == [{"0": 0.9}, {"0": 0.5}, {"0": 0.5}]


def test_rows_carry_the_trainers_time_split_and_the_generators_over_the_window(tmp_path, exporters):
    gen0, url0 = exporters()
    gen1, url1 = exporters()
    history = _history(tmp_path, {"gen-0": url0, "gen-1": url1})
    gen0.record_phases({"decode": 2.0, "idle": 0.5})
    gen1.record_phases({"decode": 1.0, "prefill": 0.25})
    split = {"timing/wait_groups": 1.25, "timing/score": 0.5, "timing/update": 0.75, "timing/other": 0.5}
    history.sources.steps_file.write_text(json.dumps({**_step(1), **split, "wall_seconds": 3.0}) + "\n")
    (row,) = history.poll()
    assert {k: row[k] for k in split} == split and row["step_wall_seconds"] == 3.0
    assert row["generator_timing"]["decode"] == 3.0 and row["generator_timing"]["prefill"] == 0.25
    assert row["generator_timing"]["idle"] == 0.5 and row["generator_timing"]["weight_sync"] == 0.0
    # The next row holds what the generators spent since the last one, not their totals.
    gen0.record_phases({"decode": 0.5})
    with history.sources.steps_file.open("a") as f:
        f.write(json.dumps(_step(2)) + "\n")
    (row2,) = history.poll()
    assert row2["generator_timing"]["decode"] == 0.5 and row2["generator_timing"]["idle"] == 0.0
    assert not any(k.startswith("timing/") for k in row2)  # a trainer that wrote no split: none made up
