"""RolloutService over real gRPC on loopback: bad trajectories are refused with a reason and the stream goes
on, duplicates are acked and stored once, many generators stream at once, stream-level problems end only
their own stream, and the service token is enforced."""

import threading
from contextlib import contextmanager
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api.sparrow.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.aio_server import AioServer
from services.common.grpc_server import GrpcSecurity, open_channel
from services.trainer.ledger import TRAINED, GroupLedger, GroupRecord
from services.trainer.metrics import TrainerMetrics
from services.trainer.rollout_servicer import RolloutServicer
from services.trainer.store import TrajectoryStore
from services.trainer.validate import Limits
from services.trainer.weight_servicer import WeightServicer
from services.trainer.weights import POLICY, WeightStore
from sparrow.tasks import ChainTask, ExampleStream, encode_words
from sparrow.tasks.vocab import BOS, TOKEN_TO_ID
from tests.integration.trainer_service.helpers import TINY, RolloutSession, sample_trajectories
from trainer.model_io import load_model

N = 4
PLAIN = GrpcSecurity()
ACCEPTED, DUPLICATE, REJECTED = (
    rollout_pb2.ACK_STATUS_ACCEPTED,
    rollout_pb2.ACK_STATUS_DUPLICATE,
    rollout_pb2.ACK_STATUS_REJECTED,
)


@pytest.fixture(scope="module")
def model():
    return load_model(TINY)


def _groups(count: int) -> list[GroupRecord]:
    examples = ExampleStream(ChainTask(4, 2), seed=5).take(count)
    return [
        GroupRecord(i, f"grp-{i}", (TOKEN_TO_ID[BOS], *encode_words(ex.prompt)), N, ex.answer, 1, 16)
        for i, ex in enumerate(examples)
    ]


@contextmanager
def _server(tmp_path, security=PLAIN, max_message_bytes=4 << 20, groups=6, max_calls=64):
    store, ledger = TrajectoryStore(tmp_path), GroupLedger(tmp_path)
    for record in _groups(groups):
        ledger.add(record)
    weights = WeightStore(tmp_path, keep=2)
    for v in (1, 2):
        weights.publish(POLICY, v, lambda out: (out / "model.safetensors").write_bytes(b"w"))
    metrics = TrainerMetrics(2000, 20)
    servicer = RolloutServicer(store, ledger, WeightServicer(weights, 1 << 16, 1 << 20), Limits(521, 20), metrics)
    server = AioServer(
        security,
        max_calls=max_calls,
        max_message_bytes=max_message_bytes,
        registry=metrics.registry,
        component="trainer",
    )
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server.server)
    server.add_health_and_reflection(["sparrow.v1.RolloutService"])
    port = server.bind("127.0.0.1:0")
    server.start()
    try:
        yield SimpleNamespace(
            address=f"127.0.0.1:{port}", store=store, ledger=ledger, metrics=metrics, weights=weights, server=server
        )
    finally:
        server.stop(0.5)
        store.close()


def _count(metrics, status):
    return metrics.registry.get_sample_value("sparrow_trainer_trajectories_total", {"status": status})


def _copy(t, **changes):
    out = rollout_pb2.Trajectory()
    out.CopyFrom(t)
    for key, value in changes.items():
        setattr(out, key, value)
    return out


