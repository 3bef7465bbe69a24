"""The trainer service's DistillSparse step: probes and metrics, bad budgets left out, publishing, checkpoints."""

import json
import logging
import math

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from services.trainer.checkpoint import CheckpointManager, TrainState
from services.trainer.config import DistillSection
from services.trainer.distill_step import CHECKPOINT_PART, SIDECAR, DistillStep
from services.trainer.weights import ADAPTER, WeightStore
from tests.unit.distill.conftest import perturb_adapter, sample_rollouts, tiny_policy
from trainer.distill import BlockRule
from trainer.grpo import GRPOConfig

NAMES = (
    "sparrow_trainer_distill_loss",
    "sparrow_trainer_distill_kl",
    "sparrow_trainer_adapter_version",
    "sparrow_trainer_alpha_probe_with_adapter_p5",
    "sparrow_trainer_alpha_probe_without_adapter_p5",
    "sparrow_trainer_distill_selection_loss",
)


def _step(policy, registry=None, **overrides) -> DistillStep:
    settings = {"enabled": True, "backend": "torch", "dense_layers": [], **overrides}
    section = DistillSection(**settings)
    return DistillStep(section, policy, registry or CollectorRegistry(), GRPOConfig(), 1.0, 32, 8)


def _samples(registry) -> dict[tuple[str, str], float]:
    from prometheus_client import generate_latest

    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, s.labels.get("bin", ""))] = s.value
    return out


def test_a_probe_step_holds_rollouts_out_scores_them_both_ways_and_exports_every_metric(policy):
    registry = CollectorRegistry()
    step = _step(policy, registry, probe_every=2, probe_samples=2, lr=1e-3)
    perturb_adapter(step.distill, scale=0.1)
    rollouts = sample_rollouts(policy, count=6)
    report = step.run(1, rollouts, torch.zeros(6))  # step 1 probes (every 2 steps, from the first)
    assert report["tokens"] == sum(len(r.token_ids) for r in rollouts[2:])  # the probe's two did not train
    rows = report["probe"]
    assert sum(r["tokens"] for r in rows) == sum(len(r.token_ids) for r in rollouts[:2])
    assert any(r["p5_with"] != r["p5_without"] for r in rows)  # the adapter matters
    seen = _samples(registry)
    for r in rows:
        assert seen[(NAMES[3], str(r["bin"]))] == r["p5_with"]
        assert seen[(NAMES[4], str(r["bin"]))] == r["p5_without"]
    assert seen[(NAMES[0], "")] == report["loss"] and seen[(NAMES[1], "")] == report["kl"]
    assert seen[(NAMES[5], "")] == report["selection"] == 0.0  # selection_coef 0: the paper's loss
    assert {name for name, _ in seen} >= set(NAMES)

    report = step.run(2, rollouts, torch.zeros(6))  # no probe on step 2: every rollout trains
    assert "probe" not in report and report["tokens"] == sum(len(r.token_ids) for r in rollouts)
    step.metrics.show_probe({}, {})  # a later probe without these bins: they read NaN, never stale
    assert math.isnan(_samples(registry)[(NAMES[3], str(rows[0]["bin"]))])


def test_rollouts_whose_budgets_cannot_be_reproduced_are_left_out_not_fatal(policy, caplog):
    from dataclasses import replace

    step = _step(policy, probe_every=0)
    good = sample_rollouts(policy, count=2)
    bad = replace(good[0], kv_budgets=(0,) + (40,) * (len(good[0].token_ids) - 1))
    with caplog.at_level(logging.WARNING, logger="sparrow.trainer.distill"):
        report = step.run(1, [bad, *good], torch.zeros(3))
    assert report["skipped"] == 1 and report["tokens"] == sum(len(r.token_ids) for r in good)
    assert "not multiples of 16" in caplog.text
    assert step.run(2, [bad], torch.zeros(1)) == {"skipped": 1}  # nothing left: no update, no crash


