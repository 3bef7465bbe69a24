"""The trainer's gRPC server under many open calls and bad bytes, for real on loopback.

- the trainer service's own server holds far more open streams and watches than any thread pool it had
  (64 threads: 32 generators filled it) while health is answered, and every trajectory sent on them is
  acked once and stored (bench/trainer_streams.py's client, the shape of `sparrow bench trainer-streams`);
- past `grpc.max_calls` a new call is refused at once with RESOURCE_EXHAUSTED, counted, and health is
  still answered; a slot freed is usable again;
- bytes that do not decode (garbage, invalid UTF-8 in a string field) are INVALID_ARGUMENT with a one-line
  reason, one log line and a count, never INTERNAL/UNKNOWN with a traceback.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.trainer_streams import RESPONSE_TOKENS, VOCAB, _Generator, group_id, prompt, trajectory
from services.api.sparrow.v1 import rollout_pb2, weights_pb2
from services.trainer.config import TrainerServiceConfig
from services.trainer.ledger import GroupLedger, GroupRecord
from services.trainer.metrics import TrainerMetrics
from services.trainer.service import TrainerService
from services.trainer.store import TrajectoryStore
from services.trainer.validate import Limits
from services.trainer.weights import POLICY, WeightStore
from sparrow.config import load_config
from tests.integration.trainer_service.helpers import TINY, RolloutSession
from tests.servers import redis_server

GENERATORS = 100  # 200 open calls: three times the 64 threads the trainer's server had
HEALTH = health_pb2.HealthCheckRequest()
# The clients here are grpc's asyncio ones, run on the server's own event loop (AioServer.call): grpc's
# asyncio runs one loop per process well, not two. `sparrow bench trainer-streams` puts them in another process.


def _health(address: str, timeout: float = 1.0) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(HEALTH, timeout=timeout).status


async def _health_async(address: str) -> int:
    # Off the client's loop: a blocking check from a thread, as a kubelet's probe would be.
    return await asyncio.to_thread(_health, address)


def test_the_trainer_service_holds_many_generators_open_and_answers_health(tmp_path):
    with redis_server() as redis:
        overrides = {
            "run_dir": str(tmp_path / "run"),
            "model_dir": str(TINY),
            "redis.url": redis.url,
            "grpc.address": "127.0.0.1:0",
            "grpc.grace_s": 0.5,
            "metrics.port": 0,
        }
        service = TrainerService(load_config(TrainerServiceConfig, overrides=overrides))
        service.start_servers()
        try:
            vocab = service.model.config.vocab_size
            for g in range(GENERATORS):
                ids = tuple(t % vocab for t in prompt(g))
                service.ledger.add(GroupRecord(10_000 + g, group_id(g), ids, 1, "", 0, RESPONSE_TOKENS))
            address = f"127.0.0.1:{service.grpc_port}"
            acks = service._server.call(_fleet(address, vocab), timeout=300)
        finally:
            service._checkpoint_on_stop = False
            service.shutdown()
    assert len(acks) == GENERATORS and {a.trajectory_id for a in acks} == {
        f"{group_id(g)}/0" for g in range(GENERATORS)
    }
    assert all(a.status == rollout_pb2.ACK_STATUS_ACCEPTED for a in acks), {a.reason for a in acks}


async def _fleet(address: str, vocab: int) -> list:
    channels = [grpc.aio.insecure_channel(address) for _ in range(4)]
    gens = [_Generator(i, channels[i % 4], ()) for i in range(GENERATORS)]
    try:
        await asyncio.gather(*(g.open() for g in gens))  # 2 x GENERATORS calls open from here on
        for _ in range(5):
            assert await _health_async(address) == health_pb2.HealthCheckResponse.SERVING
        late = _Generator(GENERATORS, channels[0], ())
        await late.open()  # a new stream still starts
        await late.close()
        for g in gens:
            t = _scaled_trajectory(g.number, vocab)
            await g.stream.write(rollout_pb2.StreamTrajectoriesRequest(trajectory=t))
            g.acks.append((await g.stream.read()).ack)
        assert await _health_async(address) == health_pb2.HealthCheckResponse.SERVING
        await asyncio.gather(*(g.close() for g in gens))
        return [a for g in gens for a in g.acks]
    finally:
        for channel in channels:
            await channel.close()


def _scaled_trajectory(generator: int, vocab: int) -> rollout_pb2.Trajectory:
    t = trajectory(generator, 0, policy_version=0)
    k = min(20, vocab)
    t.prompt_token_ids[:] = [x % vocab for x in t.prompt_token_ids]
    t.token_ids[:] = [x % (vocab - k) for x in t.token_ids]
    for top, tok in zip(t.top_logprobs, t.token_ids, strict=True):
        top.token_ids[:] = [tok + j for j in range(k)]
        del top.logprobs[k:]
    return t


def _served(tmp_path, max_calls: int):
    from services.trainer.service import build_grpc_server

    config = load_config(TrainerServiceConfig, overrides={"run_dir": str(tmp_path), "grpc.max_calls": max_calls})
    store, ledger, weights = TrajectoryStore(tmp_path), GroupLedger(tmp_path), WeightStore(tmp_path, keep=2)
    weights.publish(POLICY, 1, lambda out: (out / "model.safetensors").write_bytes(b"w"))
    for g in range(4):
        ledger.add(GroupRecord(g, group_id(g), tuple(prompt(g)), 4, "", 1, RESPONSE_TOKENS))
    metrics = TrainerMetrics(4096, 4)
    server = build_grpc_server(config, store, ledger, weights, Limits(VOCAB, 20), metrics)
    port = server.bind("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", metrics, (store, ledger, weights)


def _refused(metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("sparrow_trainer_grpc_refused_calls_total", {"reason": reason})


@pytest.fixture
def limited(tmp_path):
    server, address, metrics, parts = _served(tmp_path, max_calls=6)
    yield address, metrics, server
    parts[2].close()
    server.stop(0.5)
    parts[0].close()
    parts[1].close()


def test_past_the_maximum_a_new_call_is_refused_at_once_and_health_still_answers(limited):
    address, metrics, server = limited

    async def scenario():
        channel = grpc.aio.insecure_channel(address)
        gens = [_Generator(i, channel, ()) for i in range(3)]
        await asyncio.gather(*(g.open() for g in gens))  # 3 streams + 3 watches: the maximum of 6
        assert server.stats.open == 6
        extra = _Generator(3, channel, ())
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(extra.open(), 10)
        # The refusal may end the call before the client's hello is written: its status tells why.
        assert await extra.stream.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "maximum of 6 open calls" in await extra.stream.details()
        fetch = extra.weights.FetchPolicy(weights_pb2.FetchPolicyRequest(version=1))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fetch.read()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await _health_async(address) == health_pb2.HealthCheckResponse.SERVING
        gens[0].watch.cancel()  # a slot freed is usable again
        for _ in range(100):
            if server.stats.open < 6:
                break
            await asyncio.sleep(0.05)
        chunks = [m async for m in extra.weights.FetchPolicy(weights_pb2.FetchPolicyRequest(version=1))]
        assert chunks[0].WhichOneof("item") == "manifest"
        await channel.close()

    server.call(scenario(), timeout=120)
    assert _refused(metrics, "too_many_calls") == 2
    assert metrics.registry.get_sample_value("sparrow_trainer_grpc_open_calls") is not None


def test_undecodable_bytes_are_invalid_argument_with_one_log_line_and_a_count(limited, caplog):
    address, metrics, _ = limited
    bad_utf8 = b"\x0a\x04\x0a\x02\xff\xfe"  # hello { generator_id: <2 bytes, not UTF-8> }
    garbage = b"\xff\xff\xff\xff\x0f\x01"
    with grpc.insecure_channel(address) as channel:
        stream = channel.stream_stream("/sparrow.v1.RolloutService/StreamTrajectories")
        fetch = channel.unary_stream("/sparrow.v1.WeightService/FetchPolicy")
        calls = [
            lambda: list(stream(iter([bad_utf8]), timeout=10)),
            lambda: list(stream(iter([garbage]), timeout=10)),
            lambda: list(fetch(garbage, timeout=10)),
        ]
        with caplog.at_level(logging.INFO):
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
                assert err.value.details().startswith("undecodable request: ") and "\n" not in err.value.details()
        session = RolloutSession(channel, generator_id="after-the-garbage")  # the server goes on as before
        ack = session.send(trajectory(0, 0))
        assert ack.status == rollout_pb2.ACK_STATUS_ACCEPTED, ack.reason
        session.close()
    assert "UTF-8" in caplog.text
    refusals = [r for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(refusals) == 3 and all(r.levelno == logging.WARNING and not r.exc_info for r in refusals)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert _refused(metrics, "undecodable") == 3
