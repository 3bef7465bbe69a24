"""What `sparrow trainer` checks in the launching process, before any rank (or the one process) starts.

A rank that meets a config it cannot run, an unusable model folder or a run dir of another model
exits 2 with one line; with N ranks that is N lines among the launcher's logs, after a rendezvous
that can take minutes on several nodes. The same faults are found here first, cheaply and without
touching the run dir: the world size against the config (ranks.check_world), the model folder built
on the meta device (no weights read), and the newest checkpoint's tensor names and shapes against
that model (its DCP metadata only).
"""

from __future__ import annotations

from pathlib import Path

from services.trainer.config import TrainerServiceConfig
from trainer.model_io import model_positions


class PrecheckError(ValueError):
    """The trainer cannot start as configured; one line."""


def check_start(config: TrainerServiceConfig, world: int) -> None:
    """PrecheckError (one line) when `config` cannot train on `world` processes, its model folder cannot be built,
    or the run dir's newest checkpoint holds another model."""
    from services.trainer.ranks import RankSetupError, check_world
    from trainer.model_io import ModelLoadError, model_shapes

    try:
        check_world(config, world)
    except RankSetupError as exc:
        raise PrecheckError(str(exc)) from None
    try:
        shapes = model_shapes(config.model_dir)
        positions = model_positions(config.model_dir)
    except ModelLoadError as exc:
        raise PrecheckError(str(exc)) from None
    check_positions(config, positions)
    check_checkpoint(Path(config.run_dir) / "checkpoints", shapes, config.model_dir)


def check_positions(config: TrainerServiceConfig, positions: int | None) -> None:
    """PrecheckError when the chain task's longest prompt plus answer would run past the model's positions
    (RoPE does not extrapolate: such samples would be nonsense, not just long)."""
    if config.data.train_files or positions is None:
        return
    chain = config.task.chain()
    if chain.sequence_tokens() > positions:
        raise PrecheckError(
            f"task {chain.name}: prompt plus longest answer is {chain.sequence_tokens()} tokens, past the "
            f"{positions} positions of {config.model_dir}"
        )


def check_checkpoint(root: Path, shapes: dict[str, tuple[int, ...]], model_dir: str) -> None:
    """PrecheckError when the newest complete checkpoint under `root` holds a model other than `shapes` (names and
    sizes of the model's state dict).

    A checkpoint whose metadata does not read is left to the ranks: they fall back to the one before
    (services/trainer/checkpoint.py) or stop with one line when none loads.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from services.trainer.checkpoint import complete_checkpoints

    found = complete_checkpoints(root)
    if not found:
        return
    newest = found[-1]
    try:
        held = dcp.FileSystemReader(str(newest / "state")).read_metadata().state_dict_metadata
    except Exception:  # damaged in any way: not this check's to judge
        return
    saved = {
        key.removeprefix("model."): tuple(meta.size)
        for key, meta in held.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    problem = _difference(saved, shapes)
    if problem:
        raise PrecheckError(
            f"{newest} is a checkpoint of another model than {model_dir}: {problem}; point model_dir at the "
            "run's model, or use another run_dir"
        )


def _difference(saved: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]]) -> str:
    """The first way `saved` differs from `wanted`, in words; empty when they agree."""

    def more(n: int) -> str:
        return f" ({n} more)" if n else ""

    wrong = sorted(k for k in wanted if k in saved and saved[k] != wanted[k])
    if wrong:
        k = wrong[0]
        return f"{k} is {list(saved[k])} there and {list(wanted[k])} in the model{more(len(wrong) - 1)}"
    missing = sorted(set(wanted) - set(saved))
    if missing:
        return f"it lacks {missing[0]}{more(len(missing) - 1)}"
    extra = sorted(set(saved) - set(wanted))
    if extra:
        return f"it holds {extra[0]}, which the model has not{more(len(extra) - 1)}"
    return ""
