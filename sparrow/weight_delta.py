"""Policy versions as the engines serve them: the serving dtype, a digest of the tensors, and deltas.

A version is an HF folder (safetensors files and side files: config, tokenizer). Its *result digest*
is a sha256 over every tensor of its safetensors files in name order (name, dtype, shape, bytes), so
two folders whose files differ in byte layout but load the same weights have the same digest. The
trainer computes it once per version; a generator checks it on whatever it assembled, whoever sent
the pieces, before the version serves.

A delta of version N against version N-1 holds, for each tensor whose bits changed, the flat indices
of the changed elements (as gaps, in the narrowest unsigned type that fits, zstd-compressed) and their
new values (zstd-compressed); unchanged tensors are named in the layout only. In bf16 most of an RL
step's small updates round to no change, so a delta is a small share of a full copy. It is a
safetensors file (uint8 tensors of compressed bytes, the layout as JSON metadata): parsing hostile
input goes through safetensors and zstd with bounded output sizes, never pickle.

    digest = folder_digest(folder)
    write_delta(base_folder, new_folder, out_file, base_version, version)
    apply_delta(base_folder, delta_file, out_folder, expected_digest)   # raises DeltaError
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DELTA_FORMAT = 1
DELTA_FILE = "policy.delta"  # the one file of a published delta
META_KEY = "sparrow_delta"
SERVING_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GAP_DTYPES = (("uint8", np.uint8, 1 << 8), ("uint16", np.uint16, 1 << 16), ("uint32", np.uint32, 1 << 32))
_ZSTD_LEVEL = 3  # level 3 is zstd's default: ~300 MB/s a core, within a few % of the ratio of higher levels
_HASH_BLOCK = 1 << 20


class DeltaError(ValueError):
    """A delta that cannot be applied to this base, or whose result is not the version it claims; one line."""


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The floating tensors of `state` in `dtype` (others as they are): what an engine serving `dtype` loads."""
    return {k: v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v for k, v in state.items()}


