"""Published versions on disk: manifests with correct sha256, newest K kept, torn publishes cleaned up."""

import hashlib
import json
import threading

import pytest

from services.trainer.weights import ADAPTER, POLICY, DamagedVersion, WeightStore


def _writer(payload: bytes):
    def write(folder):
        (folder / "model.safetensors").write_bytes(payload)
        (folder / "sub").mkdir()
        (folder / "sub" / "config.json").write_text("{}")

    return write


def test_publish_writes_a_manifest_with_sizes_and_checksums(tmp_path):
    store = WeightStore(tmp_path, keep=2)
    assert store.latest(POLICY) == 0 and store.manifest(POLICY) is None
    payload = bytes(range(256)) * 5000
    manifest = store.publish(POLICY, 1, _writer(payload))
    files = {f.path: f for f in manifest.files}
    assert set(files) == {"model.safetensors", "sub/config.json"}
    assert files["model.safetensors"].size_bytes == len(payload)
    assert files["model.safetensors"].sha256 == hashlib.sha256(payload).hexdigest()
    assert store.manifest(POLICY, 0) == manifest == store.manifest(POLICY, 1)  # 0 asks for the latest
    assert (store.folder(POLICY, 1) / "model.safetensors").read_bytes() == payload
    with pytest.raises(ValueError, match="not above the latest"):
        store.publish(POLICY, 1, _writer(b"x"))


def test_only_the_newest_versions_stay(tmp_path):
    store = WeightStore(tmp_path, keep=2)
    for v in (1, 2, 5):
        store.publish(POLICY, v, _writer(bytes([v])))
    assert store.manifest(POLICY, 1) is None and not store.folder(POLICY, 1).exists()
    assert store.manifest(POLICY, 2).version == 2 and store.latest(POLICY) == 5
    assert WeightStore(tmp_path, keep=2).latest(POLICY) == 5  # a restart sees the same


def test_a_failed_or_torn_publish_leaves_nothing_visible(tmp_path):
    store = WeightStore(tmp_path, keep=3)
    store.publish(POLICY, 1, _writer(b"one"))

    def broken(folder):
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store.publish(POLICY, 2, broken)
    assert store.latest(POLICY) == 1 and list((tmp_path / POLICY).glob(".tmp-*")) == []
    # A crash between the folder's rename and its manifest: the folder is removed at the next start.
    (tmp_path / POLICY / "v00000002").mkdir()
    (tmp_path / POLICY / ".tmp-v00000003-abcd").mkdir()
    again = WeightStore(tmp_path, keep=3)
    assert again.latest(POLICY) == 1
    assert sorted(p.name for p in (tmp_path / POLICY).iterdir()) == ["v00000001", "v00000001.json"]


def test_adapters_carry_rank_and_targets_and_wake_watchers(tmp_path):
    src = tmp_path / "lora"
    src.mkdir()
    (src / "adapter_model.safetensors").write_bytes(b"lora")
    (src / "adapter_config.json").write_text('{"r": 8}')
    store = WeightStore(tmp_path / "run", keep=2)
    seen = []
    watcher = threading.Thread(target=lambda: seen.append(store.wait_for_change((0, 0), timeout=30)))
    watcher.start()
    manifest = store.publish_adapter(src, 1, rank=8, targets=["q_proj", "v_proj"])
    watcher.join()
    assert seen == [(0, 1)] and store.latest(ADAPTER) == 1
    assert manifest.lora_rank == 8 and manifest.lora_target_modules == ("q_proj", "v_proj")
    assert {f.path for f in manifest.files} == {"adapter_model.safetensors", "adapter_config.json"}
    with pytest.raises(ValueError, match="rank >= 1"):
        store.publish_adapter(src, 2, rank=0, targets=["q_proj"])


def _tamper(tmp_path, version: int, path: str) -> None:
    manifest = tmp_path / POLICY / f"v{version:08d}.json"
    data = json.loads(manifest.read_text())
    data["files"][0]["path"] = path
    manifest.write_text(json.dumps(data))


@pytest.mark.parametrize("path", ["/etc/hostname", "../../../secret.txt", "sub/../../secret.txt", "./x", "a//b", ""])
def test_a_manifest_naming_a_file_outside_its_folder_refuses_the_version(tmp_path, path):
    (tmp_path / "secret.txt").write_text("not a weight")
    store = WeightStore(tmp_path, keep=3)
    store.publish(POLICY, 1, _writer(b"one"))
    store.publish(POLICY, 2, _writer(b"two"))
    _tamper(tmp_path, 2, path)
    with pytest.raises(DamagedVersion, match="policy version 2"):
        store.manifest(POLICY, 2)
    assert store.manifest(POLICY, 1).version == 1  # the others are served as before
    again = WeightStore(tmp_path, keep=3)  # a restart finds it damaged: not served, not the latest
    assert again.latest(POLICY) == 1 and again.manifest(POLICY, 2) is None and again.manifest(POLICY, 1) is not None


def test_a_symlink_leading_out_of_the_folder_refuses_the_version(tmp_path):
    (tmp_path / "secret.txt").write_text("not a weight")
    store = WeightStore(tmp_path / "run", keep=2)
    manifest = store.publish(POLICY, 1, _writer(b"one"))
    entry = next(f for f in manifest.files if f.path == "model.safetensors")
    target = store.folder(POLICY, 1) / "model.safetensors"
    target.unlink()
    target.symlink_to(tmp_path / "secret.txt")
    with pytest.raises(DamagedVersion, match="leads outside its folder"):
        store.file_path(POLICY, 1, entry)
    with pytest.raises(DamagedVersion):
        store.manifest(POLICY, 1)


def test_only_published_versions_are_served(tmp_path):
    store = WeightStore(tmp_path, keep=3)
    store.publish(POLICY, 1, _writer(b"one"))
    # A version folder and manifest put on disk by something else than this store's publish.
    (tmp_path / POLICY / "v00000009").mkdir()
    (tmp_path / POLICY / "v00000009" / "model.safetensors").write_bytes(b"nine")
    manifest = json.loads((tmp_path / POLICY / "v00000001.json").read_text())
    (tmp_path / POLICY / "v00000009.json").write_text(json.dumps({**manifest, "version": 9}))
    assert store.manifest(POLICY, 9) is None and not store.has(POLICY, 9) and store.latest(POLICY) == 1
    # A manifest whose version is not its file's is damaged, even when found at a start.
    (tmp_path / POLICY / "v00000009.json").write_text(json.dumps({**manifest, "version": 1}))
    assert WeightStore(tmp_path, keep=3).latest(POLICY) == 1
