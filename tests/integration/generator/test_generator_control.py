"""GeneratorControl on a running generator over real gRPC: token, health, schedule, versions, status, drain."""

import threading
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
    # the token reached the trainer too: the stream opens (the generator may still be dialling it)
    h.trainer.wait_for(lambda: bool(h.trainer.hellos), 30, "the generator's hello, sent with the token")


def test_set_schedule_validates_applies_and_shows_in_status_and_trajectories(running):
    h, stub, _ = running
    bad = common_pb2.Schedule(budgets=[100], bin_width=1000, page_size=16, local_blocks=2, version=5)
    assert _code(lambda: stub.SetSchedule(generator_pb2.SetScheduleRequest(schedule=bad), timeout=5)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert _code(lambda: stub.SetSchedule(generator_pb2.SetScheduleRequest(), timeout=5)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    good = common_pb2.Schedule(budgets=[64], bin_width=1000, page_size=16, sink_blocks=1, local_blocks=2, version=9)
    later = time.time() + 600
    for bad_probe, why in (
        (generator_pb2.Probe(share=0.5, budgets=[32], expires_at=later), "sink and local"),
        (generator_pb2.Probe(share=0.5, budgets=[48, 48], expires_at=later), "bins"),
        (generator_pb2.Probe(share=1.5, budgets=[48], expires_at=later), "share"),
        (generator_pb2.Probe(share=0.5, budgets=[48], expires_at=time.time() - 1), "future"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            stub.SetSchedule(generator_pb2.SetScheduleRequest(schedule=good, probe=bad_probe), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in info.value.details()
    # Half the new sequences at 48 tokens while the schedule says 64.
    probe = generator_pb2.Probe(share=0.5, budgets=[48], expires_at=later)
    reply = stub.SetSchedule(generator_pb2.SetScheduleRequest(schedule=good, probe=probe), timeout=30)
    assert reply.schedule_version == 9
    status = stub.GetStatus(generator_pb2.GetStatusRequest(), timeout=5)
    assert list(status.schedule.budgets) == [64] and status.serving.schedule_version == 9
    assert status.HasField("probe") and list(status.probe.budgets) == [48] and status.probe.share == 0.5
    h.enqueue(group("s", n=2, pairs=25))  # 80-token prompt: past both budgets from the start
    h.wait_settled({"s": 2})
    plain, probed = sorted(h.trainer.of_group("s"), key=lambda t: t.probe)
    assert plain.versions.schedule_version == probed.versions.schedule_version == 9
    assert (plain.probe, probed.probe) == (False, True)
    assert set(plain.kv_budgets[1:]) == {64} and set(probed.kv_budgets[1:]) == {48}
    # A probe message with share 0 clears the probe: every sequence follows the schedule again.
    off = generator_pb2.SetScheduleRequest(schedule=good, probe=generator_pb2.Probe(share=0))
    assert stub.SetSchedule(off, timeout=30).schedule_version == 9
    assert not stub.GetStatus(generator_pb2.GetStatusRequest(), timeout=5).HasField("probe")
    h.enqueue(group("t", n=2, pairs=25))
    h.wait_settled({"t": 2})
    assert not any(t.probe for t in h.trainer.of_group("t"))


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


def test_stopping_the_generator_cancels_a_load_versions_download_under_way(start, monkeypatch):
    # The RPC's thread is joined when the process exits: a download it left running would hold a
    # SIGTERMed generator up to trainer.fetch_timeout_s, past any pod's grace period.
    monkeypatch.setenv("SPARROW_SECURITY__TOKEN", TOKEN)
    h = start(**{"trainer.follow_versions": False})
    h.trainer.publish("policy", 2, SMALL, hang=True)
    channel = open_channel(f"127.0.0.1:{h.generator.control.port}", GrpcSecurity(token=TOKEN))
    stub = generator_pb2_grpc.GeneratorControlStub(channel)
    answers = []

    def load():
        try:
            answers.append(stub.LoadVersions(generator_pb2.LoadVersionsRequest(policy_version=2), timeout=120))
        except grpc.RpcError as exc:
            answers.append(exc.code())

    caller = threading.Thread(target=load)
    caller.start()
    try:
        h.trainer.wait_for(lambda: ("policy", 2) in h.trainer.fetches, 30, "the download started")
        h.stop()
        h.trainer.wait_for(lambda: ("policy", 2) in h.trainer.fetches_left, 60, "the download given up")
        caller.join(60)
    finally:
        channel.close()
    assert len(answers) == 1 and h.service.serving.policy_version == 0


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
