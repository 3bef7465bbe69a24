"""engine.tensor_parallel_size: what happens before vLLM starts (the check of the model's heads, the CPU workers'
thread binding) and the buckets a streamed version reaches the workers in. Two workers decoding for real:
tests/integration/generator/test_vllm_tensor_parallel.py."""

import json

import pytest
import torch

from services.generator import vllm_engine
from services.generator.engine import EngineError
from services.generator.vllm_engine import check_tensor_parallel, load_buckets


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


def test_a_streamed_version_is_cut_into_buckets_in_order_each_tensor_whole():
    tensors = {f"t{i}": torch.zeros(n, dtype=torch.bfloat16) for i, n in enumerate([100, 300, 50, 600, 10])}
    buckets = load_buckets(tensors, 800)  # bytes: 200, 600 | 100 | 1200 (alone, past the limit) | 20
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert all(t is tensors[name] for b in buckets for name, t in b)  # no copies
    assert load_buckets(tensors, 1 << 30) == [list(tensors.items())]


def test_cpu_workers_get_a_share_of_the_cpus_each_unless_the_user_bound_them(monkeypatch):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the binding is for vLLM's CPU backend")
    monkeypatch.setattr(vllm_engine.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    vllm_engine._bind_cpu_workers(2)
    assert vllm_engine.os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    vllm_engine._bind_cpu_workers(2)
    assert vllm_engine.os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    with pytest.raises(EngineError, match="tensor_parallel_size 8 needs a CPU per worker; this process has 5"):
        vllm_engine._bind_cpu_workers(8)
