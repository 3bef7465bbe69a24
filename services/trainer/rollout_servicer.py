"""RolloutService: generators stream trajectories; each is checked, stored durably and acked.

One stream per generator: a hello first (answered with the versions the trainer publishes), then
trajectories in any number. A bad trajectory is acked REJECTED with the reason and the stream goes
on; a stream-level problem (no hello first, a message of neither kind, one over the size limit,
which gRPC itself refuses) ends that stream alone with a gRPC status.

The servicer runs on the trainer's asyncio gRPC server (services/common/aio_server.py): an open stream
holds no thread. Checking and storing a trajectory (an fsync before its ACCEPTED) runs on the server's
blocking-work pool, one trajectory of a stream at a time, so its ack is sent only once it is durable.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from services.api.sparrow.v1 import rollout_pb2, rollout_pb2_grpc
from services.trainer.ledger import DEAD, FINISHED, TAKEN, GroupLedger, GroupRecord
from services.trainer.metrics import TrainerMetrics
from services.trainer.store import ACCEPTED, StoreError, TrajectoryStore
from services.trainer.validate import MAX_ID_CHARS, Limits, check_against_group, check_structure
from services.trainer.weight_servicer import WeightServicer

log = logging.getLogger("sparrow.trainer.rollout")

_STATUS = {
    "accepted": rollout_pb2.ACK_STATUS_ACCEPTED,
    "duplicate": rollout_pb2.ACK_STATUS_DUPLICATE,
    "rejected": rollout_pb2.ACK_STATUS_REJECTED,
}


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Receives trajectories into the store for groups the ledger knows."""

    def __init__(
        self,
        store: TrajectoryStore,
        ledger: GroupLedger,
        weights: WeightServicer,
        limits: Limits,
        metrics: TrainerMetrics,
        on_stored: Callable[[rollout_pb2.Trajectory, GroupRecord], None] | None = None,
        on_hello: Callable[[str], None] | None = None,
    ) -> None:
        self.on_stored = on_stored  # scores the trajectory's reward as it arrives
        self.on_hello = on_hello  # told each generator that opens a stream (the first feed may wait for them)
        self.store = store
        self.ledger = ledger
        self.weights = weights
        self.limits = limits
        self.metrics = metrics

    async def StreamTrajectories(self, request_iterator, context: grpc.aio.ServicerContext):
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None:
            return
        if first.WhichOneof("item") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a stream must start with a hello")
        generator = first.hello.generator_id
        if not generator or len(generator) > MAX_ID_CHARS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"hello needs a generator_id of 1 to {MAX_ID_CHARS} chars"
            )
        log.info("generator %s connected (policy v%d)", generator, first.hello.versions.policy_version)
        if self.on_hello is not None:
            self.on_hello(generator)
        yield self._hello()
        # A stopping trainer ends the stream at once rather than at the end of its gRPC grace: the generator
        # would never close it, being alive, and reconnects (to the trainer's successor) on UNAVAILABLE.
        closing = asyncio.ensure_future(self.weights.wait_closed())
        try:
            while True:
                request = await _next_unless_closing(requests, closing, context)
                if request is None:
                    return
                yield await self._answer(request, generator, context)
        finally:
            closing.cancel()

    async def _answer(self, request, generator: str, context: grpc.aio.ServicerContext):
        kind = request.WhichOneof("item")
        if kind == "hello":  # a generator may ask again for the latest versions
            return self._hello()
        if kind != "trajectory":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a message must hold a hello or a trajectory")
        t = request.trajectory
        try:
            status, reason = await asyncio.to_thread(self.receive, t)
        except StoreError as exc:
            # Not the trajectory's fault: the generator reconnects and resends it.
            log.error("cannot store trajectory %s: %s", t.trajectory_id, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"trainer cannot store trajectories now: {exc}")
        self.metrics.trajectories.labels(status=status).inc()
        if status == "rejected":
            log.info("rejected trajectory %s from %s: %s", t.trajectory_id, generator, reason)
        return rollout_pb2.StreamTrajectoriesResponse(
            ack=rollout_pb2.TrajectoryAck(trajectory_id=t.trajectory_id, status=_STATUS[status], reason=reason)
        )

    def _hello(self) -> rollout_pb2.StreamTrajectoriesResponse:
        return rollout_pb2.StreamTrajectoriesResponse(hello=rollout_pb2.TrainerHello(latest=self.weights.versions()))

    def receive(self, t: rollout_pb2.Trajectory) -> tuple[str, str]:
        """(status, reason) of one trajectory; stores it when it is accepted."""
        latest = self.weights.versions()
        reason = check_structure(t, self.limits, latest.policy_version, latest.adapter_version)
        if reason is not None:
            return "rejected", reason
        if self.store.has_id(t.trajectory_id):
            return "duplicate", "trajectory already stored"
        state = self.ledger.state(t.group_id)
        if state in FINISHED:
            # Every slot of a trained (or dropped) group is filled: anything more for it is a resend.
            return "duplicate", f"group {t.group_id} is already {state}"
        group = self.ledger.get(t.group_id)
        if group is None:
            return "rejected", f"unknown group {t.group_id} (not enqueued by this trainer)"
        if state == DEAD:
            return "rejected", f"group {t.group_id} was dead-lettered: {self.ledger.dead_reason(t.group_id)}"
        reason = check_against_group(t, group)
        if reason is not None:
            return "rejected", reason
        if self.store.add(t) == ACCEPTED:
            if self.on_stored is not None:
                self.on_stored(t, group)
            return "accepted", ""
        note = "being trained now" if state == TAKEN else "already stored"
        return "duplicate", f"sample {t.sample_index} of group {t.group_id} is {note}"


async def _next_unless_closing(requests, closing: asyncio.Future, context: grpc.aio.ServicerContext):
    """The stream's next request (None at its end), or UNAVAILABLE for the caller once the trainer is stopping."""
    if not closing.done():
        upcoming = asyncio.ensure_future(anext(requests, None))
        try:
            await asyncio.wait({upcoming, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # the trainer stopping, or this handler cancelled (its caller gone): no read left behind
            read = upcoming.done()
            if not read:
                upcoming.cancel()
        if read:
            return upcoming.result()
    await context.abort(grpc.StatusCode.UNAVAILABLE, "the trainer is stopping")
