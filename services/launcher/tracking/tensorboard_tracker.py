"""TensorBoard: event files under RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR/tensorboard`)."""

from __future__ import annotations

import json
from pathlib import Path

from services.launcher.tracking.base import Tracker


class TensorBoardTracker(Tracker):
    """Scalars per step, the config as a text summary, the report's plots as images."""

    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._writer = None

    def start(self, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        # TensorBoard renders text as Markdown: indented lines stay a literal block.
        text = "\n".join("    " + line for line in json.dumps(config, indent=1, sort_keys=True).splitlines())
        self._writer.add_text("config", text, 0)
        self._writer.flush()  # raises what the writer thread met (an unwritable folder)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def log_images(self, step: int, images: dict[str, Path]) -> None:
        import numpy as np
        from PIL import Image

        for name, path in images.items():
            with Image.open(path) as image:
                self._writer.add_image(name, np.asarray(image.convert("RGB")), step, dataformats="HWC")
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
