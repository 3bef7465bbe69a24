"""Policy deltas: exact reconstruction checked by the result's digest; malformed deltas refused in one line."""

import json

import pytest
import torch
from safetensors.torch import save_file

from sparrow.weight_delta import (
    DeltaError,
    apply_delta,
    cast_state,
    checkpoint_dtype,
    folder_digest,
    read_delta_meta,
    write_delta,
)


def _master(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=g) * 0.02,
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g) * 0.02,
        "model.layers.0.input_layernorm.weight": torch.ones(64),
        "model.layers.1.mlp.down_proj.weight": torch.randn(64, 128, generator=g) * 0.02,
    }


def _save(folder, state, dtype=torch.bfloat16):
    """A sharded bf16 HF-style folder: two safetensors files, an index, a config and a tokenizer file."""
    folder.mkdir(parents=True, exist_ok=True)
    s = cast_state(state, dtype)
    names = sorted(s)
    save_file({n: s[n].contiguous() for n in names[:2]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({n: s[n].contiguous() for n in names[2:]}, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    (folder / "tokenizer.json").write_text('{"model": {}}')
    return folder


def _step(state, lr=1e-6, seed=1):
    """An Adam-like step: every element moves by about lr (the fp32 master changes everywhere)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v - lr * torch.sign(torch.randn(v.shape, generator=g)) for k, v in state.items()}


def test_a_delta_rebuilds_the_version_exactly_and_is_small_in_bf16(tmp_path):
    m0 = _master()
    m1 = _step(m0)
    base, new = _save(tmp_path / "v1", m0), _save(tmp_path / "v2", m1)
    stats = write_delta(base, new, tmp_path / "d.delta", 1, 2)
    assert stats is not None and 0 < stats.changed < 0.1 * stats.elements  # most updates round to no change
    out = tmp_path / "rebuilt"
    digest = apply_delta(base, tmp_path / "d.delta", out, folder_digest(new))
    assert digest == folder_digest(new) != folder_digest(base)
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json"):
        assert (out / name).is_file()
    meta = read_delta_meta(tmp_path / "d.delta")
    assert (meta["base_version"], meta["version"]) == (1, 2)


def test_in_fp32_every_element_changes(tmp_path):
    m0 = _master()
    base, new = _save(tmp_path / "v1", m0, torch.float32), _save(tmp_path / "v2", _step(m0), torch.float32)
    stats = write_delta(base, new, tmp_path / "d.delta", 1, 2)
    assert stats.changed > 0.99 * stats.elements - 64  # the layernorm ones move too


def test_a_delta_applied_to_another_base_is_refused_by_the_digest(tmp_path):
    m0 = _master()
    base, new = _save(tmp_path / "v1", m0), _save(tmp_path / "v2", _step(m0))
    write_delta(base, new, tmp_path / "d.delta", 1, 2)
    other = _save(tmp_path / "other", _master(seed=5))  # same names and shapes, other weights
    with pytest.raises(DeltaError, match="digest"):
        apply_delta(other, tmp_path / "d.delta", tmp_path / "out", folder_digest(new))


def test_a_base_with_other_tensors_or_side_files_is_refused(tmp_path):
    m0 = _master()
    base, new = _save(tmp_path / "v1", m0), _save(tmp_path / "v2", _step(m0))
    write_delta(base, new, tmp_path / "d.delta", 1, 2)
    short = dict(m0)
    short.pop("model.layers.0.input_layernorm.weight")
    with pytest.raises(DeltaError, match="other tensors"):
        apply_delta(_save(tmp_path / "short", short), tmp_path / "d.delta", tmp_path / "o1", folder_digest(new))
    (base / "config.json").write_text("{}")
    with pytest.raises(DeltaError, match="side file config.json"):
        apply_delta(base, tmp_path / "d.delta", tmp_path / "o2", folder_digest(new))


def _tamper(path, name, blob):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as st:
        tensors = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118
        meta = st.metadata()
    tensors[name] = blob
    save_file(tensors, str(path), metadata=meta)


def test_malformed_deltas_are_refused_in_one_line(tmp_path):
    import numpy as np
    import zstandard

    m0 = _master()
    base, new = _save(tmp_path / "v1", m0), _save(tmp_path / "v2", _step(m0))
    good = folder_digest(new)
    write_delta(base, new, tmp_path / "d.delta", 1, 2)
    name = next(iter(read_delta_meta(tmp_path / "d.delta")["changed"]))
    z = zstandard.ZstdCompressor()
    cases = {
        "bomb": (f"{name}|values", z.compress(b"\0" * (50 << 20)), "sizes do not match|exceed|Zstd|decompress"),
        "not zstd": (f"{name}|gaps", b"garbage bytes", "delta entry"),
        "zero gap": (f"{name}|gaps", None, "not strictly increasing"),
    }
    for case, (key, blob, match) in cases.items():
        path = tmp_path / f"{case}.delta"
        path.write_bytes((tmp_path / "d.delta").read_bytes())
        if blob is None:
            meta = read_delta_meta(path)
            count, gaps = meta["changed"][name]["count"], meta["changed"][name]["gaps"]
            blob = z.compress(np.zeros(count, dtype=gaps).tobytes())
        _tamper(path, key, torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        with pytest.raises(DeltaError, match=match):
            apply_delta(base, path, tmp_path / f"out-{case}", good)
    (tmp_path / "junk.delta").write_bytes(b"not a safetensors file")
    with pytest.raises(DeltaError, match="no readable delta"):
        apply_delta(base, tmp_path / "junk.delta", tmp_path / "out-junk", good)


def test_a_changed_layout_has_no_delta(tmp_path):
    m0 = _master()
    grown = dict(m0, extra=torch.zeros(3))
    assert write_delta(_save(tmp_path / "a", m0), _save(tmp_path / "b", grown), tmp_path / "d", 1, 2) is None


def test_the_checkpoint_dtype_is_read_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    assert checkpoint_dtype(tmp_path / "none") == "float32"
