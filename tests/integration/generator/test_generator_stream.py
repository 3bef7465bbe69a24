"""The trajectory stream against a real gRPC stand-in trainer: acks by id, duplicates, reconnect and resend."""

import pytest

from services.api.sparrow.v1 import common_pb2, rollout_pb2
from services.common.grpc_server import GrpcSecurity
from services.generator.trajectory_stream import Backoff, StreamClosed, TrajectoryStream
from tests.fixtures.standin_rollout_server import StandinRolloutServer

ACCEPTED, DUPLICATE, REJECTED = (
    rollout_pb2.ACK_STATUS_ACCEPTED,
    rollout_pb2.ACK_STATUS_DUPLICATE,
    rollout_pb2.ACK_STATUS_REJECTED,
)


def _trajectory(gid: str, index: int) -> rollout_pb2.Trajectory:
    return rollout_pb2.Trajectory(
        trajectory_id=f"{gid}/0/{index}", group_id=gid, sample_index=index, prompt_token_ids=[1], token_ids=[5, 2]
    )


def _hello() -> rollout_pb2.GeneratorHello:
    return rollout_pb2.GeneratorHello(generator_id="gen-t", versions=common_pb2.Versions(policy_version=1))


@pytest.fixture
def trainer():
    with StandinRolloutServer() as server:
        yield server


@pytest.fixture
def stream(trainer):
    hellos = []
    s = TrajectoryStream(trainer.address, GrpcSecurity(), _hello, hellos.append, Backoff(0.05, 0.3)).start()
    s.trainer_hellos = hellos
    assert s.wait_connected(10)
    yield s
    s.close()


def test_each_trajectory_is_acked_by_id_and_a_resend_is_a_duplicate(trainer, stream):
    futures = [stream.send(_trajectory("a", i)) for i in range(3)]
    acks = [f.result(10) for f in futures]
    assert [a.trajectory_id for a in acks] == ["a/0/0", "a/0/1", "a/0/2"]
    assert all(a.status == ACCEPTED for a in acks)
    assert stream.send(_trajectory("a", 1)).result(10).status == DUPLICATE
    assert len(trainer.trajectories) == 3 and stream.unacked == 0
    assert trainer.hellos[0].generator_id == "gen-t" and len(stream.trainer_hellos) == 1


def test_a_rejection_reaches_the_sender_with_its_reason(trainer, stream):
    trainer.reject = lambda t: "unknown group" if t.group_id == "bad" else None
    ack = stream.send(_trajectory("bad", 0)).result(10)
    assert ack.status == REJECTED and ack.reason == "unknown group"
    assert stream.send(_trajectory("ok", 0)).result(10).status == ACCEPTED


def test_a_trainer_restart_loses_nothing_unacked_is_resent_on_reconnect(trainer, stream):
    trainer.swallow = lambda t: t.group_id == "lost"  # arrives, never stored or acked: lost with the trainer
    lost = [stream.send(_trajectory("lost", i)) for i in range(2)]
    trainer.wait_for(lambda: len(trainer.swallowed) == 2, 10, "the trainer saw both")
    trainer.stop()
    trainer.swallow = None
    while_down = [stream.send(_trajectory("down", i)) for i in range(3)]
    assert not any(f.done() for f in lost + while_down)
    trainer.start()  # same port
    acks = [f.result(15) for f in lost + while_down]
    assert all(a.status == ACCEPTED for a in acks)
    assert sorted(trainer.trajectories) == ["down/0/0", "down/0/1", "down/0/2", "lost/0/0", "lost/0/1"]
    assert stream.connections == 2 and len(trainer.hellos) == 2


def test_sending_the_same_id_twice_while_unacked_gets_one_answer_for_both(trainer, stream):
    trainer.stop()
    first, second = stream.send(_trajectory("twice", 0)), stream.send(_trajectory("twice", 0))
    trainer.start()
    assert first.result(15).status == second.result(15).status == ACCEPTED
    assert [s for i, s in trainer.statuses if i == "twice/0/0"] == [ACCEPTED]


def test_closing_fails_what_was_never_acked(trainer, stream):
    trainer.swallow = lambda t: True
    future = stream.send(_trajectory("never", 0))
    trainer.wait_for(lambda: trainer.swallowed, 10, "the trainer saw it")
    stream.close()
    with pytest.raises(StreamClosed):
        future.result(5)
    with pytest.raises(StreamClosed):
        stream.send(_trajectory("after", 0)).result(5)
