"""The admin API on a real uvicorn server and a real Redis: auth, malformed overrides, pause/resume, metrics.

Prometheus is deliberately unreachable here, so the controller is blind throughout: whatever the API
does must not depend on it, and the loop must hold the schedule.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import redis
import uvicorn

from services.controller import api
from services.controller.api import create_app
from services.controller.config import ControllerConfig
from services.controller.main import build_loop
from sparrow import metrics_contract as mc
from sparrow.config import load_config
from sparrow.presets import get_preset
from tests.servers import free_port, redis_server, wait_until

TOKEN = "admin-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def stack():
    with redis_server() as rs:
        port = free_port()
        overrides = {
            "redis.url": rs.url,
            "prometheus.url": f"http://127.0.0.1:{free_port()}",  # nothing listens there
            "prometheus.timeout_s": 0.5,
            "api.port": port,
            "security.token": TOKEN,
            "interval_s": 0.2,
        }
        loop = build_loop(load_config(ControllerConfig, overrides=overrides))

        async def close():
            await loop.source.aclose()
            await loop.publisher.client.aclose()

        server = uvicorn.Server(uvicorn.Config(create_app(loop, close), host="127.0.0.1", port=port, log_level="error"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"
        r = redis.Redis.from_url(rs.url)
        wait_until(lambda: r.get(mc.SCHEDULE_KEY) is not None, 20, "initial schedule published")
        try:
            yield url, r
        finally:
            server.should_exit = True
            thread.join(15)
            assert not thread.is_alive(), "the API did not shut down"
            r.close()


def _stored(r):
    return r.get(mc.SCHEDULE_KEY), r.llen(mc.SCHEDULE_HISTORY_KEY)


def test_status_reports_blind_and_holds_the_initial_schedule(stack):
    url, r = stack
    wait_until(lambda: httpx.get(f"{url}/status").json()["ticks"] >= 3, 20, "three ticks")
    status = httpx.get(f"{url}/status").json()
    assert status["blind"] and "cannot reach Prometheus" in status["blind_reason"]
    assert status["schedule"]["budgets"] == list(get_preset("qwen3-1.7b-0.86").budgets)
    assert status["predicted_speedup"] == pytest.approx(4.35, abs=0.01)
    assert status["target"] == pytest.approx(0.88) and len(status["bins"]) == 20
    assert all(b["state"] == "no_data" for b in status["bins"])
    assert json.loads(r.get(mc.SCHEDULE_KEY))["version"] == status["schedule"]["version"]
    spec = httpx.get(f"{url}/openapi.json").json()
    assert {"/status", "/history", "/pause", "/resume", "/override", "/metrics"} <= set(spec["paths"])
    assert "requestBody" in spec["paths"]["/override"]["post"]


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}, {"Authorization": "Bearer"}],
    ids=["missing", "wrong", "not-bearer", "empty"],
)
def test_posts_without_the_right_token_are_401(stack, headers):
    url, r = stack
    before = _stored(r)
    body = {"schedule": {"budgets": [512] * 20}}
    for path, kwargs in (("/override", {"json": body}), ("/pause", {}), ("/resume", {})):
        resp = httpx.post(f"{url}{path}", headers=headers, **kwargs)
        assert resp.status_code == 401, (path, resp.text)
        assert resp.headers["www-authenticate"] == "Bearer"
    # An unauthenticated caller gets 401 even for a body that is not JSON.
    assert httpx.post(f"{url}/override", headers=headers, content=b"{oops").status_code == 401
    assert _stored(r) == before


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "malformed JSON"),
        (b"[1, 2]", "malformed override"),
        (b'{"schedule": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "malformed override"),
        ({"budgets": [512, 1024]}, "schedule: Field required"),
        ({"schedule": 5}, "schedule"),
        ({"schedule": {"budgets": [500] * 20}}, "not a multiple of the page size 16"),
        ({"schedule": {"budgets": [1024, 512]}}, "non-decreasing"),
        ({"schedule": {"budgets": [512, 65536]}}, "outside the controller's bounds"),
        ({"schedule": {"budgets": [512], "colour": "red"}}, "unknown field"),
        # Wider than the wire's int32: generators could neither report nor apply it.
        ({"schedule": {"budgets": [512], "bin_width": 10**30}}, "bin_width must be at most 2147483647"),
        ({"schedule": {"budgets": [512], "dense_layers": [2**31]}}, "dense layer indices must be at most 2147483647"),
        ({"schedule": {"budgets": ["512"]}}, "list of integers"),
        ({"schedule": {"budgets": [512]}, "pause": "maybe"}, "pause"),
    ],
)
def test_malformed_or_invalid_overrides_are_422_and_never_reach_redis(stack, body, message):
    url, r = stack
    pubsub = r.pubsub()
    pubsub.subscribe(mc.SCHEDULE_UPDATES_CHANNEL)
    pubsub.get_message(timeout=1)  # the subscribe confirmation
    before = _stored(r)
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    resp = httpx.post(f"{url}/override", headers={**AUTH, "Content-Type": "application/json"}, **kwargs)
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert isinstance(detail, str) and message in detail and "\n" not in detail
    assert _stored(r) == before
    assert pubsub.get_message(timeout=0.3) is None
    pubsub.close()


def test_an_override_body_over_the_limit_is_413_declared_or_streamed(stack):
    url, r = stack
    before = _stored(r)
    huge = b'{"schedule": {"budgets": [' + b"512, " * (api.MAX_OVERRIDE_BYTES // 5) + b"512]}}"
    headers = {**AUTH, "Content-Type": "application/json"}
    resp = httpx.post(f"{url}/override", headers=headers, content=huge)
    assert resp.status_code == 413, resp.text
    # Without a Content-Length (chunked), the body is cut off as it streams in.
    chunks = (huge[i : i + 65536] for i in range(0, len(huge), 65536))
    resp = httpx.post(f"{url}/override", headers=headers, content=chunks)
    assert resp.status_code == 413, resp.text
    assert "over 1048576 bytes" in resp.json()["detail"]
    assert _stored(r) == before
    assert httpx.get(f"{url}/healthz").json() == {"ok": True}


def test_a_valid_override_is_published_pauses_and_resume_unpauses(stack):
    url, r = stack
    pubsub = r.pubsub()
    pubsub.subscribe(mc.SCHEDULE_UPDATES_CHANNEL)
    pubsub.get_message(timeout=1)
    old_version = json.loads(r.get(mc.SCHEDULE_KEY))["version"]
    budgets = [512] * 5 + [1024] * 15
    body = {"schedule": {"budgets": budgets, "name": "ops", "version": 999}, "reason": "incident 42"}
    resp = httpx.post(f"{url}/override", headers=AUTH, json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["version"] == old_version + 1 and out["paused"]  # versions are assigned, never taken
    stored = json.loads(r.get(mc.SCHEDULE_KEY))
    assert stored["budgets"] == budgets and stored["version"] == old_version + 1
    entry = json.loads(r.lindex(mc.SCHEDULE_HISTORY_KEY, -1))
    assert entry["source"] == "override" and entry["reason"] == "incident 42" and entry["predicted_speedup"] > 1
    message = pubsub.get_message(timeout=2)
    assert message and json.loads(message["data"])["version"] == old_version + 1
    pubsub.close()

    status = httpx.get(f"{url}/status").json()
    assert status["paused"] and status["last_decisions"][0]["reason"] == "override"
    assert httpx.post(f"{url}/resume", headers=AUTH).json() == {"paused": False}
    assert not httpx.get(f"{url}/status").json()["paused"]
    assert httpx.post(f"{url}/pause", headers=AUTH).json() == {"paused": True}
    assert httpx.get(f"{url}/status").json()["paused"]
    httpx.post(f"{url}/resume", headers=AUTH)
    time.sleep(0.6)  # a few blind ticks: still no change
    assert json.loads(r.get(mc.SCHEDULE_KEY))["version"] == old_version + 1

    history = httpx.get(f"{url}/history", params={"limit": 2}).json()
    assert [h["version"] for h in history] == [old_version, old_version + 1]


def test_metrics_endpoint(stack):
    url, _ = stack
    text = httpx.get(f"{url}/metrics").text
    for line in (
        "sparrow_controller_blind 1.0",
        'sparrow_controller_budget_tokens{bin="0"}',
        'sparrow_controller_decisions_total{reason="initial"}',
        'sparrow_controller_ticks_total{outcome="blind"}',
        "sparrow_controller_predicted_speedup",
        "sparrow_controller_alpha_target 0.88",
    ):
        assert line in text, line
