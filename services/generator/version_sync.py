"""Following the trainer's versions and bringing the engine to them: watch, then fetch-then-load.

`VersionWatcher` follows `WatchVersions` (reconnecting with backoff); `VersionSync` turns the
announced versions, and the trainer's hello, into fetch-then-load, one swap at a time, fetching
through `weight_fetch` (or a `policy_source` that plans where a policy comes from). A version that
was refused is not fetched again on its own (an explicit LoadVersions still may).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from services.api.sparrow.v1 import weights_pb2, weights_pb2_grpc
from services.common.grpc_server import GrpcSecurity, open_channel
from services.generator.engine import EngineError, EngineVersions
from services.generator.metrics import GeneratorMetrics
from services.generator.policy_source import PolicySource
from services.generator.trajectory_stream import Backoff
from services.generator.weight_fetch import (
    ADAPTER,
    POLICY,
    WeightFetcher,
    WeightFetchError,
    WeightsUnavailable,
)

log = logging.getLogger("sparrow.generator.weights")


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
