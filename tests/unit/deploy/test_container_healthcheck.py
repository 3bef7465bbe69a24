"""docker/healthcheck.py, the images' HEALTHCHECK, against real servers on loopback: a gRPC server with
the standard health service (services/common/grpc_server.py) and an HTTP server."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from grpc_health.v1 import health_pb2

from services.common.grpc_server import GrpcSecurity, add_health_and_reflection, bind, build_server
from tests.servers import free_port
from tests.unit.deploy.chart_render import REPO


def healthcheck(component: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPARROW_")}
    return subprocess.run(
        [sys.executable, str(REPO / "docker/healthcheck.py"), component],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


@contextmanager
def grpc_health_server() -> Iterator[tuple[int, object]]:
    # A token is set, as in production: the health service must stay open without it.
    server = build_server(GrpcSecurity(token="s3cret"), max_workers=2)
    health = add_health_and_reflection(server, ["sparrow.v1.GeneratorControl"])
    port = bind(server, "127.0.0.1:0", GrpcSecurity(token="s3cret"))
    server.start()
    try:
        yield port, health
    finally:
        server.stop(0).wait()


@contextmanager
def http_server(paths: dict[str, int]) -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            self.send_response(paths.get(self.path, 404))
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_grpc_services_are_healthy_while_serving_and_not_after():
    with grpc_health_server() as (port, health):
        assert healthcheck("generator", {"SPARROW_CONTROL__PORT": str(port)}).returncode == 0
        assert healthcheck("trainer", {"SPARROW_GRPC__ADDRESS": f"0.0.0.0:{port}"}).returncode == 0
        health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        done = healthcheck("generator", {"SPARROW_CONTROL__PORT": str(port)})
        assert done.returncode == 1 and "NOT_SERVING" in done.stderr
    done = healthcheck("trainer", {"SPARROW_GRPC__ADDRESS": f"0.0.0.0:{free_port()}"})
    assert done.returncode == 1 and done.stderr.startswith("trainer unhealthy:")


def test_controller_and_tls_services_are_checked_over_http():
    with http_server({"/healthz": 200, "/metrics": 200}) as port:
        assert healthcheck("controller", {"SPARROW_API__PORT": str(port)}).returncode == 0
        tls = {"SPARROW_SECURITY__TLS_CERT": "/etc/sparrow/tls/tls.crt", "SPARROW_METRICS__PORT": str(port)}
        assert healthcheck("generator", tls).returncode == 0
    with http_server({"/healthz": 503}) as port:
        assert healthcheck("controller", {"SPARROW_API__PORT": str(port)}).returncode == 1


def test_unknown_component_is_a_usage_error():
    done = healthcheck("nonesuch", {})
    assert done.returncode == 2 and "usage" in done.stderr
