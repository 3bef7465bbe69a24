"""Hostile programs, each through the service and through `sparrow sandbox exec`.

Each must end within its timeout plus a second, leave no process behind, change no file outside its
jail and report the right status, while the host's Redis and a gRPC server on loopback, which the
programs try to reach, stay healthy. The service runs with SPARROW_SECURITY__TOKEN in its environment.
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.integration.sandbox.service import REPO, TOKEN, post_run, sandbox_service, sparrow_env
from tests.servers import free_port, redis_server

pytestmark = pytest.mark.slow
TIMEOUT_S = 2.0
MARK = secrets.token_hex(6)
CHECKOUT_FILE = REPO / f"sandbox-escape-{MARK}"
HOST_TMP_FILE = Path(tempfile.gettempdir()) / f"sandbox-escape-{MARK}"
ROOT_FILE = Path(f"/sandbox-escape-{MARK}")
RUN_SECRET = f"run-folder-secret-{MARK}"

WRITES = """
for path in ({checkout!r}, {tmp!r}, {root!r}):
    try:
        with open(path, "w") as f:
            f.write("escaped")
        print("wrote")
    except OSError:
        print("denied")
"""
READS = """
for path in ("/etc/shadow", {run!r}):
    try:
        print("read", open(path).read())
    except OSError:
        print("denied")
try:
    environ = open("/proc/1/environ", "rb").read()
except OSError:
    environ = b""
print("leak" if b"SPARROW" in environ else "clean")
"""
ENVIRON = """
import os, sys
print(dict(os.environ), file=sys.stderr)
print("leak" if any(k.startswith("SPARROW") for k in os.environ) else "clean")
"""
CONNECT = """
import socket
for port in ({redis}, {grpc}):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        print("connected")
    except OSError:
        print("refused")
"""
DAEMON = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(1000)
"""

# name -> (source, expected stdout or None, status through the service)
HOSTILE = {
    "infinite_loop": ("while True:\n    pass\n", None, "timeout"),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()\n", None, "runtime_error"),
    "allocate_16_gib": ("x = bytearray(16 << 30)\nprint(len(x))\n", None, "memory"),
    "stdout_10_gib": (
        "import sys\nb = b'x' * (1 << 24)\nfor _ in range(640):\n    sys.stdout.buffer.write(b)\n",
        None,
        "output_limit",
    ),
    # /tmp inside is the jail's own tmpfs: writing there is allowed and must not reach the host's /tmp
    "write_outside": (WRITES, "denied\nwrote\ndenied\n", "passed"),
    "read_secrets": (READS, "denied\ndenied\nclean\n", "passed"),
    "print_environ": (ENVIRON, "clean\n", "passed"),
    "connect_loopback": (CONNECT, "refused\nrefused\n", "passed"),
    "kill_parent": ("import os\nos.kill(os.getppid(), 9)\nprint('alive')\n", "alive\n", "passed"),
    "sleep_1000": ("import time\ntime.sleep(1000)\n", None, "timeout"),
    "ctypes_segfault": ("import ctypes\nctypes.string_at(0)\n", None, "runtime_error"),
    "daemon_escape": (DAEMON, "", "passed"),
}


@pytest.fixture(scope="module")
def host():
    """Redis and a gRPC server on loopback, a run folder with a secret, the service with the token set."""
    run_dir = Path(tempfile.mkdtemp(prefix="sparrow-run-"))
    run_dir.chmod(0o755)  # readable by anyone on the host: only the jail keeps it out of sight
    (run_dir / "secret.txt").write_text(RUN_SECRET)
    (run_dir / "secret.txt").chmod(0o644)
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), grpc_server)
    grpc_port = free_port()
    grpc_server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    grpc_server.start()
    try:
        with (
            redis_server() as redis,
            sandbox_service("--workers", "2", env=sparrow_env(SPARROW_RUN_DIR=str(run_dir))) as sandbox,
        ):
            yield {"redis": redis, "grpc_port": grpc_port, "run_dir": run_dir, "sandbox": sandbox}
    finally:
        grpc_server.stop(0)
        for path in (CHECKOUT_FILE, HOST_TMP_FILE):
            path.unlink(missing_ok=True)
        shutil.rmtree(run_dir)


def _source(name: str, host: dict) -> str:
    source = HOSTILE[name][0]
    return source.format(
        checkout=str(CHECKOUT_FILE),
        tmp=str(HOST_TMP_FILE),
        root=str(ROOT_FILE),
        run=str(host["run_dir"] / "secret.txt"),
        redis=host["redis"].port,
        grpc=host["grpc_port"],
    )


def _jailed_processes() -> list[str]:
    """Live processes of the jail's uid, or running a jailed program's file."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith("Z"):
            continue
        if fields.get("Uid", "").split()[:1] == ["65534"] or b"/sandbox/main.py" in cmdline:
            found.append(f"{entry.name} {cmdline[:80]!r}")
    return found


def _after_run(host: dict) -> None:
    deadline = time.monotonic() + 1.0
    while _jailed_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _jailed_processes() == []
    for path in (CHECKOUT_FILE, HOST_TMP_FILE, ROOT_FILE):
        assert not path.exists(), f"{path} was written from inside the jail"
    with socket.create_connection(("127.0.0.1", host["redis"].port), timeout=2) as s:
        s.sendall(b"PING\r\n")
        assert s.recv(64).startswith(b"+PONG")
    with grpc.insecure_channel(f"127.0.0.1:{host['grpc_port']}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert httpx.get(f"{host['sandbox'].url}/healthz", timeout=5).status_code == 200


def _no_secret(*texts: str) -> None:
    for text in texts:
        assert TOKEN not in text and RUN_SECRET not in text and "root:" not in text


@pytest.mark.parametrize("name", list(HOSTILE))
def test_through_the_service(host, name):
    source, expected, status = HOSTILE[name]
    tests = {"inputs": [""], "outputs": [expected if expected is not None else "never printed"]}
    start = time.monotonic()
    r = post_run(host["sandbox"], {"code": _source(name, host), "tests": tests, "timeout_s": TIMEOUT_S})
    wall = time.monotonic() - start
    assert r.status_code == 200, r.text
    case = r.json()["cases"][0]
    assert case["status"] == status, case
    assert wall <= TIMEOUT_S + 1 and case["elapsed_s"] <= TIMEOUT_S + 1
    _no_secret(case["stdout"], case["stderr"])
    _after_run(host)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_through_sandbox_exec(host, name, tmp_path):
    source, expected, status = HOSTILE[name]
    program = tmp_path / "program.py"
    program.write_text(_source(name, host))
    cmd = [sys.executable, "-m", "sparrow_cli.main", "sandbox", "exec", str(program), "--json"]
    cmd += ["--timeout-s", str(TIMEOUT_S)]
    env = sparrow_env(SPARROW_RUN_DIR=str(host["run_dir"]))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    out = json.loads(r.stdout)
    want = "ok" if status in ("passed", "failed") else status
    assert out["status"] == want and r.returncode == (0 if want == "ok" else 1), out
    if expected is not None:
        assert out["stdout"] == expected
    assert out["elapsed_s"] <= TIMEOUT_S + 1
    _no_secret(out["stdout"], out["stderr"], r.stderr)
    _after_run(host)
