"""A random tiny Qwen3 policy and sparse rollouts of it for the DistillSparse tests (one torch thread)."""

import pytest
import torch

from sparrow.schedule import Schedule

torch.set_num_threads(1)

# Budgets of 4 pages over contexts of 5 to 8 pages: page selection happens at almost every step.
SCHEDULE = Schedule(budgets=(64,), bin_width=4096, dense_layers=(), name="distill-unit")


def tiny_policy(seed: int = 0) -> torch.nn.Module:
    """A random-init Qwen3 (2 layers, 4 query / 2 KV heads of 16), float32, block-sparse attention installed."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer import sparse_attention

    torch.manual_seed(seed)
    config = Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return sparse_attention.install(Qwen3ForCausalLM(config).float().eval())


def sample_rollouts(model, count: int = 4, prompt_len: int = 70, new_tokens: int = 50, seed: int = 0):
    """`count` rollouts sampled by `model` with the reference decode loop under SCHEDULE (random prompts)."""
    from trainer.distill import rollout_of
    from trainer.reference_generate import generate

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 64, (prompt_len + 3 * i,), generator=g).tolist() for i in range(count)]
    gens = generate(model, prompts, SCHEDULE, new_tokens, seed=seed, backend="torch")
    return [rollout_of(p, gen, f"g{i // 2}", i % 2) for i, (p, gen) in enumerate(zip(prompts, gens, strict=True))]


def actor_rollouts(distill, count: int = 4, **kwargs):
    """`sample_rollouts` of the sparse actor: the policy with the adapter on."""
    with distill.adapter.on():
        return sample_rollouts(distill.policy, count, **kwargs)


@pytest.fixture
def policy():
    return tiny_policy()


def perturb_adapter(distill, scale: float = 0.3, seed: int = 1) -> None:
    """Give every LoRA matrix random values, so the adapter changes the actor's outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in distill.lora_params:
            p.copy_(scale * torch.randn(p.shape, generator=g))
