"""The vLLM plugin's pure parts: version check, layer names, the cache split, recorded budgets, adapter checks."""

from __future__ import annotations

import json

import pytest
import torch

from services.generator.plugin import UnsupportedVllmError, check_vllm_version


def test_version_check_names_the_supported_line():
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.3")
    with pytest.raises(UnsupportedVllmError, match=r"supports vLLM 0\.32\.x; found 0\.33\.0"):
        check_vllm_version("0.33.0")


def test_layer_index_and_cache_split():
    from services.generator.plugin.sparse_impl import layer_index_of, split_kv_cache

    assert layer_index_of("model.layers.3.self_attn.attn") == 3
    with pytest.raises(ValueError, match="layer number"):
        layer_index_of("lm_head")
    cache = torch.arange(2 * 3 * 32 * 8, dtype=torch.float32).view(2, 3, 32, 8)  # [nb, h, bs, 2d]
    k, v = split_kv_cache(cache)
    assert k.shape == v.shape == (2, 3, 32, 4) and k.is_contiguous() and v.is_contiguous()
    assert k.data_ptr() == cache.data_ptr() and v.data_ptr() == cache.data_ptr() + cache.numel() // 2 * 4
    with pytest.raises(RuntimeError, match="contiguous"):
        split_kv_cache(cache.transpose(0, 1))


def test_recorded_plan_places_each_budget_at_the_producing_position():
    from trainer.sparse_attention import recorded_plan

    plan = recorded_plan([5], [[0, 32, 48, 0]], 9, backend="torch")
    every = 1  # 9 positions -> 1 page
    assert plan.budgets.tolist() == [[every] * 4 + [every, 2, 3, every, every]]
    with pytest.raises(ValueError, match="multiples of 16"):
        recorded_plan([5], [[0, 20]], 9)
    with pytest.raises(ValueError, match="do not fit"):
        recorded_plan([5], [[0] * 6], 9)


def test_adapter_check_refuses_bad_rank_nan_and_shape(tmp_path):
    from safetensors.torch import save_file

    from services.generator.engine import EngineError
    from services.generator.weight_checks import check_adapter

    def adapter(name, rank, a, b):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 8}))
        save_file({"x.q_proj.lora_A.weight": a, "x.q_proj.lora_B.weight": b}, d / "adapter_model.safetensors")
        return d

    check_adapter(adapter("ok", 4, torch.zeros(4, 64), torch.zeros(64, 4)), max_rank=8)
    with pytest.raises(EngineError, match="rank 16 is not in"):
        check_adapter(adapter("big", 16, torch.zeros(16, 64), torch.zeros(64, 16)), max_rank=8)
    bad = torch.zeros(64, 4)
    bad[0, 0] = float("nan")
    with pytest.raises(EngineError, match="NaN"):
        check_adapter(adapter("nan", 4, torch.zeros(4, 64), bad), max_rank=8)
    with pytest.raises(EngineError, match="does not match rank"):
        check_adapter(adapter("shape", 4, torch.zeros(2, 64), torch.zeros(64, 4)), max_rank=8)
    with pytest.raises(EngineError, match="adapter_config.json"):
        check_adapter(tmp_path, max_rank=8)


def test_bench_engine_commands_refuse_bad_input_in_one_line(tmp_path):
    from tests.cli_runner import sparrow

    r = sparrow("bench", "parity", "--model", str(tmp_path))
    assert r.returncode == 2 and "no config.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = sparrow("bench", "parity", "--tensor-parallel-size", "0")
    assert r.returncode == 2 and "--tensor-parallel-size must be positive" in r.stderr
    r = sparrow("bench", "parity", "--tensor-parallel-size", "3")  # small has 4 heads (2 KV): one line, no engine
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "tensor_parallel_size 3 does not divide the model's 4 attention heads" in r.stderr
    r = sparrow("bench", "rollout", "--model", "models/small", "--schedule", "no-such-preset", "--gen-len", "0")
    assert r.returncode == 2 and "--gen-len must be positive" in r.stderr
    r = sparrow("bench", "rollout", "--schedule", "qwen3-1.7b-0.86", "--static-decode")
    assert r.returncode == 2 and "add --compile" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # The engine's own refusal (this machine's vLLM runs on CPU) is one line too.
    r = sparrow("bench", "rollout", "--schedule", "qwen3-1.7b-0.86", "--static-decode", "--compile", "--gen-len", "8")
    assert r.returncode == 2 and "needs a CUDA engine" in r.stderr.strip().splitlines()[-1]


