"""A reward served over HTTP, against a real local FastAPI server that scores, is slow, answers 500s, answers
garbage and is killed: every sample gets a result, failures score 0 and are counted by reason, the limit on
requests in flight holds, and a server that is down is refused in one line."""

import asyncio
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter

from services.trainer.config import HttpRewardConfig
from services.trainer.http_reward import HttpRewards, check_http_reward
from services.trainer.reward_pool import RewardPool
from services.trainer.rewarding import reward_input
from tests.servers import free_port, wait_until

CHAT = [{"role": "user", "content": "What is 2 + 3?"}]


def _app(seen: dict) -> FastAPI:
    app = FastAPI()
    seen.update(flaky=0, open=0, most_open=0, auth=set())

    @app.post("/score")
    async def score(request: Request):
        body = await request.json()
        seen["auth"].add(request.headers.get("authorization"))
        seen["open"] += 1
        seen["most_open"] = max(seen["most_open"], seen["open"])
        await asyncio.sleep(0.05)
        seen["open"] -= 1
        assert body["prompt"] == CHAT and body["columns"]["level"] == 3 and body["extras"]["data_source"] == "arith"
        return {"score": float(body["response"] == body["ground_truth"]), "length": len(body["response"])}

    @app.post("/batch")
    async def batch(request: Request):
        items = (await request.json())["items"]
        return [float(i["response"] == i["ground_truth"]) for i in items]

    @app.post("/slow")
    async def slow():
        await asyncio.sleep(2.0)
        return 1.0

    @app.post("/flaky")
    async def flaky():
        seen["flaky"] += 1
        return JSONResponse({"error": "busy"}, status_code=500) if seen["flaky"] <= 2 else JSONResponse(1.0)

    @app.post("/fail")
    async def fail():
        return JSONResponse({"error": "broken"}, status_code=500)

    @app.post("/garbage")
    async def garbage():
        return PlainTextResponse("score: one")

    return app


@contextmanager
def _server(seen: dict):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_app(seen), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the reward server")
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _inputs(n: int, right: int) -> list:
    return [
        reward_input("5" if i < right else "4", "5", "arith", {"index": i}, {"level": 3}, CHAT, {}) for i in range(n)
    ]


def test_an_http_reward_scores_retries_and_counts_every_failure_by_reason():
    registry = CollectorRegistry()
    errors = Counter("sparrow_trainer_reward_errors", "test", ["reason"], registry=registry)
    pool = RewardPool(workers=1, timeout_s=5.0, errors_counter=errors)
    config = HttpRewardConfig(timeout_s=0.5, retries=2, backoff_s=0.05, max_concurrency=3, token="s3cret")
    http = HttpRewards(config, pool)
    seen: dict = {}
    try:
        with _server(seen) as (server, base):
            assert check_http_reward(f"{base}/score") is None
            futures = [http.submit_inputs(f"{base}/score", [i]) for i in _inputs(12, right=8)]
            results = [f.result(30)[0] for f in futures]
            assert [r.score for r in results] == [1.0] * 8 + [0.0] * 4 and all(r.error is None for r in results)
            assert results[0].info == {"length": 1.0}
            assert seen["most_open"] <= 3 and seen["auth"] == {"Bearer s3cret"}
            # 500s twice, then an answer: the retries get it.
            assert http.submit_inputs(f"{base}/flaky", _inputs(1, 1)).result(30)[0].score == 1.0
            started = time.monotonic()
            failed = {
                path: http.submit_inputs(f"{base}/{path}", _inputs(2, 2)).result(30)
                for path in ("slow", "fail", "garbage")
            }
            assert time.monotonic() - started < 10  # three tries of 0.5 s plus backoff, not the 2 s sleeps
            assert {p: [r.error for r in rs] for p, rs in failed.items()} == {
                "slow": ["timeout"] * 2, "fail": ["unavailable"] * 2, "garbage": ["bad_value"] * 2,
            }  # fmt: skip
            batch = HttpRewards(config.model_copy(update={"batch_size": 3}), pool)
            try:
                scored = batch.submit_inputs(f"{base}/batch", _inputs(5, right=4)).result(30)
                assert [r.score for r in scored] == [1.0, 1.0, 1.0, 1.0, 0.0]
            finally:
                batch.close()
            server.should_exit = True  # killed mid-run: later calls fail, counted, and return
        wait_until(lambda: check_http_reward(f"{base}/score", 1.0) is not None, 30, "the server gone")
        gone = http.submit_inputs(f"{base}/score", _inputs(3, 3)).result(30)
        assert [r.error for r in gone] == ["unavailable"] * 3
        problem = check_http_reward(f"{base}/score", 1.0)
        assert problem.startswith(f"reward {base}/score: no server answers at 127.0.0.1:") and "\n" not in problem
        counted = {r: registry.get_sample_value("sparrow_trainer_reward_errors_total", {"reason": r})
                   for r in ("timeout", "unavailable", "bad_value")}  # fmt: skip
        assert counted == {"timeout": 2.0, "unavailable": 5.0, "bad_value": 2.0}
    finally:
        http.close()
        pool.close()


@pytest.mark.slow
def test_a_short_run_scored_by_a_reward_server_that_fails_some_calls(tmp_path):
    from tests.integration.trainer_service.test_trainer_steps import _config, _metrics, _running, _steps
    from tests.servers import redis_server

    seen: dict = {"calls": 0}
    app = FastAPI()

    @app.post("/judge")
    async def judge(request: Request):
        body = await request.json()
        seen["calls"] += 1
        if seen["calls"] % 5 == 0:
            return JSONResponse({"error": "overloaded"}, status_code=503)
        assert body["extras"]["data_source"] == "chain" and body["ground_truth"]
        return {"score": 1.0, "judged": 1.0}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the reward server")
    url = f"http://127.0.0.1:{port}/judge"
    try:
        with redis_server() as redis:
            config = _config(tmp_path / "run", redis.url, steps=2, **{"reward.name": url, "reward.http.retries": 0})
            with _running(config, True, tmp_path / "gen") as (service, _generator, _address):
                wait_until(lambda: len(_steps(tmp_path / "run")) >= 2, 240, "two steps", explain=service.waiting_for)
                metrics = _metrics(service)
    finally:
        server.should_exit = True
        thread.join(10)
    steps = _steps(tmp_path / "run")
    for s in steps:  # every sample scored: 1 from the server, or 0 with an error counted
        assert s["samples"] == 8 and s["reward_errors"] + round(s["reward_mean"] * 8) == 8
        assert s["reward_extra"].get(url, {"judged": 1.0}) == {"judged": 1.0}
    # The 16 trained samples took at least 16 calls, so calls 5 and 10 failed (in these groups or in later ones).
    unavailable = metrics["sparrow_trainer_reward_errors_total{reason=unavailable}"]
    assert unavailable >= 2 and unavailable >= sum(s["reward_errors"] for s in steps)
