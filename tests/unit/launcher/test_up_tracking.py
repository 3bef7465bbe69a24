"""The trackers of `sparrow up`, for real: TensorBoard event files, an offline W&B run, an MLflow file store."""

import json
import math
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from services.launcher.tracking.config import TrackingConfig
from services.launcher.tracking.factory import backend_dirs, missing_backends, open_trackers
from services.launcher.tracking.names import tracked_eval_metrics, tracked_metrics
from tests.tracking_readers import mlflow_run, mlflow_series, tensorboard_images, tensorboard_scalars, wandb_offline_run


def row(step: int, **extra) -> dict:
    """A history row as services/launcher/history.py writes it."""
    return {
        "step": step,
        "time": 1.0e9 + step,
        "elapsed_s": 2.5 * step,
        "reward": 0.25 * step,
        "accuracy": 0.5,
        "response_length": 12.0,
        "samples": 8,
        "alpha_mean": 0.93,
        "p5": {"0": 0.9 + 0.01 * step, "1": 0.8},
        "alpha_tokens": {"0": 100, "1": 40},
        "p5_promql": {},
        "probe_samples": 0,
        "probe_p5": {},
        "tau": 0.86,
        "policy_version": step,
        "published_version": step + 1,
        "trained_schedule_version": 1,
        "schedule_version": 1,
        "schedule_budgets": [64, 128],
        "bin_width": 256,
        "predicted_speedup": 1.7,
        "generated_tokens": 500.0,
        "tokens_per_s": None,
        "rollout_tokens_per_s": float("nan"),
        "sparse_token_fraction": 0.6,
        "attended_kv_fraction": 0.4,
        "generator_policy_versions": {"gen-0": step},
        "generator_adapter_versions": {"gen-0": 0},
        "staleness": 0.0,
        "kl_rollout_dense": None,
        "tis_clip_fraction": 0.0,
        "step_seconds": 1.5,
        **extra,
    }


def test_a_row_is_tracked_under_stable_names_grouped_by_prefix():
    m = tracked_metrics(row(2, eval_avg_at_4=0.5, eval={"math": {"pass@4": 0.75}}, reward_format=0.1))
    assert m["train/reward"] == 0.5 and m["train/accuracy"] == 0.5 and m["train/samples"] == 8
    assert m["tail/bin_0/p5"] == pytest.approx(0.92) and m["tail/bin_1/p5"] == 0.8
    assert m["tail/bin_0/tokens"] == 100 and m["tail/probe_samples"] == 0
    assert m["schedule/bin_0/budget"] == 64 and m["schedule/bin_1/budget"] == 128
    assert m["schedule/version"] == 1 and m["schedule/predicted_speedup"] == 1.7 and m["schedule/tau"] == 0.86
    assert m["rollout/gen-0/policy_version"] == 2 and m["rollout/sparse_token_fraction"] == 0.6
    assert m["eval/avg_at_4"] == 0.5 and m["eval/math/pass@4"] == 0.75
    assert m["train/reward_format"] == 0.1  # a field a newer trainer adds
    extra = {"reward_extra": {"/data/my_rewards.py:compute_score": {"acc": 1.0}, "math": {"format": 0.5}}}
    m2 = tracked_metrics(row(2, **extra))
    assert m2["reward/my_rewards.py:compute_score/acc"] == 1.0 and m2["reward/math/format"] == 0.5
    # None, NaN and the row's own step/time are left out.
    assert "rollout/tokens_per_s" not in m and "rollout/engine_tokens_per_s" not in m
    assert "train/kl_rollout_dense" not in m and "train/step" not in m and "train/time" not in m
    assert all(isinstance(v, int | float) and math.isfinite(v) for v in m.values())


def test_the_time_split_is_tracked_under_timing():
    m = tracked_metrics(
        row(3, **{"timing/wait_groups": 1.5, "timing/other": 0.25, "step_wall_seconds": 1.75},
            generator_timing={"decode": 2.0, "idle": float("nan")})
    )  # fmt: skip
    assert m["timing/wait_groups"] == 1.5 and m["timing/other"] == 0.25
    assert m["timing/generator/decode"] == 2.0 and "timing/generator/idle" not in m  # not finite: left out
    assert m["train/step_wall_seconds"] == 1.75
    assert not any(k.startswith("train/timing") for k in m)