def test_each_bad_trajectory_is_rejected_with_its_reason_and_the_stream_goes_on(tmp_path, model):
    with _server(tmp_path) as srv:
        session = RolloutSession(open_channel(srv.address, GrpcSecurity()))
        assert session.hello.latest.policy_version == 2
        good = sample_trajectories(model, "grp-0", srv.ledger.get("grp-0").prompt_token_ids, N, policy_version=2)
        srv.ledger.add(GroupRecord(99, "grp-dead", tuple(good[0].prompt_token_ids), N, "x", 1, 16))
        srv.ledger.mark_dead("grp-dead", "retries exhausted")

        def nan_logprob(t):
            t.logprobs[0] = float("nan")

        def unsorted_top(t):
            t.top_logprobs[0].logprobs[0], t.top_logprobs[0].logprobs[1] = -5.0, -0.1

        def short_top(t):
            del t.top_logprobs[0].token_ids[-1]
            del t.top_logprobs[0].logprobs[-1]

        def mismatch(t):
            del t.logprobs[-1]

        def out_of_vocab(t):
            t.token_ids[0] = 10_000

        def future(t):
            t.versions.policy_version = 3

        bad = [
            (mismatch, "length mismatch"),
            (nan_logprob, "logprobs must be finite"),
            (unsorted_top, "not sorted most likely first"),
            (short_top, "expected 20"),
            (out_of_vocab, "outside the vocabulary"),
            (future, "from the future (latest published is 2)"),
            (lambda t: setattr(t, "group_id", "nobody"), "unknown group nobody"),
            (lambda t: setattr(t, "group_id", "grp-dead"), "dead-lettered: retries exhausted"),
            (lambda t: setattr(t, "sample_index", N), f"outside [0, {N})"),
            (lambda t: t.prompt_token_ids.append(5), "differ from the prompt enqueued"),
        ]
        for i, (mutate, reason) in enumerate(bad):
            t = _copy(good[0], trajectory_id=f"bad-{i}")
            mutate(t)
            ack = session.send(t)
            assert ack.status == REJECTED and reason in ack.reason, (reason, ack.reason)
            assert ack.trajectory_id == f"bad-{i}"
        for t in good:  # the same stream still takes good ones
            assert session.send(t).status == ACCEPTED
        session.close()
        assert srv.store.count("grp-0") == N and srv.store.count("nobody") == 0
        assert _count(srv.metrics, "rejected") == len(bad) and _count(srv.metrics, "accepted") == N


def test_duplicates_are_acked_but_stored_and_counted_once(tmp_path, model):
    with _server(tmp_path) as srv:
        session = RolloutSession(open_channel(srv.address, GrpcSecurity()))
        first, second = sample_trajectories(model, "grp-1", srv.ledger.get("grp-1").prompt_token_ids, 2, 2, seed=3)
        assert session.send(first).status == ACCEPTED
        ack = session.send(first)  # a resend after a lost ack
        assert ack.status == DUPLICATE and "already stored" in ack.reason
        ack = session.send(_copy(second, sample_index=0))  # another sample for a filled slot
        assert ack.status == DUPLICATE and "sample 0 of group grp-1" in ack.reason
        srv.ledger.take(["grp-1"])
        srv.ledger.finish(["grp-1"], TRAINED)
        ack = session.send(_copy(second, trajectory_id="late", sample_index=1))
        assert ack.status == DUPLICATE and "already trained" in ack.reason
        session.close()
        assert srv.store.count("grp-1") == 1 and srv.store.samples("grp-1")[0].trajectory_id == first.trajectory_id
        assert _count(srv.metrics, "accepted") == 1 and _count(srv.metrics, "duplicate") == 3
    assert TrajectoryStore(tmp_path).count("grp-1") == 1  # and on disk


