"""`sparrow up --model-size tiny --steps 3 --generators 1 --no-controller --run-dir DIR --json`, for real:
Redis, Prometheus, a generator and the trainer as processes on loopback (reference engine, tiny model),
with TensorBoard, an offline W&B run and an MLflow file store, read back from each (one run serves both:
a `sparrow up` run is the expensive part of these tests)."""

import json
import re

import pytest

from report.history import read_history
from tests.cli_runner import sparrow_process as sparrow
from tests.integration.launcher.helpers import UpProcess, alive, processes, tiny_config, trained_and_dropped
from tests.tracking_readers import mlflow_run, mlflow_series, tensorboard_images, tensorboard_scalars, wandb_offline_run

pytestmark = pytest.mark.slow

TRACKING = """
[tracking]
backends = ["tensorboard", "wandb", "mlflow"]
project = "sparrow-test"
run_name = "tiny-3"
tags = ["tiny", "ci"]
"""


def test_three_steps_end_to_end_then_nothing_is_left_running(tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_config(tmp_path / "up.toml", extra=TRACKING)
    up = UpProcess(
        "--config", str(config), "--model-size", "tiny", "--steps", "3", "--generators", "1",
        "--no-controller", "--run-dir", str(run_dir), "--json",
    )  # fmt: skip
    try:
        code = up.wait(300)
    finally:
        up.kill()
    assert code == 0, up.proc.stderr.read()[-3000:]

    steps = [o for o in up.lines if o["type"] == "step"]
    (summary,) = [o for o in up.lines if o["type"] == "summary"]
    assert up.lines[-1] is summary
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert 0 <= s["reward"] <= 1 and 0 <= s["accuracy"] <= 1
        assert s["p5"] and all(0 <= v <= 1 for v in s["p5"].values())
        assert s["published_version"] == s["policy_version"] + 1
    assert summary["outcome"] == "completed" and summary["steps_done"] == 3

    # The policy version advanced on the generator: it served a version the trainer published after a step.
    # (v2 is published after step 1; the swap is asynchronous, so a 2-step run could end before it.)
    assert summary["generator_policy_versions"]["gen-0"] >= 2
    assert max(s["generator_policy_versions"].get("gen-0", 0) for s in steps) >= 1

    # The per-step JSON is the history, which is the trainer's own record of each step.
    history = read_history(run_dir)
    assert [{k: v for k, v in s.items() if k != "type"} for s in steps] == history
    trainer_steps = [json.loads(line) for line in (run_dir / "trainer" / "steps.jsonl").read_text().splitlines()]
    for row, own in zip(history, trainer_steps, strict=True):
        assert row["reward"] == own["reward_mean"] and row["accuracy"] == own["accuracy"]
        assert row["p5"] == {str(b["bin"]): b["p5"] for b in own["alpha_bins"]}

    # Every group the trainer trained on was trained once; nothing on the stream is unaccounted for.
    history_groups, dropped, ledger = trained_and_dropped(run_dir)
    trained = [g for step in history_groups for g in step]
    assert len(trained) == len(set(trained)) == 6 and not dropped
    work = summary["work"]
    assert work["lost"] == [] and work["trained_twice"] == [] and work["groups_trained"] == 6
    assert work["groups_waiting"] == len(ledger - set(trained) - set(dropped))
    assert work["groups_enqueued"] == 6 + work["groups_waiting"]

    _every_step_reached_every_tracker(run_dir, summary, history)

    # The report's figures are the history's.
    report = (run_dir / "report" / "report.md").read_text()
    figures = json.loads((run_dir / "report" / "figures.json").read_text())
    assert figures["reward_accuracy"]["reward"] == [[r["step"], r["reward"]] for r in history]
    assert figures["p5"] == {f"bin {b}": [[r["step"], r["p5"][b]] for r in history] for b in history[0]["p5"]}
    steps_table = report.split("\n## Steps\n")[1]  # the time split's table also has a row per step
    for r in history:
        line = next(x for x in steps_table.splitlines() if re.match(rf"\| {r['step']} \|", x))
        assert f"| {r['reward']:.3f} | {r['accuracy']:.3f} |" in line
        assert f"| v{r['published_version']} |" in line
    for png in ("reward_accuracy", "p5", "schedule", "tokens_per_s"):
        assert (run_dir / "report" / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["report"] == str(run_dir / "report" / "report.md")

    # The run folder holds what was promised.
    assert (run_dir / "config.toml").is_file() and (run_dir / "schedule.json").is_file()
    for name in ("trainer", "gen-0"):
        assert (run_dir / "services" / f"{name}.toml").is_file()
    for name in ("trainer", "gen-0", "redis", "prometheus", "up"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0
    # A clean stop is quiet: no service's log holds a traceback (a stopping gRPC server's cancelled calls included).
    for log_file in (run_dir / "logs").glob("*.log"):
        text = log_file.read_text(errors="replace")
        assert "Traceback (most recent call last)" not in text and "CancelledError" not in text, log_file.name
    assert list((run_dir / "trainer" / "checkpoints").glob("step-*"))

    # No child process survives the launcher.
    children = processes(run_dir)
    assert set(children) == {"redis", "prometheus", "trainer", "gen-0"}
    assert not [c["name"] for c in children.values() if alive(c["pid"])]

    # `sparrow report` rebuilds the same report from the history.
    (run_dir / "report" / "report.md").unlink()
    result = sparrow("report", run_dir)
    assert result.returncode == 0, result.stderr
    assert (run_dir / "report" / "report.md").read_text() == report


def _every_step_reached_every_tracker(run_dir, summary, history) -> None:
    """TensorBoard, MLflow and W&B each hold every step's reward and tail as the history does."""
    assert summary["tracking"] == {"tensorboard": "ok", "wandb": "ok", "mlflow": "ok"}
    reward = {r["step"]: r["reward"] for r in history}
    tail = {b: {r["step"]: r["p5"][b] for r in history} for b in history[0]["p5"]}
    assert tail

    tb = tensorboard_scalars(run_dir / "tensorboard")
    assert tb["train/reward"] == pytest.approx(reward)
    for b, series in tail.items():
        assert tb[f"tail/bin_{b}/p5"] == pytest.approx(series)
    assert {"report/p5", "report/reward_accuracy"} <= set(tensorboard_images(run_dir / "tensorboard"))

    client, run = mlflow_run((run_dir / "mlruns").as_uri(), "sparrow-test")
    assert run.info.run_name == "tiny-3" and {"tiny", "ci"} <= set(run.data.tags)
    assert run.data.params["up.steps"] == "3" and run.data.params["trainer.groups_per_step"] == "2"
    assert mlflow_series(client, run.info.run_id, "train/reward") == pytest.approx(reward)
    for b, series in tail.items():
        assert mlflow_series(client, run.info.run_id, f"tail/bin_{b}/p5") == pytest.approx(series)
    assert "report/p5.png" in {a.path for a in client.list_artifacts(run.info.run_id, "report")}

    config, rows = wandb_offline_run(run_dir)
    assert config["up"]["steps"] == 3 and config["trainer"]["sampling"]["max_new_tokens"] == 16
    by_step = {h["_step"]: h for h in rows}
    assert sorted(by_step) == [1, 2, 3]
    assert {s: h["train/reward"] for s, h in by_step.items()} == pytest.approx(reward)
    for b, series in tail.items():
        assert {s: h[f"tail/bin_{b}/p5"] for s, h in by_step.items()} == pytest.approx(series)
    assert by_step[3]["report/p5/_type"] == "image-file"
