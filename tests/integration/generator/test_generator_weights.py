"""Weight downloads from a real gRPC WeightService: chunked, verified, refused whole when anything is off."""

import hashlib
import threading
from pathlib import Path

import grpc
import pytest

from services.api.sparrow.v1 import weights_pb2, weights_pb2_grpc
from services.common.grpc_server import GrpcSecurity, bind, build_server
from services.generator.trajectory_stream import Backoff
from services.generator.version_sync import VersionWatcher
from services.generator.weight_fetch import WeightFetcher, WeightFetchError, WeightsUnavailable
from tests.fixtures.standin_rollout_server import StandinRolloutServer
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[3]
SMALL = ROOT / "models" / "small"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def trainer():
    with StandinRolloutServer() as server:
        yield server


def test_a_policy_arrives_chunk_by_chunk_identical_to_the_published_folder(trainer, tmp_path):
    trainer.publish("policy", 4, SMALL)
    fetched = WeightFetcher(trainer.address, GrpcSecurity(), tmp_path, chunk_bytes=4096).fetch("policy", 4)
    assert fetched.version == 4 and fetched.folder == tmp_path / "policy-v4"
    names = sorted(p.name for p in SMALL.iterdir())
    assert sorted(p.name for p in fetched.folder.iterdir()) == names
    for name in names:
        assert _sha(fetched.folder / name) == _sha(SMALL / name)
    assert [p.name for p in tmp_path.iterdir()] == ["policy-v4"]  # no temp folder left behind
    latest = WeightFetcher(trainer.address, GrpcSecurity(), tmp_path).fetch("policy", 0)
    assert latest.version == 4  # 0 asks for the latest


def test_a_corrupted_file_is_refused_and_nothing_is_written(trainer, tmp_path):
    trainer.publish("policy", 5, SMALL, corrupt=True)
    with pytest.raises(WeightFetchError, match=r"policy v5 refused: .*sha256 .* does not match"):
        WeightFetcher(trainer.address, GrpcSecurity(), tmp_path, chunk_bytes=4096).fetch("policy", 5)
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_version_or_an_absent_trainer_is_unavailable_not_refused(trainer, tmp_path):
    with pytest.raises(WeightsUnavailable, match="NOT_FOUND"):
        WeightFetcher(trainer.address, GrpcSecurity(), tmp_path).fetch("adapter", 9)
    with pytest.raises(WeightsUnavailable, match="UNAVAILABLE"):
        WeightFetcher(f"127.0.0.1:{free_port()}", GrpcSecurity(), tmp_path, timeout_s=5).fetch("policy", 1)
    assert list(tmp_path.iterdir()) == []


GOOD = b"hello weights"
GOOD_SHA = hashlib.sha256(GOOD).hexdigest()
GOOD_SIZE = len(GOOD)


def _manifest(*files) -> weights_pb2.WeightChunk:
    return weights_pb2.WeightChunk(manifest=weights_pb2.WeightManifest(version=3, files=list(files)))


def _file(path="a.bin", size=GOOD_SIZE, sha=GOOD_SHA) -> weights_pb2.WeightFile:
    return weights_pb2.WeightFile(path=path, size_bytes=size, sha256=sha)


def _chunk(data=GOOD, path="a.bin", offset=0) -> weights_pb2.WeightChunk:
    return weights_pb2.WeightChunk(chunk=weights_pb2.FileChunk(path=path, offset=offset, data=data))


