"""GeneratorControl on a running generator over real gRPC: token, health, schedule, versions, status, drain."""

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api.sparrow.v1 import common_pb2, generator_pb2, generator_pb2_grpc
from services.common.grpc_server import GrpcSecurity, open_channel
from tests.fixtures.standin_rollout_server import StandinRolloutServer
from tests.integration.generator.harness import SMALL, group

TOKEN = "c0ntrol-t0ken"


@pytest.fixture
def trainer():  # overrides the open stand-in: this one wants the token too
    with StandinRolloutServer(GrpcSecurity(token=TOKEN)) as server:
        yield server


@pytest.fixture
def running(start, monkeypatch):
    monkeypatch.setenv("SPARROW_SECURITY__TOKEN", TOKEN)
    h = start()
    channel = open_channel(f"127.0.0.1:{h.generator.control.port}", GrpcSecurity(token=TOKEN))
    yield h, generator_pb2_grpc.GeneratorControlStub(channel), channel
    channel.close()


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_calls_need_the_token_but_health_is_open(running):
    h, stub, _ = running
    anonymous = open_channel(f"127.0.0.1:{h.generator.control.port}", GrpcSecurity())
    try:
        bare = generator_pb2_grpc.GeneratorControlStub(anonymous)
        assert _code(lambda: bare.GetStatus(generator_pb2.GetStatusRequest(), timeout=5)) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        check = health_pb2_grpc.HealthStub(anonymous).Check
        reply = check(health_pb2.HealthCheckRequest(service="sparrow.v1.GeneratorControl"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        anonymous.close()
    status = stub.GetStatus(generator_pb2.GetStatusRequest(), timeout=5)
    assert status.generator_id == h.config.generator_id and not status.draining
    assert h.trainer.hellos  # the token reached the trainer too: the stream is open


def test_set_schedule_validates_applies_and_shows_in_status_and_trajectories(running):
    h, stub, _ = running
    bad = common_pb2.Schedule(budgets=[100], bin_width=1000, page_size=16, local_blocks=2, version=5)
    assert _code(lambda: stub.SetSchedule(generator_pb2.SetScheduleRequest(schedule=bad), timeout=5)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert _code(lambda: stub.SetSchedule(generator_pb2.SetScheduleRequest(), timeout=5)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    good = common_pb2.Schedule(budgets=[48], bin_width=1000, page_size=16, sink_blocks=1, local_blocks=2, version=9)
    probe = generator_pb2.Probe(share=0.1, budgets=[32])
    assert _code(lambda: stub.SetSchedule(generator_pb2.SetScheduleRequest(schedule=good, probe=probe))) == (
        grpc.StatusCode.UNIMPLEMENTED
    )
    assert stub.SetSchedule(generator_pb2.SetScheduleRequest(schedule=good), timeout=30).schedule_version == 9
    status = stub.GetStatus(generator_pb2.GetStatusRequest(), timeout=5)
    assert list(status.schedule.budgets) == [48] and status.serving.schedule_version == 9
    h.enqueue(group("s", n=1, pairs=20))  # 65-token prompt: past the 48-token budget from the start
    h.wait_settled({"s": 1})
    (t,) = h.trainer.of_group("s")
    assert t.versions.schedule_version == 9 and set(t.kv_budgets[1:]) == {48}


def test_load_versions_loads_a_good_policy_and_refuses_a_corrupt_or_missing_one(running):
    h, stub, _ = running
    h.trainer.publish("policy", 3, SMALL, corrupt=True)
    h.trainer.publish("policy", 2, SMALL)
    reply = stub.LoadVersions(generator_pb2.LoadVersionsRequest(policy_version=2), timeout=60)
    assert reply.serving.policy_version == 2
    with pytest.raises(grpc.RpcError) as info:
        stub.LoadVersions(generator_pb2.LoadVersionsRequest(policy_version=3), timeout=60)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "sha256" in info.value.details()
    assert _code(lambda: stub.LoadVersions(generator_pb2.LoadVersionsRequest(adapter_version=7), timeout=60)) == (
        grpc.StatusCode.NOT_FOUND
    )
    assert _code(lambda: stub.LoadVersions(generator_pb2.LoadVersionsRequest(policy_version=-1))) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert stub.GetStatus(generator_pb2.GetStatusRequest(), timeout=5).serving.policy_version == 2


def test_drain_hands_back_an_unfinished_group_and_stops_claiming(running):
    h, stub, _ = running
    h.trainer.swallow = lambda t: t.group_id == "stuck"  # never acked: the group cannot finish
    stuck_entry = h.enqueue(group("stuck", n=2))
    h.trainer.wait_for(lambda: len(h.trainer.swallowed) == 2, 60, "stuck sent")
    reply = stub.Drain(generator_pb2.DrainRequest(grace_seconds=0.5), timeout=60)
    assert (reply.groups_finished, reply.groups_returned) == (0, 1)
    assert h.pending() == 0
    entries = h.redis.xrange(h.config.queue.stream)
    assert [e[0].decode() for e in entries][0] == stuck_entry and len(entries) == 2  # a fresh copy to take
    status = stub.GetStatus(generator_pb2.GetStatusRequest(), timeout=5)
    assert status.draining and status.in_flight_sequences == 0
    time.sleep(0.5)  # a draining generator claims nothing more, not even the copy
    assert h.pending() == 0 and h.trainer.of_group("stuck") == []
