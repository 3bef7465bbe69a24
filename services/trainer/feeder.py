"""The feeder: keeps a bounded number of prompt groups on the Redis Stream the generators consume.

Each group is the next prompt of the run's dataset mix (services/trainer/training_data.py: a user's
sources, or the built-in chain task, already templated and tokenized), `n` samples at the configured
sampling, tagged with the policy version current when it was made and with the reward its
data_source uses. It is written to the ledger (answer included; answers never travel) before XADD, so a crash in
between re-enqueues it. The feeder also re-enqueues a group that has waited too long (a lost stream
entry must not stall training), every waiting group at once when the stream itself is gone (Redis
flushed or restarted empty), and reads the dead-letter stream, marking its own dead groups.

Redis errors are logged and retried on the next tick; they never stop the trainer.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from services.trainer.ledger import EVAL, OUTSTANDING, GroupLedger, GroupRecord
from services.trainer.metrics import TrainerMetrics
from services.trainer.store import TrajectoryStore
from services.trainer.training_data import TrainingData
from sparrow.work import DEAD_LETTER_STREAM, GENERATOR_GROUP, PROMPTS_STREAM, PromptGroup, Sampling, WorkItemError

log = logging.getLogger("sparrow.trainer.feeder")

DEAD_READ_COUNT = 100


@dataclass(frozen=True)
class FeedSettings:
    """What the feeder makes and how many it keeps ahead."""

    run_id: str
    data: TrainingData
    seed: int
    n: int
    sampling: Sampling
    outstanding: int
    requeue_after_s: float
    shuffle: bool = True


class Feeder:
    """Draws prompts, records them, enqueues them, and watches the dead-letter stream."""

    def __init__(
        self,
        client: redis.Redis,
        ledger: GroupLedger,
        store: TrajectoryStore,
        settings: FeedSettings,
        policy_version: Callable[[], int],
        metrics: TrainerMetrics,
    ) -> None:
        self.client = client
        self.ledger = ledger
        self.store = store
        self.settings = settings
        self.policy_version = policy_version
        self.metrics = metrics
        self.mix = settings.data.mix(settings.seed, settings.shuffle)
        self.position = 0  # prompts drawn from the mix so far
        self._queued_at: dict[str, float] = {}
        self._dead_cursor = "0-0"
        self._last_added: bytes | str | None = None  # the entry this process added last to the prompt stream
        self._lost: set[str] = set()  # groups whose entries went with the stream, to enqueue again
        self._group_ready = False
        self._redis_down = False  # log the outage once, not every tick

    # -- data position ----------------------------------------------------------------------------

    def state(self) -> dict:
        """The data position, for the checkpoint: prompts drawn and the mix's state."""
        return {"position": self.position, "mix": self.mix.state()}

    def restore(self, state: dict | None) -> None:
        """Continue the prompt stream where the checkpoint left it, then past every group the ledger holds."""
        if state and "mix" in state:
            try:
                self.mix.restore(state["mix"])
                self.position = int(state["position"])
            except (ValueError, KeyError, TypeError) as exc:
                # Another dataset than the checkpoint's: its position means nothing here; start the mix over.
                log.warning("the checkpoint's data position does not fit this dataset (%s); drawing afresh", exc)
        # Groups enqueued after the checkpoint are in the ledger: skip the prompts they used.
        while self.position < self.ledger.next_index:
            self.mix.next()
            self.position += 1
        # Compaction may have emptied the ledger; indices (and so group ids) never repeat.
        self.ledger.next_index = max(self.ledger.next_index, self.position)

    # -- the queue --------------------------------------------------------------------------------

    def ensure_consumer_group(self) -> None:
        """Create the generators' consumer group (and the stream) if missing; idempotent."""
        try:
            self.client.xgroup_create(PROMPTS_STREAM, GENERATOR_GROUP, id="0", mkstream=True)
            log.info("created consumer group %s on %s", GENERATOR_GROUP, PROMPTS_STREAM)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def tick(self) -> None:
        """One round: dead letters, groups to (re)enqueue, top-up to the bound. Never raises on Redis errors."""
        try:
            self._check_stream()
            if not self._group_ready:
                self.ensure_consumer_group()
            self._read_dead_letters()
            for record in self.ledger.unqueued():
                self._enqueue(record)
            self._enqueue_lost()
            self._requeue_stalled()
            missing = self.settings.outstanding - len(self.ledger.outstanding())
            for _ in range(max(0, missing)):
                self._enqueue(self._new_group())
        except (redis.RedisError, OSError) as exc:
            if not self._redis_down:
                log.warning("feeder: Redis unavailable (%s); retrying every tick", exc)
            self._redis_down = True
        else:
            if self._redis_down:
                log.info("feeder: Redis is back")
            self._redis_down = False
        self.metrics.outstanding.set(len(self.ledger.outstanding()))

    def _new_group(self) -> GroupRecord:
        index = self.position  # group index = the prompt's place in the stream
        _, prompt = self.mix.next()
        self.position += 1
        sample = prompt.sample
        record = GroupRecord(
            index=index,
            group_id=f"{self.settings.run_id}-{index:08d}",
            prompt_token_ids=prompt.token_ids,
            n=self.settings.n,
            answer=sample.ground_truth,
            policy_version=self.policy_version(),
            max_new_tokens=self.settings.sampling.max_new_tokens,
            prompt_text=prompt.text,
            created_at=time.time(),
            data_source=sample.data_source,
            reward=self.settings.data.rewards[sample.data_source],
            extras=sample.extras,
            columns=sample.columns,
            row_prompt=sample.prompt if isinstance(sample.prompt, str) else list(sample.prompt),
        )
        self.ledger.add(record)
        return record

    def add(self, record: GroupRecord) -> None:
        """Record a group made elsewhere (an evaluation's) and put it on the stream; a Redis error leaves it
        unqueued in the ledger, and the next tick enqueues it."""
        self.ledger.add(record)
        try:
            self._enqueue(record)
        except (redis.RedisError, OSError) as exc:
            log.warning("feeder: cannot enqueue %s now (%s); the next tick retries", record.group_id, exc)

    def _enqueue(self, record: GroupRecord, attempt: int = 0) -> None:
        group = PromptGroup(
            group_id=record.group_id,
            prompt_token_ids=record.prompt_token_ids,
            n=record.n,
            policy_version=record.policy_version,
            sampling=self.settings.sampling,
            created_at=record.created_at,
            attempt=attempt,
            prompt_text=record.prompt_text,
            dense=record.dense,
            evaluation=record.purpose == EVAL,
        )
        self._last_added = self.client.xadd(PROMPTS_STREAM, group.to_fields())
        self.ledger.mark_queued(record.group_id)
        self._queued_at[record.group_id] = time.monotonic()

    def _check_stream(self) -> None:
        # Nothing here deletes entries: when the last one added is gone, so is the stream (a FLUSHALL, Redis
        # restarted without its data, the key deleted), with every group queued on it. Waiting out
        # requeue_after_s would stall training that long.
        if self._last_added is None or self.client.xrange(PROMPTS_STREAM, self._last_added, self._last_added):
            return
        self._lost = {r.group_id for r in self.ledger.outstanding() if self.store.count(r.group_id) < r.n}
        log.warning("%s lost its entries (Redis flushed or restarted empty): enqueuing %d group(s) again",
                    PROMPTS_STREAM, len(self._lost))  # fmt: skip
        self._last_added = None
        self._group_ready = False

    def _enqueue_lost(self) -> None:
        for group_id in sorted(self._lost):
            record = self.ledger.get(group_id)
            if record is not None and self.ledger.state(group_id) == OUTSTANDING:
                self._enqueue(record)
            self._lost.discard(group_id)

    def _requeue_stalled(self) -> None:
        now = time.monotonic()
        for record in self.ledger.outstanding():
            since = self._queued_at.setdefault(record.group_id, now)  # after a restart: count from now
            if now - since > self.settings.requeue_after_s and self.store.count(record.group_id) < record.n:
                log.warning("group %s incomplete after %.0f s: enqueued again", record.group_id, now - since)
                self._enqueue(record)

    def _read_dead_letters(self) -> None:
        while True:
            entries = self.client.xrange(DEAD_LETTER_STREAM, min=f"({self._dead_cursor}", count=DEAD_READ_COUNT)
            if not entries:
                return
            for entry_id, fields in entries:
                self._dead_cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                group_id, reason = _dead_group(fields)
                if group_id and self.ledger.mark_dead(group_id, reason):
                    self.metrics.groups_dead.inc()
                    log.warning("group %s was dead-lettered: %s", group_id, reason or "no reason given")
            if len(entries) < DEAD_READ_COUNT:
                return


def _dead_group(fields: dict) -> tuple[str | None, str]:
    """(group id, reason) of a dead-letter entry: the group's JSON under `group`, or a bare `group_id` field."""
    decoded = {
        (k.decode() if isinstance(k, bytes) else k): (v.decode(errors="replace") if isinstance(v, bytes) else v)
        for k, v in fields.items()
    }
    reason = decoded.get("reason", "")
    try:
        return PromptGroup.from_fields(decoded).group_id, reason
    except WorkItemError:
        return decoded.get("group_id"), reason


def new_run_id() -> str:
    """A short id that makes this run's group ids unique on a shared stream."""
    return f"{random.SystemRandom().getrandbits(32):08x}"
