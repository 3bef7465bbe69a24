"""New policy and adapter versions from the trainer's WeightService: watch, fetch, verify, load.

`WeightFetcher` downloads one version into a folder of its own, chunk by chunk straight to disk
(a checkpoint never sits whole in memory), and checks every file's size and sha256 against the
manifest. Anything wrong (a bad hash, a short or overlong file, a chunk for a file the manifest
does not name, a path that leaves the folder) refuses the whole version with one clear line and
leaves nothing behind; the engine keeps serving what it had. Only a verified download is renamed
into place. `fetch_stream` reads a policy into host memory instead (weight_stream: checked as it
arrives, nothing on disk), for an engine that loads from host tensors and a generator that does not
relay (a relay serves its peers from disk).

`VersionWatcher` follows `WatchVersions` (reconnecting with backoff); `VersionSync` turns the
announced versions, and the trainer's hello, into fetch-then-load, one swap at a time. A version
that was refused is not fetched again on its own (an explicit LoadVersions still may).
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import grpc

from services.api.sparrow.v1 import weights_pb2, weights_pb2_grpc
from services.common.grpc_server import GrpcSecurity, open_channel
from services.generator.engine import EngineError, EngineVersions
from services.generator.metrics import GeneratorMetrics
from services.generator.trajectory_stream import Backoff
from services.generator.weight_stream import PolicyStream, StreamError

if TYPE_CHECKING:
    from services.generator.policy_source import PolicySource

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


class VersionWatcher:
    """Follows WatchVersions and hands each announced `Versions` to `on_latest`; reconnects with backoff."""

    def __init__(
        self,
        address: str,
        security: GrpcSecurity,
        generator_id: str,
        on_latest: Callable[[int, int], None],
        backoff: Backoff | None = None,
    ) -> None:
        self.address, self.security, self.generator_id = address, security, generator_id
        self.on_latest = on_latest
        self._backoff = backoff or Backoff(0.2, 10.0)
        self._closed = threading.Event()
        self._call = None
        self._thread = threading.Thread(target=self._run, name="version-watch", daemon=True)

    def start(self) -> VersionWatcher:
        """Start following in the background; returns self."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop following."""
        self._closed.set()
        if self._call is not None:
            self._call.cancel()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._closed.is_set():
            channel = open_channel(self.address, self.security)
            try:
                stub = weights_pb2_grpc.WeightServiceStub(channel)
                self._call = stub.WatchVersions(weights_pb2.WatchVersionsRequest(generator_id=self.generator_id))
                for response in self._call:
                    self._backoff.reset()
                    self.on_latest(response.latest.policy_version, response.latest.adapter_version)
            except grpc.RpcError as exc:
                if not self._closed.is_set():
                    log.warning("version watch on %s broke: %s %s", self.address, exc.code(), exc.details())
            except Exception:
                log.exception("version watch failed")
            finally:
                self._call = None
                channel.close()
            if self._closed.wait(self._backoff.next()):
                break