BAD_STREAMS = {
    "escaping path": ([_manifest(_file(path="../evil")), _chunk(path="../evil")], "unsafe file path"),
    "absolute path": ([_manifest(_file(path="/etc/x"))], "unsafe file path"),
    "NUL in a path": ([_manifest(_file(path="a\0.bin"))], "unsafe file path"),
    "not in normal form": ([_manifest(_file(path="sub//a.bin"))], "unsafe file path"),
    "a folder's name": ([_manifest(_file(path="sub/"))], "unsafe file path"),
    "file then folder": ([_manifest(_file(path="a"), _file(path="a/b"))], "both a file and a folder"),
    "folder then file": ([_manifest(_file(path="a/b/c"), _file(path="a/b"))], "both a file and a folder"),
    "chunk first": ([_chunk(), _manifest(_file())], "before the manifest"),
    "unlisted file": ([_manifest(_file()), _chunk(path="b.bin")], "does not list"),
    "gap": ([_manifest(_file()), _chunk(GOOD[:4]), _chunk(GOOD[5:], offset=5)], "expected 4"),
    "too long": ([_manifest(_file()), _chunk(GOOD + b"!")], "more bytes than"),
    "short": ([_manifest(_file()), _chunk(GOOD[:4])], "got 4 bytes"),
    "no manifest": ([], "without a manifest"),
    "bad hash field": ([_manifest(_file(sha="xyz"))], "no valid sha256"),
    "other version": ([weights_pb2.WeightChunk(manifest=weights_pb2.WeightManifest(version=4))], "sent version 4"),
}


class _Scripted(weights_pb2_grpc.WeightServiceServicer):
    def __init__(self):
        self.script = []
        self.stall_s = 0.0  # after the script, hold the stream open (sending nothing) until the caller leaves

    def FetchPolicy(self, request, context):
        yield from self.script
        if self.stall_s:
            left = threading.Event()
            context.add_callback(left.set)
            left.wait(self.stall_s)


@pytest.fixture(scope="module")
def scripted():
    servicer = _Scripted()
    server = build_server(GrpcSecurity())
    weights_pb2_grpc.add_WeightServiceServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1:0", GrpcSecurity())
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.parametrize("case", sorted(BAD_STREAMS))
def test_malformed_downloads_are_refused_whole_with_one_line(scripted, tmp_path, case):
    servicer, address = scripted
    servicer.script, message = BAD_STREAMS[case]
    with pytest.raises(WeightFetchError, match=message) as info:
        WeightFetcher(address, GrpcSecurity(), tmp_path).fetch("policy", 3)
    assert "\n" not in str(info.value) and not isinstance(info.value, WeightsUnavailable)
    assert list(tmp_path.iterdir()) == [] and not (tmp_path.parent / "evil").exists()


def test_an_empty_file_and_nested_paths_are_written(scripted, tmp_path):
    servicer, address = scripted
    empty = hashlib.sha256(b"").hexdigest()
    servicer.script = [_manifest(_file(), _file("sub/empty.json", 0, empty)), _chunk()]
    folder = WeightFetcher(address, GrpcSecurity(), tmp_path).fetch("policy", 3).folder
    assert (folder / "a.bin").read_bytes() == GOOD and (folder / "sub" / "empty.json").read_bytes() == b""


def test_a_download_that_stalls_is_given_up_at_the_deadline_as_unavailable(scripted, tmp_path):
    servicer, address = scripted
    servicer.script = [_manifest(_file())]  # then nothing: a trainer that hangs mid-download
    servicer.stall_s = 30.0
    try:
        with pytest.raises(WeightsUnavailable) as info:
            WeightFetcher(address, GrpcSecurity(), tmp_path, timeout_s=1.0).fetch("policy", 3)
    finally:
        servicer.stall_s = 0.0
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED  # worth retrying, not a refused version
    assert list(tmp_path.iterdir()) == []


def test_the_version_watcher_hears_each_publish_and_survives_a_trainer_restart(trainer):
    seen = []

    def on_latest(policy, adapter):
        seen.append((policy, adapter))

    watcher = VersionWatcher(trainer.address, GrpcSecurity(), "gen-w", on_latest, Backoff(0.05, 0.3)).start()
    try:
        trainer.wait_for(lambda: bool(seen), 10, "first announcement")
        assert seen[0] == (0, 0)
        trainer.publish("policy", 2, SMALL)
        trainer.wait_for(lambda: (2, 0) in seen, 10, "policy v2 announced")
        trainer.stop()
        trainer.publish("adapter", 1, SMALL)
        trainer.start()
        trainer.wait_for(lambda: (2, 1) in seen, 10, "versions after the restart")
    finally:
        watcher.close()
