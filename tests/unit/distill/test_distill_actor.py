"""The sparse actor of DistillSparse: the policy itself with an adapter the dense side never sees, exact sparse
logprobs, and adapter files that peft loads to the same outputs."""

import torch

from tests.unit.distill.conftest import SCHEDULE, perturb_adapter, sample_rollouts, tiny_policy
from trainer.distill import BlockRule, DistillConfig, DistillSparse

RULE = BlockRule.of(SCHEDULE)
CONFIG = DistillConfig(backend="torch")


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_the_adapter_lives_outside_the_policy_which_keeps_its_names_and_tensors(policy):
    before = [(n, p) for n, p in policy.named_parameters()]
    distill = DistillSparse(policy, CONFIG)
    after = [(n, p) for n, p in policy.named_parameters()]
    assert [n for n, _ in after] == [n for n, _ in before]  # no LoRA layer in the policy's tree
    assert all(a is b for (_, a), (_, b) in zip(after, before, strict=True))
    assert all(p.requires_grad for _, p in after)
    mine = {id(p) for _, p in before}
    assert distill.lora_params and not {id(p) for p in distill.lora_params} & mine
    assert len(distill.lora_params) == 2 * 2 * 4  # A and B, 2 layers, q/k/v/o
    assert all(p.dtype == torch.float32 for p in distill.lora_params)
    # The names peft gave the adapter inside the actor's tree: checkpoints keep their keys.
    assert "model.layers.1.self_attn.k_proj.lora_B.default.weight" in distill.adapter_tensors()


def test_the_dense_policy_never_sees_the_adapter_and_follows_every_dense_update(policy):
    ids = torch.randint(3, 64, (2, 90), generator=torch.Generator().manual_seed(3))
    dense_before = _logits(policy, ids)
    distill = DistillSparse(policy, CONFIG)
    perturb_adapter(distill)
    assert torch.equal(_logits(policy, ids), dense_before)
    with distill.adapter.on():
        assert (_logits(policy, ids) - dense_before).abs().max() > 1e-2  # the adapter does act on the actor
        with distill.adapter.off():
            assert torch.equal(_logits(policy, ids), dense_before)

    # One dense AdamW step on the policy: the actor, adapter off, is the updated policy at once.
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    policy(input_ids=ids, use_cache=False).logits.logsumexp(-1).mean().backward()
    optimizer.step()
    dense_after = _logits(policy, ids)
    assert (dense_after - dense_before).abs().max() > 1e-3
    assert all(p.grad is None for p in distill.lora_params)  # the dense backward never reached the adapter
    with distill.adapter.on():
        assert not torch.equal(_logits(policy, ids), dense_after)


def test_the_adapter_on_for_some_rows_is_those_rows_run_with_it_and_the_others_without(policy):
    ids = torch.randint(3, 64, (3, 50), generator=torch.Generator().manual_seed(4))
    distill = DistillSparse(policy, CONFIG)
    perturb_adapter(distill)
    with distill.adapter.on():
        on = _logits(policy, ids)
    off = _logits(policy, ids)
    with distill.adapter.on(rows=torch.tensor([True, False, True])):
        mixed = _logits(policy, ids)
    torch.testing.assert_close(mixed[[0, 2]], on[[0, 2]], atol=1e-6, rtol=0)
    torch.testing.assert_close(mixed[1], off[1], atol=1e-6, rtol=0)


def test_teacher_forced_sparse_logprobs_with_the_adapter_match_the_decode_loop(policy):
    distill = DistillSparse(policy, CONFIG)
    perturb_adapter(distill)
    with distill.adapter.on():
        rollouts = sample_rollouts(policy, count=3)  # the decode loop runs the actor, LoRA and all
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


def test_saved_files_are_what_peft_writes_and_peft_loads_them_to_the_same_logprobs(policy, tmp_path):
    """Init, file names, config and tensors against peft's own adapter; peft's forward against the hooks (fp32)."""
    import copy
    import json

    from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict
    from safetensors import safe_open
    from safetensors.torch import load_file

    distill = DistillSparse(policy, DistillConfig(rank=4, alpha=8.0, target_modules=("v_proj", "o_proj"), seed=3))
    with torch.random.fork_rng(devices=[]):  # peft's adapter on a copy of the policy, under the same seed
        torch.manual_seed(3)
        lora = LoraConfig(r=4, lora_alpha=8.0, target_modules=["v_proj", "o_proj"], lora_dropout=0.0)
        theirs = get_peft_model(copy.deepcopy(policy), lora)
    mine = distill.adapter.peft_tensors()
    init = get_peft_model_state_dict(theirs)
    assert set(init) == set(mine) and all(torch.equal(init[k], mine[k]) for k in mine)  # the same initial A and B

    perturb_adapter(distill)
    distill.save_adapter(tmp_path / "ours")
    set_peft_model_state_dict(theirs, load_file(tmp_path / "ours" / "adapter_model.safetensors"))
    theirs.save_pretrained(str(tmp_path / "peft"), safe_serialization=True)
    configs = [json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("ours", "peft")]
    for c in configs:
        c["target_modules"] = sorted(c["target_modules"])  # peft keeps a set
    assert configs[0] == configs[1]
    assert configs[0]["r"] == 4 and configs[0]["lora_alpha"] == 8 and configs[0]["lora_dropout"] == 0.0
    files = []
    for d in ("ours", "peft"):
        with safe_open(str(tmp_path / d / "adapter_model.safetensors"), framework="pt") as f:
            files.append((f.metadata(), {k: f.get_tensor(k) for k in f.keys()}))
    assert files[0][0] == files[1][0] and files[0][1].keys() == files[1][1].keys()
    assert all(torch.equal(files[0][1][k], files[1][1][k]) for k in files[0][1])
    assert "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight" in files[0][1]

    loaded = PeftModel.from_pretrained(copy.deepcopy(policy), str(tmp_path / "ours")).eval()
    ids = torch.randint(3, 64, (2, 40), generator=torch.Generator().manual_seed(5))
    with distill.adapter.on():
        hooked = _logits(policy, ids).log_softmax(-1)
    peft_lp = _logits(loaded, ids).log_softmax(-1)
    assert float((peft_lp - hooked).abs().max()) <= 1e-6
    assert float((_logits(policy, ids).log_softmax(-1) - hooked).abs().max()) > 1e-2  # the adapter does act


def test_a_checkpointed_layer_recomputes_with_the_adapter_as_its_forward_had_it():
    """Activation checkpointing recomputes each layer in the backward, here after `adapter.on()` was left: the
    adapter's gradients must be those of the plain model (the recompute runs with the adapter on)."""
    from trainer import distributed
    from trainer.activation_checkpoint import checkpoint_layers

    ids = torch.randint(3, 64, (2, 40), generator=torch.Generator().manual_seed(6))
    grads = []
    for checkpointed in (False, True):
        model = tiny_policy()
        if checkpointed:
            assert checkpoint_layers(model, 0) == 2
        distill = DistillSparse(model, CONFIG)
        perturb_adapter(distill)
        with distributed.frozen(model):
            with distill.adapter.on():
                loss = model(input_ids=ids, use_cache=False).logits.logsumexp(-1).mean()
            loss.backward()
        assert all(p.grad is None for p in model.parameters())  # theta frozen: no base gradient
        grads.append([p.grad.clone() for p in distill.lora_params])
    assert all(float(g.abs().max()) > 0 for g in grads[0])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
