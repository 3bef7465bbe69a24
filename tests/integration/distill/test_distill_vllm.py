"""DistillSparse adapters on the generator's vLLM engine (vLLM CPU, in this process), pushed the way a cluster
pushes them: the trainer's DistillStep publishes into its WeightStore, the real WeightService streams them, the
generator's weight_fetch verifies and loads them.

- the engine's sparse + LoRA logprobs equal the trainer's teacher-forced sparse + LoRA logprobs (fp32, <= 1e-3)
  under the budgets the engine reported, every layer sparse;
- an adapter pushed while sequences run serves the sequences submitted after it; the running ones keep the
  adapter they started with, to their last token (vLLM pins each request's LoRA);
- a corrupt adapter (a byte flipped on the trainer's disk after publishing, NaN, a rank above the engine's
  max_lora_rank) is refused and the previous adapter keeps serving.
"""

import random

import pytest
import torch
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file, save_file

from services.generator.engine import EngineError
from services.generator.weight_fetch import WeightFetchError
from services.trainer.config import DistillSection
from services.trainer.distill_step import DistillStep
from services.trainer.weights import ADAPTER
from sparrow.schedule import Schedule
from sparrow.tasks.chain import ChainTask
from sparrow.tasks.vocab import encode_words
from sparrow.work import PromptGroup, Sampling
from tests.integration.distill.adapter_push import as_rollouts, max_diff, swaps, version_sync, weight_service
from tests.unit.generator.tiny_models import SMALL
from trainer.distill import BlockRule
from trainer.grpo import GRPOConfig
from trainer.model_io import load_model

pytestmark = pytest.mark.slow

# Every layer sparse, small budgets over 200-token prompts: page selection at every decode step, and the
# adapter's k_proj moves the centroids that selection scores.
SCHEDULE = Schedule(budgets=(48, 64, 80, 96), bin_width=64, dense_layers=(), version=5, name="distill-vllm")
RULE = BlockRule.of(SCHEDULE)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    from services.generator.vllm_engine import VllmEngine, VllmEngineConfig

    eng = VllmEngine(
        VllmEngineConfig(model=str(SMALL), max_model_len=1024, max_num_seqs=8, enable_lora=True, max_lora_rank=8),
        schedule=SCHEDULE,
    )
    yield eng
    eng.close()


def _trainer(seed: int, rank: int = 4) -> DistillStep:
    section = DistillSection(enabled=True, rank=rank, alpha=2.0 * rank, target_modules=TARGETS, dense_layers=[])
    step = DistillStep(section, load_model(SMALL), CollectorRegistry(), GRPOConfig(), 1.0, 128, 8)
    _randomise(step, seed)
    return step


def _randomise(step: DistillStep, seed: int) -> None:
    # What peft's init_lora_weights=False does: B away from zero, so the adapter changes every output.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in step.distill.lora_params:
            p.copy_(0.15 * torch.randn(p.shape, generator=g))


def _group(gid: str, seed: int, n: int = 2, new: int = 60) -> PromptGroup:
    prompt = [1, *encode_words(ChainTask(64, 40, 40).sample(random.Random(seed)).prompt)]
    return PromptGroup(gid, tuple(prompt), n, 0, Sampling(max_new_tokens=new))


def _finish(engine, done: list) -> list:
    while engine.in_flight:
        done.extend(engine.step())
    return sorted(done, key=lambda s: (s.group_id, s.sample_index))


def test_sparse_lora_logprobs_match_the_trainers_and_a_mid_run_push_serves_new_sequences_only(engine, tmp_path):
    first, second = _trainer(seed=1), _trainer(seed=2)
    with weight_service(tmp_path / "trainer") as (store, address):
        sync, metrics = version_sync(engine, address, tmp_path / "generator")
        assert first.publish(store, policy_version=1, step=1) == 1
        assert sync.load_now(0, 1).adapter_version == 1
        engine.submit(_group("early", 1))
        done = [s for _ in range(20) for s in engine.step()]
        second.adapter_version = 1
        assert second.publish(store, 1, 2) == 2
        assert sync.load_now(0, 2).adapter_version == 2  # between two steps, while "early" runs
        engine.submit(_group("late", 2))
        done = _finish(engine, done)
    early = [s for s in done if s.group_id == "early"]
    late = [s for s in done if s.group_id == "late"]
    assert [s.versions.adapter_version for s in early] == [1, 1]
    assert [s.versions.adapter_version for s in late] == [2, 2]
    assert all(len(s.token_ids) > 20 for s in early)  # they did run past the push
    for s in done:
        plen = len(s.prompt_token_ids)
        assert all(0 < b < plen + t for t, b in enumerate(s.kv_budgets) if t >= 1)  # every decode step sparse
    # The trainer's teacher-forced sparse + LoRA forward, under the budgets the engine reported.
    assert max_diff(first.distill.logprobs(as_rollouts(early), RULE), early) <= 1e-3
    assert max_diff(second.distill.logprobs(as_rollouts(late), RULE), late) <= 1e-3
    # The running sequences kept adapter 1 to the end: adapter 2 would score their later tokens otherwise.
    tail = [
        (lp[20:] - torch.tensor(s.logprobs[20:])).abs().max()
        for lp, s in zip(second.distill.logprobs(as_rollouts(early), RULE), early, strict=True)
    ]
    assert float(max(tail)) > 1e-2
    assert max_diff(first.distill.logprobs(as_rollouts(late), RULE), late) > 1e-2
    assert swaps(metrics, "ok") == 2


