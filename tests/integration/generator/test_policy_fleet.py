"""Policy versions across a fleet on loopback: real WeightService servers (the trainer's and each generator's
relay) and clients, digests, deltas and the source plan. The engine is the stand-in of bench/weight_fleet.py
(it loads each version into torch tensors after today's host checks): vLLM is not what is under test here."""

import threading
import time

import grpc
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import services.generator.policy_relay as policy_relay
from bench.weight_fleet import PublishingTrainer, StandinGenerator
from services.api.sparrow.v1 import weights_pb2, weights_pb2_grpc
from services.common.grpc_server import GrpcSecurity, open_channel
from services.generator.metrics import GeneratorMetrics
from services.generator.policy_relay import HeldPolicy, RelayServer
from services.generator.weight_fetch import POLICY_DELTA, WeightFetcher, WeightFetchError, WeightsUnavailable
from sparrow.weight_delta import DELTA_FILE, META_KEY, cast_state

SIDE = {"config.json": '{"dtype": "bfloat16"}', "tokenizer.json": '{"model": {}}'}


class Policy:
    """fp32 master weights and Adam-like steps of lr 1e-6; published in bf16."""

    def __init__(self, seed=0):
        self.g = torch.Generator().manual_seed(seed)
        self.master = {
            "model.embed_tokens.weight": torch.randn(512, 128, generator=self.g) * 0.02,
            "model.layers.0.mlp.up_proj.weight": torch.randn(256, 128, generator=self.g) * 0.02,
            "model.norm.weight": torch.ones(128),
        }

    def step(self):
        self.master = {k: v - 1e-6 * torch.sign(torch.randn(v.shape, generator=self.g)) for k, v in self.master.items()}

    def serving(self):
        return cast_state(self.master, torch.bfloat16)


