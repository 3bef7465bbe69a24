"""The metrics history: trainer steps joined with real generator exporters' counters, one row per step."""

import json

import pytest
from rich.console import Console

from services.generator.metrics import GeneratorMetrics
from services.launcher.history import History, HistorySources, read_history
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
