"""The sparse actor of DistillSparse: shared weights, an adapter the dense side never sees, exact sparse logprobs."""

import torch

from tests.unit.distill.conftest import SCHEDULE, perturb_adapter, sample_rollouts
from trainer.distill import BlockRule, DistillConfig, DistillSparse

RULE = BlockRule.of(SCHEDULE)
CONFIG = DistillConfig(backend="torch")


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_the_actor_shares_every_weight_and_the_policy_keeps_its_names(policy):
    before = [(n, p) for n, p in policy.named_parameters()]
    distill = DistillSparse(policy, CONFIG)
    after = [(n, p) for n, p in policy.named_parameters()]
    assert [n for n, _ in after] == [n for n, _ in before]  # no LoRA layer in the policy's tree
    assert all(a is b for (_, a), (_, b) in zip(after, before, strict=True))
    assert all(p.requires_grad for _, p in after)  # peft's freezing did not leak into the policy
    mine = {id(p) for _, p in before}
    assert {id(p) for p in distill._base_params} == mine  # the actor's base weights are the policy's objects
    assert distill.lora_params and not {id(p) for p in distill.lora_params} & mine
    assert len(distill.lora_params) == 2 * 2 * 4  # A and B, 2 layers, q/k/v/o


def test_the_dense_policy_never_sees_the_adapter_and_follows_every_dense_update(policy):
    ids = torch.randint(3, 64, (2, 90), generator=torch.Generator().manual_seed(3))
    dense_before = _logits(policy, ids)
    distill = DistillSparse(policy, CONFIG)
    perturb_adapter(distill)
    assert torch.equal(_logits(policy, ids), dense_before)
    assert (_logits(distill.actor, ids) - dense_before).abs().max() > 1e-2  # the adapter does act on the actor
    with distill.peft.disable_adapter():
        assert torch.equal(_logits(distill.actor, ids), dense_before)

    # One dense AdamW step on the policy: the actor, adapter off, is the updated policy at once.
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    policy(input_ids=ids, use_cache=False).logits.logsumexp(-1).mean().backward()
    optimizer.step()
    dense_after = _logits(policy, ids)
    assert (dense_after - dense_before).abs().max() > 1e-3
    with distill.peft.disable_adapter():
        assert torch.equal(_logits(distill.actor, ids), dense_after)
    assert all(p.grad is None for p in distill.lora_params)  # the dense backward never reached the adapter


def test_teacher_forced_sparse_logprobs_with_the_adapter_match_the_decode_loop(policy):
    distill = DistillSparse(policy, CONFIG)
    perturb_adapter(distill)
    rollouts = sample_rollouts(distill.actor, count=3)  # the decode loop runs the actor, LoRA and all
    for r in rollouts:
        kv = [r.prompt_len + t for t in range(len(r.token_ids))]
        assert all(0 < b < k for b, k in zip(r.kv_budgets[1:], kv[1:], strict=True))  # selection happened
    teacher = distill.logprobs(rollouts, RULE)
    for r, lp in zip(rollouts, teacher, strict=True):
        diff = (lp - torch.tensor(r.logprobs)).abs().max()
        assert float(diff) <= 1e-4, f"decode loop vs teacher-forced: {float(diff):.2e}"
    plain = distill.logprobs(rollouts, RULE, adapter=False)
    dense = distill.logprobs(rollouts, RULE, dense=True)
    assert max(float((a - b).abs().max()) for a, b in zip(plain, teacher, strict=True)) > 1e-2
    assert max(float((a - b).abs().max()) for a, b in zip(plain, dense, strict=True)) > 1e-3  # sparse != dense


def test_save_adapter_writes_peft_safetensors_that_peft_loads_back(policy, tmp_path):
    import copy
    import json

    from peft import PeftModel
    from safetensors import safe_open

    distill = DistillSparse(policy, DistillConfig(rank=4, alpha=8.0, target_modules=("v_proj", "o_proj")))
    perturb_adapter(distill)
    distill.save_adapter(tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and sorted(cfg["target_modules"]) == ["o_proj", "v_proj"]
    assert cfg["lora_dropout"] == 0.0
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        keys = sorted(f.keys())
    assert len(keys) == 8 and all(k.startswith("base_model.model.model.layers.") for k in keys)
    # A fresh copy of the policy with the saved adapter computes what the actor computes.
    loaded = PeftModel.from_pretrained(copy.deepcopy(policy), str(tmp_path / "adapter")).eval()
    ids = torch.randint(3, 64, (1, 40), generator=torch.Generator().manual_seed(5))
    assert torch.allclose(_logits(loaded, ids), _logits(distill.actor, ids), atol=1e-6)
