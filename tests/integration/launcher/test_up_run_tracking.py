"""`sparrow up --steps 2` with TensorBoard, an offline W&B run and an MLflow file store, read back from each."""

import json

import pytest

from services.launcher.history import read_history
from tests.integration.launcher.helpers import UpProcess, tiny_config
from tests.tracking_readers import mlflow_run, mlflow_series, tensorboard_images, tensorboard_scalars, wandb_offline_run

pytestmark = pytest.mark.slow

TRACKING = """
[tracking]
backends = ["tensorboard", "wandb", "mlflow"]
project = "sparrow-test"
run_name = "tiny-2"
tags = ["tiny", "ci"]
"""


def _up(tmp_path, extra: str) -> tuple[UpProcess, int]:
    config = tiny_config(tmp_path / "up.toml", extra=extra)
    up = UpProcess(
        "--config", str(config), "--model-size", "tiny", "--steps", "2", "--no-controller",
        "--run-dir", str(tmp_path / "run"), "--json",
    )  # fmt: skip
    try:
        code = up.wait(300)
    finally:
        up.kill()
    return up, code


def test_every_step_reaches_every_tracker_as_in_the_history(tmp_path):
    up, code = _up(tmp_path, TRACKING)
    assert code == 0, up.proc.stderr.read()[-3000:]
    run_dir = tmp_path / "run"
    (summary,) = [o for o in up.lines if o["type"] == "summary"]  # --json stdout stayed one object per line
    assert summary["tracking"] == {"tensorboard": "ok", "wandb": "ok", "mlflow": "ok"}
    history = read_history(run_dir)
    assert [r["step"] for r in history] == [1, 2]
    reward = {r["step"]: r["reward"] for r in history}
    tail = {b: {r["step"]: r["p5"][b] for r in history} for b in history[0]["p5"]}
    assert tail

    tb = tensorboard_scalars(run_dir / "tensorboard")
    assert tb["train/reward"] == pytest.approx(reward)
    for b, series in tail.items():
        assert tb[f"tail/bin_{b}/p5"] == pytest.approx(series)
    assert {"report/p5", "report/reward_accuracy"} <= set(tensorboard_images(run_dir / "tensorboard"))

    client, run = mlflow_run((run_dir / "mlruns").as_uri(), "sparrow-test")
    assert run.info.run_name == "tiny-2" and {"tiny", "ci"} <= set(run.data.tags)
    assert run.data.params["up.steps"] == "2" and run.data.params["trainer.groups_per_step"] == "2"
    assert mlflow_series(client, run.info.run_id, "train/reward") == pytest.approx(reward)
    for b, series in tail.items():
        assert mlflow_series(client, run.info.run_id, f"tail/bin_{b}/p5") == pytest.approx(series)
    assert "report/p5.png" in {a.path for a in client.list_artifacts(run.info.run_id, "report")}

    config, rows = wandb_offline_run(run_dir)
    assert config["up"]["steps"] == 2 and config["trainer"]["sampling"]["max_new_tokens"] == 16
    by_step = {h["_step"]: h for h in rows}
    assert sorted(by_step) == [1, 2]
    assert {s: h["train/reward"] for s, h in by_step.items()} == pytest.approx(reward)
    for b, series in tail.items():
        assert {s: h[f"tail/bin_{b}/p5"] for s, h in by_step.items()} == pytest.approx(series)
    assert by_step[2]["report/p5/_type"] == "image-file"


def test_a_tracker_that_cannot_write_its_folder_is_reported_once_and_the_run_completes(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the event folder's parent should be")
    extra = f'[tracking]\nbackends = ["tensorboard", "mlflow"]\n[tracking.tensorboard]\ndir = "{blocker / "tb"}"\n'
    up, code = _up(tmp_path, extra)
    assert code == 0, up.proc.stderr.read()[-3000:]
    run_dir = tmp_path / "run"
    (summary,) = [o for o in up.lines if o["type"] == "summary"]
    assert summary["outcome"] == "completed" and summary["steps_done"] == 2
    assert summary["tracking"]["mlflow"] == "ok" and summary["tracking"]["tensorboard"].startswith("disabled:")
    log = (run_dir / "logs" / "up.log").read_text()
    assert log.count("tracking: tensorboard failed") == 1, log
    assert json.loads((run_dir / "summary.json").read_text())["tracking"] == summary["tracking"]
    client, run = mlflow_run((run_dir / "mlruns").as_uri(), "sparrow")
    assert sorted(mlflow_series(client, run.info.run_id, "train/reward")) == [1, 2]
