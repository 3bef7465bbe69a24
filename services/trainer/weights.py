"""Published policy versions and LoRA adapters on disk, each a folder with a manifest beside it.

    run_dir/policy/v00000003/          model.safetensors (or model-0000i-of-0000n.safetensors and their
                                       index), config.json, tokenizer files ...
    run_dir/policy/v00000003.json      {"version", "files": [{"path", "size_bytes", "sha256"}], ...}
    run_dir/adapters/v00000001/ (+ .json, with lora_rank and lora_target_modules)

A version is written into a temporary folder, renamed into place, then its manifest (checksums
computed once, here) is written and renamed: a version exists once its manifest does, and a crash
leaves at worst a folder without one, which the next start removes. Only the newest `keep`
versions of each kind stay. Watchers wait on `wait_for_change` for new versions.

Only versions this store published, or found whole at its start, are served; a manifest that names a
file outside its version's folder (an absolute path, `..`, a symlink leading out) makes the version
DamagedVersion, never a file server for the rest of the disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from services.trainer.store import fsync_dir, replace_text

log = logging.getLogger("sparrow.trainer.weights")

POLICY, ADAPTER = "policy", "adapters"
# Files of at most this many bytes (HF's decimal GB, the hub's usual split): Qwen3-8B in bf16 goes out as 4.
DEFAULT_SHARD_BYTES = 5 * 10**9
_VERSION_DIR = re.compile(r"^v(\d{8,})$")
_HASH_BLOCK = 1 << 20
# Files a generator needs beside the weights to load the policy the way the trainer does: every tokenizer
# and chat-template file a hub checkpoint may carry (transformers 5 keeps the template in chat_template.jinja).
MODEL_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


@dataclass(frozen=True)
class FileEntry:
    """One file of a version: its path inside the folder, size and hex sha256."""

    path: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a version holds; the wire's WeightManifest."""

    version: int
    files: tuple[FileEntry, ...]
    lora_rank: int = 0
    lora_target_modules: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        d = json.loads(text)
        return cls(
            version=int(d["version"]),
            files=tuple(FileEntry(**f) for f in d["files"]),
            lora_rank=int(d.get("lora_rank", 0)),
            lora_target_modules=tuple(d.get("lora_target_modules", ())),
        )


class DamagedVersion(ValueError):
    """A published version whose manifest cannot be read or names a file outside its folder: refused whole."""


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in blocks (never whole)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    for path in [folder, *sorted(p for p in folder.rglob("*") if p.is_dir())]:
        fsync_dir(path)


