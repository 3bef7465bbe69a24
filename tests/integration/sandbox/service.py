"""`sparrow sandbox` as a real process on a free loopback port, for the tests of this folder."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.servers import Server, _stop, free_port, require_binary, wait_until

REPO = Path(__file__).resolve().parents[3]
TOKEN = "sandbox-test-token-0123456789"


def sparrow_env(**extra: str) -> dict[str, str]:
    """The environment of a `sparrow` child: this checkout on PYTHONPATH, the service token set."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", SPARROW_SECURITY__TOKEN=TOKEN)
    env.update(extra)
    return env


@contextmanager
def sandbox_service(*flags: str, env: dict[str, str] | None = None, port: int | None = None) -> Iterator[Server]:
    """`sparrow sandbox` started with `flags` and SPARROW_SECURITY__TOKEN set; stopped (SIGTERM) after."""
    require_binary("bwrap")
    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="sparrow-sandbox-svc-") as tmp:
        log = Path(tmp) / "sandbox.log"
        cmd = [sys.executable, "-m", "sparrow_cli.main", "sandbox", "--port", str(port), *flags]
        with log.open("wb") as out:
            process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp, env=env or sparrow_env())
        server = Server(port, f"http://127.0.0.1:{port}", Path(tmp), process, log)
        try:
            wait_until(lambda: httpx.get(f"{server.url}/readyz").status_code == 200, 60, "sandbox ready", server)
            yield server
        finally:
            _stop(process)


def post_run(server: Server, body: dict | bytes, token: str | None = TOKEN, timeout: float = 60) -> httpx.Response:
    """POST /v1/run with the bearer token."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if isinstance(body, bytes):
        return httpx.post(f"{server.url}/v1/run", content=body, headers=headers, timeout=timeout)
    return httpx.post(f"{server.url}/v1/run", json=body, headers=headers, timeout=timeout)
