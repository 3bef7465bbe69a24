"""`GeneratorControl`: set the schedule, load versions, drain and read the status of a running generator.

Every call that changes the engine is carried out by the engine thread (`GeneratorService.call`);
bad requests answer INVALID_ARGUMENT, refusals (a schedule or adapter the engine will not take, a
download that fails verification) FAILED_PRECONDITION, and an unreachable trainer UNAVAILABLE.

The server is grpc's asyncio one (services/common/aio_server.py): a call waiting on the engine (a
policy load takes minutes) waits on the blocking-work pool, and health is answered meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc

from services.api.sparrow.v1 import common_pb2, generator_pb2, generator_pb2_grpc
from services.common.aio_server import AioServer
from services.common.grpc_server import GrpcSecurity
from services.generator.engine import EngineError
from services.generator.service import GeneratorService
from services.generator.weight_fetch import WeightFetchError, WeightsUnavailable
from sparrow.probe import Probe, ProbeError, ProbePlan
from sparrow.schedule import Schedule, ScheduleError

log = logging.getLogger("sparrow.generator.control")

SERVICE_NAME = "sparrow.v1.GeneratorControl"
CALL_TIMEOUT_S = 600.0  # a policy download and load may take minutes
MAX_CALLS = 64  # a controller and an operator or two; past it RESOURCE_EXHAUSTED, health still answered


def schedule_from_proto(message: common_pb2.Schedule) -> Schedule:
    """The core schedule of a wire schedule; ScheduleError (one line) when it breaks a rule."""
    return Schedule(
        budgets=tuple(message.budgets),
        bin_width=message.bin_width,
        page_size=message.page_size,
        sink_blocks=message.sink_blocks,
        local_blocks=message.local_blocks,
        dense_layers=tuple(message.dense_layers),
        version=message.version,
        name=message.name or None,
    )


def schedule_to_proto(schedule: Schedule | None) -> common_pb2.Schedule:
    """The wire form of a schedule (an empty message for dense attention)."""
    if schedule is None:
        return common_pb2.Schedule()
    return common_pb2.Schedule(
        budgets=schedule.budgets,
        bin_width=schedule.bin_width,
        page_size=schedule.page_size,
        sink_blocks=schedule.sink_blocks,
        local_blocks=schedule.local_blocks,
        dense_layers=schedule.dense_layers,
        version=schedule.version,
        name=schedule.name or "",
    )


def probe_from_proto(p: generator_pb2.Probe, schedule: Schedule) -> Probe | None:
    """The probe of a SetSchedule call for `schedule` (budget 0 keeps the schedule's; share 0: no probe).

    Raises ProbeError when it is malformed, expired or does not fit the schedule."""
    if p.share == 0:
        return None
    if p.expires_at <= time.time():
        raise ProbeError("expires_at must be a time in the future (Unix seconds)")
    budgets = tuple(b if b else None for b in p.budgets)
    probe = Probe(schedule.version, p.share, budgets, p.expires_at)
    probe.plan(schedule)  # raises when the budgets do not fit the schedule's layout
    return probe


def probe_to_proto(plan: ProbePlan | None) -> generator_pb2.Probe | None:
    """The wire form of the probe in force (budgets equal to the schedule's as 0); None when there is none."""
    if plan is None:
        return None
    budgets = [b if b != s else 0 for b, s in zip(plan.budgets, plan.schedule.budgets, strict=True)]
    return generator_pb2.Probe(share=plan.share, budgets=budgets, expires_at=plan.expires_at)


def _versions(service: GeneratorService) -> common_pb2.Versions:
    v = service.serving
    return common_pb2.Versions(
        policy_version=v.policy_version, adapter_version=v.adapter_version, schedule_version=v.schedule_version
    )


class GeneratorControlServicer(generator_pb2_grpc.GeneratorControlServicer):
    """The control API of one generator, backed by its service loop."""

    def __init__(self, service: GeneratorService) -> None:
        self.service = service

    async def SetSchedule(self, request, context):
        """Validate the schedule and apply it from the next engine step."""
        if not request.HasField("schedule"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "schedule is required")
        try:
            schedule = schedule_from_proto(request.schedule)
        except ScheduleError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid schedule: {exc}")
        probe = None
        if request.HasField("probe"):
            try:
                probe = probe_from_proto(request.probe, schedule)
            except ProbeError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid probe: {exc}")

        def apply() -> int:
            version = self.service.apply_schedule(schedule)
            if request.HasField("probe"):  # a probe message with share 0 clears the probe
                self.service.apply_probe(probe)
            return version

        try:
            version = await asyncio.to_thread(self.service.call, apply, CALL_TIMEOUT_S)
        except (EngineError, ValueError) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the engine refused the schedule or probe: {exc}")
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        log.info("schedule v%d set through the control API", version)
        return generator_pb2.SetScheduleResponse(schedule_version=version)

    async def LoadVersions(self, request, context):
        """Fetch and load the asked versions now; answers with what is served afterwards."""
        if request.policy_version < 0 or request.adapter_version < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "versions must be >= 0")
        sync = self.service.sync
        if sync is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this generator fetches no weights (no trainer)")
        try:
            await asyncio.to_thread(sync.load_now, request.policy_version, request.adapter_version)
        except WeightsUnavailable as exc:
            await context.abort(exc.code, str(exc))
        except (WeightFetchError, EngineError) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return generator_pb2.LoadVersionsResponse(serving=_versions(self.service))

    async def Drain(self, request, context):
        """Stop claiming; answers once in-flight groups finished or were handed back (0 s: the configured grace)."""
        grace = request.grace_seconds
        if not math.isfinite(grace) or grace < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "grace_seconds must be a finite number >= 0")
        future = self.service.request_drain(grace or None)
        wait = (grace or self.service.config.drain_grace_s) + 60.0
        try:
            finished, returned = await asyncio.wait_for(asyncio.wrap_future(future), wait)
        except Exception as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"drain did not complete: {exc}")
        return generator_pb2.DrainResponse(groups_finished=finished, groups_returned=returned)

    async def GetStatus(self, request, context):
        """Identity, versions, schedule, in-flight sequences and whether it is draining."""
        s = self.service
        return generator_pb2.GetStatusResponse(
            generator_id=s.generator_id,
            serving=_versions(s),
            in_flight_sequences=s.in_flight_sequences,
            draining=s.draining,
            schedule=schedule_to_proto(s.schedule),
            probe=probe_to_proto(s.engine.probe_plan),
        )


class ControlServer:
    """The GeneratorControl gRPC server with health, reflection and the service token."""

    def __init__(self, service: GeneratorService, security: GrpcSecurity, host: str, port: int, registry=None) -> None:
        self.server = AioServer(
            security, max_calls=MAX_CALLS, blocking_threads=4, registry=registry, component="generator_control",
            name="control-grpc",
        )  # fmt: skip
        try:
            generator_pb2_grpc.add_GeneratorControlServicer_to_server(
                GeneratorControlServicer(service), self.server.server
            )
            self.server.add_health_and_reflection([SERVICE_NAME])
            self.port = self.server.bind(f"{host}:{port}")
        except BaseException:
            self.server.stop(0)  # its loop thread and pool, which a failed bind would leave behind
            raise

    def start(self) -> ControlServer:
        """Start serving; returns self."""
        self.server.start()
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        """Report NOT_SERVING, let calls finish for `grace_s`, stop."""
        self.server.stop(grace_s)
