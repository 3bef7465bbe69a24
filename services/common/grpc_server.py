"""What every Sparrow gRPC server and client shares: service tokens, optional TLS, health, reflection.

Servers: the services (the trainer, a generator's control API) run the asyncio server of
`aio_server.py`, whose open calls hold no thread and which refuses calls past a maximum. The
thread-pool server here, one thread held per open call, serves small fixed loads (test stand-ins):

    server = build_server(GrpcSecurity(token="s3cret"), max_message_bytes=64 << 20)
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, ["sparrow.v1.RolloutService"])
    port = bind(server, "127.0.0.1:0", security)
    server.start()
    ...
    stop_gracefully(server, health, grace_s=10)

Clients:

    channel = open_channel("127.0.0.1:50051", security)   # token sent on every call

The token travels as `authorization: Bearer <token>` metadata and is compared in constant time.
Health checks and reflection stay open without a token so that Kubernetes probes and
`grpcurl list` work; every other method answers UNAUTHENTICATED without it.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class GrpcSecurity:
    """A service token (empty: no token required or sent) and optional TLS files (PEM paths)."""

    token: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert or self.tls_ca)


class _TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong service token")

        def deny_stream(request_iterator, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong service token")

        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny_stream),
            (True, True): grpc.stream_stream_rpc_method_handler(deny_stream),
        }

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return continuation(handler_call_details)
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else value
        if hmac.compare_digest(presented, self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return self._deny[(handler.request_streaming, handler.response_streaming)]


def build_server(security: GrpcSecurity, max_workers: int = 16, max_message_bytes: int = 64 << 20) -> grpc.Server:
    """A thread-pool gRPC server that checks the service token (when one is set)."""
    interceptors = [_TokenInterceptor(security.token)] if security.token else []
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), interceptors=interceptors, options=options)


def add_health_and_reflection(server: grpc.Server, service_names: Iterable[str]) -> health.HealthServicer:
    """Registers the standard health service (every named service SERVING) and reflection."""
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = list(service_names)
    for name in ["", *names]:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


def bind(server: grpc.Server, address: str, security: GrpcSecurity) -> int:
    """Binds `address` (TLS when configured); returns the port (useful with port 0)."""
    if security.tls:
        if not (security.tls_cert and security.tls_key):
            raise ValueError("TLS needs both tls_cert and tls_key on a server")
        creds = grpc.ssl_server_credentials(
            [(Path(security.tls_key).read_bytes(), Path(security.tls_cert).read_bytes())],
            root_certificates=Path(security.tls_ca).read_bytes() if security.tls_ca else None,
            require_client_auth=False,
        )
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address} (in use?)")
    return port


def stop_gracefully(server: grpc.Server, health_servicer: health.HealthServicer | None, grace_s: float) -> None:
    """Reports NOT_SERVING, lets in-flight calls finish for `grace_s`, then stops."""
    if health_servicer is not None:
        health_servicer.enter_graceful_shutdown()
    server.stop(grace_s).wait()


class _BearerAuth(grpc.AuthMetadataPlugin):
    def __init__(self, token: str):
        self._token = token

    def __call__(self, context, callback):
        callback((("authorization", f"Bearer {self._token}"),), None)


class _TokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    # Plaintext channels cannot carry call credentials, so the token goes in as metadata here.
    def __init__(self, token: str):
        self._pair = ("authorization", f"Bearer {token}")

    def _details(self, d):
        metadata = [*(d.metadata or ()), self._pair]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, d, request):
        return continuation(self._details(d), request)

    def intercept_unary_stream(self, continuation, d, request):
        return continuation(self._details(d), request)

    def intercept_stream_unary(self, continuation, d, request_iterator):
        return continuation(self._details(d), request_iterator)

    def intercept_stream_stream(self, continuation, d, request_iterator):
        return continuation(self._details(d), request_iterator)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


def open_channel(address: str, security: GrpcSecurity, max_message_bytes: int = 64 << 20) -> grpc.Channel:
    """A channel to `address` that sends the service token on every call (TLS when configured)."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if security.tls:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(security.tls_ca).read_bytes() if security.tls_ca else None
        )
        if security.token:
            call_creds = grpc.metadata_call_credentials(_BearerAuth(security.token))
            creds = grpc.composite_channel_credentials(creds, call_creds)
        return grpc.secure_channel(address, creds, options=options)
    channel = grpc.insecure_channel(address, options=options)
    if security.token:
        channel = grpc.intercept_channel(channel, _TokenClientInterceptor(security.token))
    return channel
