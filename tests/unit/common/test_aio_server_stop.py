"""A clean stop of the asyncio gRPC server is quiet (services/common/aio_server.py): a stream still open after
the grace (its peer is going away too, as when every service of a run gets SIGTERM at once) is ended inside its
own handler, and grpc logs no CancelledError traceback. Real server, real client, on loopback."""

import asyncio
import logging
import threading
import time

import grpc

from services.api.sparrow.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.aio_server import AioServer
from services.common.grpc_server import GrpcSecurity, open_channel


class _Busy(rollout_pb2_grpc.RolloutServiceServicer):
    """Every request takes blocking work (as storing a trajectory does); the stream never ends by itself."""

    def __init__(self) -> None:
        self.ended = threading.Event()

    async def StreamTrajectories(self, requests, context):
        try:
            async for _ in requests:
                await asyncio.to_thread(time.sleep, 0.3)
                yield rollout_pb2.TrajectoryAck()
        except (asyncio.CancelledError, GeneratorExit):
            # CancelledError when the stop's cancel lands inside the handler (awaiting a request or the blocking
            # work), GeneratorExit at its yield when it lands while grpc writes a response: ended either way.
            self.ended.set()
            raise


def _serve(servicer) -> tuple[AioServer, grpc.Channel]:
    """`servicer` on a real server on loopback, and a channel to it."""
    server = AioServer(GrpcSecurity(), max_calls=8)
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server.server)
    port = server.bind("127.0.0.1:0")
    server.start()
    return server, open_channel(f"127.0.0.1:{port}", GrpcSecurity())


def test_a_stream_open_after_the_grace_is_ended_in_its_handler_without_a_traceback(caplog):
    servicer = _Busy()
    server, channel = _serve(servicer)
    stop_sending = threading.Event()

    def requests():
        while not stop_sending.is_set():
            yield rollout_pb2.StreamTrajectoriesRequest()
            time.sleep(0.05)

    call = rollout_pb2_grpc.RolloutServiceStub(channel).StreamTrajectories(requests())
    codes = []

    def consume():
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            codes.append(exc.code())

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    while server.stats.open == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stats.open == 1
    with caplog.at_level(logging.INFO):
        server.stop(grace_s=0.3)
    stop_sending.set()
    reader.join(10)
    channel.close()
    assert server.ended_at_stop == 1 and servicer.ended.is_set()
    assert codes and codes[0] in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    noisy = [r for r in caplog.records if r.exc_info or "not handled" in r.getMessage()]
    assert not noisy, [r.getMessage() for r in noisy]
    assert "ended 1 call(s) still open after the 0.3 s grace" in caplog.text


class _Writing(rollout_pb2_grpc.RolloutServiceServicer):
    """Answers as fast as grpc writes: a stop's cancel nearly always lands in grpc's write, not in the handler."""

    def __init__(self) -> None:
        self.ended = threading.Event()

    async def StreamTrajectories(self, requests, context):
        try:
            while True:
                yield rollout_pb2.TrajectoryAck()
        finally:
            self.ended.set()


def test_a_handler_stopped_while_its_response_is_written_runs_its_clean_up_before_stop_returns():
    servicer = _Writing()
    server, channel = _serve(servicer)
    call = rollout_pb2_grpc.RolloutServiceStub(channel).StreamTrajectories(
        iter([rollout_pb2.StreamTrajectoriesRequest()])
    )

    def consume():
        try:
            for _ in call:
                pass
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    while server.stats.open == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.stop(grace_s=0.1)
    assert server.ended_at_stop == 1
    assert servicer.ended.is_set()  # before stop returned, not whenever the garbage collector runs
    reader.join(10)
    channel.close()
