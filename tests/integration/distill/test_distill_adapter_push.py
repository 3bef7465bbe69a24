"""Adapters from the trainer's DistillSparse step to a generator, through the real WeightService and weight_fetch,
on the reference engine (the project's paged decode loop, no vLLM; tests/integration/distill/test_distill_vllm.py
does the same on vLLM): the generator's sparse + LoRA logprobs are the trainer's teacher-forced ones, and a
corrupt adapter (bad sha256 in transit, NaN, a rank above the engine's limit) is refused while the previous one
keeps serving."""

import random

import pytest
import torch
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file, save_file

from services.generator.engine import EngineError
from services.generator.reference_engine import ReferenceEngine
from services.generator.weight_fetch import WeightFetchError
from services.trainer.config import DistillSection
from services.trainer.distill_step import DistillStep
from services.trainer.weights import ADAPTER
from sparrow.schedule import Schedule
from sparrow.tasks.chain import ChainTask
from sparrow.tasks.vocab import encode_words
from sparrow.work import PromptGroup, Sampling
from tests.integration.distill.adapter_push import as_rollouts, max_diff, swaps, version_sync, weight_service
from tests.unit.generator.tiny_models import TINY
from trainer.distill import BlockRule
from trainer.grpo import GRPOConfig
from trainer.model_io import load_model

torch.set_num_threads(1)
# Every layer sparse, 3 pages kept over prompts of 65 tokens and more: selection at every decode step.
SCHEDULE = Schedule(budgets=(48,), bin_width=4096, dense_layers=(), version=3, name="push")
RULE = BlockRule.of(SCHEDULE)


def _step(rank: int = 4, seed: int = 0) -> DistillStep:
    section = DistillSection(enabled=True, rank=rank, alpha=2.0 * rank, backend="torch", dense_layers=[], seed=seed)
    step = DistillStep(section, load_model(TINY), CollectorRegistry(), GRPOConfig(), 1.0, 64, 4)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a trained-looking adapter: B away from zero, so it changes every output
        for p in step.distill.lora_params:
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return step


def _group(gid: str, seed: int) -> PromptGroup:
    prompt = [1, *encode_words(ChainTask(20, 6, 6).sample(random.Random(seed)).prompt)]
    return PromptGroup(gid, tuple(prompt), 2, 0, Sampling(max_new_tokens=30))


def _generate(engine, gid: str, seed: int):
    engine.submit(_group(gid, seed))
    out = []
    while engine.in_flight:
        out.extend(engine.step())
    return out


@pytest.fixture
def engine():
    eng = ReferenceEngine(TINY, kernel_backend="torch", max_model_len=256, max_lora_rank=8, seed=1)
    eng.set_schedule(SCHEDULE)
    yield eng
    eng.close()


def test_a_published_adapter_serves_sparse_lora_logprobs_equal_to_the_trainers_and_corrupt_ones_are_refused(
    engine, tmp_path
):
    trainer = _step()
    with weight_service(tmp_path / "trainer") as (store, address):
        sync, metrics = version_sync(engine, address, tmp_path / "generator")
        assert trainer.publish(store, policy_version=1, step=1) == 1
        assert sync.load_now(0, 1).adapter_version == 1
        first = _generate(engine, "a", 1)
        assert all(s.versions.adapter_version == 1 for s in first)
        assert any(0 < b < 65 for s in first for b in s.kv_budgets)  # decoded sparsely
        mine = trainer.distill.logprobs(as_rollouts(first), RULE)
        assert max_diff(mine, first) <= 1e-4
        assert max_diff(trainer.distill.logprobs(as_rollouts(first), RULE, adapter=False), first) > 1e-2

        # 1. Bad sha256 in transit: a byte of the stored file flips after its manifest was written.
        with torch.no_grad():
            trainer.distill.lora_params[0].mul_(2.0)
        assert trainer.publish(store, 1, 2) == 2
        stored = store.folder(ADAPTER, 2) / "adapter_model.safetensors"
        data = bytearray(stored.read_bytes())
        data[len(data) // 2] ^= 0xFF
        stored.write_bytes(bytes(data))
        with pytest.raises(WeightFetchError, match="sha256"):
            sync.load_now(0, 2)
        assert not (tmp_path / "generator" / "adapter-v2").exists()

        # 2. NaN inside a well-formed, correctly hashed adapter.
        trainer.distill.save_adapter(tmp_path / "nan")
        tensors = load_file(tmp_path / "nan" / "adapter_model.safetensors")
        tensors[next(iter(tensors))][0, 0] = float("nan")
        save_file(tensors, tmp_path / "nan" / "adapter_model.safetensors")
        store.publish_adapter(tmp_path / "nan", 3, 4, ["q_proj", "k_proj", "v_proj", "o_proj"])
        with pytest.raises(EngineError, match="NaN"):
            sync.load_now(0, 3)

        # 3. A rank above the generator's max_lora_rank.
        wide = _step(rank=16, seed=2)
        wide.adapter_version = 3
        assert wide.publish(store, 1, 3) == 4
        with pytest.raises(EngineError, match="rank 16"):
            sync.load_now(0, 4)

        assert engine.versions.adapter_version == 1 and swaps(metrics, "refused") == 3 and swaps(metrics, "ok") == 1
        with torch.no_grad():
            trainer.distill.lora_params[0].div_(2.0)  # back to the adapter v1 holds
        later = _generate(engine, "b", 2)
        assert all(s.versions.adapter_version == 1 for s in later)
        assert max_diff(trainer.distill.logprobs(as_rollouts(later), RULE), later) <= 1e-4


def test_a_replaced_adapter_folder_goes_once_the_engine_no_longer_needs_it(engine, tmp_path):
    # The reference engine reads an adapter whole when it loads it: the old folder goes at the swap.
    # While the engine cannot say what it needs (its loop stopping), replaced folders are kept until it can.
    steps = [_step(seed=10 + i) for i in range(3)]
    with weight_service(tmp_path / "trainer") as (store, address):
        sync, _ = version_sync(engine, address, tmp_path / "generator")
        for i, s in enumerate(steps):
            s.adapter_version = i
            assert s.publish(store, 1, i + 1) == i + 1
        assert sync.load_now(0, 1).adapter_version == 1
        assert sync.load_now(0, 2).adapter_version == 2
        folders = sorted(p.name for p in (tmp_path / "generator").iterdir())
        assert folders == ["adapter-v2"] and sync.sweep() == []

        def unknown() -> set:
            raise RuntimeError("the generator loop has stopped")

        sync.in_use = unknown
        assert sync.load_now(0, 3).adapter_version == 3
        assert sync.sweep() == [tmp_path / "generator" / "adapter-v2"]  # kept: nobody could say
        sync.in_use = engine.adapter_folders_in_use
        assert sync.sweep() == [] and sorted(p.name for p in (tmp_path / "generator").iterdir()) == ["adapter-v3"]
