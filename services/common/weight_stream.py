"""A folder of weight files as a WeightChunk stream: the manifest, then each file's chunks in manifest order.

Shared by the trainer's policy deltas and a generator's relay (peers), which serve files the same way
as the trainer's WeightService does: one chunk in memory at a time, the size a caller asks for capped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
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


def stream_folder(
    folder: Path, manifest: weights_pb2.WeightManifest, chunk_bytes: int, context: grpc.ServicerContext
) -> Iterator[weights_pb2.WeightChunk]:
    """Yield `manifest`, then the chunks of its files read from `folder`; a file gone mid-stream is NOT_FOUND."""
    yield weights_pb2.WeightChunk(manifest=manifest)
    for entry in manifest.files:
        try:
            f = (folder / entry.path).open("rb")
        except FileNotFoundError:
            context.abort(grpc.StatusCode.NOT_FOUND, f"version {manifest.version} was retired mid-fetch")
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
