"""The admin API (FastAPI, OpenAPI at /docs and /openapi.json): status, history, pause/resume, override, /metrics."""

from __future__ import annotations

import asyncio
import hmac
import json
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from services.controller.loop import ControlLoop
from services.controller.publisher import StoreError
from sparrow.schedule import ScheduleError

# A 20-bin schedule is well under a kilobyte; a body past this is refused (413) before it is parsed, so a
# careless or hostile caller cannot hold the event loop, which also runs the control loop, on a huge parse.
MAX_OVERRIDE_BYTES = 1 << 20


class BinOut(BaseModel):
    """One length bin as the last tick saw it."""

    bin: int
    budget: int = Field(description="Current budget, kept KV tokens.")
    state: str = Field(
        description="no_data | waiting (data from an older budget) | few_tokens | fresh | "
        "confirming (under target but above tau: waiting for raise_min_readings) | at_max"
    )
    p5: float | None = Field(
        description="The reading that decided (exact gauge or histogram quantile; lossless mode: mean acceptance of "
        "one draft over the window)."
    )
    estimate: float | None = Field(
        description="Running mean of p5 readings at this budget (lossless mode: of the draft acceptance)."
    )
    readings: int = Field(0, description="Distinct fresh readings since this budget was set.")
    noise: float | None = Field(
        None, description="Learned scatter (RMS) of one reading around its budget's mean; None before a repeat."
    )
    headroom: float | None = Field(description="estimate - (tau + margin); negative means below target.")
    p5_exact: float | None
    p5_histogram: float | None
    tokens: float
    source: str | None
    since_version: int = Field(description="Schedule version that set this budget.")
    predicted_cheapest: int | None = Field(
        description="Cheapest budget the bin's fitted curve predicts holds target (lossless mode: the draft budget "
        "predicted to give the most tokens per cost)."
    )
    predicted_gain: float | None = Field(
        None, description="Lossless mode: predicted tokens per cost over dense decoding's at the bin's budget."
    )


class StatusOut(BaseModel):
    """The controller's state."""

    mode: str = Field("tail", description="tail (lossy sparse rollouts: p5 >= tau) or lossless (speculative).")
    schedule: dict[str, Any] | None
    compact: str | None
    predicted_speedup: float | None
    cost: dict[str, Any]
    step_overhead: dict[str, Any] | None = Field(
        None,
        description="Lossless mode: the step overhead priced (multiples of 2P), configured, measured from the "
        "generators' timed cycles (per bin and pooled), and whether measuring is on; null in tail mode.",
    )
    cycle_times: dict[str, Any] | None = Field(
        None,
        description="Lossless mode: the generators' timed cycles as the gain prices them: a draft step's seconds "
        "fitted as a fixed part plus a slope in its attention eFLOPs, and the verify's measured seconds per "
        "bin (keyed by the bin's middle KV length); null in tail mode.",
    )
    tau: float
    margin: float
    hysteresis: float
    target: float
    blind: bool = Field(description="True while no fresh trainer metrics are readable; the schedule is held.")
    blind_reason: str | None
    paused: bool
    store_error: str | None
    trainer_schedule_version: int | None
    bins: list[BinOut]
    last_decisions: list[dict[str, Any]]
    probe: dict[str, Any] | None = Field(
        None,
        description="The probe request last written: schedule_version, share, budgets per probed bin (null: none).",
    )
    ticks: int
    last_tick: float | None
    trainer_steps: int | None = Field(None, description="The trainer's step counter at the last tick.")
    trainer_steps_unseen: int = Field(
        0, description="Trainer steps that ended between two ticks: their readings were never read."
    )


class OverrideIn(BaseModel):
    """A full schedule to publish by hand (the JSON form of `sparrow schedule`); its version is assigned."""

    schedule: dict[str, Any] = Field(
        description="Schedule JSON; only `budgets` is required.",
        examples=[{"budgets": [512, 1024, 1536, 2048], "bin_width": 2000}],
    )
    reason: str = Field("manual override", max_length=500, description="Logged with the new version.")
    pause: bool = Field(True, description="Pause retuning so the override holds until POST /resume.")


class PausedOut(BaseModel):
    """Whether retuning is paused."""

    paused: bool


def create_app(loop: ControlLoop, on_shutdown: Any = None) -> FastAPI:
    """The admin app; its lifespan runs the control loop and stops it (then `on_shutdown()`) at exit."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        stop = asyncio.Event()
        task = asyncio.create_task(loop.run(stop))
        try:
            yield
        finally:
            stop.set()
            await task
            if on_shutdown is not None:
                await on_shutdown()

    app = FastAPI(
        title="Sparrow controller",
        description="Closed-loop sparsity schedule: tail acceptance per length bin in, schedule versions out.",
        version="1",
        lifespan=lifespan,
    )
    token = loop.config.security.token

    def require_token(request: Request) -> None:
        """Bearer-token check for every POST, in constant time."""
        if token is None:
            raise HTTPException(403, "admin actions are disabled: no security.token configured")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        expected = token.get_secret_value().encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/status", response_model=StatusOut, summary="Current schedule, per-bin p5, decisions, blind/paused")
    async def status() -> dict[str, Any]:
        return loop.status()

    @app.get("/history", summary="Published schedule versions, oldest first")
    async def history(limit: int = Query(100, ge=1, le=10000)) -> list[dict[str, Any]]:
        try:
            return await loop.publisher.history(limit)
        except StoreError as exc:
            raise HTTPException(503, str(exc)) from None

    @app.post("/pause", response_model=PausedOut, dependencies=[Depends(require_token)], summary="Stop retuning")
    async def pause() -> PausedOut:
        loop.set_paused(True)
        return PausedOut(paused=True)

    @app.post("/resume", response_model=PausedOut, dependencies=[Depends(require_token)], summary="Resume retuning")
    async def resume() -> PausedOut:
        loop.set_paused(False)
        return PausedOut(paused=False)

    @app.post(
        "/override",
        dependencies=[Depends(require_token)],
        summary="Publish a full schedule by hand (401 without the token, 422 if invalid: nothing is written)",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": OverrideIn.model_json_schema()}},
            }
        },
    )
    async def override(request: Request) -> dict[str, Any]:
        # The body is parsed here, after the token check, so an unauthenticated caller learns nothing of it.
        try:
            body = OverrideIn.model_validate(json.loads(await _read_body(request, MAX_OVERRIDE_BYTES)))
        except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested past the parser's depth
            return _unprocessable(_one_line(exc))
        try:
            new = await loop.override(body.schedule, body.reason, body.pause)
        except ScheduleError as exc:
            return _unprocessable(f"invalid schedule: {exc}")
        except StoreError as exc:
            raise HTTPException(503, str(exc)) from None
        return {"version": new.version, "schedule": new.to_dict(), "paused": loop.paused}

    @app.get("/metrics", summary="The controller's Prometheus metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(loop.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/healthz", summary="Liveness")
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, or 413 as soon as it is known to be longer than `limit` bytes (declared or streamed)."""
    too_large = HTTPException(413, f"request body over {limit} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


def _unprocessable(message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=422)


def _one_line(exc: ValueError | RecursionError) -> str:
    """A short message for a body that is not JSON or not an override."""
    errors = getattr(exc, "errors", None)
    if callable(errors):  # pydantic: name the first offending field
        first = errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        return f"malformed override: {where}: {first['msg']}"
    if isinstance(exc, json.JSONDecodeError):
        return f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
    return f"malformed override: {exc}"
