"""The long-lived trajectory stream to the trainer: send, match acks, reconnect, resend.

One bidirectional `StreamTrajectories` call carries a hello and then every finished trajectory;
a background thread reads the trainer's hello and acks and resolves each trajectory's future by
its id. When the call breaks (trainer restart, network), the thread reconnects on a fresh channel
with capped exponential backoff and jitter, and sends again everything not yet acked, oldest
first. A resend is safe because the trainer is idempotent by trajectory id (DUPLICATE).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections.abc import Callable
from concurrent.futures import Future

import grpc

from services.api.sparrow.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.grpc_server import GrpcSecurity, open_channel
from services.generator.engine import FINISH_ABORTED, FINISH_LENGTH, FINISH_STOP, FinishedSample

log = logging.getLogger("sparrow.generator.stream")

_FINISH = {
    FINISH_STOP: rollout_pb2.FINISH_REASON_STOP,
    FINISH_LENGTH: rollout_pb2.FINISH_REASON_LENGTH,
    FINISH_ABORTED: rollout_pb2.FINISH_REASON_ABORTED,
}
_END = object()


class StreamClosed(RuntimeError):
    """The stream was closed before the trainer acked this trajectory."""


class Backoff:
    """Exponential delays with jitter, capped: uniform in [d/2, d] with d = min(cap, initial * 2^n)."""

    def __init__(self, initial_s: float, max_s: float, rng: random.Random | None = None) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self._failures = 0
        self._rng = rng or random.Random()

    def next(self) -> float:
        """The delay before the next attempt (grows with each call until `reset`)."""
        d = min(self.max_s, self.initial_s * 2 ** min(self._failures, 30))
        self._failures += 1
        return self._rng.uniform(d / 2, d)

    def reset(self) -> None:
        """A connection worked: start again from the initial delay."""
        self._failures = 0


def trajectory_id(group_id: str, attempt: int, sample_index: int) -> str:
    """The deterministic id the trainer deduplicates by (see work_queue's docstring)."""
    return f"{group_id}/{attempt}/{sample_index}"


def to_trajectory(sample: FinishedSample, attempt: int, generator_id: str) -> rollout_pb2.Trajectory:
    """The wire form of a finished sample of a group delivered for the `attempt`-th time."""
    v = sample.versions
    return rollout_pb2.Trajectory(
        trajectory_id=trajectory_id(sample.group_id, attempt, sample.sample_index),
        group_id=sample.group_id,
        sample_index=sample.sample_index,
        prompt_token_ids=sample.prompt_token_ids,
        token_ids=sample.token_ids,
        logprobs=sample.logprobs,
        top_logprobs=[
            rollout_pb2.TopLogprobs(token_ids=ids, logprobs=lps)
            for ids, lps in zip(sample.top_token_ids, sample.top_logprobs, strict=True)
        ],
        kv_budgets=sample.kv_budgets,
        versions=common_pb2.Versions(
            policy_version=v.policy_version, adapter_version=v.adapter_version, schedule_version=v.schedule_version
        ),
        finish_reason=_FINISH.get(sample.finish_reason, rollout_pb2.FINISH_REASON_UNSPECIFIED),
        timings=rollout_pb2.Timings(queue_seconds=sample.queue_seconds, generate_seconds=sample.generate_seconds),
        generator_id=generator_id,
        probe=sample.probe,
    )


class TrajectoryStream:
    """`send(trajectory) -> Future[TrajectoryAck]` over one stream that survives trainer restarts."""

    def __init__(
        self,
        address: str,
        security: GrpcSecurity,
        hello: Callable[[], rollout_pb2.GeneratorHello],
        on_hello: Callable[[rollout_pb2.TrainerHello], None] | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.address = address
        self.security = security
        self._hello = hello
        self._on_hello = on_hello
        self._backoff = backoff or Backoff(0.2, 10.0)
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[rollout_pb2.Trajectory, Future]] = {}
        self._outbox: queue.Queue | None = None
        self._call = None
        self._closed = threading.Event()
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trajectory-stream", daemon=True)
        self.connections = 0  # streams opened that got the trainer's hello

    def start(self) -> TrajectoryStream:
        """Start connecting in the background; returns self."""
        self._thread.start()
        return self

    @property
    def connected(self) -> bool:
        """True while a stream is open and the trainer has said hello on it."""
        return self._connected.is_set()

    def wait_connected(self, timeout: float) -> bool:
        """Block until connected (or `timeout` seconds); returns whether it is."""
        return self._connected.wait(timeout)

    @property
    def unacked(self) -> int:
        """Trajectories sent (or waiting to be) that the trainer has not acked."""
        with self._lock:
            return len(self._pending)

    def send(self, trajectory: rollout_pb2.Trajectory) -> Future:
        """Queue `trajectory`; the future resolves with the trainer's TrajectoryAck (resent until acked)."""
        future: Future = Future()
        if self._closed.is_set():
            future.set_exception(StreamClosed("trajectory stream is closed"))
            return future
        request = rollout_pb2.StreamTrajectoriesRequest(trajectory=trajectory)
        with self._lock:
            old = self._pending.get(trajectory.trajectory_id)
            if old is not None:  # the same id again: one ack answers both
                old[1].add_done_callback(lambda f: _chain(f, future))
                return future
            self._pending[trajectory.trajectory_id] = (trajectory, future)
            if self._outbox is not None:
                self._outbox.put(request)
        return future

    def close(self, timeout: float = 5.0) -> None:
        """Stop the stream; unacked futures fail with StreamClosed."""
        self._closed.set()
        with self._lock:
            if self._outbox is not None:
                self._outbox.put(_END)
            if self._call is not None:
                self._call.cancel()
            pending, self._pending = self._pending, {}
        if self._thread.is_alive():
            self._thread.join(timeout)
        for _, future in pending.values():
            if not future.done():
                future.set_exception(StreamClosed("trajectory stream closed before the trainer acked"))

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._stream_once()
            except grpc.RpcError as exc:
                if not self._closed.is_set():
                    log.warning("trajectory stream to %s broke: %s %s", self.address, exc.code(), exc.details())
            except Exception:  # a bug must not silently end the thread that carries every trajectory
                log.exception("trajectory stream failed")
            self._connected.clear()
            if self._closed.wait(self._backoff.next()):
                break

    def _stream_once(self) -> None:
        channel = open_channel(self.address, self.security)
        outbox: queue.Queue = queue.Queue()
        outbox.put(rollout_pb2.StreamTrajectoriesRequest(hello=self._hello()))
        try:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            with self._lock:
                if self._closed.is_set():
                    return
                for trajectory, _ in self._pending.values():  # resend, oldest first
                    outbox.put(rollout_pb2.StreamTrajectoriesRequest(trajectory=trajectory))
                self._outbox = outbox
                self._call = stub.StreamTrajectories(iter(outbox.get, _END))
            for response in self._call:
                kind = response.WhichOneof("item")
                if kind == "hello":
                    self.connections += 1
                    self._backoff.reset()
                    self._connected.set()
                    v = response.hello.latest
                    log.info(
                        "trajectory stream to %s open (trainer publishes policy v%d, adapter v%d)",
                        self.address,
                        v.policy_version,
                        v.adapter_version,
                    )
                    if self._on_hello is not None:
                        self._on_hello(response.hello)
                elif kind == "ack":
                    self._resolve(response.ack)
            log.warning("trainer %s ended the trajectory stream", self.address)
        finally:
            with self._lock:
                if self._outbox is outbox:
                    self._outbox = None
                self._call = None
            outbox.put(_END)  # frees gRPC's request-reading thread
            channel.close()

    def _resolve(self, ack: rollout_pb2.TrajectoryAck) -> None:
        with self._lock:
            entry = self._pending.pop(ack.trajectory_id, None)
        if entry is None:
            return  # the ack of a resend whose first ack already arrived
        if not entry[1].done():
            entry[1].set_result(ack)


def _chain(source: Future, target: Future) -> None:
    if target.done():
        return
    if source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())
