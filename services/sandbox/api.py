"""The sandbox's HTTP API (FastAPI; OpenAPI at /docs and /openapi.json): POST /v1/run, health, /metrics.

A request is checked whole before anything runs: its body size (413), its token (401), its shape and
its tests (422 with a message), its limits against the service's maximum (422). Only then does it take
a place in the pool, or get 429 when the queue is full.
"""

from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError

from services.sandbox.config import SandboxConfig
from services.sandbox.jail import Jail
from services.sandbox.metrics import SandboxMetrics
from services.sandbox.pool import BoundedPool, QueueFull
from services.sandbox.runner import CASE_STATUSES, run_suite
from services.sandbox.runtimes import get_runtime
from services.sandbox.testcases import TestFormatError, parse_tests

log = logging.getLogger("sparrow.sandbox")


class RunRequest(BaseModel):
    """One program and the tests of its problem."""

    model_config = {"extra": "forbid"}

    code: str = Field(min_length=1, description="The program's source.")
    language: str = Field("python3", description="A runtime of the table (python3).")
    tests: Any = Field(
        description="TACO/APPS input_output ({inputs, outputs, fn_name?}) or LiveCodeBench cases, object or JSON text."
    )
    timeout_s: float | None = Field(None, gt=0, description="Wall-clock seconds per case (default: the service's).")
    memory_mb: int | None = Field(None, ge=16, description="Address-space limit per case, MiB.")
    stop_on_first_failure: bool = Field(False, description="Stop at the first case that does not pass.")
    float_tolerance: float | None = Field(None, ge=0, description="Numbers in outputs match within this (abs/rel).")


class CaseOut(BaseModel):
    """How one case went."""

    status: str = Field(description=" | ".join(CASE_STATUSES))
    exit_code: int | None
    elapsed_s: float
    peak_memory_bytes: int
    stdout: str = Field(description="First bytes of stdout (the result marker of a call-based case removed).")
    stderr: str = Field(description="First bytes of stderr.")


class RunResponse(BaseModel):
    """All cases of one request."""

    status: str = Field(description="passed when every case passed, else the first other case's status.")
    passed: int
    total: int
    not_run: int = Field(
        description="Cases not run: after a stop at the first failure, a compile error or max_request_s."
    )
    pass_fraction: float
    cases: list[CaseOut]


def _error(code: int, message: str, metrics: SandboxMetrics, status: str = "invalid") -> JSONResponse:
    metrics.requests.labels(status).inc()
    return JSONResponse({"detail": message}, status_code=code)


def create_app(config: SandboxConfig, jail: Jail, metrics: SandboxMetrics | None = None) -> FastAPI:
    """The service's app; its lifespan owns the worker pool."""
    metrics = metrics or SandboxMetrics()
    pool = BoundedPool(config.pool.workers, config.pool.queue_limit, metrics)
    token = config.security.token.get_secret_value().encode() if config.security.token else None
    limits = config.limits

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            yield
        finally:
            pool.close()

    app = FastAPI(
        title="Sparrow sandbox",
        description="Runs model-written programs against tests in a bubblewrap jail, one worker per program.",
        version="1",
        lifespan=lifespan,
    )
    app.state.pool = pool

    @app.post(
        "/v1/run",
        response_model=RunResponse,
        openapi_extra={"requestBody": {"content": {"application/json": {"schema": RunRequest.model_json_schema()}}}},
        responses={401: {}, 413: {}, 422: {}, 429: {}},
    )
    async def run(request: Request):
        """Run the program against every case of its tests (or up to the first failure)."""
        if token is not None:
            got = request.headers.get("authorization", "").removeprefix("Bearer ").encode()
            if not hmac.compare_digest(got, token):
                return _error(401, "missing or wrong bearer token", metrics, "unauthorized")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            return _error(413, f"body of {declared} bytes is over the limit of {limits.max_body_bytes}", metrics)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limits.max_body_bytes:
                return _error(413, f"body is over the limit of {limits.max_body_bytes} bytes", metrics)
        try:
            req = RunRequest.model_validate_json(bytes(body))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            return _error(422, f"{where}: {first['msg']}", metrics)
        if not req.code.strip():
            return _error(422, "code: the program is empty", metrics)
        if req.timeout_s is not None and req.timeout_s > limits.max_timeout_s:
            return _error(
                422, f"timeout_s {req.timeout_s} is over the service's maximum {limits.max_timeout_s}", metrics
            )
        if req.memory_mb is not None and req.memory_mb > limits.max_memory_mb:
            return _error(
                422, f"memory_mb {req.memory_mb} is over the service's maximum {limits.max_memory_mb}", metrics
            )
        try:
            runtime = get_runtime(req.language)
            if runtime.interpreter() is None:
                raise ValueError(f"language {req.language} is not installed on this sandbox")
            suite = parse_tests(req.tests)
        except (ValueError, TestFormatError) as exc:
            return _error(422, str(exc), metrics)
        job_limits = limits.for_request(req.timeout_s, req.memory_mb)

        def job():
            return run_suite(
                jail,
                runtime,
                req.code,
                suite,
                job_limits,
                stop_on_first_failure=req.stop_on_first_failure,
                keep_bytes=limits.keep_bytes,
                float_tolerance=req.float_tolerance,
                budget_s=limits.max_request_s,
            )

        try:
            result = await pool.run(job)
        except QueueFull as exc:
            return _error(429, f"the sandbox is busy: {exc}; retry with backoff", metrics, "rejected")
        except Exception:  # a bug of ours must answer 500 and keep the service up
            log.exception("run failed")
            return _error(500, "the sandbox failed to run the program", metrics, "error")
        for case in result.cases:
            metrics.cases.labels(case.status).inc()
            metrics.run_seconds.observe(case.elapsed_s)
        metrics.requests.labels("ok").inc()
        first_bad = next((c.status for c in result.cases if c.status != "passed"), None)
        if config.api.access_log:
            seconds = sum(c.elapsed_s for c in result.cases)
            log.info("run: %d/%d passed, %s, %.2f s", result.passed, result.total, first_bad or "passed", seconds)
        return RunResponse(
            status=first_bad or "passed",
            passed=result.passed,
            total=result.total,
            not_run=result.total - len(result.cases),
            pass_fraction=result.pass_fraction,
            cases=[CaseOut(**c.to_dict()) for c in result.cases],
        )

    @app.get("/healthz")
    async def healthz():
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        """Readiness: the jail was checked at start; the pool's state for the autoscaler and the curious."""
        return {
            "status": "ok",
            "jailed": not jail.insecure_local,
            "workers": pool.workers,
            "waiting": pool.waiting,
            "queue_limit": pool.queue_limit,
            "time": time.time(),
        }

    @app.get("/metrics")
    async def prometheus_metrics():
        """Prometheus text format."""
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
