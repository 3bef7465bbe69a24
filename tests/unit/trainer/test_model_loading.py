"""Loading a model folder: every missing or mismatched file is one clear ModelLoadError."""

import json
import shutil

import pytest

from trainer.model_io import ModelLoadError, load_model, load_tokenizer


@pytest.fixture
def folder(tiny_dir, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_dir, copy)
    return copy


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _fails(folder, fragment):
    with pytest.raises(ModelLoadError) as info:
        load_model(folder)
    message = str(info.value)
    assert fragment in message and "\n" not in message and str(folder) in message
    return message


def test_a_good_folder_loads_with_the_sparse_attention_installed(folder):
    model = load_model(folder)
    assert model.config._attn_implementation == "sparrow_block_sparse" and not model.training


def test_missing_folder(tmp_path):
    _fails(tmp_path / "nowhere", "no such model folder")


def test_missing_config(folder):
    (folder / "config.json").unlink()
    _fails(folder, "missing config.json")


def test_unreadable_config(folder):
    (folder / "config.json").write_text("{not json")
    _fails(folder, "cannot read the config")


def test_missing_weights(folder):
    (folder / "model.safetensors").unlink()
    _fails(folder, "missing model weights (model.safetensors or model.safetensors.index.json)")


def test_corrupt_weights(folder):
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    _fails(folder, "not a readable safetensors file")


def test_weights_of_the_wrong_shape(folder):
    _edit_config(folder, intermediate_size=96)
    message = _fails(folder, "weights do not fit config.json")
    assert "[128, 64] in the weights" in message and "[96, 64]" in message


def test_weights_lacking_tensors_the_config_needs(folder):
    # transformers alone would fill the fifth layer with random values and carry on
    _edit_config(folder, num_hidden_layers=5, layer_types=["full_attention"] * 5)
    _fails(folder, "the weights lack 11 tensor(s) the config needs, e.g. model.layers.4.")


def test_weights_with_tensors_the_config_has_no_place_for(folder):
    _edit_config(folder, num_hidden_layers=3, layer_types=["full_attention"] * 3)
    _fails(folder, "tensor(s) the config has no place for, e.g. model.layers.3.")


def test_sharded_weights_load_and_a_missing_shard_is_named(folder, tmp_path):
    from transformers import Qwen3ForCausalLM

    sharded = tmp_path / "sharded"
    Qwen3ForCausalLM.from_pretrained(folder).save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    load_model(sharded)
    next(sharded.glob("model-*.safetensors")).unlink()
    _fails(sharded, "missing weight shard")


def test_missing_tokenizer(folder):
    with pytest.raises(ModelLoadError, match="missing tokenizer files"):
        load_tokenizer(folder)


def test_a_saved_tokenizer_loads(folder):
    from offline.tokenizer import save_tokenizer

    save_tokenizer(folder)
    tok = load_tokenizer(folder)
    assert tok.eos_token_id is not None and tok("kab dop")["input_ids"][0] == tok.bos_token_id
