"""A random-init tiny Qwen3 saved in HF format, shared by the trainer tests (one torch thread)."""

import pytest
import torch

torch.set_num_threads(1)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=100,
)


def save_tiny(folder, seed: int = 0, **overrides) -> None:
    """Write a random tiny Qwen3ForCausalLM (config.json + model.safetensors) to `folder`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    Qwen3ForCausalLM(Qwen3Config(**{**TINY, **overrides})).save_pretrained(folder)


@pytest.fixture(scope="session")
def make_tiny():
    """The writer of random tiny checkpoints, for tests that need a variant."""
    return save_tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_random")
    save_tiny(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from trainer.model_io import load_model

    return load_model(tiny_dir)


@pytest.fixture(scope="session")
def scorer(tiny_model):
    from trainer.scoring import Scorer

    return Scorer(tiny_model)
