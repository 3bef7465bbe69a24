"""Readiness checks of the cluster's services: each returns True when ready and never raises."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Callable
from urllib.parse import urlparse


def redis_ready(url: str) -> Callable[[], bool]:
    """redis-server answers PING."""
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379

    def check() -> bool:
        try:
            with socket.create_connection((host, port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))  # a password-protected Redis is up too
        except OSError:
            return False

    return check


def http_ok(url: str) -> Callable[[], bool]:
    """GET `url` answers 200."""

    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status == 200
        except (OSError, ValueError):
            return False

    return check


def grpc_serving(address: str, service: str) -> Callable[[], bool]:
    """The standard gRPC health service reports `service` SERVING (health stays open without a token)."""

    def check() -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            with grpc.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    return check


def all_of(*checks: Callable[[], bool]) -> Callable[[], bool]:
    """Ready when every check is."""
    return lambda: all(check() for check in checks)
