"""Policy versions over several .safetensors files and their index, written by the trainer's own writer (the tiny
model in bf16, a small `max_shard_bytes`), through every way a generator takes a version, on loopback with the real
WeightService and relays: fetched to disk and loaded, streamed into host memory, relayed and digest-checked, and as
a delta (file by file) against the version before. The engine is bench/weight_fleet.py's stand-in."""

import time
from pathlib import Path

import pytest
import torch

from bench.weight_fleet import PublishingTrainer, StandinGenerator
from services.common.grpc_server import GrpcSecurity
from services.generator.weight_checks import check_policy, checkpoint_layout
from services.generator.weight_fetch import POLICY, WeightFetcher
from services.trainer.policy_sync import publish_policy
from services.trainer.weights import save_hf_policy
from sparrow.weight_delta import folder_digest, tensors_digest
from trainer.hf_checkpoint import INDEX_NAME
from trainer.model_io import load_model

TINY = Path(__file__).resolve().parents[3] / "models" / "tiny"
SHARD_BYTES = 20_000  # the tiny model in bf16 spans about 10 files


@pytest.fixture
def trainer(tmp_path):
    t = PublishingTrainer(tmp_path / "run", trainer_fanout=1, peer_fanout=2)
    t.model = load_model(TINY)
    yield t
    t.close()


def _publish(trainer, version: int) -> str:
    def write(out):
        save_hf_policy(trainer.model, out, TINY, "bfloat16", SHARD_BYTES)

    publish_policy(trainer.store, trainer.sync, version, write, "bfloat16")
    return trainer.sync.record(version).result_sha256


def _bf16(model) -> dict:
    return {n: p.detach().to(torch.bfloat16) for n, p in model.state_dict().items()}


def _wait(gens, version, timeout=120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(g.version == version for g in gens):
            return
        time.sleep(0.05)
    raise AssertionError(f"not every generator reached v{version}: {[g.version for g in gens]}")


def test_a_version_over_several_files_is_fetched_to_disk_and_streamed_whole(trainer, tmp_path):
    """Proves: the download to disk holds every file and the index, fits the model folder's layout and loads
    as the trainer's weights in bf16; the streamed load assembles every tensor of every file, layout-checked
    against the model folder, to the published digest."""
    digest = _publish(trainer, 1)
    files = sorted(p.name for p in trainer.store.folder(POLICY, 1).glob("*.safetensors"))
    assert len(files) > 3
    fetcher = WeightFetcher(trainer.address, GrpcSecurity(), tmp_path / "fetched", chunk_bytes=4096)
    fetched = fetcher.fetch(POLICY, 1)
    assert sorted(p.name for p in fetched.folder.glob("*.safetensors")) == files
    assert (fetched.folder / INDEX_NAME).is_file() and folder_digest(fetched.folder) == digest
    layout = checkpoint_layout(TINY)
    check_policy(fetched.folder, layout, 1)
    want = _bf16(trainer.model)
    assert all(torch.equal(t, want[n].float()) for n, t in load_model(fetched.folder).state_dict().items())
    streamed = fetcher.fetch_stream(1, layout)
    assert {n: tuple(t.shape) for n, t in streamed.tensors.items()} == layout
    assert tensors_digest((n, streamed.tensors[n]) for n in sorted(streamed.tensors)) == digest


def test_a_fleet_serves_versions_over_several_files_relayed_streamed_and_as_deltas(trainer, tmp_path):
    """Proves: three digest-checked generators (one fed by the trainer, two by relays) and one streamed generator
    serve v1 and v2 with the published digests, and v2 reaches the checked ones as a delta over several files:
    the trainer sends one delta, and a full copy only to the streamed generator (which takes no deltas)."""
    digests = {1: _publish(trainer, 1)}
    gens = [StandinGenerator(trainer.address, tmp_path / f"g{i}", f"g{i}").start() for i in range(3)]
    gens.append(StandinGenerator(trainer.address, tmp_path / "s", "s", relay=False, digest_checked=False, stream=True))
    gens[-1].start()
    try:
        _wait(gens, 1)
        before = dict(trainer.sent)
        with torch.no_grad():
            trainer.model.model.norm.weight.add_(0.25)  # a step that moves one tensor in bf16
        digests[2] = _publish(trainer, 2)
        _wait(gens, 2)
        record = trainer.sync.record(2)
        whole = sum(f.size_bytes for f in trainer.store.manifest(POLICY, 2).files)
        assert record.delta_base_version == 1 and 0 < record.delta_bytes < record.full_bytes / 4
        assert trainer.sent["delta"] - before["delta"] == record.delta_bytes
        assert trainer.sent["full"] - before["full"] == whole
        for g in gens:
            assert g.loaded == digests, g.generator_id
    finally:
        for g in gens:
            g.close()
