"""engine.tensor_parallel_size: the check of the model's heads before vLLM starts (TP itself runs on a GPU only)."""

import json

import pytest

from services.generator.engine import EngineError
from services.generator.vllm_engine import check_tensor_parallel


def _model(tmp_path, heads: int, kv_heads: int | None, nested: bool = False):
    config = {"num_attention_heads": heads}
    if kv_heads is not None:
        config["num_key_value_heads"] = kv_heads
    (tmp_path / "config.json").write_text(json.dumps({"text_config": config} if nested else config))
    return str(tmp_path)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_sizes_that_divide_every_head_count_pass(tmp_path, size):
    check_tensor_parallel(_model(tmp_path, 32, 8), size)  # Qwen3-8B: 32 heads, 8 KV heads


@pytest.mark.parametrize(
    "heads, kv_heads, size, message",
    [
        (32, 8, 16, "16 does not divide the model's 8 KV heads"),  # vLLM would replicate KV heads
        (32, 8, 3, "3 does not divide the model's 32 attention heads"),
        (40, 8, 5, "5 does not divide the model's 8 KV heads"),  # Qwen3-14B: 40 / 8
        (12, None, 8, "8 does not divide the model's 12 attention heads"),  # no KV heads named: as many as heads
    ],
)
def test_sizes_that_split_a_head_are_refused_in_one_line(tmp_path, heads, kv_heads, size, message):
    with pytest.raises(EngineError, match=message) as info:
        check_tensor_parallel(_model(tmp_path, heads, kv_heads), size)
    assert "\n" not in str(info.value)


def test_a_multimodal_config_is_read_from_its_text_config_and_an_unreadable_one_refused(tmp_path):
    with pytest.raises(EngineError, match="2 does not divide the model's 3 KV heads"):
        check_tensor_parallel(_model(tmp_path, 6, 3, nested=True), 2)
    with pytest.raises(EngineError, match="cannot read"):
        check_tensor_parallel(str(tmp_path / "none"), 2)
    check_tensor_parallel(str(tmp_path / "none"), 1)  # one worker needs nothing of the config