def test_many_generators_stream_at_once_and_each_slot_is_filled_once(tmp_path, model):
    with _server(tmp_path) as srv:
        groups = [r.group_id for r in srv.ledger.outstanding()]
        # Every generator samples every group under its own trajectory ids: they race for the same slots.
        work = {
            w: [
                _copy(t, trajectory_id=f"gen{w}/{t.trajectory_id}")
                for gid in groups
                for t in sample_trajectories(model, gid, srv.ledger.get(gid).prompt_token_ids, N, 2, seed=w)
            ]
            for w in range(4)
        }
        statuses: dict[int, list[int]] = {}

        def generator(w: int) -> None:
            session = RolloutSession(open_channel(srv.address, GrpcSecurity()), f"gen{w}")
            statuses[w] = [session.send(t).status for t in work[w]]
            session.close()

        threads = [threading.Thread(target=generator, args=(w,)) for w in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        flat = [s for w in statuses.values() for s in w]
        assert len(statuses) == 4 and len(flat) == 4 * len(groups) * N
        assert flat.count(ACCEPTED) == len(groups) * N and flat.count(DUPLICATE) == 3 * len(groups) * N
        assert all(srv.store.count(g) == N for g in groups)


def _raw_stream(address, requests, security=PLAIN):
    stub = rollout_pb2_grpc.RolloutServiceStub(open_channel(address, security))
    return list(stub.StreamTrajectories(iter(requests), timeout=30))


def test_stream_level_problems_end_only_their_own_stream(tmp_path, model):
    with _server(tmp_path, max_message_bytes=1 << 20) as srv:
        bystander = RolloutSession(open_channel(srv.address, GrpcSecurity()), "bystander")
        good = sample_trajectories(model, "grp-2", srv.ledger.get("grp-2").prompt_token_ids, 2, 2)
        with pytest.raises(grpc.RpcError) as err:
            _raw_stream(srv.address, [rollout_pb2.StreamTrajectoriesRequest(trajectory=good[0])])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "start with a hello" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            _raw_stream(srv.address, [rollout_pb2.StreamTrajectoriesRequest(hello=rollout_pb2.GeneratorHello())])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "generator_id" in err.value.details()
        huge = _copy(good[0], trajectory_id="huge")
        huge.prompt_token_ids.extend([5] * 1_500_000)  # 1.5 MB on the wire, over the 1 MiB limit
        hello = rollout_pb2.StreamTrajectoriesRequest(hello=rollout_pb2.GeneratorHello(generator_id="big"))
        with pytest.raises(grpc.RpcError) as err:
            _raw_stream(srv.address, [hello, rollout_pb2.StreamTrajectoriesRequest(trajectory=huge)])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        reply = bystander.send_raw(hello)  # a second hello just asks for the versions again
        assert reply.hello.latest.policy_version == 2
        assert bystander.send(good[1]).status == ACCEPTED  # the other stream never noticed
        bystander.close()
        assert srv.store.count("grp-2") == 1


def test_the_service_token_is_required_but_health_stays_open(tmp_path, model):
    secure = GrpcSecurity(token="s3cret")
    with _server(tmp_path, security=secure, groups=1) as srv:
        with pytest.raises(grpc.RpcError) as err:
            RolloutSession(open_channel(srv.address, GrpcSecurity()))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            RolloutSession(open_channel(srv.address, GrpcSecurity(token="wrong")))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(open_channel(srv.address, GrpcSecurity()))
        check = health.Check(health_pb2.HealthCheckRequest(service="sparrow.v1.RolloutService"), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        session = RolloutSession(open_channel(srv.address, secure))
        t = sample_trajectories(model, "grp-0", srv.ledger.get("grp-0").prompt_token_ids, 1, 1)[0]
        assert session.send(t).status == ACCEPTED
        session.close()


def test_a_stopping_trainer_ends_an_open_stream_at_once_with_unavailable(tmp_path, model):
    """A live generator never closes its stream; the trainer ends it when it stops (its weight store closes), so
    the server's stop does not sit out its grace, and the generator is told to reconnect (UNAVAILABLE)."""
    with _server(tmp_path) as srv:
        session = RolloutSession(open_channel(srv.address, GrpcSecurity()), timeout=60)  # a hang fails
        good = sample_trajectories(model, "grp-0", srv.ledger.get("grp-0").prompt_token_ids, N, policy_version=2)
        assert session.send(good[0]).status == ACCEPTED  # acked before the stop: stored and answered
        srv.weights.close()
        with pytest.raises(grpc.RpcError) as exc:
            session.receive()  # nothing sent: the server ends the stream by itself
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and "stopping" in exc.value.details()
        srv.server.stop(5.0)
        assert srv.server.ended_at_stop == 0  # no call was left open to sit out the grace
        assert srv.store.has_id(good[0].trajectory_id)
