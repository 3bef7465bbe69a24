"""A generator's relay: the policy version it holds, served read-only to peers as a WeightService.

A peer asks for a version this generator holds (its verified folder, and the delta it was built
from, if any) or is still fetching: the call then waits until the version is held (a delta: until
it has arrived here whole, before it is applied), or fails as UNAVAILABLE when this generator
gives it up, so the trainer can hand out a source before that source has finished (a tree of
relays fills in one pass). WatchVersions, FetchAdapter and
GetPolicySource stay the trainer's (UNIMPLEMENTED here). The server checks the same service token
as the trainer's; whatever a relay sends, the receiver checks the result against the trainer's digest.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.api.sparrow.v1 import weights_pb2, weights_pb2_grpc
from services.common.grpc_server import GrpcSecurity, add_health_and_reflection, bind, build_server, stop_gracefully
from services.common.weight_stream import folder_manifest, stream_folder

log = logging.getLogger("sparrow.generator.relay")


@dataclass
class _Held:
    version: int
    folder: Path
    delta_folder: Path | None
    delta_base: int
    manifest: weights_pb2.WeightManifest | None = None  # of the full folder, computed at the first full fetch
    lock: threading.Lock = field(default_factory=threading.Lock)


class HeldPolicy:
    """The policy version this generator holds (verified), and the one it is fetching; thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: _Held | None = None
        self._pending: int = 0
        self._delta: _Held | None = None  # a delta of the pending version, arrived, not yet applied
        self._closed = False

    @property
    def version(self) -> int:
        with self._cond:
            return self._held.version if self._held else 0

    def fetching(self, version: int) -> None:
        """This generator started fetching `version`: peers asking for it wait."""
        with self._cond:
            self._pending = version
            self._cond.notify_all()

    def delta_arrived(self, version: int, delta_folder: Path, delta_base: int) -> None:
        """The delta to `version` arrived whole (its file checksum matched): peers may have it while it is applied
        here. Each receiver checks the result against the trainer's digest, so nothing depends on this copy."""
        with self._cond:
            if self._pending == version:
                self._delta = _Held(version, delta_folder, delta_folder, delta_base)
                self._cond.notify_all()

    def gave_up(self, version: int) -> None:
        """The fetch of `version` failed: peers waiting for it are answered UNAVAILABLE."""
        with self._cond:
            if self._pending == version:
                self._pending = 0
            if self._delta is not None and self._delta.version == version:
                self._delta = None
            self._cond.notify_all()

    def hold(self, version: int, folder: Path, delta_folder: Path | None = None, delta_base: int = 0) -> None:
        """`folder` (and the delta it was built from) now holds verified `version`."""
        with self._cond:
            self._held = _Held(version, folder, delta_folder, delta_base)
            if self._pending <= version:
                self._pending = 0
            if self._delta is not None and self._delta.version <= version:
                self._delta = None
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait_for(self, version: int, timeout_s: float) -> _Held | None:
        """The held `version` once it is (None: not held, not coming, or not within `timeout_s`)."""
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    self._closed
                    or (self._held is not None and self._held.version == version)
                    or self._pending != version
                ),
                timeout=timeout_s,
            )
            held = self._held
            return held if held is not None and held.version == version and not self._closed else None

    def wait_for_delta(self, version: int, timeout_s: float) -> _Held | None:
        """The delta to `version`, from the held version or one that arrived for the pending one (None: neither)."""
        with self._cond:

            def ready() -> _Held | None:
                for h in (self._held, self._delta):
                    if h is not None and h.version == version and h.delta_folder is not None:
                        return h
                return None

            self._cond.wait_for(lambda: self._closed or ready() is not None or self._pending != version, timeout_s)
            return None if self._closed else ready()

    def full_manifest(self, held: _Held) -> weights_pb2.WeightManifest:
        """The manifest of `held`'s full folder (sha256 of every file), computed once (outside the lock: it reads
        the whole folder, and waiting peers must not wait on it)."""
        with held.lock:
            if held.manifest is None:
                held.manifest = folder_manifest(held.folder, held.version)
            return held.manifest


class RelayServicer(weights_pb2_grpc.WeightServiceServicer):
    """FetchPolicy and FetchPolicyDelta of the version in `held`; every other RPC is the trainer's."""

    def __init__(self, held: HeldPolicy, wait_s: float, chunk_bytes: int = 1 << 20, max_chunk_bytes: int = 4 << 20):
        self.held, self.wait_s = held, wait_s
        self.chunk_bytes, self.max_chunk_bytes = chunk_bytes, max_chunk_bytes

    def _get(self, version: int, context: grpc.ServicerContext) -> _Held:
        if version <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a relay serves explicit policy versions (> 0)")
        held = self.held.wait_for(version, self.wait_s)
        if held is None:
            context.abort(
                grpc.StatusCode.UNAVAILABLE, f"this relay does not hold policy v{version} (holds v{self.held.version})"
            )
        return held

    def _size(self, asked: int) -> int:
        return min(asked or self.chunk_bytes, self.max_chunk_bytes)

    def FetchPolicy(self, request: weights_pb2.FetchPolicyRequest, context: grpc.ServicerContext):
        held = self._get(request.version, context)
        yield from stream_folder(held.folder, self.held.full_manifest(held), self._size(request.chunk_bytes), context)

    def FetchPolicyDelta(self, request: weights_pb2.FetchPolicyDeltaRequest, context: grpc.ServicerContext):
        if request.version <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a relay serves explicit policy versions (> 0)")
        held = self.held.wait_for_delta(request.version, self.wait_s)
        if held is None:
            context.abort(
                grpc.StatusCode.UNAVAILABLE, f"this relay does not hold policy v{request.version} or a delta to it"
            )
        if held.delta_base != request.base_version:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"this relay holds no delta from v{request.base_version} to v{request.version}",
            )
        manifest = folder_manifest(held.delta_folder, held.version, held.delta_base)
        yield from stream_folder(held.delta_folder, manifest, self._size(request.chunk_bytes), context)


class RelayServer:
    """The relay's gRPC server (token and TLS as the generator's control server)."""

    def __init__(self, held: HeldPolicy, security: GrpcSecurity, address: str, wait_s: float) -> None:
        self.server = build_server(security, max_workers=16)
        weights_pb2_grpc.add_WeightServiceServicer_to_server(RelayServicer(held, wait_s), self.server)
        self._health = add_health_and_reflection(self.server, ["sparrow.v1.WeightService"])
        self.port = bind(self.server, address, security)
        self.held = held

    def start(self) -> RelayServer:
        self.server.start()
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        self.held.close()
        stop_gracefully(self.server, self._health, grace_s)