def _all_three(tmp_path) -> TrackingConfig:
    return TrackingConfig(backends=["tensorboard", "wandb", "mlflow"], project="proj", run_name="r1", tags=["t"])


def test_every_backend_reads_back_each_step_once_with_the_config_and_the_plots(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "report").mkdir(parents=True)
    shutil.copy(_png(tmp_path), run_dir / "report" / "p5.png")
    config = _all_three(tmp_path)
    messages = []
    trackers = open_trackers(config, run_dir, {"up": {"steps": 3, "tau": 0.86}}, messages.append)
    rows = [row(1), row(2), row(2), row(3)]  # step 2 seen twice (the last poll): logged once
    for r in rows:
        trackers.log_row(r)
    trackers.finish(run_dir / "report")
    assert messages == [] and trackers.status == {"tensorboard": "ok", "wandb": "ok", "mlflow": "ok"}

    want_reward = {1: 0.25, 2: 0.5, 3: 0.75}
    want_p5 = {s: 0.9 + 0.01 * s for s in (1, 2, 3)}
    tb = tensorboard_scalars(run_dir / "tensorboard")
    assert tb["train/reward"] == pytest.approx(want_reward) and tb["tail/bin_0/p5"] == pytest.approx(want_p5)
    assert tensorboard_images(run_dir / "tensorboard") == ["report/p5"]

    client, run = mlflow_run((run_dir / "mlruns").as_uri(), "proj")
    assert run.info.run_name == "r1" and "t" in run.data.tags and run.data.params["up.steps"] == "3"
    assert mlflow_series(client, run.info.run_id, "train/reward") == pytest.approx(want_reward)
    assert mlflow_series(client, run.info.run_id, "tail/bin_0/p5") == pytest.approx(want_p5)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "report")}
    assert artifacts == {"report/p5.png"}
    local = client.download_artifacts(run.info.run_id, "config.json", str(tmp_path))
    assert json.loads(Path(local).read_text()) == {"up": {"steps": 3, "tau": 0.86}}

    wandb_config, history = wandb_offline_run(run_dir)
    assert wandb_config["up"] == {"steps": 3, "tau": 0.86}
    by_step = {h["_step"]: h for h in history}
    assert sorted(by_step) == [1, 2, 3]
    assert {s: h["train/reward"] for s, h in by_step.items()} == pytest.approx(want_reward)
    assert {s: h["tail/bin_0/p5"] for s, h in by_step.items()} == pytest.approx(want_p5)
    assert by_step[3]["report/p5/_type"] == "image-file"


def eval_row(rnd: int, step: int, mode: str, avg: float, **extra) -> dict:
    """An evaluation row of the history as services/launcher/history.py writes it."""
    figures = {"prompts": 3, "samples": 12, "avg@4": avg, "pass@1": avg, "pass@4": min(1.0, 2 * avg)}
    return {
        "kind": "eval",
        "step": step,
        "round": rnd,
        "time": 1.0e9,
        "elapsed_s": 1.0,
        "policy_version": step + 1,
        "k": 4,
        "mode": mode,
        "dense": mode == "dense",
        "complete": True,
        "prompts": 3,
        "sources": {"toy/arith": figures},
        "eval_seconds": 2.5,
        **extra,
    }


def _round(rnd: int, step: int, dense: float, scheduled: float) -> list[dict]:
    gap = {"toy/arith": {"avg@4": dense - scheduled, "pass@1": dense - scheduled}}
    return [eval_row(rnd, step, "dense", dense), eval_row(rnd, step, "schedule", scheduled, dense_gap=gap)]


