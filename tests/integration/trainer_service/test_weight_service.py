"""WeightService over real gRPC on loopback: versions are watched, policies and adapters stream in capped,
sha256-checked chunks and load back as the model that was published; unknown or retired versions are NOT_FOUND."""

import copy
import json
import logging
from types import SimpleNamespace

import grpc
import pytest
import torch

from services.api.sparrow.v1 import weights_pb2, weights_pb2_grpc
from services.common.aio_server import AioServer
from services.common.grpc_server import GrpcSecurity, open_channel
from services.trainer.weight_servicer import WeightServicer
from services.trainer.weights import POLICY, WeightStore, save_hf_policy
from tests.integration.trainer_service.helpers import TINY, fetch_policy
from trainer.model_io import load_model

MAX_CHUNK = 64 << 10


@pytest.fixture
def served(tmp_path):
    base = load_model(TINY)
    changed = copy.deepcopy(base)
    with torch.no_grad():
        changed.model.embed_tokens.weight.add_(0.5)
    store = WeightStore(tmp_path / "run", keep=2)
    for version, model in ((1, base), (2, changed)):
        store.publish(POLICY, version, lambda out, m=model: save_hf_policy(m, out, TINY, "float32"))
    server = AioServer(GrpcSecurity(), max_calls=64)
    weights_pb2_grpc.add_WeightServiceServicer_to_server(WeightServicer(store, 16 << 10, MAX_CHUNK), server.server)
    server.add_health_and_reflection(["sparrow.v1.WeightService"])
    port = server.bind("127.0.0.1:0")
    server.start()
    channel = open_channel(f"127.0.0.1:{port}", GrpcSecurity())
    yield SimpleNamespace(channel=channel, store=store, base=base, changed=changed, tmp=tmp_path)
    store.close()
    server.stop(0.5)


def _same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_latest_and_by_version_fetch_whole_checked_and_loadable(served):
    version, chunks = fetch_policy(served.channel, served.tmp / "latest", version=0)
    assert version == 2
    assert _same_weights(load_model(served.tmp / "latest"), served.changed)
    version, _ = fetch_policy(served.channel, served.tmp / "v1", version=1, chunk_bytes=4096)
    assert version == 1 and _same_weights(load_model(served.tmp / "v1"), served.base)
    assert (served.tmp / "v1" / "tokenizer.json").is_file()  # generators get the tokenizer with the weights


def test_chunk_size_is_capped_and_files_stream_in_order(served):
    stub = weights_pb2_grpc.WeightServiceStub(served.channel)
    messages = list(stub.FetchPolicy(weights_pb2.FetchPolicyRequest(version=2, chunk_bytes=1 << 30), timeout=30))
    manifest = messages[0].manifest
    chunks = [m.chunk for m in messages[1:]]
    assert max(len(c.data) for c in chunks) == MAX_CHUNK  # asked for 1 GiB, got the cap
    weights = next(f for f in manifest.files if f.path == "model.safetensors")
    offsets = [c.offset for c in chunks if c.path == "model.safetensors"]
    assert offsets == list(range(0, weights.size_bytes, MAX_CHUNK))
    assert [m.WhichOneof("item") for m in messages[:2]] == ["manifest", "chunk"]
    default = list(stub.FetchPolicy(weights_pb2.FetchPolicyRequest(version=2), timeout=30))
    assert max(len(m.chunk.data) for m in default[1:]) == 16 << 10  # the default when none is asked


def test_unknown_and_retired_versions_are_not_found(served):
    stub = weights_pb2_grpc.WeightServiceStub(served.channel)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.FetchPolicy(weights_pb2.FetchPolicyRequest(version=7), timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "latest: 2" in err.value.details()
    served.store.publish(POLICY, 3, lambda out: (out / "model.safetensors").write_bytes(b"3"))
    with pytest.raises(grpc.RpcError) as err:  # keep = 2: version 1 is gone
        list(stub.FetchPolicy(weights_pb2.FetchPolicyRequest(version=1), timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        list(stub.FetchAdapter(weights_pb2.FetchAdapterRequest(version=0), timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "adapter latest" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.FetchPolicy(weights_pb2.FetchPolicyRequest(version=-1), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_watchers_see_the_latest_now_and_every_new_version(served):
    stub = weights_pb2_grpc.WeightServiceStub(served.channel)
    call = stub.WatchVersions(weights_pb2.WatchVersionsRequest(generator_id="g"), timeout=30)
    first = next(call).latest
    assert (first.policy_version, first.adapter_version) == (2, 0)
    served.store.publish(POLICY, 3, lambda out: (out / "model.safetensors").write_bytes(b"3"))
    assert next(call).latest.policy_version == 3
    lora = served.tmp / "lora"
    lora.mkdir()
    (lora / "adapter_model.safetensors").write_bytes(b"adapter")
    (lora / "adapter_config.json").write_text('{"r": 4}')
    served.store.publish_adapter(lora, 1, rank=4, targets=["q_proj", "v_proj"])
    latest = next(call).latest
    assert (latest.policy_version, latest.adapter_version) == (3, 1)
    call.cancel()
    late = next(stub.WatchVersions(weights_pb2.WatchVersionsRequest(generator_id="late"), timeout=30)).latest
    assert (late.policy_version, late.adapter_version) == (3, 1)  # a generator joining later gets the latest
    messages = list(stub.FetchAdapter(weights_pb2.FetchAdapterRequest(version=1), timeout=10))
    manifest = messages[0].manifest
    assert manifest.lora_rank == 4 and list(manifest.lora_target_modules) == ["q_proj", "v_proj"]
    data = {m.chunk.path: m.chunk.data for m in messages[1:]}
    assert data == {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"adapter"}


def test_a_tampered_manifest_is_refused_and_no_outside_byte_is_served(served, caplog):
    # A damaged run dir must not turn the service into a file server: the version is refused whole.
    secret = served.tmp / "secret.txt"
    secret.write_bytes(b"outside the version folder")
    path = served.tmp / "run" / "policy" / "v00000002.json"
    manifest = json.loads(path.read_text())
    stub = weights_pb2_grpc.WeightServiceStub(served.channel)
    for name in (str(secret), "../../../secret.txt"):
        manifest["files"][0]["path"] = name
        path.write_text(json.dumps(manifest))
        with caplog.at_level(logging.ERROR, logger="sparrow.trainer.weights"):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.FetchPolicy(weights_pb2.FetchPolicyRequest(version=2), timeout=10))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
        assert "policy version 2" in err.value.details() and name in err.value.details()
        assert any("refusing a fetch" in r.getMessage() for r in caplog.records)
    version, _ = fetch_policy(served.channel, served.tmp / "v1", version=1)  # the others are served as before
    assert version == 1
    # A version on disk that the store never published is not served either.
    fake = served.tmp / "run" / "policy" / "v00000005"
    fake.mkdir()
    (fake / "model.safetensors").write_bytes(b"5")
    (fake.parent / "v00000005.json").write_text(
        json.dumps({"version": 5, "files": [{"path": "model.safetensors", "size_bytes": 1, "sha256": "0" * 64}]})
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stub.FetchPolicy(weights_pb2.FetchPolicyRequest(version=5), timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
