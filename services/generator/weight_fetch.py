"""New policy and adapter versions from the trainer's WeightService: watch, fetch, verify, load.

`WeightFetcher` downloads one version into a folder of its own, chunk by chunk straight to disk
(a checkpoint never sits whole in memory), and checks every file's size and sha256 against the
manifest. Anything wrong (a bad hash, a short or overlong file, a chunk for a file the manifest
does not name, a path that leaves the folder) refuses the whole version with one clear line and
leaves nothing behind; the engine keeps serving what it had. Only a verified download is renamed
into place. `fetch_stream` reads a policy into host memory instead (weight_stream: checked as it
arrives, nothing on disk), for an engine that loads from host tensors and a generator that does not
relay (a relay serves its peers from disk).

What watches for new versions and loads them is `version_sync`.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import grpc

from services.api.sparrow.v1 import weights_pb2, weights_pb2_grpc
from services.common.grpc_server import GrpcSecurity, open_channel
from services.generator.policy_stream import PolicyStream, StreamError

log = logging.getLogger("sparrow.generator.weights")

POLICY, ADAPTER, POLICY_DELTA = "policy", "adapter", "policy-delta"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class WeightFetchError(RuntimeError):
    """A version that could not be fetched or failed verification; nothing was written."""


class WeightsUnavailable(WeightFetchError):
    """The WeightService could not be reached or failed the call (worth retrying later); `code` is its status."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Fetched:
    """A verified download: its folder and the manifest it matched."""

    kind: str
    version: int
    folder: Path
    manifest: weights_pb2.WeightManifest


