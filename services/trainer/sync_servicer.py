"""The trainer's WeightService with policy deltas and sources: WeightServicer plus two RPCs.

FetchPolicyDelta streams the delta of a version against the one before it (only that pair: a caller
further behind fetches the full version). GetPolicySource answers the digest a version's tensors must
have, whether a delta from the caller's version exists, and where to fetch (SourcePlanner); with
held_version >= version it is the caller's report that it holds the version. Both answer only versions
the store published (not yet retired).

Async, on the trainer's asyncio server like the rest of the WeightService: the record read, the delta's
manifest (a sha256 of its file) and the file reads run in the server's blocking-work pool.
"""

from __future__ import annotations

import asyncio

import grpc

from services.api.sparrow.v1 import weights_pb2
from services.common.weight_stream import astream_folder, folder_manifest
from services.trainer.policy_sources import SourcePlanner
from services.trainer.policy_sync import PolicySyncStore
from services.trainer.weight_servicer import WeightServicer
from services.trainer.weights import POLICY, WeightStore

_MAX_ADDRESS = 256


class TrainerWeightServicer(WeightServicer):
    """WeightServicer with FetchPolicyDelta and GetPolicySource over a PolicySyncStore and a SourcePlanner."""

    def __init__(
        self,
        store: WeightStore,
        default_chunk_bytes: int,
        max_chunk_bytes: int,
        sync: PolicySyncStore,
        planner: SourcePlanner,
    ) -> None:
        super().__init__(store, default_chunk_bytes, max_chunk_bytes)
        self.sync, self.planner = sync, planner

    async def _record(self, version: int):
        """The sync record of published `version` (None: not published, retired, or no record)."""
        return await asyncio.to_thread(self.sync.record, version) if self.store.has(POLICY, version) else None

    async def FetchPolicyDelta(self, request: weights_pb2.FetchPolicyDeltaRequest, context: grpc.aio.ServicerContext):
        if request.version <= 0 or request.base_version <= 0 or request.chunk_bytes < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "version and base_version must be > 0, chunk_bytes >= 0"
            )
        record = await self._record(request.version)
        if record is None or record.delta_base_version != request.base_version:
            kept = f"against v{record.delta_base_version}" if record and record.delta_base_version else "none"
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no delta from policy v{request.base_version} to v{request.version} (kept: {kept}); fetch it whole",
            )
        folder = self.sync.delta_folder(request.version)
        try:
            manifest = await asyncio.to_thread(_delta_manifest, folder, request.version, request.base_version)
        except FileNotFoundError:  # retired between the record's read and here
            await context.abort(grpc.StatusCode.NOT_FOUND, f"policy v{request.version} was retired; fetch the latest")
        size = min(request.chunk_bytes or self.default_chunk_bytes, self.max_chunk_bytes)
        async for chunk in astream_folder(folder, manifest, size, context):
            yield chunk

    async def GetPolicySource(
        self, request: weights_pb2.GetPolicySourceRequest, context: grpc.aio.ServicerContext
    ) -> weights_pb2.GetPolicySourceResponse:
        if not request.generator_id or request.version <= 0 or request.held_version < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "generator_id, version > 0 and held_version >= 0 needed"
            )
        addresses = [request.relay_address, *request.failed_sources]
        if len(request.failed_sources) > 64 or any(len(a) > _MAX_ADDRESS or "\0" in a for a in addresses):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "relay and failed source addresses must be host:port")
        if request.relay_address and ":" not in request.relay_address:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"relay address {request.relay_address!r} is no host:port"
            )
        record = await self._record(request.version)
        if record is None:
            latest = self.store.latest(POLICY)
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"policy v{request.version} is not published (latest: {latest or 'none'})"
            )
        response = weights_pb2.GetPolicySourceResponse(
            version=record.version,
            result_sha256=record.result_sha256,
            published_unix_seconds=record.published_unix_s,
        )
        if request.held_version >= request.version:
            self.planner.report(request.generator_id, request.version, request.relay_address)
            return response
        if record.delta_base_version and record.delta_base_version == request.held_version:
            response.delta_base_version = record.delta_base_version
        response.sources.extend(
            self.planner.assign(
                request.generator_id, request.version, request.relay_address, list(request.failed_sources)
            )
        )
        return response


def _delta_manifest(folder, version: int, base_version: int) -> weights_pb2.WeightManifest:
    if not folder.is_dir():
        raise FileNotFoundError(folder)
    return folder_manifest(folder, version, base_version)