def test_publishing_writes_a_versioned_peft_adapter_and_a_restart_republishes_only_when_needed(policy, tmp_path):
    weights = WeightStore(tmp_path, keep=3)
    step = _step(policy, rank=4, alpha=8.0, target_modules=["v_proj", "o_proj"])
    assert step.publish(weights, policy_version=5, step=4) == 1
    folder = weights.folder(ADAPTER, 1)
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", SIDECAR]
    assert json.loads((folder / SIDECAR).read_text()) == {"adapter_version": 1, "policy_version": 5, "step": 4}
    manifest = weights.manifest(ADAPTER, 1)
    assert manifest.lora_rank == 4 and manifest.lora_target_modules == ("v_proj", "o_proj")
    assert step.publish(weights, 6, 5) == 2 and weights.latest(ADAPTER) == 2

    with torch.no_grad():
        step.distill.lora_params[0][0, 0] = float("nan")
    assert step.publish(weights, 7, 6) == 2 and weights.latest(ADAPTER) == 2  # never publishes a NaN adapter
    step.publish_start(weights, 6, 5)  # the trainer's adapter is the latest published: nothing to do
    assert weights.latest(ADAPTER) == 2
    behind = _step(tiny_policy(), rank=4, alpha=8.0, target_modules=["v_proj", "o_proj"])
    behind.adapter_version = 1  # a checkpoint taken before v2 went out
    behind.publish_start(weights, 6, 5)
    assert weights.latest(ADAPTER) == 3 and behind.adapter_version == 3


def test_the_adapter_is_checkpointed_with_the_model_and_a_checkpoint_without_it_starts_fresh(tmp_path, caplog):
    policy = tiny_policy()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    step = _step(policy, lr=1e-3)
    rollouts = sample_rollouts(policy, count=2)
    step.run(1, rollouts, torch.zeros(2))
    step.adapter_version = 7
    manager = CheckpointManager(tmp_path / "ckpt", keep=2)
    manager.save(policy, optimizer, TrainState(run_id="r", step=1), {CHECKPOINT_PART: step})

    fresh_policy = tiny_policy(seed=9)
    fresh = _step(fresh_policy, lr=1e-3)
    state = manager.load_latest(fresh_policy, torch.optim.AdamW(fresh_policy.parameters()), {CHECKPOINT_PART: fresh})
    assert state.step == 1 and fresh.adapter_version == 7
    mine, theirs = step.distill.adapter_tensors(), fresh.distill.adapter_tensors()
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), fresh_policy.parameters(), strict=True))
    key = step.distill.lora_params[0]
    assert torch.equal(step.distill.optimizer.state[key]["exp_avg"], fresh.distill.optimizer.state[
        fresh.distill.lora_params[0]]["exp_avg"])  # fmt: skip

    # A run that turns DistillSparse on resumes from a checkpoint that has no adapter in it.
    plain = CheckpointManager(tmp_path / "plain", keep=2)
    plain.save(policy, optimizer, TrainState(run_id="r", step=3))
    late = _step(tiny_policy(), lr=1e-3)
    with caplog.at_level(logging.WARNING, logger="sparrow.trainer.checkpoint"):
        state = plain.load_latest(late.distill.policy, torch.optim.AdamW(late.distill.policy.parameters()), {
            CHECKPOINT_PART: late})  # fmt: skip
    assert state.step == 3 and late.adapter_version == 0 and "holds no 'distill' state" in caplog.text
    assert all(float(p.abs().max()) == 0 for n, p in late.distill.adapter_tensors().items() if "lora_B" in n)


def test_the_block_rule_comes_from_the_configured_fallback_without_redis(policy):
    step = _step(policy, sink_blocks=0, local_blocks=3, dense_layers=[1])
    assert step.rule_source() == step.fallback == BlockRule(0, 3, frozenset({1}))