def test_probe_rows_take_the_probe_budget_by_request_id_and_the_rest_the_schedule():
    from services.generator.plugin.scheduled_decode import PROBE_PREFIX, ScheduledDecode
    from sparrow.schedule import Schedule

    impl = ScheduledDecode()
    impl.set_schedule(Schedule(budgets=(64, 128), bin_width=100))
    seq_lens = torch.tensor([50, 150, 150, 50])
    assert impl.budget_pages(seq_lens).tolist() == [4, 8, 8, 4]
    ids = ["seq:a-1", f"{PROBE_PREFIX}b-2", "seq:c-3", f"{PROBE_PREFIX}d-4"]
    with pytest.raises(ValueError, match="row_ids"):
        impl.set_probe([3, 5])
    impl.set_probe([3, 5], lambda: ids)
    assert impl.budget_pages(seq_lens).tolist() == [4, 5, 8, 3]
    # A subset of the batch's rows (decode rows of a mixed step), by their batch row.
    assert impl.budget_pages(seq_lens[[1, 3]], torch.tensor([1, 3])).tolist() == [5, 3]
    assert impl.budget_pages(seq_lens[[0, 2]], torch.tensor([0, 2])).tolist() == [4, 8]
    ids[1] = "seq:b-2"  # the batch changed (a row was refilled): read again, not cached by position
    assert impl.budget_pages(seq_lens).tolist() == [4, 8, 8, 3]
    ids[3] = "seq:d-4"  # no probe row left in the batch, step after step
    for _ in range(2):
        assert impl.budget_pages(seq_lens).tolist() == [4, 8, 8, 4]
        assert impl.budget_pages(seq_lens[[1, 3]], torch.tensor([1, 3])).tolist() == [8, 4]
    impl.set_probe(None)
    assert impl.budget_pages(seq_lens).tolist() == [4, 8, 8, 4]


def test_host_bounds_follow_the_schedule_and_the_probe_rows():
    # The sizes a CUDA decode step takes from the host instead of the GPU: the longest row and the
    # most pages a row selects, the same as the device-side budgets give, probe rows included.
    from kernels import DecodeBounds, num_pages
    from services.generator.plugin.scheduled_decode import PROBE_PREFIX, ScheduledDecode
    from sparrow.schedule import Schedule

    impl = ScheduledDecode()
    impl.set_schedule(Schedule(budgets=(64, 128), bin_width=100))
    lens = torch.tensor([50, 150, 150, 50])

    def on_device():  # what the kernels would have read from the device
        bounds, budgets = impl.host_plan(lens, lens.device)
        assert torch.equal(budgets, impl.budget_pages(lens))  # the same budgets, worked out on the host
        return int(torch.minimum(num_pages(lens), impl.budget_pages(lens)).max())

    assert impl.host_bounds(lens) == DecodeBounds(150, 8) and on_device() == 8
    twin = ScheduledDecode()  # another layer of the same worker and step: the same plan, its budgets copied once
    twin.context = impl.context
    twin.set_schedule(impl.schedule)
    assert twin.host_plan(lens, lens.device)[1] is impl.host_plan(lens, lens.device)[1]
    ids = ["seq:a-1", f"{PROBE_PREFIX}b-2", "seq:c-3", f"{PROBE_PREFIX}d-4"]
    impl.set_probe([3, 9], lambda: ids)
    assert impl.host_bounds(lens) == DecodeBounds(150, 9) and on_device() == 9
    ids[1] = "seq:b-2"  # the same step's lengths, another batch: not the cached bounds
    assert impl.host_bounds(lens) == DecodeBounds(150, 8) and on_device() == 8
    impl.set_schedule(Schedule(budgets=(48, 64), bin_width=100))
    assert impl.host_bounds(lens) == DecodeBounds(150, 4) and on_device() == 4
    impl.set_probe([2, 9], lambda: ids)  # row d (4 pages) would get 2, short of the sink and local pages
    with pytest.raises(ValueError, match="fewer than 3 pages"):
        impl.host_bounds(lens)
    impl.set_probe(None)
    impl.set_schedule(None)
    assert impl.host_bounds(lens) == DecodeBounds(150, 0)
    with pytest.raises(ValueError, match="not for a subset"):
        impl.decode_rows(None, None, None, None, lens, rows=torch.tensor([0]), seq_lens_cpu=lens)


