"""The policy written as an HF checkpoint straight from its parameters (FSDP2 shards or whole), a tensor at a time.

`save_pretrained` wants the whole state dict in one process: under FSDP2 that is every full tensor
gathered onto rank 0's host (32 GB for Qwen3-8B in fp32), and for a bf16 version a cast copy beside
it. Here the layout comes first, from the parameters' global shapes alone: the names and order
`save_pretrained` would write, split into files of at most `max_shard_bytes` by the same rule
(huggingface_hub's), and each file's safetensors header with every offset. Then every rank walks the
same tensors in the same order: each is cast to the serving dtype where its shard lies (the GPU, when
there is one), gathered whole, and rank 0 appends its bytes to the file it belongs to. Rank 0 holds
one full tensor, in the serving dtype, at a time.

Why `DTensor.full_tensor()` (an all-gather) and not a gather to rank 0: FSDP2 shards dim 0 unevenly
(the last ranks may hold fewer rows, or none), which `full_tensor` undoes and a raw gather would have
to pad and trim; it is the collective FSDP2 itself runs for every forward, on gloo and NCCL alike;
and what it costs the other ranks, one full tensor on the device for a moment, is less than the
whole decoder layer each forward unshards. Casting the shard before the gather halves the bytes on
the wire for a bf16 version and changes no bit (a cast is elementwise).

The files are byte for byte what `save_pretrained` writes for the model cast to the serving dtype:
the same names (a tied head written once, under the name transformers keeps), the same split, file
names and `model.safetensors.index.json`, the tensors of each file in safetensors' own order.
"""

from __future__ import annotations

import copy
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.model_io import ModelLoadError

