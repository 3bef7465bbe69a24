"""The run's trackers from `[tracking]`: each backend imported only when it is named."""

from __future__ import annotations

import importlib.util
import json
import uuid
from collections.abc import Callable
from pathlib import Path

from services.launcher.tracking.base import Tracker, Trackers
from services.launcher.tracking.config import TrackingConfig
from services.trainer.store import replace_text

KEY_FILE = "tracking.json"  # the run's tracker key: a resumed run (sparrow up --resume) logs on into the same runs

# backend -> (the module it needs, the extra that installs it)
REQUIRES = {
    "tensorboard": ("tensorboard", "sparrow-cluster[tensorboard]"),
    "wandb": ("wandb", "sparrow-cluster[wandb]"),
    "mlflow": ("mlflow", "sparrow-cluster[mlflow]"),
}


def missing_backends(config: TrackingConfig) -> list[str]:
    """One line per named backend whose package is not installed."""
    out = []
    for backend in config.backends:
        module, extra = REQUIRES[backend]
        if importlib.util.find_spec(module) is None:
            out.append(f"tracking backend {backend} needs the {module} package: pip install '{extra}'")
    return out


def backend_dirs(config: TrackingConfig, run_dir: Path) -> dict[str, Path]:
    """The local folder each named backend writes (an MLflow server or database has none)."""
    dirs = {}
    for backend in config.backends:
        if backend == "tensorboard":
            dirs[backend] = Path(config.tensorboard.dir or run_dir / "tensorboard")
        elif backend == "wandb":
            dirs[backend] = Path(config.wandb.dir or run_dir)
        elif backend == "mlflow" and _mlflow_uri(config, run_dir).startswith("file:"):
            dirs[backend] = Path(_mlflow_uri(config, run_dir).removeprefix("file://").removeprefix("file:"))
    return dirs


def _mlflow_uri(config: TrackingConfig, run_dir: Path) -> str:
    return config.mlflow.tracking_uri or (run_dir / "mlruns").resolve().as_uri()


def run_key(run_dir: Path) -> str:
    """The run's tracker key, made at its first start and kept in the run folder: the W&B run id, and the
    MLflow run's `sparrow.run_key` tag, so that a resumed run logs on into the runs it started."""
    path = run_dir / KEY_FILE
    try:
        key = str(json.loads(path.read_text())["key"])
        if key.isalnum():
            return key
    except (OSError, ValueError, KeyError, TypeError):
        pass
    key = uuid.uuid4().hex
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_text(path, json.dumps({"key": key}) + "\n")
    return key


def make_tracker(backend: str, config: TrackingConfig, run_dir: Path) -> Tracker:
    """One backend's tracker (its package is imported when the run starts, not here)."""
    name = config.run_name or run_dir.name
    dirs = backend_dirs(config, run_dir)
    if backend == "tensorboard":
        from services.launcher.tracking.tensorboard_tracker import TensorBoardTracker

        return TensorBoardTracker(dirs[backend])
    if backend == "wandb":
        from services.launcher.tracking.wandb_tracker import WandbTracker

        w = config.wandb
        return WandbTracker(
            project=config.project,
            run_name=name,
            tags=config.tags,
            mode=w.mode,
            root=dirs[backend],
            entity=w.entity,
            run_id=run_key(run_dir),
        )
    if backend == "mlflow":
        from services.launcher.tracking.mlflow_tracker import MlflowTracker

        return MlflowTracker(
            tracking_uri=_mlflow_uri(config, run_dir),
            experiment=config.mlflow.experiment or config.project,
            run_name=name,
            tags=config.tags,
            run_key=run_key(run_dir),
        )
    raise ValueError(f"unknown tracking backend {backend!r}")


def open_trackers(
    config: TrackingConfig, run_dir: Path, run_config: dict, notify: Callable[[str], None] = lambda message: None
) -> Trackers:
    """Every named backend's tracker, started with `run_config`; one that cannot start is reported and left out."""
    for message in missing_backends(config):  # `sparrow up` refuses these before the run; a direct caller is told
        notify(message)
    missing = {b for b in config.backends if importlib.util.find_spec(REQUIRES[b][0]) is None}
    made = [make_tracker(b, config, run_dir) for b in config.backends if b not in missing]
    trackers = Trackers(made, notify, record=run_dir / KEY_FILE)
    trackers.start(run_config)
    return trackers