def test_dense_rows_take_every_page_beside_scheduled_and_probe_rows():
    # Evaluation samples decode densely whatever the schedule, in the batch beside the sparse ones: their
    # budget is their whole page count, on the device path (CPU) and the host plan (CUDA) alike.
    from kernels import DecodeBounds, num_pages
    from services.generator.plugin.scheduled_decode import DENSE_PREFIX, PROBE_PREFIX, ScheduledDecode
    from sparrow.schedule import Schedule

    impl = ScheduledDecode()
    impl.set_schedule(Schedule(budgets=(64, 128), bin_width=100))
    lens = torch.tensor([50, 150, 150, 300, 150])
    ids = ["seq:a-1", f"{DENSE_PREFIX}b-2", f"{PROBE_PREFIX}c-3", f"{DENSE_PREFIX}d-4", "seq:e-5"]
    impl.context.dense_row_ids = lambda: ids
    impl.set_probe([3, 5], lambda: ids)
    want = [4, 10, 5, 19, 8]  # b: 150 tokens in 10 pages, d: 300 in 19; the probe and the schedule's rows unchanged
    assert impl.budget_pages(lens).tolist() == want
    assert impl.budget_pages(lens[[1, 4]], torch.tensor([1, 4])).tolist() == [10, 8]
    bounds, budgets = impl.host_plan(lens, lens.device)
    assert budgets.tolist() == want and bounds == DecodeBounds(300, int(num_pages(lens).max()))
    ids[3] = "seq:d-4"  # the dense row finished and another took its place
    assert impl.budget_pages(lens).tolist() == [4, 10, 5, 8, 8]
    assert impl.host_plan(lens, lens.device)[1].tolist() == [4, 10, 5, 8, 8]
    impl.set_probe(None)
    assert impl.budget_pages(lens).tolist() == [4, 10, 8, 8, 8]
    impl.context.dense_row_ids = None  # not tracked: every row follows the schedule
    assert impl.budget_pages(lens).tolist() == [4, 8, 8, 8, 8]


def test_layers_share_rows_and_plans_only_through_their_workers_context():
    from types import SimpleNamespace

    from services.generator.plugin.scheduled_decode import PROBE_PREFIX, ScheduledDecode
    from services.generator.plugin.worker_ext import SparrowWorkerExtension
    from sparrow.schedule import Schedule

    alone, other = ScheduledDecode(), ScheduledDecode()
    alone.set_probe([3, 5], lambda: [f"{PROBE_PREFIX}a"])
    assert alone.context.current_probe_row_ids() == [f"{PROBE_PREFIX}a"]
    assert other.context is not alone.context and other.context.current_probe_row_ids() is None

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.impl = ScheduledDecode()

    model = torch.nn.Sequential(Layer(), Layer())
    worker = SparrowWorkerExtension()
    worker.model_runner = SimpleNamespace(get_model=lambda: model, input_batch=SimpleNamespace(req_ids=["dense:x"]))
    assert worker.sparrow_track_rows() == 2
    first, second = (layer.impl for layer in model)
    assert first.context is second.context and first.context.current_dense_row_ids() == ["dense:x"]
    assert alone.context.current_dense_row_ids() is None  # another worker's layer (or none) sees nothing of it
    first.set_schedule(Schedule(budgets=(64, 128), bin_width=100))
    second.set_schedule(first.schedule)
    lens = torch.tensor([50, 150])
    assert first.host_plan(lens, lens.device)[1] is second.host_plan(lens, lens.device)[1]
    assert alone.context.last_plan is None
    another = SparrowWorkerExtension()
    another.model_runner = SimpleNamespace(get_model=lambda: torch.nn.Sequential(Layer()))
    assert another.sparrow_attention_layers() == 1 and another._sparrow_context() is not worker._sparrow_context()
