"""`sparrow up --model-size tiny --steps 3 --generators 1 --no-controller --run-dir DIR --json`, for real:
Redis, Prometheus, a generator and the trainer as processes on loopback (reference engine, tiny model)."""

import json
import re

import pytest

from services.launcher.history import read_history
from tests.cli_runner import sparrow
from tests.integration.launcher.helpers import UpProcess, alive, processes, tiny_config, trained_and_dropped

pytestmark = pytest.mark.slow


def test_three_steps_end_to_end_then_nothing_is_left_running(tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_config(tmp_path / "up.toml")
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

    # The report's figures are the history's.
    report = (run_dir / "report" / "report.md").read_text()
    figures = json.loads((run_dir / "report" / "figures.json").read_text())
    assert figures["reward_accuracy"]["reward"] == [[r["step"], r["reward"]] for r in history]
    assert figures["p5"] == {f"bin {b}": [[r["step"], r["p5"][b]] for r in history] for b in history[0]["p5"]}
    for r in history:
        line = next(x for x in report.splitlines() if re.match(rf"\| {r['step']} \|", x))
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
