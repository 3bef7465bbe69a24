"""The group ledger: every prompt group the feeder enqueued, with its answer, durable in the run dir.

A group is written here (fsync'd) before it goes on the Redis Stream, and marked `queued` once it is
there, so a crash between the two re-enqueues it instead of leaving it outstanding forever (a
duplicate entry costs only duplicate acks). Answers never leave the trainer. The log is JSON
lines; a torn last line is cut off on start, damage before the end stops the start.

States live in memory: `outstanding` (enqueued, not yet in a step), `taken` (in the step running
now), `trained`, `dropped` (too stale) and `dead` (dead-lettered, written here too). Which groups
were trained or dropped is the checkpoint's to say (it must match the model's state); `finish`
records it in memory and the next checkpoint makes it durable.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.trainer.store import fsync_dir

log = logging.getLogger("sparrow.trainer.ledger")

LEDGER_NAME = "groups.log"
OUTSTANDING, TAKEN, TRAINED, DROPPED, DEAD = "outstanding", "taken", "trained", "dropped", "dead"
EVALUATED = "evaluated"  # an evaluation group whose samples were scored (never trained)
FINISHED = (TRAINED, DROPPED, EVALUATED)
TRAIN, EVAL = "train", "eval"


class LedgerError(RuntimeError):
    """The ledger cannot be read back (damaged before its end) or written."""


@dataclass(frozen=True)
class GroupRecord:
    """What the trainer keeps about one enqueued group."""

    index: int
    group_id: str
    prompt_token_ids: tuple[int, ...]
    n: int
    answer: str | None  # the ground truth (None: the row had none)
    policy_version: int
    max_new_tokens: int
    prompt_text: str = ""
    created_at: float = 0.0
    data_source: str = "chain"  # ledgers written before datasets held chain groups only
    reward: str = "chain"
    extras: dict = field(default_factory=dict)  # the row's extra_info, for the reward
    columns: dict = field(default_factory=dict)  # the row's other fields (its prompt left out), for the reward
    row_prompt: str | list = ""  # the row's prompt as it held it (text or chat messages), for the reward
    purpose: str = TRAIN  # or EVAL: a held-out prompt of an evaluation round, scored and never trained
    dense: bool = False  # generated with dense attention whatever the schedule (evaluation rounds)


class GroupLedger:
    """Enqueued groups by id with their states; thread-safe."""

    def __init__(self, folder: str | Path, finished: dict[str, str] | None = None) -> None:
        """Read the ledger back; `finished` (group id -> trained|dropped) comes from the checkpoint resumed."""
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / LEDGER_NAME
        self._lock = threading.RLock()  # compaction's predicate may ask for a state
        self._records: dict[str, GroupRecord] = {}
        self._state: dict[str, str] = dict(finished or {})
        self._queued: set[str] = set()
        self._dead_reason: dict[str, str] = {}
        self.next_index = 0
        for offset, entry in self._read():
            try:
                self._apply(entry)
            except (KeyError, TypeError, AttributeError, ValueError) as exc:  # JSON, but not an entry of ours
                raise LedgerError(
                    f"{self.path}: damaged entry at byte {offset} ({type(exc).__name__}: {exc})"
                ) from None
        self._file = self.path.open("a", encoding="utf-8")
        fsync_dir(self.folder)

    def _read(self) -> list[tuple[int, dict]]:
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        entries, offset = [], 0
        for line in data.splitlines(keepends=True):
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no newline")
                entries.append((offset, json.loads(line)))
            except ValueError:
                if offset + len(line) == len(data):
                    log.warning("%s: cutting a torn last line left by a crash", self.path)
                    with self.path.open("r+b") as f:
                        f.truncate(offset)
                        os.fsync(f.fileno())
                    break
                raise LedgerError(f"{self.path}: damaged line at byte {offset} with more lines after it") from None
            offset += len(line)
        return entries

    def _apply(self, entry: dict) -> None:
        kind, gid = entry.get("kind"), entry.get("group_id")
        if kind == "enqueued":
            rec = GroupRecord(**{**entry["group"], "prompt_token_ids": tuple(entry["group"]["prompt_token_ids"])})
            self._records[rec.group_id] = rec
            self._state.setdefault(rec.group_id, OUTSTANDING)
            if rec.purpose == TRAIN:  # eval groups are no place in the training prompt stream
                self.next_index = max(self.next_index, rec.index + 1)
        elif kind == "queued":
            self._queued.add(gid)
        elif kind == "dead":
            if self._state.get(gid) not in FINISHED:
                self._state[gid] = DEAD
                self._dead_reason[gid] = entry.get("reason", "")
        else:
            raise LedgerError(f"{self.path}: unknown entry kind {kind!r}")

    def _append(self, entry: dict) -> None:
        try:
            self._file.write(json.dumps(entry, separators=(",", ":"), default=str) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise LedgerError(f"{self.path}: cannot write: {exc.strerror or exc}") from None

    def add(self, record: GroupRecord) -> None:
        """Record a new group durably (before it is put on the stream)."""
        with self._lock:
            if record.group_id in self._records or record.group_id in self._state:
                raise LedgerError(f"group {record.group_id} is already in the ledger")
            self._append({"kind": "enqueued", "group": asdict(record)})
            self._records[record.group_id] = record
            self._state[record.group_id] = OUTSTANDING
            if record.purpose == TRAIN:
                self.next_index = max(self.next_index, record.index + 1)

    def mark_queued(self, group_id: str) -> None:
        """The group is on the stream."""
        with self._lock:
            self._append({"kind": "queued", "group_id": group_id})
            self._queued.add(group_id)

    def mark_dead(self, group_id: str, reason: str) -> bool:
        """Dead-lettered: never trained. False when the group is not one of ours still waiting."""
        with self._lock:
            if self._state.get(group_id) not in (OUTSTANDING,):
                return False
            self._append({"kind": "dead", "group_id": group_id, "reason": reason})
            self._state[group_id] = DEAD
            self._dead_reason[group_id] = reason
            return True

    def get(self, group_id: str) -> GroupRecord | None:
        """The group's record (None when unknown or compacted away)."""
        with self._lock:
            return self._records.get(group_id)

    def state(self, group_id: str) -> str | None:
        """outstanding, taken, trained, dropped, dead, or None for a group never enqueued here."""
        with self._lock:
            return self._state.get(group_id)

    def dead_reason(self, group_id: str) -> str:
        with self._lock:
            return self._dead_reason.get(group_id, "")

    def evaluated_ids(self) -> set[str]:
        """Evaluation groups already scored and reported."""
        with self._lock:
            return {gid for gid, s in self._state.items() if s == EVALUATED}

    def dead_ids(self) -> set[str]:
        """Groups dead-lettered."""
        with self._lock:
            return {gid for gid, s in self._state.items() if s == DEAD}

    def outstanding(self, purpose: str = TRAIN) -> list[GroupRecord]:
        """Groups of `purpose` enqueued and not yet taken by a step (or evaluated), oldest first."""
        with self._lock:
            recs = [
                r for gid, r in self._records.items() if self._state.get(gid) == OUTSTANDING and r.purpose == purpose
            ]
        return sorted(recs, key=lambda r: r.index)

    def unqueued(self) -> list[GroupRecord]:
        """Outstanding groups never confirmed on the stream (a crash or a Redis error came between)."""
        with self._lock:
            recs = [r for gid, r in self._records.items() if self._state.get(gid) == OUTSTANDING]
            return sorted((r for r in recs if r.group_id not in self._queued), key=lambda r: r.index)

    def take(self, group_ids: Iterable[str]) -> None:
        """Groups going into the step running now."""
        self._move(group_ids, OUTSTANDING, TAKEN)

    def release(self, group_ids: Iterable[str]) -> None:
        """A step that failed gives its groups back."""
        self._move(group_ids, TAKEN, OUTSTANDING)

    def finish(self, group_ids: Iterable[str], state: str) -> None:
        """Groups trained or dropped (the next checkpoint makes it durable)."""
        if state not in FINISHED:
            raise ValueError(f"finish state must be one of {FINISHED}, got {state!r}")
        with self._lock:
            for gid in group_ids:
                self._state[gid] = state

    def _move(self, group_ids: Iterable[str], src: str, dst: str) -> None:
        with self._lock:
            for gid in group_ids:
                if self._state.get(gid) != src:
                    raise ValueError(f"group {gid} is {self._state.get(gid)}, not {src}")
                self._state[gid] = dst

    def finished(self) -> dict[str, str]:
        """Group id -> trained|dropped, for the checkpoint."""
        with self._lock:
            return {gid: s for gid, s in self._state.items() if s in FINISHED}

    def compact(self, keep: Callable[[str], bool]) -> int:
        """Rewrite the log with the groups `keep` accepts (temp file, fsync, rename); returns groups removed."""
        with self._lock:
            kept = [r for gid, r in sorted(self._records.items(), key=lambda kv: kv[1].index) if keep(gid)]
            removed = len(self._records) - len(kept)
            if removed == 0:
                return 0
            tmp = self.path.with_suffix(".compact")
            with tmp.open("w", encoding="utf-8") as f:
                for r in kept:
                    entry = {"kind": "enqueued", "group": asdict(r)}
                    f.write(json.dumps(entry, separators=(",", ":"), default=str) + "\n")
                    if r.group_id in self._queued:
                        f.write(json.dumps({"kind": "queued", "group_id": r.group_id}) + "\n")
                    if self._state.get(r.group_id) == DEAD:
                        reason = self._dead_reason.get(r.group_id, "")
                        f.write(json.dumps({"kind": "dead", "group_id": r.group_id, "reason": reason}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self._file.close()
            os.replace(tmp, self.path)
            fsync_dir(self.folder)
            self._file = self.path.open("a", encoding="utf-8")
            for gid in [g for g in self._records if not keep(g)]:
                self._records.pop(gid)
            return removed

    def close(self) -> None:
        with self._lock:
            self._file.close()