class VersionSync:
    """Brings the engine to the announced policy and adapter versions: fetch (here), load (engine thread).

    `load(kind, folder, version)` must run the engine's load in its own thread and return the
    serving versions, raising EngineError when the engine refuses; with `load_tensors` (and no policy
    source: a relay needs the folder), policies are streamed into host memory and loaded from there
    (`load_tensors(tensors, version)`, in the engine thread too) and never touch disk. A replaced policy
    folder is deleted at once (the load copied it into the engine); a replaced adapter folder waits until
    `in_use()` (the engine's `adapter_folders_in_use`, asked in its thread) no longer names it: vLLM reads an adapter
    from disk again whenever a sequence still running under it needs it and its cache evicted it.
    """

    def __init__(
        self,
        fetcher: WeightFetcher,
        load: Callable[[str, Path, int], EngineVersions],
        serving: Callable[[], EngineVersions],
        metrics: GeneratorMetrics | None = None,
        in_use: Callable[[], set[Path]] | None = None,
        policy_source: PolicySource | None = None,
        load_tensors: Callable[[dict, int], EngineVersions] | None = None,
        layout: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        self.fetcher, self.load, self.serving, self.metrics = fetcher, load, serving, metrics
        # Streamed loads: policies arrive into host memory and load from there (no disk), unless a relay
        # needs the version on disk to serve it. `layout` is the engine's (name -> shape).
        self.load_tensors = load_tensors if policy_source is None else None
        self.layout = layout or {}
        self.in_use = in_use
        self.policy_source = policy_source  # None: policies come whole from the trainer, unchecked by digest
        self._delta_folder: Path | None = None  # the delta the serving policy was built from (its relay serves it)
        # Every version offered and not yet passed: one that turns out unpublished must not hide the others.
        self._offered: dict[str, set[int]] = {POLICY: set(), ADAPTER: set()}
        self._refused: dict[str, set[int]] = {POLICY: set(), ADAPTER: set()}
        self._folders: dict[str, Path] = {}
        self._retired: list[Path] = []  # adapter folders replaced while sequences may still read them
        self._cond = threading.Condition()
        self._swap_lock = threading.Lock()  # one fetch + load at a time, whoever asks
        self._closed = False
        self._retry_backoff = Backoff(0.5, 10.0)
        self._thread = threading.Thread(target=self._run, name="version-sync", daemon=True)

    def start(self) -> VersionSync:
        """Start the background swapper; returns self."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the background swapper; a download under way (its own or a LoadVersions call's) is cancelled.

        A load under way finishes first. The engine loop has stopped by now, so no download could be loaded,
        and a LoadVersions call's thread still downloading would keep the process from exiting.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.fetcher.close()
        if self._thread.is_alive():
            self._thread.join(5)

    def offer(self, policy_version: int, adapter_version: int) -> None:
        """The trainer announced these versions (0: none); newer ones than served get fetched in the background."""
        with self._cond:
            for kind, version in ((POLICY, policy_version), (ADAPTER, adapter_version)):
                if version > 0:
                    self._offered[kind].add(version)
            self._cond.notify_all()

    def load_now(self, policy_version: int, adapter_version: int) -> EngineVersions:
        """Fetch and load these versions now (0 leaves that part); raises WeightFetchError or EngineError."""
        for kind, version in ((POLICY, policy_version), (ADAPTER, adapter_version)):
            if version > 0:
                self._swap(kind, version)
        return self.serving()

    def _behind(self) -> list[tuple[str, int]]:
        serving = self.serving()
        have = {POLICY: serving.policy_version, ADAPTER: serving.adapter_version}
        todo = []
        for kind, offered in self._offered.items():
            offered -= {v for v in offered if v <= have[kind] or v in self._refused[kind]}
            if offered:
                todo.append((kind, max(offered)))
        return todo

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._behind():
                    self._cond.wait(1.0)  # also re-checks after a swap made elsewhere
                    if self._retired:
                        break
                if self._closed:
                    return
                todo = self._behind()
            if self._retired:
                self.sweep()
            for kind, version in todo:
                try:
                    self._swap(kind, version)
                except WeightsUnavailable as exc:
                    if exc.code == grpc.StatusCode.NOT_FOUND:  # not published, or retired: the next offer may be
                        log.error("%s", exc)
                        with self._cond:
                            self._refused[kind].add(version)
                        continue
                    log.warning("%s", exc)  # the trainer may be restarting: try again later
                    with self._cond:
                        self._cond.wait(self._retry_backoff.next())
                except (WeightFetchError, EngineError) as exc:
                    log.error("%s", exc)
                    with self._cond:
                        self._refused[kind].add(version)
                except Exception:  # the engine thread may be gone (shutdown): never kill this thread
                    log.exception("loading %s v%d failed", kind, version)
                    with self._cond:
                        self._refused[kind].add(version)

    def _fetch(self, kind: str, version: int):
        if kind != POLICY or self.policy_source is None:
            return self.fetcher.fetch(kind, version), None
        base = self._folders.get(POLICY)
        got = self.policy_source.fetch(version, base, self.serving().policy_version if base else 0)
        return got.fetched, got

    def _swap(self, kind: str, version: int) -> None:
        if kind == POLICY and self.load_tensors is not None:
            self._swap_streamed(version)
            return
        with self._swap_lock:
            try:
                fetched, got = self._fetch(kind, version)
            except WeightsUnavailable:
                raise  # not a refusal: nothing was judged
            except WeightFetchError:
                self._count(kind, "refused")
                raise
            try:
                self.load(kind, fetched.folder, fetched.version)
            except Exception:
                self._count(kind, "refused")
                shutil.rmtree(fetched.folder, ignore_errors=True)
                if got is not None:
                    self.policy_source.held.gave_up(fetched.version)
                    if got.delta_folder is not None:
                        shutil.rmtree(got.delta_folder, ignore_errors=True)
                raise
            self._count(kind, "ok")
            if got is not None:  # peers get it from here on, and the trainer hears so
                self.policy_source.held.hold(fetched.version, fetched.folder, got.delta_folder, got.delta_base)
                if self._delta_folder is not None and self._delta_folder != got.delta_folder:
                    shutil.rmtree(self._delta_folder, ignore_errors=True)
                self._delta_folder = got.delta_folder
                if self.metrics is not None and got.published_unix_s:
                    self.metrics.policy_sync_seconds.set(max(0.0, time.time() - got.published_unix_s))
                self.policy_source.report_held(fetched.version)
            self._retry_backoff.reset()
            log.info("now serving %s v%d", kind, fetched.version)
            old = self._folders.get(kind)
            self._folders[kind] = fetched.folder
            if old is not None and old != fetched.folder:
                if kind == ADAPTER:  # sequences started under it may still need it read (vLLM loads LoRA lazily)
                    self._retired.append(old)
                else:  # a policy is copied into the engine's weights by the load
                    shutil.rmtree(old, ignore_errors=True)
            self._sweep()

    def _swap_streamed(self, version: int) -> None:
        with self._swap_lock:
            try:
                streamed = self.fetcher.fetch_stream(version, self.layout)
            except WeightsUnavailable:
                raise
            except WeightFetchError:
                self._count(POLICY, "refused")
                raise
            try:
                self.load_tensors(streamed.tensors, streamed.version)
            except Exception:
                self._count(POLICY, "refused")
                raise
            finally:
                streamed.tensors.clear()  # the staging buffer: the engine holds its own copy now
            self._count(POLICY, "ok")
            self._retry_backoff.reset()
            log.info("now serving policy v%d (streamed)", streamed.version)

    def sweep(self) -> list[Path]:
        """Delete the replaced adapter folders that no unfinished sequence uses any more; returns those kept.

        Runs after every swap and, while folders wait, every second in the background swapper.
        """
        with self._swap_lock:
            self._sweep()
            return list(self._retired)

    def _sweep(self) -> None:
        if not self._retired:
            return
        try:
            busy = {p.resolve() for p in self.in_use()} if self.in_use is not None else set()
        except Exception as exc:  # the engine loop is stopping: keep them, nothing is lost
            log.debug("cannot tell which adapter folders are in use: %s", exc)
            return
        kept = []
        for folder in self._retired:
            if folder.resolve() in busy:
                kept.append(folder)
            else:
                shutil.rmtree(folder, ignore_errors=True)
        self._retired = kept

    def _count(self, kind: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.swaps.labels(kind=kind, outcome=outcome).inc()
