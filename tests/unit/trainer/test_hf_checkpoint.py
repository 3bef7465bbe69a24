"""A policy written a tensor at a time (trainer/hf_checkpoint.py) is the checkpoint `save_pretrained` writes."""

import copy
import json
import weakref

import pytest
import torch
from safetensors import safe_open

import trainer.hf_checkpoint as hf_checkpoint
from trainer.hf_checkpoint import INDEX_NAME, plan, save_config, write_checkpoint
from trainer.model_io import ModelLoadError, load_model

ONE_FILE, SEVERAL = 50 * 10**9, 6000  # save_pretrained's default; a tiny model then spans about 20 files


@pytest.fixture(scope="module")
def models(tmp_path_factory, make_tiny):
    """tied and untied: loaded as the trainer loads them; fresh: built from a config, never loaded (transformers
    then keeps the parameters' order where a loaded model's names are sorted, and so splits them otherwise)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = {}
    for kind, tied in (("tied", True), ("untied", False)):
        folder = tmp_path_factory.mktemp(kind)
        make_tiny(folder, seed=3, tie_word_embeddings=tied)
        out[kind] = load_model(folder)
    torch.manual_seed(5)
    out["fresh"] = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    with torch.no_grad():
        for model in out.values():  # values that bf16 rounds, so a cast left out would show
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
    return out


def _written(model, folder, dtype, shard_bytes):
    folder.mkdir()
    write_checkpoint(model, folder, dtype, shard_bytes)
    save_config(model, folder)
    return folder


@pytest.mark.parametrize("shard_bytes", [ONE_FILE, SEVERAL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["tied", "untied", "fresh"])
def test_the_files_are_save_pretrained_s_byte_for_byte(models, tmp_path, kind, dtype, shard_bytes):
    """Proves: for the model cast to the serving dtype, save_pretrained's file names, each .safetensors file
    byte for byte (names, dtypes, shapes, offsets, values), its index json, and its config apart from the dtype
    (the publish sets that); several files when the shard size forces them."""
    model = models[kind]
    reference = tmp_path / "reference"
    copy.deepcopy(model).to(dtype).save_pretrained(reference, max_shard_size=shard_bytes)
    ours = _written(model, tmp_path / "ours", dtype, shard_bytes)
    names = sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == names
    assert (INDEX_NAME in names) == (shard_bytes == SEVERAL) and len(names) > (10 if shard_bytes == SEVERAL else 2)
    for name in names:
        if name == "config.json":
            mine, theirs = (json.loads((f / name).read_text()) for f in (ours, reference))
            assert mine["dtype"] == "float32" and {**mine, "dtype": theirs["dtype"]} == theirs
        else:
            assert (ours / name).read_bytes() == (reference / name).read_bytes(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_the_files_hold_each_tensor_once_in_the_serving_dtype_and_load_back(models, tmp_path, kind, dtype):
    """Proves: every tensor of the model, cast, under its own name and nowhere twice (a tied head goes out
    once, as `model.embed_tokens.weight`, in bf16 too), readable by safetensors and by from_pretrained."""
    model = models[kind]
    folder = _written(model, tmp_path / "v", dtype, SEVERAL)
    seen = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 -- safe_open handles have no __iter__
                assert name not in seen
                seen[name] = st.get_tensor(name)
    expected = {n: p.detach().to(dtype) for n, p in model.state_dict().items()}
    if kind == "tied":
        del expected["lm_head.weight"]
    assert seen.keys() == expected.keys()
    assert all(seen[n].dtype == dtype and torch.equal(seen[n], expected[n]) for n in expected)
    index = json.loads((folder / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(expected) and index["metadata"]["total_parameters"] == model.num_parameters()
    loaded = load_model(folder).state_dict()
    assert all(torch.equal(loaded[n], p.detach().to(dtype).float()) for n, p in model.state_dict().items())


def test_each_full_tensor_is_let_go_before_the_next_is_gathered(models, tmp_path, monkeypatch):
    """Proves the writer's memory bound: when a tensor is gathered, no earlier one is still alive."""
    real, alive = hf_checkpoint.full_tensor, []

    def watched(t, dtype):
        assert not [r for r in alive if r() is not None], "an earlier full tensor is still held"
        result = real(t, dtype)
        alive.append(weakref.ref(result))
        return result

    monkeypatch.setattr(hf_checkpoint, "full_tensor", watched)
    layout = _written(models["untied"], tmp_path / "v", torch.bfloat16, SEVERAL)
    assert len(alive) == len(list(_names(layout)))


def test_a_failed_write_still_walks_every_tensor_then_raises(models, tmp_path, monkeypatch):
    """Proves: a write that fails (here the first file cannot be created) does not stop the walk, so the
    other ranks are never left waiting inside a gather; the error comes out at the end."""
    model = models["tied"]
    layout = plan(model, torch.bfloat16, SEVERAL)
    out = tmp_path / "v"
    (out / layout.files[0].name).mkdir(parents=True)  # a folder where the file should go
    gathered = []
    real = hf_checkpoint.full_tensor
    monkeypatch.setattr(hf_checkpoint, "full_tensor", lambda t, d: gathered.append(d) or real(t, d))
    with pytest.raises(IsADirectoryError):
        write_checkpoint(model, out, torch.bfloat16, SEVERAL)
    assert len(gathered) == sum(len(f.entries) for f in layout.files) and not (out / INDEX_NAME).exists()


def test_a_rank_without_a_folder_gathers_and_writes_nothing(models, tmp_path):
    """Proves: the other ranks' call (no folder) walks the same layout and leaves no file anywhere."""
    layout = write_checkpoint(models["tied"], None, torch.bfloat16, SEVERAL)
    assert layout == plan(models["tied"], torch.bfloat16, SEVERAL) and len(layout.files) > 10
    assert not list(tmp_path.iterdir())


def _names(folder):
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            yield from st.keys()


def test_a_model_whose_weights_transformers_fuses_on_save_is_refused_in_one_line():
    """Proves: a model saved under other names than its parameters (Qwen3-MoE's fused experts, split per expert
    on save) is refused before any gather with a ModelLoadError naming a tensor, never written wrongly."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=2,
        num_experts_per_tok=1,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape))
    with pytest.raises(ModelLoadError, match=r"^Qwen3MoeForCausalLM: transformers renames or fuses .*experts") as err:
        plan(model, torch.bfloat16, ONE_FILE)
    assert "\n" not in str(err.value)