def _wait(gens, version, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(g.version == version for g in gens):
            return
        time.sleep(0.02)
    raise AssertionError(f"not every generator reached v{version}: {[g.version for g in gens]}")


@pytest.fixture
def fleet(tmp_path):
    made = []

    def make(**kw):
        trainer = PublishingTrainer(tmp_path / "run", **kw)
        made.append(trainer)
        return trainer

    def gen(trainer, name, **kw):
        g = StandinGenerator(trainer.address, tmp_path / name, name, **kw).start()
        made.append(g)
        return g

    yield make, gen
    for part in reversed(made):
        part.close()


def test_every_generator_serves_the_trainers_weights_and_the_trainer_sends_fanout_deltas(fleet):
    make, gen = fleet
    trainer, policy = make(trainer_fanout=2, peer_fanout=2), Policy()
    digests = {1: trainer.publish(1, policy.serving(), "bfloat16", SIDE)}
    gens = [gen(trainer, f"g{i}") for i in range(6)]
    _wait(gens, 1)
    full = trainer.sync.record(1).full_bytes
    assert trainer.sent["full"] <= 2 * full + 4096  # two roots from the trainer, the rest from peers
    for v in (2, 3):
        before = dict(trainer.sent)
        policy.step()
        digests[v] = trainer.publish(v, policy.serving(), "bfloat16", SIDE)
        _wait(gens, v)
        record = trainer.sync.record(v)
        assert record.delta_base_version == v - 1 and record.delta_bytes < 0.2 * full
        assert trainer.sent["full"] == before["full"]  # nobody fetched a full copy from the trainer
        assert trainer.sent["delta"] - before["delta"] == 2 * record.delta_bytes
        sources = trainer.planner.sources_of(v)
        assert sorted(sources.values()).count("") == 2 and len(sources) == 6
    for g in gens:
        assert g.loaded == digests  # every version served, each identical to the trainer's


def test_a_generator_added_while_versions_are_published_catches_up(fleet):
    make, gen = fleet
    trainer, policy = make(), Policy()
    digests = {1: trainer.publish(1, policy.serving(), "bfloat16", SIDE)}
    gens = [gen(trainer, f"g{i}") for i in range(3)]
    _wait(gens, 1)

    def publish():
        for v in range(2, 7):
            policy.step()
            digests[v] = trainer.publish(v, policy.serving(), "bfloat16", SIDE)
            time.sleep(0.15)

    publisher = threading.Thread(target=publish)
    publisher.start()
    time.sleep(0.2)
    late = gen(trainer, "late")
    publisher.join()
    gens.append(late)
    _wait(gens, 6)
    for g in gens:
        assert all(digests[v] == d for v, d in g.loaded.items())
    assert late.loaded[6] == digests[6]


def test_a_relay_killed_mid_transfer_leaves_its_children_to_fall_back(fleet, monkeypatch):
    make, gen = fleet
    trainer, policy = make(trainer_fanout=1, peer_fanout=3), Policy()
    trainer.publish(1, policy.serving(), "bfloat16", SIDE)
    root = gen(trainer, "root")
    _wait([root], 1)
    streaming = threading.Event()
    real = policy_relay.stream_folder

    def slow(folder, manifest, chunk_bytes, context):  # the relay sends slowly, so the kill lands mid-stream
        for i, chunk in enumerate(real(folder, manifest, 2048, context)):
            if i == 3:
                streaming.set()
            time.sleep(0.05)
            yield chunk

    monkeypatch.setattr(policy_relay, "stream_folder", slow)
    children = [gen(trainer, f"child{i}") for i in range(2)]
    assert streaming.wait(30)
    root.relay.server.stop(0)  # killed: its calls end at once, mid-transfer
    _wait(children, 1)
    digest = trainer.sync.record(1).result_sha256
    assert all(c.loaded == {1: digest} for c in children)
    assert set(trainer.planner.sources_of(1).values()) == {""}  # every child ended on the trainer


def _tamper_delta_value(path):
    import zstandard

    with safe_open(str(path), framework="pt") as st:
        tensors = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118
        meta = st.metadata()
    key = next(k for k in tensors if k.endswith("|values"))
    raw = bytearray(zstandard.ZstdDecompressor().decompress(tensors[key].numpy().tobytes()))
    raw[0] ^= 0x40  # one value off by a bit: a well-formed delta with a wrong result
    tensors[key] = torch.frombuffer(bytearray(zstandard.ZstdCompressor().compress(bytes(raw))), dtype=torch.uint8)
    save_file(tensors, str(path), metadata=meta)
    assert META_KEY in meta


def test_a_corrupted_delta_is_caught_by_the_digest_and_the_full_version_served(fleet):
    make, gen = fleet
    trainer, policy = make(trainer_fanout=4), Policy()
    trainer.publish(1, policy.serving(), "bfloat16", SIDE)
    metrics = [GeneratorMetrics() for _ in range(2)]
    gens = [gen(trainer, f"g{i}", metrics=m) for i, m in enumerate(metrics)]
    _wait(gens, 1)
    policy.step()
    # The delta is tampered with between publish and fetch: publish, then corrupt before anyone is told.
    real_publish = trainer.store.publish

    def publish_then_corrupt(kind, version, write, *args):
        def write_and_corrupt(out):
            write(out)
            _tamper_delta_value(trainer.sync.delta_folder(version) / DELTA_FILE)

        return real_publish(kind, version, write_and_corrupt, *args)

    trainer.store.publish = publish_then_corrupt
    digest = trainer.publish(2, policy.serving(), "bfloat16", SIDE)
    _wait(gens, 2)
    for g in gens:
        assert g.loaded == {1: trainer.sync.record(1).result_sha256, 2: digest}  # the corrupt one never served
    assert trainer.sent["delta"] > 0 and trainer.sent["full"] >= 2 * trainer.sync.record(2).full_bytes
    for m in metrics:  # each counted the refused delta, and the bytes it received by kind and source
        assert m.policy_fetch_failures.labels(reason="digest")._value.get() == 1
        assert m.policy_fetch_bytes.labels(kind="full", source="trainer")._value.get() > 0
        assert m.policy_fetch_bytes.labels(kind="delta", source="trainer")._value.get() == 0  # none applied
        assert 0 <= m.policy_sync_seconds._value.get() < 60


def test_a_delta_for_a_version_not_held_is_refused_with_a_clear_status(fleet, tmp_path):
    make, _ = fleet
    trainer, policy = make(), Policy()
    for v in (1, 2, 3):
        trainer.publish(v, policy.serving(), "bfloat16", SIDE)
        policy.step()
    fetcher = WeightFetcher(trainer.address, GrpcSecurity(), tmp_path / "f")
    with pytest.raises(WeightsUnavailable, match=r"NOT_FOUND no delta from policy v1 to v3 \(kept: against v2\)"):
        fetcher.fetch(POLICY_DELTA, 3, base_version=1)
    # A relay that answers a delta against another base than the one asked for is refused before any write.
    held = HeldPolicy()
    delta_dir = trainer.sync.delta_folder(3)
    held.hold(3, trainer.store.folder("policy", 3), delta_dir, 2)
    relay = RelayServer(held, GrpcSecurity(), "127.0.0.1:0", 1.0).start()
    try:
        with pytest.raises(WeightsUnavailable, match="NOT_FOUND this relay holds no delta from v1 to v3"):
            fetcher.fetch(POLICY_DELTA, 3, f"127.0.0.1:{relay.port}", base_version=1)
        with pytest.raises(WeightsUnavailable, match="UNAVAILABLE this relay does not hold policy v2"):
            fetcher.fetch("policy", 2, f"127.0.0.1:{relay.port}")
    finally:
        relay.stop(0)
    assert not list((tmp_path / "f").glob("policy*"))


def test_a_relay_answering_another_models_weights_is_refused_and_never_served(fleet, tmp_path):
    make, gen = fleet
    trainer, policy = make(trainer_fanout=1), Policy()
    trainer.publish(1, policy.serving(), "bfloat16", SIDE)
    # Another model's weights, same names and shapes, served by a relay that says it holds v1.
    other = tmp_path / "other"
    other.mkdir()
    save_file(Policy(seed=7).serving(), str(other / "model.safetensors"))
    for name, text in SIDE.items():
        (other / name).write_text(text)
    held = HeldPolicy()
    held.hold(1, other)
    liar = RelayServer(held, GrpcSecurity(), "127.0.0.1:0", 1.0).start()
    channel = open_channel(trainer.address, GrpcSecurity())
    stub = weights_pb2_grpc.WeightServiceStub(channel)
    stub.GetPolicySource(weights_pb2.GetPolicySourceRequest(generator_id="first", version=1))  # the trainer slot
    report = weights_pb2.GetPolicySourceRequest(
        generator_id="liar", version=1, held_version=1, relay_address=f"127.0.0.1:{liar.port}"
    )
    assert stub.GetPolicySource(report).result_sha256 == trainer.sync.record(1).result_sha256
    try:
        g = gen(trainer, "victim")
        _wait([g], 1)
        assert g.loaded == {1: trainer.sync.record(1).result_sha256}
        assert trainer.planner.sources_of(1)["victim"] == ""  # the liar was dropped for the trainer
        with pytest.raises(WeightFetchError, match=r"from 127\.0\.0\.1:\d+ refused: its tensors' digest"):
            g.sync.policy_source._from(
                f"127.0.0.1:{liar.port}",
                weights_pb2.GetPolicySourceResponse(version=1, result_sha256=trainer.sync.record(1).result_sha256),
                None,
                0,
            )
    finally:
        liar.stop(0)
        channel.close()


def test_the_trainer_refuses_bad_source_requests(fleet):
    make, _ = fleet
    trainer = make()
    trainer.publish(1, Policy().serving(), "bfloat16", SIDE)
    channel = open_channel(trainer.address, GrpcSecurity())
    stub = weights_pb2_grpc.WeightServiceStub(channel)
    bad = {
        "no id": (weights_pb2.GetPolicySourceRequest(version=1), grpc.StatusCode.INVALID_ARGUMENT),
        "version 0": (
            weights_pb2.GetPolicySourceRequest(generator_id="g", version=0),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "unpublished": (weights_pb2.GetPolicySourceRequest(generator_id="g", version=9), grpc.StatusCode.NOT_FOUND),
        "odd relay": (
            weights_pb2.GetPolicySourceRequest(generator_id="g", version=1, relay_address="nohost"),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    }
    try:
        for case, (request, code) in bad.items():
            with pytest.raises(grpc.RpcError) as err:
                stub.GetPolicySource(request, timeout=5)
            assert err.value.code() == code, case
        answer = stub.GetPolicySource(weights_pb2.GetPolicySourceRequest(generator_id="g", version=1))
        assert list(answer.sources) == [""]
    finally:
        channel.close()


def test_a_generator_more_than_one_version_behind_fetches_the_full_version(fleet, tmp_path):
    from services.generator.policy_source import PolicySource

    make, _ = fleet
    trainer, policy = make(), Policy()
    for v in (1, 2, 3):
        trainer.publish(v, policy.serving(), "bfloat16", SIDE)
        policy.step()
    source = PolicySource(WeightFetcher(trainer.address, GrpcSecurity(), tmp_path / "f"), "behind", HeldPolicy())
    v1 = trainer.store.folder("policy", 1)
    behind = source.fetch(3, v1, 1)
    assert behind.kind == "full" and behind.fetched.version == 3
    current = source.fetch(3, trainer.store.folder("policy", 2), 2)
    assert current.kind == "delta" and current.nbytes == trainer.sync.record(3).delta_bytes
    assert trainer.sent["delta"] == trainer.sync.record(3).delta_bytes