class WeightStore:
    """Versioned policy and adapter folders under `root`; thread-safe, with a condition for watchers."""

    def __init__(self, root: str | Path, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self._cond = threading.Condition()
        self._closed = False
        self._listeners: list[Callable[[], None]] = []
        self._latest: dict[str, int] = {}
        self._published: dict[str, set[int]] = {}
        for kind in (POLICY, ADAPTER):
            (self.root / kind).mkdir(parents=True, exist_ok=True)
            self._clean(kind)
            self._published[kind] = set()
            for version in self._versions(kind):
                try:
                    self._read_manifest(kind, version)
                except DamagedVersion as exc:
                    log.error("not serving %s", exc)
                    continue
                self._published[kind].add(version)
            self._latest[kind] = max(self._published[kind], default=0)

    def _clean(self, kind: str) -> None:
        base = self.root / kind
        for path in base.iterdir():
            m = _VERSION_DIR.match(path.name)
            torn = path.is_dir() and (m is None or not (base / f"{path.name}.json").is_file())
            if path.name.startswith(".tmp-") or torn:
                log.warning("removing %s: a publish that did not finish", path)
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    def _versions(self, kind: str) -> list[int]:
        base = self.root / kind
        out = []
        for path in base.iterdir():
            m = _VERSION_DIR.match(path.name)
            if m and path.is_dir() and (base / f"{path.name}.json").is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self, kind: str = POLICY) -> int:
        """Newest published version of `kind` (0: none)."""
        with self._cond:
            return self._latest[kind]

    def has(self, kind: str, version: int) -> bool:
        """Whether `version` of `kind` is published (and not yet retired)."""
        with self._cond:
            return version in self._published[kind]

    def folder(self, kind: str, version: int) -> Path:
        return self.root / kind / f"v{version:08d}"

    def manifest(self, kind: str, version: int = 0) -> Manifest | None:
        """The manifest of `version` (0: the latest), or None when it is not (or no longer) published.

        DamagedVersion when the version is published but its manifest on disk is unreadable or names a file
        outside the version's folder.
        """
        if version == 0:
            version = self.latest(kind)
        if version <= 0 or not self.has(kind, version):
            return None
        try:
            return self._read_manifest(kind, version)
        except DamagedVersion:
            if not self.has(kind, version):
                return None  # retired while it was read: gone, not damaged
            raise

    def file_path(self, kind: str, version: int, entry: FileEntry) -> Path:
        """Where `entry` of `version` lies, resolved; DamagedVersion unless inside the version's folder."""
        folder = self.folder(kind, version)
        path = PurePosixPath(entry.path) if isinstance(entry.path, str) else None
        what = f"{kind} version {version}"
        if path is None or not entry.path or path.is_absolute() or ".." in path.parts or "\\" in entry.path:
            raise DamagedVersion(f"{what}: its manifest names {entry.path!r}, not a path inside its folder")
        if "\0" in entry.path or str(path) != entry.path:
            raise DamagedVersion(f"{what}: its manifest names {entry.path!r}, not a path in normal form")
        resolved = (folder / entry.path).resolve()
        if not resolved.is_relative_to(folder.resolve()):
            raise DamagedVersion(f"{what}: {entry.path!r} leads outside its folder (a symlink)")
        return resolved

    def _read_manifest(self, kind: str, version: int) -> Manifest:
        what = f"{kind} version {version}"
        try:
            manifest = Manifest.from_json((self.root / kind / f"v{version:08d}.json").read_text())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DamagedVersion(f"{what}: unreadable manifest ({type(exc).__name__}: {exc})") from None
        if manifest.version != version:
            raise DamagedVersion(f"{what}: its manifest says version {manifest.version}")
        for entry in manifest.files:
            self.file_path(kind, version, entry)
        return manifest

    def publish(
        self, kind: str, version: int, write: Callable[[Path], None], lora_rank: int = 0, targets: tuple[str, ...] = ()
    ) -> Manifest:
        """Publish `version` of `kind`: `write(folder)` fills a temporary folder, which is then put in place."""
        if version <= self.latest(kind):
            raise ValueError(f"{kind} version {version} is not above the latest published {self.latest(kind)}")
        base = self.root / kind
        tmp = base / f".tmp-v{version:08d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            write(tmp)
            files = tuple(
                FileEntry(str(p.relative_to(tmp)), p.stat().st_size, sha256_of(p))
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            )
            if not files:
                raise ValueError(f"{kind} version {version}: nothing was written")
            _fsync_tree(tmp)
            final = self.folder(kind, version)
            os.replace(tmp, final)
            manifest = Manifest(version, files, lora_rank, tuple(targets))
            replace_text(base / f"v{version:08d}.json", manifest.to_json())
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        with self._cond:
            self._published[kind].add(version)
            self._latest[kind] = version
            self._cond.notify_all()
        self._notify()
        self._retire(kind)
        return manifest

    def publish_adapter(
        self, folder: str | Path, version: int, rank: int, targets: list[str] | tuple[str, ...]
    ) -> Manifest:
        """Publish a peft LoRA adapter folder as adapter `version` (copied; rank and targets go in the manifest)."""
        src = Path(folder)
        if not src.is_dir():
            raise ValueError(f"{src}: no such adapter folder")
        if rank < 1 or not targets:
            raise ValueError("an adapter needs rank >= 1 and at least one target module")

        def copy(dst: Path) -> None:
            shutil.copytree(src, dst, dirs_exist_ok=True)

        return self.publish(ADAPTER, version, copy, rank, tuple(targets))

    def _retire(self, kind: str) -> None:
        # Watchers and fetches of a retired version get NOT_FOUND; open file handles still read to the end.
        for version in self._versions(kind)[: -self.keep]:
            with self._cond:
                self._published[kind].discard(version)
            (self.root / kind / f"v{version:08d}.json").unlink(missing_ok=True)
            shutil.rmtree(self.folder(kind, version), ignore_errors=True)

    def wait_for_change(self, seen: tuple[int, int], timeout: float) -> tuple[int, int]:
        """Block until (policy, adapter) latest versions differ from `seen`, the store closes, or `timeout`."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._closed or (self._latest[POLICY], self._latest[ADAPTER]) != seen, timeout=timeout
            )
            return self._latest[POLICY], self._latest[ADAPTER]

    @property
    def closed(self) -> bool:
        return self._closed

    def add_listener(self, wake: Callable[[], None]) -> None:
        """Call `wake()` (from the publishing thread; it must not block) after every publish and at close."""
        with self._cond:
            self._listeners.append(wake)

    def _notify(self) -> None:
        with self._cond:
            listeners = list(self._listeners)
        for wake in listeners:
            try:
                wake()
            except RuntimeError:  # a listener's event loop is closed: its server has stopped
                pass

    def close(self) -> None:
        """Wake every watcher so streams end before the server stops."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._notify()


def save_hf_policy(
    model, out: Path | None, model_dir: str | Path, dtype: str, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> None:
    """Write the policy in HF format into `out`: safetensors files in `dtype` (a serving dtype name, e.g.
    "bfloat16"), config, and the tokenizer files of `model_dir`.

    Every rank calls it (under FSDP2 each tensor is gathered in turn, trainer/hf_checkpoint.py); only
    the rank given an `out` writes, the others pass None. The whole model is never in one process's memory.
    """
    from sparrow.weight_delta import SERVING_DTYPES
    from trainer.hf_checkpoint import save_config, write_checkpoint

    write_checkpoint(model, out, SERVING_DTYPES[dtype], max_shard_bytes)
    if out is None:
        return
    save_config(model, out)
    for name in MODEL_SIDE_FILES:
        src = Path(model_dir) / name
        if src.is_file() and not (out / name).exists():
            shutil.copyfile(src, out / name)
