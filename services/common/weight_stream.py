"""A folder of weight files as a WeightChunk stream: the manifest, then each file's chunks in manifest order.

Shared by the trainer's policy deltas (`astream_folder`, on its asyncio server: file reads go to the
server's blocking-work pool) and a generator's relay (`stream_folder`, on a thread-pool server), which
serve files the same way as the trainer's WeightService does: one chunk in memory at a time, the size a
caller asks for capped. A manifest entry is opened only inside its folder.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc

from services.api.sparrow.v1 import weights_pb2

_HASH_BLOCK = 1 << 20


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def folder_manifest(folder: Path, version: int, base_version: int = 0) -> weights_pb2.WeightManifest:
    """The manifest of every file under `folder` (sizes and sha256), as the wire carries it."""
    files = [
        weights_pb2.WeightFile(path=str(p.relative_to(folder)), size_bytes=p.stat().st_size, sha256=file_sha256(p))
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    ]
    return weights_pb2.WeightManifest(version=version, files=files, base_version=base_version)


def _inside(folder: Path, path: str) -> Path:
    """`folder / path`, or ValueError when it resolves outside `folder` (a link, `..`)."""
    target = (folder / path).resolve()
    if not target.is_relative_to(folder.resolve()):
        raise ValueError(f"{path!r} resolves outside the folder served")
    return target


def stream_folder(
    folder: Path, manifest: weights_pb2.WeightManifest, chunk_bytes: int, context: grpc.ServicerContext
) -> Iterator[weights_pb2.WeightChunk]:
    """Yield `manifest`, then the chunks of its files read from `folder`; a file gone mid-stream is NOT_FOUND."""
    yield weights_pb2.WeightChunk(manifest=manifest)
    for entry in manifest.files:
        try:
            f = _inside(folder, entry.path).open("rb")
        except FileNotFoundError:
            context.abort(grpc.StatusCode.NOT_FOUND, f"version {manifest.version} was retired mid-fetch")
        except ValueError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"version {manifest.version}: {exc}")
        with f:
            offset = 0
            while context.is_active():
                data = f.read(chunk_bytes)
                if not data and offset > 0:
                    break
                yield weights_pb2.WeightChunk(chunk=weights_pb2.FileChunk(path=entry.path, offset=offset, data=data))
                offset += len(data)
                if not data:  # an empty file still sends one (empty) chunk, so the receiver creates it
                    break


async def astream_folder(
    folder: Path, manifest: weights_pb2.WeightManifest, chunk_bytes: int, context: grpc.aio.ServicerContext
) -> AsyncIterator[weights_pb2.WeightChunk]:
    """`stream_folder` for an asyncio server: opens and reads go to the loop's executor, so a slow disk
    holds no event loop; a caller gone cancels this at its next await."""
    yield weights_pb2.WeightChunk(manifest=manifest)
    for entry in manifest.files:
        try:
            f = await asyncio.to_thread(lambda p=entry.path: _inside(folder, p).open("rb"))
        except FileNotFoundError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"version {manifest.version} was retired mid-fetch")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"version {manifest.version}: {exc}")
        with f:
            offset = 0
            while True:
                data = await asyncio.to_thread(f.read, chunk_bytes)
                if not data and offset > 0:
                    break
                yield weights_pb2.WeightChunk(chunk=weights_pb2.FileChunk(path=entry.path, offset=offset, data=data))
                offset += len(data)
                if not data:  # an empty file still sends one (empty) chunk, so the receiver creates it
                    break
