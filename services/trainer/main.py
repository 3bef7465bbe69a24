"""Starts the trainer: logs the resolved config, trains until the steps are done or SIGTERM, exits cleanly.

Under torchrun (WORLD_SIZE > 1) every process joins the process group first; rank 0 then runs the
service and the others follow it (services/trainer/ranks.py).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from services.trainer.config import TrainerServiceConfig

log = logging.getLogger("sparrow.trainer")


class SetupError(ValueError):
    """The config names something unusable (a missing model folder, a damaged run dir); one line."""


def serve(config: TrainerServiceConfig) -> int:
    """Run the trainer service; SIGTERM or SIGINT checkpoints and stops it. Returns the steps done."""
    from services.trainer.checkpoint import CheckpointError, TrainState
    from services.trainer.ledger import LedgerError
    from services.trainer.ranks import RankSetupError, check_world, follow
    from services.trainer.service import RunDirError, TrainerService
    from services.trainer.store import StoreError
    from services.trainer.training_data import DataInputError
    from trainer import distributed
    from trainer.model_io import ModelLoadError

    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        check_world(config, world)
    except RankSetupError as exc:
        raise SetupError(str(exc)) from None
    if distributed.launched_by_torchrun():
        _die_with_torchrun()
        distributed.init_from_env(config.device, config.distributed.timeout_s)
        if distributed.rank() != 0:
            try:
                return _follower(config, follow)
            finally:
                distributed.close()
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
        distributed.close()
    return state.step


def _follower(config: TrainerServiceConfig, follow) -> int:
    from services.trainer.checkpoint import CheckpointError
    from trainer.model_io import ModelLoadError

    try:
        return follow(config)
    except (ModelLoadError, CheckpointError) as exc:
        raise SetupError(str(exc)) from None


def _die_with_torchrun() -> None:
    """This rank ends when torchrun does, even by SIGKILL: an orphaned rank 0 would hold the run's ports."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