def test_swaps_faster_than_sequences_finish_keep_each_adapter_folder_until_its_last_sequence(engine, tmp_path):
    # vLLM caches max_loras adapters (2 here), evicts the least recently used one when another is added,
    # and reads an evicted one from its folder again when a batch needs it. A group submitted under
    # adapter 21 and not yet scheduled when 22 and 23 arrive has lost 21 from the cache. Deleting a
    # replaced folder at once made that read fail in a cluster run (the whole engine step failed, and
    # groups retried into the same failure were dead-lettered): the folder must stay until the last
    # sequence started under it has finished.
    trainers = [_trainer(seed=20 + i) for i in range(4)]
    with weight_service(tmp_path / "trainer") as (store, address):
        sync, _ = version_sync(engine, address, tmp_path / "generator")
        for i, t in enumerate(trainers):
            t.adapter_version = 20 + i
            assert t.publish(store, 1, i + 1) == 21 + i
        assert sync.load_now(0, 21).adapter_version == 21
        engine.submit(_group("held", 7, new=80))
        assert sync.load_now(0, 22).adapter_version == 22
        assert sync.load_now(0, 23).adapter_version == 23  # evicts 21, which no step has used yet
        folder_21 = tmp_path / "generator" / "adapter-v21"
        assert folder_21.is_dir() and sync.sweep() == [folder_21]  # 22 served no sequence: gone
        assert not (tmp_path / "generator" / "adapter-v22").exists()
        done = [s for _ in range(5) for s in engine.step()]  # reads 21 from its folder again
        assert sync.load_now(0, 24).adapter_version == 24
        engine.submit(_group("after", 8, new=20))
        done = _finish(engine, done)
        assert sync.sweep() == [] and not folder_21.exists()
        assert not (tmp_path / "generator" / "adapter-v23").exists()
    held = [s for s in done if s.group_id == "held"]
    assert [s.versions.adapter_version for s in held] == [21, 21]
    assert all(len(s.token_ids) == 80 for s in held)  # to the last token, with adapter 21
    assert max_diff(trainers[0].distill.logprobs(as_rollouts(held), RULE), held) <= 1e-3
    assert [s.versions.adapter_version for s in done if s.group_id == "after"] == [24, 24]


def test_a_corrupt_adapter_is_refused_and_the_previous_one_keeps_serving(engine, tmp_path):
    good = _trainer(seed=3)
    # Versions above the other test's: this engine (module-wide) has adapters 1 and 2 loaded, and vLLM keeps
    # the adapter it already holds under a LoRA id (the version) rather than load another one under it.
    good.adapter_version = 10
    with weight_service(tmp_path / "trainer") as (store, address):
        sync, metrics = version_sync(engine, address, tmp_path / "generator")
        assert good.publish(store, 1, 1) == 11
        assert sync.load_now(0, 11).adapter_version == 11

        flipped = _trainer(seed=4)
        flipped.adapter_version = 11
        assert flipped.publish(store, 1, 2) == 12
        stored = store.folder(ADAPTER, 12) / "adapter_model.safetensors"
        data = bytearray(stored.read_bytes())
        data[-7] ^= 0x01
        stored.write_bytes(bytes(data))
        with pytest.raises(WeightFetchError, match="sha256"):
            sync.load_now(0, 12)

        good.distill.save_adapter(tmp_path / "nan")
        tensors = load_file(tmp_path / "nan" / "adapter_model.safetensors")
        tensors[sorted(tensors)[0]][1, 1] = float("nan")
        save_file(tensors, tmp_path / "nan" / "adapter_model.safetensors")
        store.publish_adapter(tmp_path / "nan", 13, 4, TARGETS)
        with pytest.raises(EngineError, match="NaN"):
            sync.load_now(0, 13)

        wide = _trainer(seed=5, rank=16)
        wide.adapter_version = 13
        assert wide.publish(store, 1, 4) == 14
        with pytest.raises(EngineError, match="rank 16"):
            sync.load_now(0, 14)
        assert engine.versions.adapter_version == 11 and swaps(metrics, "refused") == 3

        engine.submit(_group("after", 6, new=40))
        after = _finish(engine, [])
    assert all(s.versions.adapter_version == 11 for s in after)
    assert max_diff(good.distill.logprobs(as_rollouts(after), RULE), after) <= 1e-3
