"""Weights & Biases: offline by default (RUN_DIR/wandb/offline-run-*, upload later with `wandb sync`).

W&B keeps one step axis that only moves forward (a row for a step below the last one logged is dropped),
while an evaluation round reports steps after the step it ran after. Its metrics (eval/*) are therefore
drawn against an axis of their own, eval/step (`define_metric`), and ride on the newest row.
"""

from __future__ import annotations

from pathlib import Path

from services.launcher.tracking.base import Tracker

EVAL_STEP = "eval/step"  # the x-axis of the evaluation metrics: the training step each round ran after


class WandbTracker(Tracker):
    """wandb.init with the run's config and tags; one `log` per step; the report's plots as wandb.Image."""

    name = "wandb"

    def __init__(
        self, *, project: str, run_name: str, tags: list[str], mode: str, root: Path, entity: str, run_id: str = ""
    ) -> None:
        self.project, self.run_name, self.tags = project, run_name, tags
        self.mode, self.root, self.entity = mode, root, entity
        self.run_id = run_id  # the W&B run id: a resumed run (same id) logs on into the same run
        self._run = None
        self._step = 0  # the last step logged

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
            id=self.run_id or None,
            resume="allow" if self.run_id else None,
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
        self._run.define_metric(EVAL_STEP)
        self._run.define_metric("eval/*", step_metric=EVAL_STEP)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)
        self._step = max(self._step, step)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log({**metrics, EVAL_STEP: step}, step=max(step, self._step))

    def log_images(self, step: int, images: dict[str, Path]) -> None:
        import wandb

        self._run.log({name: wandb.Image(str(path)) for name, path in images.items()}, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
