"""Starts the trainer: logs the resolved config, trains until the steps are done or SIGTERM, exits cleanly."""

from __future__ import annotations

import logging
import signal
import threading

from services.trainer.config import TrainerServiceConfig

log = logging.getLogger("sparrow.trainer")


class SetupError(ValueError):
    """The config names something unusable (a missing model folder, a damaged run dir); one line."""


def serve(config: TrainerServiceConfig) -> int:
    """Run the trainer service; SIGTERM or SIGINT checkpoints and stops it. Returns the steps done."""
    from services.trainer.checkpoint import CheckpointError, TrainState
    from services.trainer.ledger import LedgerError
    from services.trainer.service import RunDirError, TrainerService
    from services.trainer.store import StoreError
    from services.trainer.training_data import DataInputError
    from trainer.model_io import ModelLoadError

    log.info("config %s", config.dump())
    stop = threading.Event()
    try:
        service = TrainerService(config)
    except (ModelLoadError, StoreError, LedgerError, CheckpointError, RunDirError, DataInputError) as exc:
        raise SetupError(str(exc)) from None
    except OSError as exc:  # the run dir is not a folder, not writable, on a full disk ...
        where = f"{exc.filename}: " if exc.filename else ""
        what = "not a folder" if isinstance(exc, (FileExistsError, NotADirectoryError)) else exc.strerror or exc
        raise SetupError(f"cannot start: {where}{what}") from None
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        state: TrainState = service.run(stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return state.step