WEIGHTS_NAME = "model{suffix}.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# safetensors' dtype codes, in the order its writer sorts a file's tensors (then by name): larger first.
_CODES = {
    torch.uint64: "U64",
    torch.int64: "I64",
    torch.float64: "F64",
    torch.float32: "F32",
    torch.uint32: "U32",
    torch.int32: "I32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.uint16: "U16",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ORDER = {code: i for i, code in enumerate(_CODES.values())}


class CheckpointLayoutError(ModelLoadError):
    """A model whose checkpoint cannot be written a tensor at a time (one line naming why).

    A ModelLoadError: the trainer's first publish is part of its start, which ends on it in one line (exit 2)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint: its name (also its key in `model.state_dict()`), dtype and shape on disk."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ShardFile:
    """One .safetensors file: its name, its tensors in the order of their bytes, and its header (length first)."""

    name: str
    entries: tuple[Entry, ...]
    header: bytes

    @property
    def size(self) -> int:
        return len(self.header) + sum(e.nbytes for e in self.entries)


@dataclass(frozen=True)
class Layout:
    """The whole checkpoint: its files in writing order and the index json (None when there is one file)."""

    files: tuple[ShardFile, ...]
    index: dict | None


def serving_dtype(own: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """What a tensor of dtype `own` is written in for a version served in `dtype`: floating ones in `dtype`."""
    return dtype if own.is_floating_point else own


def plan(model: torch.nn.Module, dtype: torch.dtype, max_shard_bytes: int) -> Layout:
    """The checkpoint `save_pretrained` would write for `model` cast to `dtype`, from global shapes only.

    Every rank computes the same layout (it depends on the model's structure, never on its shards).
    CheckpointLayoutError for a model that transformers renames or fuses on save (its conversion
    mapping, e.g. MoE experts), whose tensors are not the parameters' one to one.
    """
    from huggingface_hub import split_state_dict_into_shards_factory
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    params = model.state_dict(keep_vars=True)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        params.pop(key, None)
    # Stand-ins of the global shapes, tied names sharing one (as their tensors do), so that transformers'
    # own rules pick which tied name goes out and in which order the names are split.
    stand_ins: dict[int, torch.Tensor] = {}
    state = {}
    for key, t in params.items():
        if id(t) not in stand_ins:
            stand_ins[id(t)] = torch.empty(t.shape, dtype=serving_dtype(t.dtype, dtype), device="meta")
        state[key] = stand_ins[id(t)]
    state = revert_weight_conversion(model, remove_tied_weights_from_state_dict(state, model))
    for name, t in state.items():
        if name not in params or tuple(t.shape) != tuple(params[name].shape):
            raise CheckpointLayoutError(
                f"{type(model).__name__}: transformers renames or fuses its weights when saving ({name}); "
                "policies are published only from models saved as their parameters (dense Qwen3 and the like)"
            )
        if t.dtype not in _CODES:
            raise CheckpointLayoutError(f"{name}: dtype {t.dtype} has no safetensors code")
    split = split_state_dict_into_shards_factory(
        state,
        get_storage_size=lambda t: t.numel() * t.element_size(),
        filename_pattern=WEIGHTS_NAME,
        max_shard_size=max_shard_bytes,
    )
    files = []
    for fname, names in split.filename_to_tensors.items():
        entries = sorted(
            (Entry(n, state[n].dtype, tuple(state[n].shape)) for n in names),
            key=lambda e: (_ORDER[_CODES[e.dtype]], e.name),
        )
        files.append(ShardFile(fname, tuple(entries), _header(entries)))
    index = None
    if split.is_sharded:
        index = {
            "metadata": {"total_parameters": model.num_parameters(), **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
    return Layout(tuple(files), index)


def _header(entries: list[Entry]) -> bytes:
    """The length-prefixed JSON header safetensors writes: compact, metadata first, padded with spaces to 8."""
    header: dict = {"__metadata__": {"format": "pt"}}
    at = 0
    for e in entries:
        header[e.name] = {"dtype": _CODES[e.dtype], "shape": list(e.shape), "data_offsets": [at, at + e.nbytes]}
        at += e.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_checkpoint(model: torch.nn.Module, out: Path | None, dtype: torch.dtype, max_shard_bytes: int) -> Layout:
    """Write `model`'s weights in `dtype` as HF safetensors files (and their index) into folder `out`.

    Under torch.distributed every rank calls it, in the same order relative to its other collectives,
    and each tensor is gathered in turn; only the rank given an `out` writes (the others pass None).
    A write that fails (a full disk) stops the writing, not the gathers, so the other ranks are never
    left inside a collective; the error is raised once every tensor went by. Returns the layout.
    """
    layout = plan(model, dtype, max_shard_bytes)
    params = model.state_dict(keep_vars=True)
    failed: OSError | None = None
    for shard in layout.files:
        handle = None
        if out is not None and failed is None:
            try:
                handle = (Path(out) / shard.name).open("wb")
                handle.write(shard.header)
            except OSError as exc:
                failed, handle = exc, _close(handle)
        for entry in shard.entries:
            tensor = full_tensor(params[entry.name], entry.dtype)
            if handle is not None:
                try:
                    handle.write(_raw(tensor.cpu().contiguous()))
                except OSError as exc:
                    failed, handle = exc, _close(handle)
            del tensor  # before the next gather: one full tensor at a time
        if handle is not None:
            assert handle.tell() == shard.size, (shard.name, handle.tell(), shard.size)
            try:
                handle.close()
            except OSError as exc:
                failed = exc
    if failed is not None:
        raise failed
    if out is not None and layout.index is not None:
        (Path(out) / INDEX_NAME).write_text(json.dumps(layout.index, indent=2, sort_keys=True) + "\n")
    return layout


def _close(handle) -> None:
    if handle is not None:
        try:
            handle.close()
        except OSError:
            pass
    return None


def full_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Parameter `t` whole, in `dtype`, where it lies (the GPU under NCCL): a collective when `t` is a DTensor shard."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        t = t.detach()
        if t.dtype != dtype:
            t = t.to(dtype)  # the shard, where it lies: on the GPU, before the copy to host
        if isinstance(t, DTensor):
            mesh_device = t.device_mesh.device_type
            if t.device.type != mesh_device:  # FSDP2's CPU offload keeps shards on the host; NCCL gathers on the GPU
                t = t.to(mesh_device)
            t = t.full_tensor()
        return t


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def save_config(model: torch.nn.Module, out: Path) -> None:
    """config.json and generation_config.json as `save_pretrained` writes them (the model's config untouched)."""
    config = copy.deepcopy(model.config)
    config.dtype = str(model.dtype).split(".")[1]
    # FSDP2 swaps the class for a subclass named FSDP<name>; the checkpoint names the model's own.
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)
