"""WeightService: version watching and chunked, checksummed policy and adapter downloads.

Files are read from disk one chunk at a time, so a multi-GB checkpoint never sits whole in memory;
the chunk size a caller asks for is capped. A version retired while it streams ends the call with
NOT_FOUND (the caller fetches the newer one it is told about).
"""

from __future__ import annotations

import logging

import grpc

from services.api.sparrow.v1 import common_pb2, weights_pb2, weights_pb2_grpc
from services.trainer.weights import ADAPTER, POLICY, DamagedVersion, Manifest, WeightStore

log = logging.getLogger("sparrow.trainer.weights")

WATCH_POLL_S = 1.0


class WeightServicer(weights_pb2_grpc.WeightServiceServicer):
    """Serves the policy and adapter versions of a `WeightStore`."""

    def __init__(self, store: WeightStore, default_chunk_bytes: int, max_chunk_bytes: int) -> None:
        self.store = store
        self.default_chunk_bytes = default_chunk_bytes
        self.max_chunk_bytes = max_chunk_bytes

    def versions(self) -> common_pb2.Versions:
        """What the trainer publishes now (schedules come from the controller through Redis, not from here)."""
        return common_pb2.Versions(policy_version=self.store.latest(POLICY), adapter_version=self.store.latest(ADAPTER))

    def WatchVersions(self, request: weights_pb2.WatchVersionsRequest, context: grpc.ServicerContext):
        seen: tuple[int, int] | None = None
        while context.is_active() and not self.store.closed:
            current = (self.store.latest(POLICY), self.store.latest(ADAPTER))
            if current != seen:
                seen = current
                yield weights_pb2.WatchVersionsResponse(
                    latest=common_pb2.Versions(policy_version=current[0], adapter_version=current[1])
                )
            self.store.wait_for_change(seen, WATCH_POLL_S)

    def FetchPolicy(self, request: weights_pb2.FetchPolicyRequest, context: grpc.ServicerContext):
        yield from self._fetch(POLICY, request.version, request.chunk_bytes, context)

    def FetchAdapter(self, request: weights_pb2.FetchAdapterRequest, context: grpc.ServicerContext):
        yield from self._fetch(ADAPTER, request.version, request.chunk_bytes, context)

    def _fetch(self, kind: str, version: int, chunk_bytes: int, context: grpc.ServicerContext):
        what = "policy" if kind == POLICY else "adapter"
        if version < 0 or chunk_bytes < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "version and chunk_bytes must be >= 0")
        try:
            manifest = self.store.manifest(kind, version)
        except DamagedVersion as exc:
            manifest, damaged = None, str(exc)
        else:
            damaged = None
        if damaged is not None:
            log.error("refusing a fetch: %s", damaged)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, damaged)
        if manifest is None:
            latest = self.store.latest(kind)
            asked = "latest" if version == 0 else f"version {version}"
            context.abort(grpc.StatusCode.NOT_FOUND, f"{what} {asked} is not published (latest: {latest or 'none'})")
        size = min(chunk_bytes or self.default_chunk_bytes, self.max_chunk_bytes)
        yield weights_pb2.WeightChunk(manifest=_manifest_message(manifest))
        for entry in manifest.files:
            try:
                # Resolved again here: the folder may have changed on disk since its manifest was checked.
                f = self.store.file_path(kind, manifest.version, entry).open("rb")
            except DamagedVersion as exc:
                log.error("refusing a fetch: %s", exc)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            except FileNotFoundError:
                context.abort(grpc.StatusCode.NOT_FOUND, f"{what} version {manifest.version} was retired mid-fetch")
            with f:
                offset = 0
                while context.is_active():
                    data = f.read(size)
                    if not data and offset > 0:
                        break
                    yield weights_pb2.WeightChunk(
                        chunk=weights_pb2.FileChunk(path=entry.path, offset=offset, data=data)
                    )
                    offset += len(data)
                    if not data:  # an empty file still sends one (empty) chunk, so the receiver creates it
                        break


def _manifest_message(m: Manifest) -> weights_pb2.WeightManifest:
    return weights_pb2.WeightManifest(
        version=m.version,
        files=[weights_pb2.WeightFile(path=f.path, size_bytes=f.size_bytes, sha256=f.sha256) for f in m.files],
        lora_rank=m.lora_rank,
        lora_target_modules=list(m.lora_target_modules),
    )
