"""The generator's side of the work contract (`sparrow.work`): claiming, acking, retrying and dead-lettering.

Every generator reads the prompts stream through one consumer group, as consumer `generator_id`.
An entry stays pending in the group until the trainer has acked all `n` trajectories of its group;
only then is it XACKed. A live generator touches its pending entries (XCLAIM to itself with JUSTID,
which resets their idle time without counting a delivery), so only a dead generator's entries
grow idle past `claim_idle_s`; those are taken over with XAUTOCLAIM by whichever generator looks
next. An entry delivered more than `max_deliveries` times is poison (it kills whoever takes it)
and is dead-lettered instead of generated again.

Why no group reaches the trainer twice. Trajectory ids are deterministic:
`{group_id}/{attempt}/{sample_index}`, and the trainer is idempotent by id (a second trajectory
with a known id is acked DUPLICATE and not stored again). A generator that reclaims a group
another one half-sent regenerates all `n` samples (new samples, same ids): the ids the dead
generator got through come back DUPLICATE and only the missing ones are stored, so the trainer
ends with exactly one trajectory per sample index. A retry after a rejection advances `attempt`,
so its trajectories are new ids: the trainer decided to refuse the old ones and judges the new
ones afresh. A group handed back on drain keeps its attempt (nothing was wrong with it), so the
same duplicate rule covers whatever part of it the trainer already has.

Malformed entries (`WorkItemError`) are never retried: they go to the dead-letter stream with the
reason and are acked. Retries and dead-letters write the new entry and ack the old one in one
MULTI, so a crash between the two can neither lose the group nor leave both.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import redis

from services.generator.config import QueueConfig
from services.generator.metrics import GeneratorMetrics
from sparrow.work import GROUP_FIELD, PromptGroup, WorkItemError

log = logging.getLogger("sparrow.generator.queue")

DONE, RETRIED, DEAD_LETTERED, RECLAIMED = "done", "retried", "dead_lettered", "reclaimed"


@dataclass(frozen=True)
class Claimed:
    """A prompt group this generator now owns, with the stream entry it came from."""

    entry_id: str
    group: PromptGroup
    enqueued_at: float  # unix seconds, from the entry id
    deliveries: int  # times the entry was handed to some generator, this time included
    reclaimed: bool  # taken over from another (dead) generator


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _readable(value: bytes | str) -> str:
    """Text of a field of any entry: bytes that are not UTF-8 are kept as backslash escapes."""
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else value


def entry_time(entry_id: str) -> float:
    """Unix seconds at which Redis created entry `entry_id` (its id is `<ms>-<seq>`)."""
    return int(entry_id.split("-", 1)[0]) / 1000.0


class WorkQueue:
    """Claims prompt groups from the stream and settles them: ack, retry, hand back or dead-letter."""

    def __init__(
        self, client: redis.Redis, config: QueueConfig, consumer: str, metrics: GeneratorMetrics | None = None
    ) -> None:
        self.client = client
        self.config = config
        self.consumer = consumer
        self.metrics = metrics
        self._cursor = "0-0"
        self._next_reclaim = 0.0

    def ensure_group(self) -> None:
        """Create the consumer group (and the stream) unless it exists; entries already there are read too."""
        try:
            self.client.xgroup_create(self.config.stream, self.config.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def claim(self, count: int, block_ms: int | None = None) -> list[Claimed]:
        """Up to `count` groups: entries of dead generators first, then new ones (blocking up to `block_ms`)."""
        if count <= 0:
            return []
        out: list[Claimed] = []
        now = time.monotonic()
        if now >= self._next_reclaim:
            # A quarter of the idle timeout is soon enough to notice a dead peer and cheap on Redis.
            self._next_reclaim = now + max(0.05, self.config.claim_idle_s / 4)
            out += self._reclaim(count)
        if len(out) < count:
            out += self._read_new(count - len(out), None if out else block_ms)
        return out

    def _read_new(self, count: int, block_ms: int | None) -> list[Claimed]:
        try:
            reply = self.client.xreadgroup(
                self.config.group, self.consumer, {self.config.stream: ">"}, count=count, block=block_ms
            )
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group()  # the stream was deleted under us (FLUSHDB, trimming by hand)
            return []
        out = []
        for _stream, entries in reply or []:
            for raw_id, fields in entries:
                claimed = self._accept(_text(raw_id), fields, deliveries=1, reclaimed=False)
                if claimed is not None:
                    out.append(claimed)
        return out

    def _reclaim(self, count: int) -> list[Claimed]:
        idle_ms = int(self.config.claim_idle_s * 1000)
        try:
            reply = self.client.xautoclaim(
                self.config.stream, self.config.group, self.consumer, idle_ms, start_id=self._cursor, count=count
            )
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group()
            return []
        self._cursor = _text(reply[0])
        out = []
        for raw_id, fields in reply[1]:
            entry_id = _text(raw_id)
            if fields is None:  # deleted from the stream while pending (Redis < 7 reports it this way)
                self.client.xack(self.config.stream, self.config.group, entry_id)
                continue
            deliveries = self._deliveries(entry_id)
            log.warning("reclaimed %s from a silent generator (delivery %d)", entry_id, deliveries)
            if self.metrics is not None:
                self.metrics.groups.labels(outcome=RECLAIMED).inc()
            if deliveries > self.config.max_deliveries:
                reason = f"delivered {deliveries} times without being finished (poison group?)"
                self.dead_letter(entry_id, fields, reason)
                continue
            claimed = self._accept(entry_id, fields, deliveries=deliveries, reclaimed=True)
            if claimed is not None:
                out.append(claimed)
        return out

    def _deliveries(self, entry_id: str) -> int:
        info = self.client.xpending_range(self.config.stream, self.config.group, entry_id, entry_id, 1)
        return int(info[0]["times_delivered"]) if info else 1

    def _accept(self, entry_id: str, fields: dict, deliveries: int, reclaimed: bool) -> Claimed | None:
        try:
            group = PromptGroup.from_fields(fields)
        except WorkItemError as exc:
            self.dead_letter(entry_id, fields, f"malformed prompt group: {exc}")
            return None
        enqueued = entry_time(entry_id)
        if self.metrics is not None:
            self.metrics.queue_wait.observe(max(0.0, time.time() - enqueued))
        return Claimed(entry_id, group, enqueued, deliveries, reclaimed)

    def ack(self, entry_id: str) -> None:
        """The trainer holds every trajectory of the entry's group: remove it from the pending list."""
        self.client.xack(self.config.stream, self.config.group, entry_id)
        if self.metrics is not None:
            self.metrics.groups.labels(outcome=DONE).inc()

    def retry(self, claimed: Claimed, reason: str) -> str:
        """Re-enqueue a rejected group with attempt + 1, or dead-letter it at the limit; returns the outcome."""
        group = claimed.group
        if group.attempt + 1 >= self.config.max_attempts:
            self.dead_letter(
                claimed.entry_id,
                group.to_fields(),
                f"rejected on attempt {group.attempt + 1} of {self.config.max_attempts}: {reason}",
            )
            return DEAD_LETTERED
        self._replace(claimed.entry_id, group.retried().to_fields())
        log.warning("group %s rejected (%s); re-enqueued as attempt %d", group.group_id, reason, group.attempt + 1)
        if self.metrics is not None:
            self.metrics.groups.labels(outcome=RETRIED).inc()
        return RETRIED

    def hand_back(self, claimed: Claimed) -> None:
        """Give an unfinished group back to the stream (same attempt) so another generator takes it at once."""
        self._replace(claimed.entry_id, claimed.group.to_fields())

    def _replace(self, entry_id: str, fields: dict[str, str]) -> None:
        with self.client.pipeline(transaction=True) as pipe:
            pipe.xadd(self.config.stream, fields)
            pipe.xack(self.config.stream, self.config.group, entry_id)
            pipe.execute()

    def dead_letter(self, entry_id: str, fields: dict, reason: str) -> None:
        """Move an entry to the dead-letter stream with the reason, and ack it (never generated again)."""
        raw = fields.get(GROUP_FIELD, fields.get(GROUP_FIELD.encode()))
        if raw is None:  # keep whatever the entry held, for whoever reads the dead letters
            raw = json.dumps({_readable(k): _readable(v) for k, v in fields.items()})
        letter = {
            GROUP_FIELD: raw,
            "reason": reason,
            "entry_id": entry_id,
            "generator_id": self.consumer,
            "time": repr(time.time()),
        }
        with self.client.pipeline(transaction=True) as pipe:
            pipe.xadd(self.config.dead_letter_stream, letter)
            pipe.xack(self.config.stream, self.config.group, entry_id)
            pipe.execute()
        log.error("dead-lettered %s: %s", entry_id, reason)
        if self.metrics is not None:
            self.metrics.groups.labels(outcome=DEAD_LETTERED).inc()

    def heartbeat(self, entry_ids: list[str]) -> set[str]:
        """Reset the idle time of our pending entries; returns those no longer ours (taken over by a peer)."""
        if not entry_ids:
            return set()
        ours = {
            _text(p["message_id"])
            for p in self.client.xpending_range(
                self.config.stream,
                self.config.group,
                min(entry_ids, key=_id_key),
                max(entry_ids, key=_id_key),
                len(entry_ids) + 16,
                consumername=self.consumer,
            )
        }
        mine = [e for e in entry_ids if e in ours]
        if mine:
            # JUSTID: the delivery counter stays as it is, so heartbeats never look like redeliveries.
            self.client.xclaim(self.config.stream, self.config.group, self.consumer, 0, mine, justid=True)
        return set(entry_ids) - ours

    def backlog(self) -> Backlog | None:
        """The consumer group's lag and pending entries; None when the group does not exist (yet)."""
        return consumer_group_backlog(self.client, self.config.stream, self.config.group)


@dataclass(frozen=True)
class Backlog:
    """Where the stream's work stands for one consumer group (XINFO GROUPS)."""

    lag: int | None  # entries not yet delivered to any consumer; None before Redis 7
    pending: int  # delivered and not acked: in flight, or left by a dead consumer until reclaimed

    @property
    def outstanding(self) -> int:
        """Groups waiting or in progress: what the generators together must hold to keep up."""
        return (self.lag or 0) + self.pending


def consumer_group_backlog(client: redis.Redis, stream: str, group: str) -> Backlog | None:
    """`group`'s Backlog on `stream`; None when the stream or the group does not exist."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream yet
        return None
    for info in groups:
        if _text(info["name"]) == group:
            lag = info.get("lag")
            return Backlog(lag=None if lag is None else int(lag), pending=int(info.get("pending", 0)))
    return None


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