def test_an_eval_row_is_tracked_per_mode_and_source_with_the_gap():
    dense, scheduled = _round(1, 2, 0.5, 0.25)
    assert tracked_eval_metrics(dense) == {
        "eval/dense/toy/arith/prompts": 3,
        "eval/dense/toy/arith/samples": 12,
        "eval/dense/toy/arith/avg@4": 0.5,
        "eval/dense/toy/arith/pass@1": 0.5,
        "eval/dense/toy/arith/pass@4": 1.0,
        "eval/dense/seconds": 2.5,
    }
    m = tracked_eval_metrics(scheduled)
    assert m["eval/schedule/toy/arith/avg@4"] == 0.25 and m["eval/schedule/toy/arith/pass@4"] == 0.5
    assert m["eval/dense_gap/toy/arith/avg@4"] == 0.25 and m["eval/dense_gap/toy/arith/pass@1"] == 0.25
    # A row of a trainer from before eval.modes (no mode, `dense` only) is tracked under its mode all the same.
    old = {k: v for k, v in eval_row(0, 0, "schedule", 0.1).items() if k != "mode"}
    assert tracked_eval_metrics(old)["eval/schedule/toy/arith/avg@4"] == 0.1


def test_every_backend_reads_back_each_eval_round_at_the_step_it_ran_after(tmp_path):
    run_dir = tmp_path / "run"
    messages = []
    trackers = open_trackers(_all_three(tmp_path), run_dir, {"up": {"steps": 3}}, messages.append)
    # Round 0 runs before step 1; round 1 runs after step 2 and ends after step 3 was logged (training goes
    # on while a round generates): the order the history hands them over.
    for r in [*_round(0, 0, 0.5, 0.25), row(1), row(2), row(3), *_round(1, 2, 0.75, 0.5)]:
        if r.get("kind") == "eval":
            trackers.log_eval(r)
        else:
            trackers.log_row(r)
    trackers.finish(None)
    assert messages == [] and trackers.status == {"tensorboard": "ok", "wandb": "ok", "mlflow": "ok"}

    want = {
        "eval/dense/toy/arith/avg@4": {0: 0.5, 2: 0.75},
        "eval/schedule/toy/arith/avg@4": {0: 0.25, 2: 0.5},
        "eval/dense_gap/toy/arith/avg@4": {0: 0.25, 2: 0.25},
    }
    tb = tensorboard_scalars(run_dir / "tensorboard")
    client, run = mlflow_run((run_dir / "mlruns").as_uri(), "proj")
    for name, series in want.items():
        assert tb[name] == pytest.approx(series), name
        assert mlflow_series(client, run.info.run_id, name.replace("@", "_")) == pytest.approx(series), name
    assert tb["train/reward"] == pytest.approx({1: 0.25, 2: 0.5, 3: 0.75})  # the steps' own rows untouched

    # W&B: a step below the last one logged would be dropped; the figures ride on the newest row, against
    # their own axis eval/step (define_metric), so that none is lost and each is drawn at its step.
    _config, history = wandb_offline_run(run_dir)
    evals = [h for h in history if "eval/step" in h]
    for name, series in want.items():
        assert {h["eval/step"]: h[name] for h in evals if name in h} == pytest.approx(series), name
    assert sorted(h["_step"] for h in history if "train/reward" in h) == [1, 2, 3]


def test_a_backend_that_fails_mid_run_is_reported_once_and_dropped_while_the_others_go_on(tmp_path):
    run_dir = tmp_path / "run"
    config = TrackingConfig(backends=["mlflow", "tensorboard"], project="proj")
    messages = []
    trackers = open_trackers(config, run_dir, {"up": {}}, messages.append)
    trackers.log_row(row(1))
    trackers.flush()
    # The MLflow store is gone (a disk swapped out, a folder removed): a file stands where it was.
    shutil.rmtree(run_dir / "mlruns")
    (run_dir / "mlruns").write_text("not a folder")
    for step in (2, 3):
        trackers.log_row(row(step))
    trackers.finish(None)
    assert len(messages) == 1 and messages[0].startswith("tracking: mlflow failed to log step 2")
    assert trackers.status["mlflow"].startswith("disabled:") and trackers.status["tensorboard"] == "ok"
    assert sorted(tensorboard_scalars(run_dir / "tensorboard")["train/reward"]) == [1, 2, 3]


