"""The trajectory store: an append-only log of accepted trajectories in the run dir, fsync'd before each ack.

Each record is `length (u32) | crc32 (u32) | Trajectory message bytes`. On start the log is read back
to rebuild the index; a torn last record (a crash mid-write: short, or its checksum wrong at the end
of the file) is cut off, since its ack was never sent. A bad record with more data after it is
damage, not a torn write, and the store refuses to start rather than silently lose what follows.

Exactly one trajectory is kept per (group_id, sample_index); a trajectory id seen before, or a
second trajectory for a filled slot, is a duplicate. Trained groups stay (so resends of their
trajectories stay duplicates) until `compact` removes them from memory and file, once every kept
checkpoint records them as trained.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

from services.api.sparrow.v1 import rollout_pb2

log = logging.getLogger("sparrow.trainer.store")

LOG_NAME = "trajectories.log"
_HEADER = struct.Struct("<II")
ACCEPTED, DUPLICATE = "accepted", "duplicate"


class StoreError(RuntimeError):
    """The log cannot be read back (damaged in the middle) or written; one line naming the file and offset."""


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _whole_record_after(data: bytes, start: int) -> int | None:
    """Offset of the first whole record (non-empty, checksum right) starting after `start`; None when none."""
    for p in range(start + 1, len(data) - _HEADER.size + 1):
        length, crc = _HEADER.unpack_from(data, p)
        end = p + _HEADER.size + length
        if 0 < length and end <= len(data) and zlib.crc32(data[p + _HEADER.size : end]) == crc:
            return p
    return None


def replace_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a temporary file beside it, fsync'd, renamed over it, folder fsync'd."""
    tmp = path.with_name(f".tmp-{path.name}")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class TrajectoryStore:
    """Accepted trajectories by group and sample index, durable on disk; safe to use from many threads."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / LOG_NAME
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._groups: dict[str, dict[int, rollout_pb2.Trajectory]] = {}
        self._ids: dict[str, tuple[str, int]] = {}
        self._records = 0
        self._load()
        self._file = self.path.open("ab")
        fsync_dir(self.folder)

    def _load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        offset = 0
        while offset < len(data):
            end = offset + _HEADER.size
            if end > len(data):
                break  # torn header
            length, crc = _HEADER.unpack_from(data, offset)
            if end + length > len(data):
                after = _whole_record_after(data, offset)
                if after is None:
                    break  # torn body
                # A torn write leaves part of one record; a length that runs past whole records is damage.
                raise StoreError(
                    f"{self.path}: damaged record at byte {offset} (its length runs past the end) "
                    f"with a record at byte {after} after it"
                )
            body = data[end : end + length]
            if zlib.crc32(body) != crc:
                if end + length == len(data):
                    break  # the last record, half written
                raise StoreError(f"{self.path}: damaged record at byte {offset} with more records after it")
            t = rollout_pb2.Trajectory.FromString(body)
            self._index(t)
            self._records += 1
            offset = end + length
        if offset < len(data):
            log.warning("%s: cutting a torn last record (%d bytes) left by a crash", self.path, len(data) - offset)
            with self.path.open("r+b") as f:
                f.truncate(offset)
                f.flush()
                os.fsync(f.fileno())

    def _index(self, t: rollout_pb2.Trajectory) -> None:
        self._groups.setdefault(t.group_id, {})[t.sample_index] = t
        self._ids[t.trajectory_id] = (t.group_id, t.sample_index)

    def add(self, t: rollout_pb2.Trajectory) -> str:
        """Store `t` durably (ACCEPTED) unless its id or its (group, sample index) slot is taken (DUPLICATE)."""
        body = t.SerializeToString()
        with self._lock:
            if t.trajectory_id in self._ids or t.sample_index in self._groups.get(t.group_id, {}):
                return DUPLICATE
            try:
                self._file.write(_HEADER.pack(len(body), zlib.crc32(body)) + body)
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError as exc:
                raise StoreError(f"{self.path}: cannot write: {exc.strerror or exc}") from None
            self._index(t)
            self._records += 1
            self._changed.notify_all()
        return ACCEPTED

    def has_id(self, trajectory_id: str) -> bool:
        """Whether a trajectory with this id is stored."""
        with self._lock:
            return trajectory_id in self._ids

    def count(self, group_id: str) -> int:
        """Samples stored for the group."""
        with self._lock:
            return len(self._groups.get(group_id, {}))

    def samples(self, group_id: str) -> list[rollout_pb2.Trajectory]:
        """The group's stored trajectories, by sample index."""
        with self._lock:
            slots = self._groups.get(group_id, {})
            return [slots[i] for i in sorted(slots)]

    def group_ids(self) -> set[str]:
        """Groups with at least one stored trajectory."""
        with self._lock:
            return set(self._groups)

    def wait(self, timeout: float) -> None:
        """Block until a trajectory is added or `timeout` seconds pass."""
        with self._changed:
            self._changed.wait(timeout)

    def compact(self, keep: Callable[[str], bool]) -> int:
        """Rewrite the log with only the records of groups `keep` accepts; returns the records dropped.

        Written to a temporary file, fsync'd and renamed over the log, so a crash leaves one or the other.
        """
        with self._lock:
            kept = [t for slots in self._groups.values() for t in slots.values() if keep(t.group_id)]
            dropped = self._records - len(kept)
            if dropped == 0:
                return 0
            tmp = self.path.with_suffix(".compact")
            with tmp.open("wb") as f:
                for t in kept:
                    body = t.SerializeToString()
                    f.write(_HEADER.pack(len(body), zlib.crc32(body)) + body)
                f.flush()
                os.fsync(f.fileno())
            self._file.close()
            os.replace(tmp, self.path)
            fsync_dir(self.folder)
            self._file = self.path.open("ab")
            self._records = len(kept)
            for gid in [g for g in self._groups if not keep(g)]:
                for t in self._groups.pop(gid).values():
                    self._ids.pop(t.trajectory_id, None)
            return dropped

    def close(self) -> None:
        """Close the log file and wake every waiter."""
        with self._lock:
            self._file.close()
            self._changed.notify_all()
