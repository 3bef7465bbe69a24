"""Checkpoints: model and optimizer (torch.distributed.checkpoint), and the run's position, atomically.

    run_dir/checkpoints/step-000000012/state/   DCP shards of {"model", "optim"} (one file per rank)
    run_dir/checkpoints/step-000000012/meta.json  step, policy version, feeder position, finished groups

Model and optimizer go through `get_state_dict` / `set_state_dict` and DCP, so the same code saves
a plain module and one sharded with FSDP2 (each rank writes its shards; rank 0 the metadata). A
checkpoint is written under a temporary name, fsync'd and renamed: it exists whole or not at all.
The newest `keep` are kept; a start resumes from the newest that loads and sets aside (renamed
`damaged-step-...`) the newer ones that do not.

`history` lists the groups each step trained on and `dropped` those too stale to train: with the
model, they are what makes a resume neither lose nor re-train an accepted trajectory.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from services.common.faults import fault_point
from services.trainer.store import fsync_dir

log = logging.getLogger("sparrow.trainer.checkpoint")

_NAME = re.compile(r"^step-(\d{9,})$")
META = "meta.json"


@dataclass
class TrainState:
    """Everything of a run besides the tensors."""

    run_id: str
    step: int = 0
    policy_version: int = 0
    feeder: dict = field(default_factory=dict)
    history: list[list[str]] = field(default_factory=list)  # history[i]: the groups step i + 1 trained on
    dropped: list[str] = field(default_factory=list)  # groups dropped as too stale, never trained

    @property
    def finished(self) -> dict[str, str]:
        """Group id -> trained | dropped, for every group a step has consumed."""
        out = {gid: "dropped" for gid in self.dropped}
        out.update((gid, "trained") for groups in self.history for gid in groups)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> TrainState:
        return cls(
            run_id=str(d["run_id"]),
            step=int(d["step"]),
            policy_version=int(d["policy_version"]),
            feeder=dict(d.get("feeder", {})),
            history=[[str(g) for g in groups] for groups in d.get("history", [])],
            dropped=[str(g) for g in d.get("dropped", [])],
        )


def _rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _same_on_every_rank(value: str) -> str:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CheckpointPacing:
    """When a checkpoint is due: every `every` steps, or (every = 0) by the time the last one took.

    A checkpoint of a large model costs minutes (Qwen3-8B: about 130 GB of fp32 weights and AdamW
    state); one after every step would spend a large share of the run writing. Paced, a checkpoint
    is due once the time since the last one ended is at least `(1 - f) / f` times what that one took,
    so writing them takes at most the share `f` of the run, or once `max_interval_s` have passed,
    which bounds the training a crash costs (the trajectories are stored: a resume trains those
    steps again, it generates nothing again). A tiny model's checkpoint takes milliseconds, so it
    still gets one nearly every step. The first step of a process always checkpoints: it measures.
    """

    def __init__(
        self, every: int, max_overhead: float, max_interval_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every, self.max_overhead, self.max_interval_s = every, max_overhead, max_interval_s
        self.clock = clock
        self.last_seconds: float | None = None  # what the last checkpoint of this process took
        self.last_end = clock()

    def due(self, step: int) -> bool:
        """Whether the checkpoint of `step` (just trained) is due."""
        if self.every > 0:
            return step % self.every == 0
        if self.last_seconds is None:
            return True
        wait = self.last_seconds * (1.0 - self.max_overhead) / self.max_overhead
        return self.clock() - self.last_end >= min(wait, self.max_interval_s)

    def taken(self, started: float) -> None:
        """Record a checkpoint that began at `started` (this pacing's clock) and has just ended."""
        self.last_end = self.clock()
        self.last_seconds = self.last_end - started


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first (none when `root` does not exist); reads, never writes."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _NAME.match(path.name)
        if m and (path / META).is_file() and (path / "state" / ".metadata").is_file():
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


class CheckpointError(RuntimeError):
    """Checkpoints exist but none loads: resuming from scratch would silently lose the run, so stop instead."""


class CheckpointManager:
    """Saves, lists, prunes and loads the checkpoints under `root`."""

    def __init__(self, root: str | Path, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)

    def remove_unfinished(self) -> None:
        """Delete checkpoints a crash left half written; only the process that writes checkpoints calls it."""
        if _rank0():
            for leftover in self.root.glob(".tmp-*"):
                log.warning("removing %s: a checkpoint that did not finish", leftover)
                shutil.rmtree(leftover, ignore_errors=True)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return complete_checkpoints(self.root)

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainState,
        extra: Mapping[str, Stateful] | None = None,
    ) -> Path:
        """Write a checkpoint of `state` with the model and optimizer; every rank calls it.

        `extra` names further stateful parts (the DistillSparse adapter and its optimizer) saved with them.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        final = self.root / f"step-{state.step:09d}"
        if final.exists():
            return final  # this step is saved already (a stop right after a scheduled checkpoint)
        # One name for every rank (rank 0's): each rank writes its shards into the folder rank 0 renames.
        tmp = self.root / f".tmp-step-{state.step:09d}-{_same_on_every_rank(uuid.uuid4().hex[:8])}"
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # A value every rank holds (the DistillSparse adapter, its version) is written by rank 0, the one that
        # publishes: DCP would otherwise pick any rank's copy of it.
        planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")  # the one-process case is intended
            parts = {"model": model_sd, "optim": optim_sd, **(extra or {})}
            dcp.save(parts, checkpoint_id=str(tmp / "state"), planner=planner)
        _barrier()
        if _rank0():
            fault_point("trainer:checkpoint")
            (tmp / META).write_text(json.dumps(asdict(state)))
            for path in tmp.rglob("*"):
                if path.is_file():
                    with path.open("rb") as f:
                        os.fsync(f.fileno())
            fsync_dir(tmp / "state")
            fsync_dir(tmp)
            os.replace(tmp, final)
            fsync_dir(self.root)
            for old in self.checkpoints()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    def read_state(self, path: Path) -> TrainState:
        """The meta of one checkpoint; ValueError when unreadable."""
        try:
            return TrainState.from_dict(json.loads((path / META).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path / META}: unreadable ({exc})") from None

    def load_latest(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: Mapping[str, Stateful] | None = None,
    ) -> TrainState | None:
        """Load the newest checkpoint that reads back whole into model and optimizer; None when there is none.

        Each part of `extra` the checkpoint holds is loaded too; one it lacks (a run that turns
        DistillSparse on) keeps its fresh state, with a warning. Raises CheckpointError when there
        are checkpoints and none of them loads (a different model, say).
        """
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

        failures, damaged = [], []
        for path in reversed(self.checkpoints()):
            try:
                state = self.read_state(path)
                self._load_tensors(path, model, optimizer, extra or {})
            except (Exception, CheckpointException) as exc:  # damaged in any way: fall back to the one before
                first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                log.error("checkpoint %s does not load (%s); trying the one before", path.name, first_line)
                failures.append(f"{path.name}: {first_line}")
                damaged.append(path)
                continue
            log.info("resumed from %s (step %d, policy v%d)", path.name, state.step, state.policy_version)
            self._set_aside(damaged)
            return state
        if failures:
            raise CheckpointError(f"no checkpoint under {self.root} loads into this model ({failures[-1]})")
        return None

    def _set_aside(self, damaged: list[Path]) -> None:
        # The run continues from an older checkpoint: a damaged newer one left under its name would be taken
        # for the resumed run's own checkpoint of that step (never written) and for what compaction may drop.
        if _rank0():
            for path in damaged:
                aside = path.with_name(f"damaged-{path.name}-{uuid.uuid4().hex[:8]}")
                os.replace(path, aside)
                log.warning("set %s aside as %s", path.name, aside.name)
            if damaged:
                fsync_dir(self.root)
        _barrier()

    def oldest_state(self) -> TrainState | None:
        """The meta of the oldest kept checkpoint: what any possible resume has recorded as finished."""
        for path in self.checkpoints():
            try:
                return self.read_state(path)
            except ValueError:
                continue
        return None

    @staticmethod
    def _load_tensors(
        path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: Mapping[str, Stateful]
    ) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        target: dict = {"model": model_sd, "optim": optim_sd}
        if extra:
            held = dcp.FileSystemReader(str(path / "state")).read_metadata().state_dict_metadata
            for name, part in extra.items():
                if any(key == name or key.startswith(f"{name}.") for key in held):
                    target[name] = part
                else:
                    log.warning("checkpoint %s holds no %r state; it starts fresh", path.name, name)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(target, checkpoint_id=str(path / "state"))
        set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])
