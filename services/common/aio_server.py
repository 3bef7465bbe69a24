"""An asyncio gRPC server for the services' long-lived calls, started and stopped from synchronous code.

    server = AioServer(security, max_calls=1024, registry=metrics.registry, component="trainer")
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server.server)   # async servicers
    server.add_health_and_reflection(["sparrow.v1.RolloutService"])
    port = server.bind("127.0.0.1:0")
    server.start()
    ...
    server.stop(grace_s=10)

The trainer holds a trajectory stream and a version watch open for every generator. On a thread-pool
server each open call holds a thread, so once a fleet opens as many calls as there are threads nothing
more is answered, health checks included. Here every call is a coroutine on one event loop, run in a
thread of its own; the servicers hand blocking work (fsync, file reads, engine calls) to a small
executor with `asyncio.to_thread`, so an idle stream costs memory, not a thread.

Every call passes one guard, beside the service token and TLS of `grpc_server.py`:
- past `max_calls` open calls a new one is refused at once with RESOURCE_EXHAUSTED; health and
  reflection are never counted nor refused, so probes are answered however full the server is;
- a request that does not decode (garbage bytes, invalid UTF-8 in a string field) is the peer's fault:
  INVALID_ARGUMENT with a one-line reason, one log line and a count, not an UNKNOWN with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.grpc_server import OPEN_METHOD_PREFIXES, GrpcSecurity, bind

log = logging.getLogger("sparrow.grpc")

REFUSAL_REASONS = ("too_many_calls", "undecodable")
_WARN_EVERY_S = 10.0  # a storm of refusals logs one line per this many seconds, with the count


class CallStats:
    """Open calls and refusals of one server; exported as Prometheus metrics when given a registry."""

    def __init__(self, registry: CollectorRegistry | None = None, component: str = "") -> None:
        self.open = 0
        self.refused = dict.fromkeys(REFUSAL_REASONS, 0)
        self._gauge = self._counter = None
        if registry is not None:
            prefix = f"sparrow_{component}_grpc" if component else "sparrow_grpc"
            self._gauge = Gauge(
                f"{prefix}_open_calls", "Open gRPC calls, health and reflection left out.", registry=registry
            )
            self._counter = Counter(
                f"{prefix}_refused_calls", "gRPC calls refused by the server's guard.", ["reason"], registry=registry
            )
            for reason in REFUSAL_REASONS:
                self._counter.labels(reason=reason)

    def enter(self) -> None:
        self.open += 1
        if self._gauge is not None:
            self._gauge.set(self.open)

    def leave(self) -> None:
        self.open -= 1
        if self._gauge is not None:
            self._gauge.set(self.open)

    def refuse(self, reason: str) -> None:
        self.refused[reason] += 1
        if self._counter is not None:
            self._counter.labels(reason=reason).inc()


class _Undecodable:
    """Stands in for a request whose bytes did not decode; the guard answers it, no servicer sees it."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _safe(deserializer):
    if deserializer is None:
        return None

    def decode(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, or whatever a deserializer raises on bad bytes
            return _Undecodable(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    return decode


class _Guard(grpc.aio.ServerInterceptor):
    """Service token, the open-call limit and undecodable requests, for every method of one server."""

    def __init__(self, token: str, max_calls: int, stats: CallStats) -> None:
        self._expected = f"Bearer {token}".encode() if token else None
        self.max_calls = max_calls
        self.stats = stats
        self._last_warning: dict[str, float] = {}
        self.calls: set[asyncio.Task] = set()  # the tasks running open calls' handlers (health aside)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        if self._expected is not None and not self._authorized(details):
            return _shaped(handler, None, _deny_unauthenticated, _deny_unauthenticated_stream)
        return self._wrap(handler, details.method)

    def _authorized(self, details) -> bool:
        presented = b""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else value
        return hmac.compare_digest(presented, self._expected)

    def _warn(self, reason: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning.get(reason, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self._last_warning[reason] = now
            log.warning("%s (%d refused so far for this reason)", message, self.stats.refused[reason])

    @contextlib.asynccontextmanager
    async def _slot(self, method: str, context):
        if self.stats.open >= self.max_calls:
            self.stats.refuse("too_many_calls")
            self._warn("too_many_calls", f"refused {method}: {self.stats.open} calls open, the maximum")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server holds its maximum of {self.max_calls} open calls; retry later",
            )
        self.stats.enter()
        task = asyncio.current_task()
        self.calls.add(task)
        try:
            yield
        finally:
            self.calls.discard(task)
            self.stats.leave()

    async def _check(self, request, method: str, context):
        if isinstance(request, _Undecodable):
            self.stats.refuse("undecodable")
            # One line each (no traceback): a peer sending such bytes has a bug worth seeing, call by call.
            log.warning("refused an undecodable %s request from %s: %s", method, context.peer(), request.reason)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: {request.reason}")
        return request

    async def _checked(self, requests, method: str, context):
        async for request in requests:
            yield await self._check(request, method, context)

    def _wrap(self, handler, method: str):
        if not handler.request_streaming and not handler.response_streaming:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                async with self._slot(method, context):
                    return await _result(inner(await self._check(request, method, context), context))

            return _shaped(handler, _safe(handler.request_deserializer), unary_unary, None)
        if not handler.request_streaming:
            inner = handler.unary_stream

            async def unary_stream(request, context):
                async with self._slot(method, context):
                    async for response in inner(await self._check(request, method, context), context):
                        yield response

            return _shaped(handler, _safe(handler.request_deserializer), None, unary_stream)
        inner = handler.stream_unary if not handler.response_streaming else handler.stream_stream

        if not handler.response_streaming:

            async def stream_unary(requests, context):
                async with self._slot(method, context):
                    return await _result(inner(self._checked(requests, method, context), context))

            return _shaped(handler, _safe(handler.request_deserializer), stream_unary, None)

        async def stream_stream(requests, context):
            async with self._slot(method, context):
                async for response in inner(self._checked(requests, method, context), context):
                    yield response

        return _shaped(handler, _safe(handler.request_deserializer), None, stream_stream)


async def _result(value):
    return await value if inspect.isawaitable(value) else value


async def _deny_unauthenticated(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong service token")


async def _deny_unauthenticated_stream(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong service token")
    yield  # never reached: makes this an async generator, the shape a streaming response needs


def _shaped(handler, deserializer, unary_response, streaming_response):
    """A handler of `handler`'s kind (request and response streaming) with other behaviours."""
    serializer = handler.response_serializer
    kind = (handler.request_streaming, handler.response_streaming)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[kind]
    behaviour = streaming_response if handler.response_streaming else unary_response
    return make(behaviour, request_deserializer=deserializer, response_serializer=serializer)


class AioServer:
    """A grpc.aio server on an event loop of its own thread, with the guard above and a blocking-work pool."""

    def __init__(
        self,
        security: GrpcSecurity,
        *,
        max_calls: int,
        max_message_bytes: int = 64 << 20,
        blocking_threads: int = 8,
        registry: CollectorRegistry | None = None,
        component: str = "",
        name: str = "grpc",
    ) -> None:
        if max_calls < 1 or blocking_threads < 1:
            raise ValueError("max_calls and blocking_threads must be >= 1")
        self.security = security
        self.stats = CallStats(registry, component)
        self.health: health_aio.HealthServicer | None = None
        self._loop = asyncio.new_event_loop()
        # asyncio.to_thread runs on the loop's default executor: this bounded pool.
        self._executor = ThreadPoolExecutor(blocking_threads, thread_name_prefix=f"{name}-blocking")
        self._loop.set_default_executor(self._executor)
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-loop", daemon=True)
        self._thread.start()
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self._guard = _Guard(security.token, max_calls, self.stats)
        self.server: grpc.aio.Server = self.call(_create(options, self._guard))
        self._stopped = False
        self.ended_at_stop = 0  # calls still open after the stop's grace, ended by the stop

    def call(self, coro, timeout: float | None = None):
        """Run `coro` on the server's loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def add_health_and_reflection(self, service_names: Iterable[str]) -> None:
        """The standard health service (every named service SERVING) and reflection."""
        names = list(service_names)

        async def serving() -> health_aio.HealthServicer:
            servicer = health_aio.HealthServicer()
            for n in ["", *names]:
                await servicer.set(n, health_pb2.HealthCheckResponse.SERVING)
            return servicer

        self.health = self.call(serving())
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([*names, HEALTH_SERVICE, reflection.SERVICE_NAME], self.server)

    def bind(self, address: str) -> int:
        """Binds `address` (TLS when configured); returns the port (useful with port 0)."""
        return bind(self.server, address, self.security)

    def start(self) -> None:
        """Start serving."""
        self.call(self.server.start())

    def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING, let in-flight calls finish for `grace_s`, cancel the rest, stop the loop."""
        if self._stopped:
            return
        self._stopped = True

        async def stop() -> None:
            if self.health is not None:
                await self.health.enter_graceful_shutdown()
            # grpc's own stop aborts what is left a second after our grace: first, calls still open at the
            # grace (a long-lived stream whose peer is going away too, as when every service of a run gets
            # SIGTERM at once) are ended inside their own handlers, which grpc answers as CANCELLED without a
            # word. Cancelling grpc's own scheduling tasks instead made it log a CancelledError traceback per
            # call on what was a clean stop; letting grpc's abort race ours made the count a matter of luck.
            stopping = asyncio.ensure_future(self.server.stop(grace_s + 1.0))
            await asyncio.wait([stopping], timeout=grace_s)
            calls = [t for t in self._guard.calls if not t.done()]
            for task in calls:
                task.cancel()
            if calls:
                await asyncio.wait(calls, timeout=5.0)
                log.info("ended %d call(s) still open after the %.1f s grace", len(calls), grace_s)
            self.ended_at_stop = len(calls)
            await stopping
            # Whatever else still runs on the loop ends before the loop does: given a moment, then cancelled.
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if rest:
                _, pending = await asyncio.wait(rest, timeout=0.5)
                for task in pending:
                    task.cancel()
                if pending:
                    await asyncio.wait(pending, timeout=5.0)
            # A cancel that lands while grpc writes a response (not inside the handler) leaves the handler's
            # generator suspended at its yield: close every generator still open, so each handler's own
            # clean-up runs now (GeneratorExit at its yield), not whenever the garbage collector gets to it.
            await asyncio.get_running_loop().shutdown_asyncgens()

        try:
            self.call(stop(), timeout=grace_s + 30.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30.0)
            # Blocking work already started (an fsync before an ACCEPTED) finishes; nothing new starts.
            self._executor.shutdown(wait=True, cancel_futures=True)
            if not self._thread.is_alive():
                self._loop.close()


async def _create(options, guard) -> grpc.aio.Server:
    return grpc.aio.server(interceptors=[guard], options=options)
