"""The sandbox service over HTTP: answers, bad input refused with nothing run, the queue limit, metrics."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.integration.sandbox.service import post_run, sandbox_service, sparrow_env

ADD = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
GOOD = "a, b = map(int, input().split())\nprint(a + b)\n"


@pytest.fixture(scope="module")
def server():
    with sandbox_service("--workers", "2") as s:
        yield s


def test_a_program_is_scored_case_by_case(server):
    r = post_run(server, {"code": GOOD, "tests": ADD})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["status"], body["passed"], body["total"], body["pass_fraction"]) == ("passed", 2, 2, 1.0)
    case = body["cases"][0]
    assert case["stdout"] == "3\n" and case["exit_code"] == 0 and case["peak_memory_bytes"] > 0
    r = post_run(server, {"code": "print(3)", "tests": ADD, "stop_on_first_failure": True})
    assert r.json()["status"] == "failed" and [c["status"] for c in r.json()["cases"]] == ["passed", "failed"]


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        ({"tests": ADD}, 422, "code: Field required"),
        ({"code": "", "tests": ADD}, 422, "code: String should have at least 1 character"),
        ({"code": "   \n", "tests": ADD}, 422, "the program is empty"),
        ({"code": GOOD, "tests": {"inputs": "1 2"}}, 422, "needs 'inputs' and 'outputs' lists"),
        ({"code": GOOD, "tests": [{"in": "1"}]}, 422, "string 'input' and 'output'"),
        ({"code": GOOD, "tests": ADD, "timeout_s": 31}, 422, "over the service's maximum 30.0"),
        ({"code": GOOD, "tests": ADD, "memory_mb": 1 << 20}, 422, "over the service's maximum 4096"),
        ({"code": GOOD, "tests": ADD, "language": "cobol"}, 422, "unknown language 'cobol'"),
        ({"code": GOOD, "tests": ADD, "extra": 1}, 422, "extra: Extra inputs are not permitted"),
        (b"{not json", 422, "JSON"),
        (b'{"code": "' + b"x" * (17 << 20) + b'", "tests": []}', 413, "over the limit"),
    ],
)
def test_bad_input_is_a_4xx_with_a_message_and_runs_nothing(server, body, code, message):
    before = httpx.get(f"{server.url}/metrics").text
    r = post_run(server, body)
    assert r.status_code == code and message in r.json()["detail"], r.text
    after = httpx.get(f"{server.url}/metrics").text
    ran = [line for line in after.splitlines() if line.startswith("sparrow_sandbox_run_seconds_count")]
    assert ran == [line for line in before.splitlines() if line.startswith("sparrow_sandbox_run_seconds_count")]


def test_a_post_without_the_token_is_refused(server):
    assert post_run(server, {"code": GOOD, "tests": ADD}, token=None).status_code == 401
    assert post_run(server, {"code": GOOD, "tests": ADD}, token="wrong").status_code == 401


def test_metrics_count_requests_cases_and_run_seconds(server):
    post_run(server, {"code": GOOD, "tests": ADD})
    text = httpx.get(f"{server.url}/metrics").text
    assert 'sparrow_sandbox_requests_total{status="ok"}' in text
    assert 'sparrow_sandbox_cases_total{status="passed"}' in text
    assert "sparrow_sandbox_queue_depth 0.0" in text and "sparrow_sandbox_workers 2.0" in text
    assert "sparrow_sandbox_run_seconds_bucket" in text
    assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}
    assert "/v1/run" in httpx.get(f"{server.url}/openapi.json").json()["paths"]


def test_over_the_queue_limit_a_request_gets_429_at_once():
    with sandbox_service("--workers", "1", "--queue-limit", "0") as server:
        slow = {"code": "import time; time.sleep(3)", "tests": {"inputs": [""], "outputs": [""]}, "timeout_s": 5}
        first: list[httpx.Response] = []
        t = threading.Thread(target=lambda: first.append(post_run(server, slow)))
        t.start()
        for _ in range(100):  # until the first one holds the worker
            if "sparrow_sandbox_busy_workers 1.0" in httpx.get(f"{server.url}/metrics").text:
                break
            threading.Event().wait(0.05)
        r = post_run(server, {"code": GOOD, "tests": ADD})
        assert r.status_code == 429 and "retry" in r.json()["detail"]
        t.join()
        assert first[0].status_code == 200
        assert 'sparrow_sandbox_requests_total{status="rejected"} 1.0' in httpx.get(f"{server.url}/metrics").text


def test_the_service_refuses_to_start_where_bubblewrap_cannot_run():
    import shutil
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp(prefix="sparrow-fake-bwrap-"))
    try:
        _refuses(tmp)
    finally:
        shutil.rmtree(tmp)


def _refuses(tmp):
    import subprocess
    import sys

    tmp.chmod(0o755)  # the jail starts bwrap as nobody when the tests run as root

    # A kernel without user namespaces cannot be had here: a stand-in bwrap fails as Debian's does there.
    fake = tmp / "bwrap"
    fake.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to create new namespace, likely because the kernel does not "
        "allow non-privileged user namespaces.' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    for bwrap, why in (("no-such-bwrap", "is not installed"), (str(fake), "No permissions to create new namespace")):
        env = sparrow_env(SPARROW_JAIL__BWRAP=bwrap)
        cmd = [sys.executable, "-m", "sparrow_cli.main", "sandbox"]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        last = r.stderr.splitlines()[-1]
        assert r.returncode == 2 and last.startswith("sparrow sandbox: error: ") and why in last, r.stderr
        assert "will not run programs unjailed" in last and "user namespaces" in last or why == "is not installed"
    env = sparrow_env(SPARROW_JAIL__INSECURE_LOCAL="true", SPARROW_JAIL__BWRAP="no-such-bwrap")
    with sandbox_service("--workers", "1", env=env) as server:
        assert post_run(server, {"code": GOOD, "tests": ADD}).json()["status"] == "passed"
        assert "UNJAILED" in server.log.read_text()


def test_a_service_killed_mid_run_leaves_no_jail_behind():
    import os
    import signal
    import time

    from tests.integration.sandbox.test_hostile_programs import _jailed_processes

    with sandbox_service("--workers", "1") as server:
        sleeper = {"code": "import time; time.sleep(1000)", "tests": {"inputs": [""], "outputs": [""]}, "timeout_s": 20}
        t = threading.Thread(target=lambda: _swallow(lambda: post_run(server, sleeper, timeout=30)), daemon=True)
        t.start()

        # The program itself, not bwrap still setting up: a bwrap killed then can leave its init behind,
        # which the next sandbox kills (tests/unit/sandbox/test_jail.py), not this one.
        def program_runs() -> bool:
            return any("bwrap" not in line.split()[1] for line in _jailed_processes())

        deadline = time.monotonic() + 10
        while not program_runs() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert program_runs(), "the program never started"
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait()
        deadline = time.monotonic() + 2
        while _jailed_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _jailed_processes() == []


def _swallow(call):
    try:
        call()
    except httpx.HTTPError:
        pass  # the service was killed under the request: that is the test
