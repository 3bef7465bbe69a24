"""Real servers for tests, on loopback: redis-server and prometheus on free ports in temp dirs.

    from tests.servers import prometheus_server, redis_server

    with redis_server() as redis, prometheus_server(["127.0.0.1:9123"]) as prom:
        ...  # redis.url, prom.url

Missing binaries fail the test with a message naming scripts/setup.sh (which installs both); nothing
is skipped. Each server is stopped with SIGTERM (SIGKILL after a grace period) and its temp dir removed;
on a start failure the error carries the end of the server's log.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common import free_ports

START_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now and reserved for this test (`services.common.free_ports`: not one a
    client's connection may take before the test's server binds it)."""
    return free_ports.free_port()


def require_binary(name: str) -> str:
    """The path of `name`, or fail the test saying how to install it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; scripts/setup.sh installs redis-server and prometheus", pytrace=False)
    return path


@dataclass
class Server:
    """A started server: its port, base URL, data dir and process."""

    port: int
    url: str
    dir: Path
    process: subprocess.Popen
    log: Path

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the server's output, for failure messages."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def wait_until(
    check: Callable[[], bool],
    timeout: float,
    what: str,
    server: Server | None = None,
    explain: Callable[[], str] | None = None,
) -> None:
    """Poll `check` every 0.1 s until it is true; fail naming `what` (and the server's log, and what `explain`
    says of the state it was in) after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and server.process.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {server.process.returncode}\n{server.log_tail()}")
        try:
            if check():
                return
        except Exception:  # not up yet
            pass
        time.sleep(0.1)
    tail = f"\n{server.log_tail()}" if server is not None else ""
    state = f"\n{explain()}" if explain is not None else ""
    raise TimeoutError(f"{what}: not true after {timeout:.0f} s{state}{tail}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def _started(cmd: list[str], port: int, url: str, workdir: Path, ready: Callable[[], bool], name: str):
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    server = Server(port, url, workdir, process, log)
    try:
        wait_until(ready, START_TIMEOUT_S, f"{name} on port {port} ready", server)
        yield server
    finally:
        _stop(process)


@contextmanager
def redis_server() -> Iterator[Server]:
    """A throw-away redis-server (no persistence) on a free loopback port; `url` is redis://127.0.0.1:PORT/0."""
    binary = require_binary("redis-server")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="sparrow-redis-") as tmp:
        cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--dir", tmp, "--protected-mode", "yes"]

        def ready() -> bool:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")

        with _started(cmd, port, f"redis://127.0.0.1:{port}/0", Path(tmp), ready, "redis") as server:
            yield server


def prometheus_config(
    scrape_targets: dict[str, list[str]] | list[str], scrape_interval: str = "1s", rule_files: Sequence[Path] = ()
) -> str:
    """prometheus.yml text scraping `scrape_targets` (job -> host:port list, or one list for job `test`),
    evaluating the alerting/recording rules in `rule_files` (absolute paths)."""
    jobs = scrape_targets if isinstance(scrape_targets, dict) else {"test": list(scrape_targets)}
    lines = ["global:", f"  scrape_interval: {scrape_interval}", f"  evaluation_interval: {scrape_interval}"]
    if rule_files:
        lines.append("rule_files:")
        lines += [f'  - "{path}"' for path in rule_files]
    lines.append("scrape_configs:")
    for job, targets in jobs.items():
        quoted = ", ".join(f'"{t}"' for t in targets)
        lines += [f"  - job_name: {job}", f"    scrape_timeout: {scrape_interval}", "    static_configs:"]
        lines.append(f"      - targets: [{quoted}]")
    return "\n".join(lines) + "\n"


@contextmanager
def prometheus_server(
    scrape_targets: dict[str, list[str]] | list[str],
    scrape_interval: str = "1s",
    rule_files: Sequence[Path] = (),
    data_dir: Path | None = None,
) -> Iterator[Server]:
    """A real Prometheus scraping `scrape_targets` and evaluating `rule_files`, with its TSDB in a temp dir
    (or in `data_dir`: a finished run's, to query what it recorded); `url` is its HTTP API base."""
    binary = require_binary("prometheus")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="sparrow-prometheus-") as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(prometheus_config(scrape_targets, scrape_interval, rule_files))
        cmd = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={data_dir or Path(tmp) / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h" if data_dir is None else "--storage.tsdb.retention.time=30d",
            "--log.level=warn",
        ]
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as resp:
                return resp.status == 200

        with _started(cmd, port, url, Path(tmp), ready, "prometheus") as server:
            yield server
