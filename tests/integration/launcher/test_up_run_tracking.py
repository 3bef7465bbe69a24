"""`sparrow up --steps 2` with a tracker that cannot write: reported once, the run completes.

Every tracker reading back every step of a healthy run is checked in `test_up_run.py` (one run serves both)."""

import json

import pytest

from tests.integration.launcher.helpers import UpProcess, tiny_config
from tests.tracking_readers import mlflow_run, mlflow_series

pytestmark = pytest.mark.slow


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
