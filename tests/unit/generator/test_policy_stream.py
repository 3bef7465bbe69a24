"""The streamed policy parser: safetensors files read off arbitrary chunk boundaries into host tensors,
refused in one line as soon as a header or a tensor is wrong (weight_stream)."""

import json
import struct

import pytest
import torch
from safetensors.torch import save

from services.generator.policy_stream import PolicyStream, StreamError


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(37, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g),
        "model.norm.weight": torch.ones(8, dtype=torch.bfloat16),
        "model.empty": torch.empty(0, 4),
    }


def _layout(state) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


def _stream(files: dict[str, bytes], serving, chunk: int, sizes=None) -> dict[str, torch.Tensor]:
    stream = PolicyStream(serving)
    for path, data in files.items():
        stream.open(path, (sizes or {}).get(path, len(data)))
    for path, data in files.items():
        for at in range(0, len(data), chunk):
            stream.write(path, data[at : at + chunk])
    return stream.finish()


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_tensors_arrive_whole_across_any_chunk_boundaries_and_side_files_are_not_kept(chunk):
    state = _state()
    shards = {
        "a.safetensors": save(dict(list(state.items())[:2])),
        "b.safetensors": save(dict(list(state.items())[2:])),
    }
    got = _stream({**shards, "config.json": b"{}"}, _layout(state), chunk)
    assert sorted(got) == sorted(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)


def _header_file(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _bad(state):
    one = dict(state)
    wrong = dict(one, **{"model.norm.weight": torch.ones(9, dtype=torch.bfloat16)})
    unknown = dict(one, **{"model.layers.9.x": torch.ones(2)})
    nan = dict(one)
    nan["model.layers.0.mlp.up_proj.weight"] = nan["model.layers.0.mlp.up_proj.weight"].clone()
    nan["model.layers.0.mlp.up_proj.weight"][3, 3] = float("nan")
    missing = {k: v for k, v in one.items() if k != "model.norm.weight"}
    good = save(one)
    return {
        "wrong shape": ({"m.safetensors": save(wrong)}, "model.norm.weight is \\[9\\], serving \\[8\\]"),
        "unknown": ({"m.safetensors": save(unknown)}, "model.layers.9.x unknown"),
        "NaN": ({"m.safetensors": save(nan)}, "has NaN or inf"),
        "missing": ({"m.safetensors": save(missing)}, "model.norm.weight missing"),
        "twice": ({"a.safetensors": good, "b.safetensors": good}, "in two files"),
        "truncated": ({"m.safetensors": good[:-3]}, "ended before its last tensor"),
        "huge header": ({"m.safetensors": struct.pack("<Q", 1 << 40) + b"{}"}, "a header of"),
        "not JSON": ({"m.safetensors": struct.pack("<Q", 4) + b"{{{{"}, "not JSON"),
        "bad dtype": (
            {"m.safetensors": _header_file({"x": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}, b"\0")},
            "unknown dtype",
        ),
        "offsets past shape": (
            {
                "m.safetensors": _header_file(
                    {"model.norm.weight": {"dtype": "BF16", "shape": [8], "data_offsets": [0, 18]}}, bytes(18)
                )
            },
            "do not fit",
        ),
        "gap": (
            {
                "m.safetensors": _header_file(
                    {"model.norm.weight": {"dtype": "BF16", "shape": [8], "data_offsets": [2, 18]}}, bytes(18)
                )
            },
            "starts at 2",
        ),
        "no weights": ({"config.json": b"{}"}, "no .safetensors"),
    }


@pytest.mark.parametrize("case", sorted(_bad(_state())))
def test_a_malformed_or_unfitting_stream_is_refused_in_one_line(case):
    state = _state()
    files, message = _bad(state)[case]
    sizes = {"m.safetensors": len(save(state))} if case == "truncated" else None  # the manifest's size
    with pytest.raises(StreamError, match=message) as info:
        _stream(files, _layout(state), 64, sizes)
    assert "\n" not in str(info.value)


def test_an_unfitting_tensor_is_refused_from_the_header_before_its_bytes_arrive():
    state = _state()
    wrong = dict(state, **{"model.norm.weight": torch.ones(9, dtype=torch.bfloat16)})
    data = save(wrong)
    n = struct.unpack("<Q", data[:8])[0]
    stream = PolicyStream(_layout(state))
    stream.open("m.safetensors", len(data))
    with pytest.raises(StreamError, match="does not fit"):
        stream.write("m.safetensors", data[: 8 + n])  # the header only
