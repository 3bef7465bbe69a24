"""The generator service on the production engine: vLLM with the sparse-attention plugin, real Redis,
a real gRPC stand-in trainer. The plumbing is tested at length with the reference engine
(test_generator_service.py); this checks the same service drives vLLM: groups in, trajectories with
per-position budgets out, a schedule from Redis applied mid-run, a new policy loaded in place.
"""

import json
import time
from pathlib import Path

import pytest

from services.generator.main import cpu_auto_dtype
from sparrow import metrics_contract as mc
from sparrow.schedule import Schedule
from tests.integration.generator.harness import SMALL, TINY, group

pytestmark = pytest.mark.slow


def test_vllm_generator_serves_groups_applies_schedules_and_loads_policies(start, trainer, client):
    first = Schedule(budgets=(48,), bin_width=1000, dense_layers=(), version=1)
    client.set(mc.SCHEDULE_KEY, first.to_json())
    h = start(
        **{
            "engine.kind": "vllm",
            "engine.model_dir": str(TINY),
            "engine.max_model_len": 256,
            "engine.gpu_memory_utilization": 0.05,
        }
    )
    trainer.wait_for(lambda: h.service.serving.schedule_version == 1, 120, "v1 applied")
    # dtype "auto" on CPU: bf16 only where the CPU computes it natively, else float32 (services.generator.main)
    assert h.service.engine.config.dtype == cpu_auto_dtype()
    for i in range(2):
        h.enqueue(group(f"a{i}", n=2, max_new_tokens=30, pairs=20, seed=i))
    h.wait_settled({"a0": 2, "a1": 2})
    second = first.with_budgets([64])
    client.set(mc.SCHEDULE_KEY, second.to_json())
    client.publish(mc.SCHEDULE_UPDATES_CHANNEL, second.to_json())
    trainer.wait_for(lambda: h.service.serving.schedule_version == 2, 60, "v2 applied")
    trainer.publish("policy", 1, SMALL)
    trainer.wait_for(lambda: h.service.serving.policy_version == 1, 60, "policy v1 loaded")
    # Streamed: the version went from the stream into the engine through memory, no folder written.
    weights = Path(h.config.trainer.weights_dir)
    assert not weights.exists() or not any(weights.rglob("*.safetensors"))
    h.enqueue(group("b", n=2, max_new_tokens=30, pairs=20, seed=7))
    h.wait_settled({"a0": 2, "a1": 2, "b": 2})
    # A probe request in Redis, as the controller writes it: half the new sequences at 48 tokens.
    probe = {"schedule_version": 2, "share": 0.5, "budgets": [48], "expires_at": time.time() + 300}
    client.set(mc.PROBE_KEY, json.dumps(probe))
    trainer.wait_for(lambda: h.service.engine.probe_plan is not None, 60, "the probe taken")
    h.enqueue(group("c", n=2, max_new_tokens=30, pairs=20, seed=8))
    h.wait_settled({"a0": 2, "a1": 2, "b": 2, "c": 2})

    for gid in ("a0", "a1"):
        for t in trainer.of_group(gid):
            assert t.versions.schedule_version == 1 and t.versions.policy_version == 0
            assert t.kv_budgets[0] == 0 and set(t.kv_budgets[1:]) == {48}  # 65-token prompts: past the budget
            assert len(t.token_ids) == len(t.logprobs) == len(t.top_logprobs) == len(t.kv_budgets)
            assert all(len(p.token_ids) == 20 for p in t.top_logprobs)
    for t in trainer.of_group("b"):
        assert (t.versions.schedule_version, t.versions.policy_version) == (2, 1)
        assert set(t.kv_budgets[1:]) == {64}
    plain, probed = sorted(trainer.of_group("c"), key=lambda t: t.probe)
    assert (plain.probe, probed.probe) == (False, True)
    assert set(plain.kv_budgets[1:]) == {64} and set(probed.kv_budgets[1:]) == {48}
    assert h.metric("sparrow_generator_probe_sequences_total") == 1
    assert h.dead() == [] and h.pending() == 0
    assert h.metric("sparrow_generator_tokens_total", mode="sparse") > 0
    assert h.metric("sparrow_generator_swaps_total", kind="policy", outcome="ok") == 1
