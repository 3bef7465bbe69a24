"""Container health check of a Sparrow service: `python healthcheck.py generator|trainer|controller|sandbox`.

The trainer and the generator answer the standard gRPC health check on their service port (open
without the service token); with TLS configured, where a loopback check could not verify the
server's name, their Prometheus exporter must answer instead. The controller and the sandbox answer
GET /healthz.
Ports come from the same SPARROW_* variables the services read, so the check follows a changed port.
Exit status 0 when healthy, 1 otherwise, with one line saying why.
"""

from __future__ import annotations

import os
import sys
import urllib.request

# component -> (service port variable, its default, metrics port variable, its default). The trainer's
# gRPC port is the end of SPARROW_GRPC__ADDRESS (host:port).
PORTS = {
    "generator": ("SPARROW_CONTROL__PORT", 50052, "SPARROW_METRICS__PORT", 9102),
    "trainer": ("SPARROW_GRPC__ADDRESS", 50051, "SPARROW_METRICS__PORT", 9101),
    "controller": ("SPARROW_API__PORT", 8470, "SPARROW_API__PORT", 8470),
    "sandbox": ("SPARROW_API__PORT", 8490, "SPARROW_API__PORT", 8490),
}
TIMEOUT_S = 4.0


def port(variable: str, default: int) -> int:
    """The port in `variable` (a port, or host:port), else `default`."""
    value = os.environ.get(variable, "")
    return int(value.rsplit(":", 1)[-1]) if value else default


def http_ok(url: str) -> None:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}")


def grpc_serving(address: str) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S).status
    if status != health_pb2.HealthCheckResponse.SERVING:
        raise RuntimeError(f"{address} is {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")


def check(component: str) -> None:
    """Raises when `component` on this host is not healthy."""
    service_var, service_default, metrics_var, metrics_default = PORTS[component]
    if component in ("controller", "sandbox"):
        http_ok(f"http://127.0.0.1:{port(service_var, service_default)}/healthz")
    elif os.environ.get("SPARROW_SECURITY__TLS_CERT"):
        http_ok(f"http://127.0.0.1:{port(metrics_var, metrics_default)}/metrics")
    else:
        grpc_serving(f"127.0.0.1:{port(service_var, service_default)}")


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in PORTS:
        print(f"usage: healthcheck.py {'|'.join(PORTS)}", file=sys.stderr)
        return 2
    try:
        check(argv[0])
    except Exception as exc:  # any failure is "unhealthy", said in one line
        print(f"{argv[0]} unhealthy: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