def test_a_tracking_server_that_never_answers_holds_up_neither_the_caller_nor_the_other_trackers(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # once released, fail at once
    release = threading.Event()
    accepted = threading.Event()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def hold():  # accepts MLflow's first request and answers nothing until released
        conn, _ = server.accept()
        accepted.set()
        release.wait(60)
        conn.close()
        server.close()

    threading.Thread(target=hold, daemon=True).start()
    uri = f"http://127.0.0.1:{server.getsockname()[1]}"
    config = TrackingConfig(backends=["mlflow", "tensorboard"], mlflow={"tracking_uri": uri})
    messages = []
    trackers = open_trackers(config, tmp_path / "run", {}, messages.append)
    assert accepted.wait(30)
    for step in (1, 2, 3):
        trackers.log_row(row(step))  # returns while MLflow's start is still waiting for its answer
    deadline = time.monotonic() + 60
    while sorted(tensorboard_scalars(tmp_path / "run" / "tensorboard").get("train/reward", {})) != [1, 2, 3]:
        assert time.monotonic() < deadline, "TensorBoard never got the steps while MLflow was blocked"
        time.sleep(0.1)
    assert not release.is_set() and messages == []  # MLflow is still blocked: TensorBoard went on without it
    release.set()
    trackers.finish(None)
    assert len(messages) == 1 and messages[0].startswith("tracking: mlflow failed to start"), messages
    assert trackers.status["tensorboard"] == "ok" and trackers.status["mlflow"].startswith("disabled:")


def test_a_backend_whose_folder_cannot_be_written_is_disabled_at_start(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    config = TrackingConfig(backends=["tensorboard", "wandb"], tensorboard={"dir": str(blocker / "tb")},
                            wandb={"dir": str(blocker / "wb")})  # fmt: skip
    messages = []
    trackers = open_trackers(config, tmp_path / "run", {}, messages.append)
    trackers.log_row(row(1))
    trackers.finish(None)
    assert sorted(m.split(" failed")[0] for m in messages) == ["tracking: tensorboard", "tracking: wandb"]
    assert set(trackers.status) == {"tensorboard", "wandb"}
    assert all(s.startswith("disabled:") for s in trackers.status.values())
    assert not list(tmp_path.glob("**/offline-run-*"))  # W&B did not fall back to another folder


def test_backend_folders_and_the_install_hint(tmp_path, monkeypatch):
    config = _all_three(tmp_path)
    dirs = backend_dirs(config, tmp_path)
    assert dirs == {"tensorboard": tmp_path / "tensorboard", "wandb": tmp_path, "mlflow": tmp_path / "mlruns"}
    assert missing_backends(config) == []
    server = TrackingConfig(backends=["mlflow"], mlflow={"tracking_uri": "http://127.0.0.1:5000"})
    assert backend_dirs(server, tmp_path) == {}
    import importlib.util

    real = importlib.util.find_spec
    # Not installed: simulated by hiding the package from the import system (it is installed here).
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert missing_backends(config) == [
        "tracking backend wandb needs the wandb package: pip install 'sparrow-cluster[wandb]'"
    ]


def _png(tmp_path):
    from PIL import Image

    path = tmp_path / "plot.png"
    Image.new("RGB", (16, 8), (200, 30, 30)).save(path)
    return path


def test_the_two_arms_of_a_comparison_are_two_tracker_runs(tmp_path):
    from services.launcher.compare import _tracking
    from services.launcher.config import UpConfig

    up = UpConfig(tracking={"backends": ["tensorboard", "wandb"], "tags": ["x"], "tensorboard": {"dir": "tb"}})
    dense, sparse = (_tracking(up, tmp_path / "cmp", m) for m in ("dense", "sparse"))
    assert (dense.run_name, sparse.run_name) == ("cmp-dense", "cmp-sparse")
    assert dense.tags == ["x", "dense"] and sparse.tensorboard.dir == str(Path("tb") / "sparse")
    assert dense.wandb.dir == "" and up.tracking.run_name == "" and up.tracking.tags == ["x"]
