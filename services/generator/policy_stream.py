"""A policy version read straight off the fetch stream into host memory, checked as it arrives.

The trainer's WeightService sends a policy as an HF folder, file by file in chunks. `PolicyStream`
parses each `.safetensors` file as its bytes arrive (the 8-byte header length, the JSON header, then
each tensor's bytes at its offsets) into one host tensor per checkpoint tensor: the *staging buffer*,
one copy of the version in the dtype it was published in (the serving dtype: 16 GB for Qwen3-8B in
bf16, 1.2 GB for 0.6B), held from the first chunk until the engine has loaded it, then freed. No byte
is written to disk.

Every check of the from-disk path happens on the way, before the engine is touched:
- names and shapes against the checkpoint the engine serves, from each file's header (a version that
  does not fit is refused before its tensors are downloaded);
- finiteness, per tensor as soon as its last byte arrived (overlapping the rest of the download);
- each file's size and sha256 against the manifest (`weight_fetch._Download`, over the same bytes);
- at the end, that every serving tensor arrived exactly once.
Only then does `version_sync.VersionSync` hand the staged tensors to the engine, which loads them in
one engine-thread call (no step runs between two of its tensors); a version refused anywhere leaves
the engine's weights untouched, so the old version keeps serving.

Why a staging buffer and not a load into the engine per arriving layer: a digest or a NaN found at
the last tensor would then leave the engine half overwritten, and undoing that needs a copy of the
old weights, which costs the same memory on the device instead of on the host.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


class StreamError(ValueError):
    """A streamed policy that cannot be loaded as it is (one line; the version is refused whole)."""


@dataclass
class _Tensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # offsets in the file's data section
    end: int
    buffer: torch.Tensor | None = None  # uint8, allocated when its first byte arrives


class _SafetensorsFile:
    """One .safetensors file parsed from its chunks; completed tensors go to `on_tensor(name, tensor)`."""

    def __init__(self, path: str, size: int, owner: PolicyStream) -> None:
        self.path, self.size, self.owner = path, size, owner
        self.head = bytearray()  # the 8-byte length and the header, until parsed
        self.data_start = -1  # file offset of the data section, once the header is parsed
        self.tensors: list[_Tensor] = []  # in offset order
        self.at = 0  # index of the tensor the next data byte belongs to
        self.data_at = 0  # offset in the data section of the next byte

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.data_start < 0:
                view = self._feed_header(view)
                continue
            view = self._feed_data(view)

    def _feed_header(self, view: memoryview) -> memoryview:
        need = 8 if len(self.head) < 8 else 8 + int.from_bytes(self.head[:8], "little")
        take = min(need - len(self.head), len(view))
        self.head += view[:take]
        if len(self.head) == 8:
            n = int.from_bytes(self.head[:8], "little")
            if n <= 1 or n > _MAX_HEADER or 8 + n > self.size:
                self.fail(f"a header of {n} bytes in a file of {self.size}")
        elif len(self.head) == need:
            self._parse_header(bytes(self.head[8:]))
            self.data_start = need
            self.head = bytearray()
        return view[take:]

    def _parse_header(self, raw: bytes) -> None:
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            self.fail("its header is not JSON")
        if not isinstance(header, dict):
            self.fail("its header is not a JSON object")
        header.pop("__metadata__", None)
        data_size = self.size - 8 - len(raw)
        for name, entry in header.items():
            if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
                self.fail(f"tensor {name}: unknown dtype {entry.get('dtype') if isinstance(entry, dict) else entry!r}")
            shape, offsets = entry.get("shape"), entry.get("data_offsets")
            ints = isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            pair = isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            if not ints or not pair:
                self.fail(f"tensor {name}: malformed shape or data_offsets")
            dtype = _DTYPES[entry["dtype"]]
            begin, end = offsets
            if not 0 <= begin <= end <= data_size or end - begin != math.prod(shape) * dtype.itemsize:
                self.fail(f"tensor {name}: data_offsets {offsets} do not fit its shape {shape} or the file")
            self.owner.admit(name, tuple(shape))  # refused before any of its bytes arrive
            self.tensors.append(_Tensor(name, dtype, tuple(shape), begin, end))
        self.tensors.sort(key=lambda t: t.begin)
        at = 0
        for t in self.tensors:  # safetensors packs tensors back to back: no gap, no overlap
            if t.begin != at:
                self.fail(f"tensor {t.name} starts at {t.begin}, expected {at}")
            at = t.end
        if at != data_size:
            self.fail(f"its tensors end at {at}, the file's data section at {data_size}")
        self._complete_empty()

    def _feed_data(self, view: memoryview) -> memoryview:
        if self.at >= len(self.tensors):
            self.fail("bytes past its last tensor")
        t = self.tensors[self.at]
        if t.buffer is None:  # allocated on its first byte: memory follows what arrived, within the serving layout
            t.buffer = torch.empty(t.end - t.begin, dtype=torch.uint8)
        start = self.data_at - t.begin
        take = min(t.end - self.data_at, len(view))
        t.buffer.numpy()[start : start + take] = np.frombuffer(view[:take], dtype=np.uint8)
        self.data_at += take
        if self.data_at == t.end:
            self._complete(t)
            self.at += 1
            self._complete_empty()
        return view[take:]

    def _complete_empty(self) -> None:
        while self.at < len(self.tensors) and self.tensors[self.at].begin == self.tensors[self.at].end:
            self.tensors[self.at].buffer = torch.empty(0, dtype=torch.uint8)
            self._complete(self.tensors[self.at])
            self.at += 1

    def _complete(self, t: _Tensor) -> None:
        tensor = t.buffer.view(t.dtype).reshape(t.shape)
        t.buffer = None
        self.owner.arrived(t.name, tensor)

    def finish(self) -> None:
        if self.data_start < 0 or self.at != len(self.tensors):
            self.fail("it ended before its last tensor")

    def fail(self, why: str):
        raise StreamError(f"{self.path}: {why}")


@dataclass
class PolicyStream:
    """The staging buffer of one streamed policy version: tensors checked as they arrive (see the module doc).

    `serving` is the engine's checkpoint layout (name -> shape; empty: unknown, nothing to compare).
    """

    serving: dict[str, tuple[int, ...]]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    _files: dict[str, _SafetensorsFile] = field(default_factory=dict)
    _names: set[str] = field(default_factory=set)

    def open(self, path: str, size: int) -> None:
        """A file of the manifest begins; only .safetensors files are kept (side files are checked, not kept)."""
        if path.endswith(".safetensors"):
            self._files[path] = _SafetensorsFile(path, size, self)

    def write(self, path: str, data: bytes) -> None:
        """The next bytes of `path` (in order: `_Download` checks offsets first)."""
        f = self._files.get(path)
        if f is not None:
            f.feed(data)

    def admit(self, name: str, shape: tuple[int, ...]) -> None:
        """A file's header names this tensor: it must be one the engine serves, in its shape, named once."""
        if name in self._names:
            raise StreamError(f"tensor {name} is in two files")
        if self.serving and name not in self.serving:
            raise StreamError(f"does not fit the serving model: tensor {name} unknown")
        if self.serving and shape != self.serving[name]:
            raise StreamError(
                f"does not fit the serving model: {name} is {list(shape)}, serving {list(self.serving[name])}"
            )
        self._names.add(name)

    def arrived(self, name: str, tensor: torch.Tensor) -> None:
        """A tensor's last byte arrived: refuse NaN or inf now (every logprob of the version would be NaN)."""
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise StreamError(f"tensor {name} has NaN or inf values")
        self.tensors[name] = tensor

    def finish(self) -> dict[str, torch.Tensor]:
        """The whole version arrived and each file matched its sha256: every serving tensor must be here."""
        for f in self._files.values():
            f.finish()
        if not self.tensors:
            raise StreamError("no .safetensors weights")
        missing = sorted(set(self.serving) - set(self.tensors))
        if missing:
            raise StreamError(
                f"does not fit the serving model: tensor {missing[0]} missing ({len(missing)} names differ)"
            )
        return self.tensors
