"""Weights & Biases: offline by default (RUN_DIR/wandb/offline-run-*, upload later with `wandb sync`)."""

from __future__ import annotations

from pathlib import Path

from services.launcher.tracking.base import Tracker


class WandbTracker(Tracker):
    """wandb.init with the run's config and tags; one `log` per step; the report's plots as wandb.Image."""

    name = "wandb"

    def __init__(self, *, project: str, run_name: str, tags: list[str], mode: str, root: Path, entity: str) -> None:
        self.project, self.run_name, self.tags = project, run_name, tags
        self.mode, self.root, self.entity = mode, root, entity
        self._run = None

    def start(self, config: dict) -> None:
        import wandb

        # W&B falls back to a temporary folder when `dir` is unwritable; a run kept elsewhere than
        # configured is a failure here, so the folder is made (or refused) first.
        self.root.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=self.project,
            name=self.run_name,
            tags=self.tags or None,
            entity=self.entity or None,
            mode=self.mode,
            dir=str(self.root),
            config=config,
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def log_images(self, step: int, images: dict[str, Path]) -> None:
        import wandb

        self._run.log({name: wandb.Image(str(path)) for name, path in images.items()}, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
