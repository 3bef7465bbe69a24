"""WeightService: version watching and chunked, checksummed policy and adapter downloads.

Files are read from disk one chunk at a time, so a multi-GB checkpoint never sits whole in memory;
the chunk size a caller asks for is capped. A version retired while it streams ends the call with
NOT_FOUND (the caller fetches the newer one it is told about).

It runs on the trainer's asyncio gRPC server: a version watch waits on the event loop (woken by the
store when a version is published) and file reads go to the server's blocking-work pool, so neither
holds a thread while it waits.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.api.sparrow.v1 import common_pb2, weights_pb2, weights_pb2_grpc
from services.trainer.weights import ADAPTER, POLICY, DamagedVersion, Manifest, WeightStore

log = logging.getLogger("sparrow.trainer.weights")

WATCH_POLL_S = 5.0  # a watch rechecks this often even unwoken (the store wakes it on every publish and close)


class WeightServicer(weights_pb2_grpc.WeightServiceServicer):
    """Serves the policy and adapter versions of a `WeightStore`."""

    def __init__(self, store: WeightStore, default_chunk_bytes: int, max_chunk_bytes: int) -> None:
        self.store = store
        self.default_chunk_bytes = default_chunk_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self._changed: asyncio.Event | None = None  # set and cleared on the loop at every publish

    def _change_event(self) -> asyncio.Event:
        if self._changed is None:  # made on the server's loop, the first time a watch waits
            loop, event = asyncio.get_running_loop(), asyncio.Event()

            def wake() -> None:
                event.set()
                event.clear()  # the waiters already woken stay woken

            self.store.add_listener(lambda: loop.call_soon_threadsafe(wake))
            self._changed = event
        return self._changed

    def versions(self) -> common_pb2.Versions:
        """What the trainer publishes now (schedules come from the controller through Redis, not from here)."""
        return common_pb2.Versions(policy_version=self.store.latest(POLICY), adapter_version=self.store.latest(ADAPTER))

    async def wait_closed(self) -> None:
        """Return once the store is closed (the trainer is stopping)."""
        changed = self._change_event()
        while not self.store.closed:
            try:
                await asyncio.wait_for(changed.wait(), WATCH_POLL_S)
            except TimeoutError:
                pass

    async def WatchVersions(self, request: weights_pb2.WatchVersionsRequest, context: grpc.aio.ServicerContext):
        changed = self._change_event()
        seen: tuple[int, int] | None = None
        while not self.store.closed:  # a caller gone cancels this coroutine at its next wait
            current = (self.store.latest(POLICY), self.store.latest(ADAPTER))
            if current != seen:
                seen = current
                yield weights_pb2.WatchVersionsResponse(
                    latest=common_pb2.Versions(policy_version=current[0], adapter_version=current[1])
                )
                continue  # check again before waiting: a publish during the yield woke nobody
            try:
                await asyncio.wait_for(changed.wait(), WATCH_POLL_S)
            except TimeoutError:
                pass

    async def FetchPolicy(self, request: weights_pb2.FetchPolicyRequest, context: grpc.aio.ServicerContext):
        async for chunk in self._fetch(POLICY, request.version, request.chunk_bytes, context):
            yield chunk

    async def FetchAdapter(self, request: weights_pb2.FetchAdapterRequest, context: grpc.aio.ServicerContext):
        async for chunk in self._fetch(ADAPTER, request.version, request.chunk_bytes, context):
            yield chunk

    async def _fetch(self, kind: str, version: int, chunk_bytes: int, context: grpc.aio.ServicerContext):
        what = "policy" if kind == POLICY else "adapter"
        if version < 0 or chunk_bytes < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "version and chunk_bytes must be >= 0")
        try:
            manifest = await asyncio.to_thread(self.store.manifest, kind, version)
        except DamagedVersion as exc:
            manifest, damaged = None, str(exc)
        else:
            damaged = None
        if damaged is not None:
            log.error("refusing a fetch: %s", damaged)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, damaged)
        if manifest is None:
            latest = self.store.latest(kind)
            asked = "latest" if version == 0 else f"version {version}"
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"{what} {asked} is not published (latest: {latest or 'none'})"
            )
        size = min(chunk_bytes or self.default_chunk_bytes, self.max_chunk_bytes)
        yield weights_pb2.WeightChunk(manifest=_manifest_message(manifest))
        for entry in manifest.files:
            try:
                # Resolved again here: the folder may have changed on disk since its manifest was checked.
                f = self.store.file_path(kind, manifest.version, entry).open("rb")
            except DamagedVersion as exc:
                log.error("refusing a fetch: %s", exc)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            except FileNotFoundError:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND, f"{what} version {manifest.version} was retired mid-fetch"
                )
            with f:
                offset = 0
                while True:  # a caller gone cancels this coroutine at its next await
                    data = await asyncio.to_thread(f.read, size)
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