class WeightFetcher:
    """Downloads policy and adapter versions into `root/<kind>-v<version>/`, verified."""

    def __init__(
        self, address: str, security: GrpcSecurity, root: Path, chunk_bytes: int = 4 << 20, timeout_s: float = 600.0
    ) -> None:
        self.address, self.security = address, security
        self.root = Path(root)
        self.chunk_bytes, self.timeout_s = chunk_bytes, timeout_s
        self._lock = threading.Lock()
        self._calls: set = set()  # downloads under way, cancelled by close()
        self._closed = False

    def close(self) -> None:
        """Cancel the downloads under way and every later one (they fail as WeightsUnavailable CANCELLED)."""
        with self._lock:
            self._closed = True
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def fetch(
        self, kind: str, version: int, address: str = "", base_version: int = 0, timeout_s: float = 0.0
    ) -> Fetched:
        """Fetch `version` (0: the latest) of `kind` ("policy", "adapter", or "policy-delta" from `base_version`)
        from `address` (default: the trainer); raises WeightFetchError."""
        address = address or self.address
        what = f"{kind} v{version}" if version else f"latest {kind}"
        if address != self.address:
            what += f" from peer {address}"
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=self.root))
        try:
            download = _Download(tmp, version, what, base_version)
            manifest = self._run(download, kind, version, address, base_version, timeout_s)
            final = self.root / f"{kind}-v{manifest.version}"
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            return Fetched(kind, manifest.version, final, manifest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def fetch_stream(self, version: int, serving: dict[str, tuple[int, ...]]) -> Streamed:
        """Fetch policy `version` from the trainer into host memory, checked against the engine's layout
        `serving` as it arrives (weight_stream); nothing is written to disk. Raises WeightFetchError."""
        stream = PolicyStream(serving)
        what = f"policy v{version}" if version else "latest policy"
        manifest = self._run(_StreamDownload(stream, version, what), POLICY, version, self.address, 0, 0.0)
        return Streamed(manifest.version, stream.tensors, manifest)

    def _run(
        self, download: _Download, kind: str, version: int, address: str, base_version: int, timeout_s: float
    ) -> weights_pb2.WeightManifest:
        channel = open_channel(address, self.security)
        # The deadline bounds a trainer that hangs mid-download: without it the swap would wait forever.
        timeout = timeout_s or self.timeout_s
        try:
            stub = weights_pb2_grpc.WeightServiceStub(channel)
            if kind == POLICY:
                request = weights_pb2.FetchPolicyRequest(version=version, chunk_bytes=self.chunk_bytes)
                call = stub.FetchPolicy(request, timeout=timeout)
            elif kind == ADAPTER:
                request = weights_pb2.FetchAdapterRequest(version=version, chunk_bytes=self.chunk_bytes)
                call = stub.FetchAdapter(request, timeout=timeout)
            elif kind == POLICY_DELTA and version > 0 and base_version > 0:
                request = weights_pb2.FetchPolicyDeltaRequest(
                    version=version, base_version=base_version, chunk_bytes=self.chunk_bytes
                )
                call = stub.FetchPolicyDelta(request, timeout=timeout)
            else:
                raise ValueError(f"unknown weight kind {kind!r} (or a delta without versions)")
            with self._lock:
                self._calls.add(call)
                if self._closed:
                    call.cancel()
            try:
                return download.run(call)
            except grpc.RpcError as exc:
                message = f"cannot fetch {download.what} from {address}: {exc.code().name} {exc.details()}"
                raise WeightsUnavailable(message, exc.code()) from None
            finally:
                with self._lock:
                    self._calls.discard(call)
        finally:
            channel.close()


@dataclass(frozen=True)
class Streamed:
    """A policy version streamed into host memory, every check passed: name -> tensor, and its manifest."""

    version: int
    tensors: dict[str, Any]  # torch tensors (torch is imported lazily here)
    manifest: weights_pb2.WeightManifest


class _Download:
    """One fetch stream written into `folder`: the manifest, then each file's chunks in order."""

    def __init__(self, folder: Path, version: int, what: str, base_version: int = 0) -> None:
        self.folder, self.version, self.what, self.base_version = folder, version, what, base_version
        self.files: dict[str, weights_pb2.WeightFile] = {}
        self.written: dict[str, int] = {}
        self.hashes: dict[str, Any] = {}  # hashlib objects
        self.current: str | None = None
        self.handle = None
        self.folders: set[str] = set()  # every folder the manifest's paths pass through

    def run(self, call) -> weights_pb2.WeightManifest:
        manifest = None
        try:
            for message in call:
                kind = message.WhichOneof("item")
                if kind == "manifest":
                    if manifest is not None:
                        self.fail("a second manifest arrived")
                    manifest = message.manifest
                    self.check_manifest(manifest)
                elif kind == "chunk":
                    if manifest is None:
                        self.fail("a chunk arrived before the manifest")
                    self.write(message.chunk)
            if manifest is None:
                self.fail("the stream ended without a manifest")
            self.close_current()
            for path, info in self.files.items():
                self.finish(path, info)
            return manifest
        finally:
            if self.handle is not None:
                self.handle.close()

    def fail(self, why: str):
        raise WeightFetchError(f"{self.what} refused: {why}")

    def check_manifest(self, manifest: weights_pb2.WeightManifest) -> None:
        if self.version and manifest.version != self.version:
            self.fail(f"the trainer sent version {manifest.version}")
        if manifest.version <= 0:
            self.fail(f"manifest version must be positive, got {manifest.version}")
        if manifest.base_version != self.base_version:  # a delta against a version this generator does not hold
            self.fail(f"a delta against v{manifest.base_version} arrived, this generator holds v{self.base_version}")
        if not manifest.files:
            self.fail("the manifest lists no files")
        for f in manifest.files:
            path = PurePosixPath(f.path)
            # A path must be in normal form (no `a//b`, `a/`, `./a`), so no two names reach the same file.
            unsafe = "\\" in f.path or "\0" in f.path or ".." in path.parts or str(path) != f.path
            if not f.path or f.path.startswith("/") or unsafe:
                self.fail(f"unsafe file path {f.path!r} in the manifest")
            if f.path in self.files:
                self.fail(f"{f.path} is listed twice in the manifest")
            # `a` and `a/b` cannot both be written: one path would have to be a file and a folder.
            folders = {str(p) for p in path.parents if str(p) != "."}
            if f.path in self.folders or not folders.isdisjoint(self.files):
                self.fail(f"{f.path} is both a file and a folder in the manifest")
            self.folders |= folders
            if f.size_bytes < 0:
                self.fail(f"{f.path} has a negative size")
            if not _SHA256.match(f.sha256):
                self.fail(f"{f.path} has no valid sha256 in the manifest")
            self.files[f.path] = f
            self.written[f.path] = 0
            self.hashes[f.path] = hashlib.sha256()

    def write(self, chunk: weights_pb2.FileChunk) -> None:
        info = self.files.get(chunk.path)
        if info is None:
            self.fail(f"a chunk for {chunk.path!r}, which the manifest does not list")
        if chunk.offset != self.written[chunk.path]:
            self.fail(f"{chunk.path}: chunk at offset {chunk.offset}, expected {self.written[chunk.path]}")
        if self.written[chunk.path] + len(chunk.data) > info.size_bytes:
            self.fail(f"{chunk.path}: more bytes than the {info.size_bytes} of the manifest")
        self.hashes[chunk.path].update(chunk.data)
        self.store(chunk.path, chunk.data)
        self.written[chunk.path] += len(chunk.data)

    def store(self, path: str, data: bytes) -> None:
        """Keep the next bytes of `path` (here: append them to its file in the folder)."""
        if path != self.current:
            self.close_current()
            target = self.folder / path
            target.parent.mkdir(parents=True, exist_ok=True)
            self.handle = target.open("ab")
            self.current = path
        self.handle.write(data)

    def close_current(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        self.current = None

    def finish(self, path: str, info: weights_pb2.WeightFile) -> None:
        if self.written[path] != info.size_bytes:
            self.fail(f"{path}: got {self.written[path]} bytes, the manifest says {info.size_bytes}")
        digest = self.hashes[path].hexdigest()
        if digest != info.sha256:
            self.fail(f"{path}: sha256 {digest[:16]}... does not match the manifest's {info.sha256[:16]}...")
        self.stored(path)

    def stored(self, path: str) -> None:
        """`path` arrived whole and matched the manifest."""
        target = self.folder / path
        if not target.exists():  # an empty file has no chunks
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()


class _StreamDownload(_Download):
    """One policy fetch stream read into a PolicyStream's host tensors instead of files (weight_stream)."""

    def __init__(self, stream: PolicyStream, version: int, what: str) -> None:
        super().__init__(Path(), version, what)
        self.stream = stream

    def check_manifest(self, manifest: weights_pb2.WeightManifest) -> None:
        super().check_manifest(manifest)
        for f in manifest.files:
            self.stream.open(f.path, f.size_bytes)

    def store(self, path: str, data: bytes) -> None:
        try:
            self.stream.write(path, data)
        except StreamError as exc:
            self.fail(str(exc))

    def stored(self, path: str) -> None:
        pass  # nothing on disk; the tensors are checked whole in run()

    def run(self, call) -> weights_pb2.WeightManifest:
        manifest = super().run(call)
        try:
            self.stream.finish()
        except StreamError as exc:
            self.fail(str(exc))
        return manifest