def checkpoint_dtype(folder: str | Path) -> str:
    """The dtype an HF checkpoint declares in its config.json ("dtype" or the older "torch_dtype"); float32 if none."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return name if name in SERVING_DTYPES else "float32"


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def tensors_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, bytes) of each tensor, in the order given (name order: see callers)."""
    digest = hashlib.sha256()
    for name, t in tensors:
        digest.update(json.dumps([name, str(t.dtype).removeprefix("torch."), list(t.shape)]).encode() + b"\0")
        flat = t.reshape(-1)
        step = max(1, _HASH_BLOCK // max(1, t.element_size()))
        for start in range(0, flat.numel(), step):  # blocks, so a view of a mmap'd file is never copied whole
            digest.update(_raw(flat[start : start + step]))
    return digest.hexdigest()


def weight_files(folder: Path) -> list[Path]:
    """The .safetensors files of a checkpoint folder, sorted."""
    return sorted(Path(folder).glob("*.safetensors"))


def folder_layout(folder: Path) -> dict[str, list[str]]:
    """file name -> its tensor names (sorted), for every .safetensors file of `folder`."""
    from safetensors import safe_open

    out = {}
    for f in weight_files(folder):
        with safe_open(str(f), framework="pt") as st:
            out[f.name] = sorted(st.keys())
    return out


def folder_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of `folder`'s safetensors files in name order (files memory-mapped)."""
    from safetensors import safe_open

    where = {name: f for f, names in folder_layout(folder).items() for name in names}
    handles = {f: safe_open(str(Path(folder) / f), framework="pt") for f in sorted(set(where.values()))}
    for name in sorted(where):
        yield name, handles[where[name]].get_tensor(name)


def folder_digest(folder: Path) -> str:
    """The result digest of a checkpoint folder (its tensors, not its files' bytes)."""
    return tensors_digest(folder_tensors(folder))


def side_files(folder: Path) -> dict[str, str]:
    """path -> sha256 of every file of `folder` that is not a .safetensors file (config, tokenizer, shard index)."""
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file() and p.suffix != ".safetensors":
            digest = hashlib.sha256()
            with p.open("rb") as f:
                while block := f.read(_HASH_BLOCK):
                    digest.update(block)
            out[str(p.relative_to(folder))] = digest.hexdigest()
    return out


@dataclass(frozen=True)
class DeltaStats:
    """What a delta holds: elements changed of all, tensors touched, bytes of the delta file."""

    changed: int
    elements: int
    tensors_changed: int
    tensors: int
    delta_bytes: int


def _zstd():
    import zstandard

    return zstandard


def write_delta(
    base: Path, new: Path, out: Path, base_version: int, version: int, result_sha256: str | None = None
) -> DeltaStats | None:
    """Write the delta turning folder `base` into folder `new` to the file `out`; None when there is none to
    write (the layouts differ: other names, shapes or dtypes). `result_sha256`: `new`'s digest if known."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    layout = folder_layout(new)
    if not layout or layout != folder_layout(base):
        return None
    z = _zstd().ZstdCompressor(level=_ZSTD_LEVEL)
    blobs: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    changed = elements = 0
    for fname, names in layout.items():
        with safe_open(str(base / fname), framework="pt") as old_st, safe_open(str(new / fname), framework="pt") as st:
            for name in names:
                a, b = old_st.get_tensor(name), st.get_tensor(name)
                if a.dtype != b.dtype or a.shape != b.shape or b.element_size() not in _INT_VIEW:
                    return None
                elements += b.numel()
                view = _INT_VIEW[b.element_size()]
                # Bitwise comparison: -0.0 vs 0.0 and NaN payloads count as changes, so the result is exact.
                idx = torch.nonzero(a.reshape(-1).view(view) != b.reshape(-1).view(view)).reshape(-1)
                if idx.numel() == 0:
                    continue
                changed += idx.numel()
                gaps = np.diff(idx.numpy(), prepend=-1)
                gap_name, gap_type, _ = next(g for g in _GAP_DTYPES if int(gaps.max()) < g[2])
                values = b.reshape(-1)[idx]
                blobs[f"{name}|gaps"] = _bytes_tensor(z.compress(gaps.astype(gap_type).tobytes()))
                blobs[f"{name}|values"] = _bytes_tensor(z.compress(bytes(_raw(values))))
                entries[name] = {"count": int(idx.numel()), "gaps": gap_name}
    meta = {
        "format": DELTA_FORMAT,
        "base_version": base_version,
        "version": version,
        "result_sha256": result_sha256 or folder_digest(new),
        "layout": layout,
        "side_files": side_files(new),
        "changed": entries,
    }
    if not blobs:  # safetensors needs one tensor: an empty marker keeps "nothing changed" a valid delta
        blobs["|empty"] = torch.zeros(0, dtype=torch.uint8)
    save_file(blobs, str(out), metadata={META_KEY: json.dumps(meta)})
    return DeltaStats(changed, elements, len(entries), sum(len(n) for n in layout.values()), out.stat().st_size)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def read_delta_meta(delta_file: Path) -> dict:
    """The JSON layout of a delta file; DeltaError when it is no delta of this format."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(delta_file), framework="pt") as st:
            meta = json.loads((st.metadata() or {})[META_KEY])
    except (OSError, SafetensorError, KeyError, ValueError) as exc:
        raise DeltaError(f"{delta_file.name} is no readable delta: {type(exc).__name__}: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != DELTA_FORMAT:
        raise DeltaError(f"{delta_file.name}: delta format {meta.get('format') if isinstance(meta, dict) else meta!r}")
    return meta


def apply_delta(base: Path, delta_file: Path, out: Path, expected_sha256: str) -> str:
    """Build the delta's version from folder `base` into folder `out` (created); return its result digest.

    Raises DeltaError, leaving `out` for the caller to delete, when the base is not the delta's (names,
    shapes, side files), the delta is malformed (indices out of range or not increasing, sizes that do not
    match), or the result's digest is not `expected_sha256` (the trainer's word, not the sender's)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    meta = read_delta_meta(delta_file)
    try:
        layout = {str(f): list(names) for f, names in meta["layout"].items()}
        entries = dict(meta["changed"])
        sides = {str(p): str(h) for p, h in meta["side_files"].items()}
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise DeltaError(f"delta layout unreadable: {exc}") from None
    have = folder_layout(base)
    if have != layout:
        raise DeltaError("the delta's base has other tensors than the version held here")
    held_sides = side_files(base)
    for path, sha in sides.items():
        if held_sides.get(path) != sha:
            raise DeltaError(f"side file {path} differs from the version held here")
    unknown = set(entries) - {n for names in layout.values() for n in names}
    if unknown:
        raise DeltaError(f"the delta changes tensor {sorted(unknown)[0]}, which the layout does not name")
    out.mkdir(parents=True, exist_ok=True)
    dz = _zstd().ZstdDecompressor()
    try:
        with safe_open(str(delta_file), framework="pt") as dst:
            for fname, names in layout.items():
                tensors = {}
                with safe_open(str(base / fname), framework="pt") as st:
                    for name in names:
                        t = st.get_tensor(name)
                        if name in entries:
                            t = t.clone()
                            _patch(t, name, entries[name], dst, dz)
                        tensors[name] = t
                save_file(tensors, str(out / fname), metadata={"format": "pt"})
                del tensors  # one file's tensors in memory at a time
    except SafetensorError as exc:
        raise DeltaError(f"delta unreadable: {exc}") from None
    for path in sides:
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(base / path, out / path)
    got = folder_digest(out)
    if got != expected_sha256:
        raise DeltaError(f"the result's digest {got[:16]}... is not the version's {expected_sha256[:16]}...")
    return got


def _patch(t: torch.Tensor, name: str, entry: dict, dst, dz) -> None:
    """Write the delta's changed elements of tensor `name` into `t` (a fresh copy), checking every bound."""
    try:
        count, gap_name = int(entry["count"]), str(entry["gaps"])
        gap_type = {g[0]: g[1] for g in _GAP_DTYPES}[gap_name]
        gaps_blob = dst.get_tensor(f"{name}|gaps").numpy().tobytes()
        values_blob = dst.get_tensor(f"{name}|values").numpy().tobytes()
    except Exception as exc:  # noqa: BLE001 - any malformed entry is the delta's fault, named in one line
        raise DeltaError(f"delta entry for {name} unreadable: {type(exc).__name__}: {exc}") from None
    itemsize = np.dtype(gap_type).itemsize
    if not 0 < count <= t.numel():
        raise DeltaError(f"delta entry for {name}: {count} changes in a tensor of {t.numel()}")
    try:
        # Bounded output: a crafted frame cannot decompress into more than the entry's own size.
        gaps_raw = dz.decompress(gaps_blob, max_output_size=count * itemsize)
        values_raw = dz.decompress(values_blob, max_output_size=count * t.element_size())
    except _zstd().ZstdError as exc:
        raise DeltaError(f"delta entry for {name}: {exc}") from None
    if len(gaps_raw) != count * itemsize or len(values_raw) != count * t.element_size():
        raise DeltaError(f"delta entry for {name}: sizes do not match its {count} changes")
    gaps = np.frombuffer(gaps_raw, dtype=gap_type).astype(np.int64)
    if (gaps < 1).any():
        raise DeltaError(f"delta entry for {name}: indices not strictly increasing")
    idx = np.cumsum(gaps) - 1
    if idx[-1] >= t.numel():
        raise DeltaError(f"delta entry for {name}: index {int(idx[-1])} beyond its {t.numel()} elements")
    values = torch.frombuffer(bytearray(values_raw), dtype=t.dtype)
    t.reshape(-1)[torch.from_numpy(idx)] = values
