"""Activation checkpointing per decoder layer (trainer/activation_checkpoint.py), in one process, fp32: the gradients
of the trainer's loss path equal those without it, each layer really runs again in the backward, and short or no-grad
forwards keep their activations. The FSDP2 (gloo, 2 ranks) side: tests/integration/trainer_dist."""

import pytest
import torch

from trainer import lm_head
from trainer.activation_checkpoint import checkpoint_layers, checkpointed
from trainer.model_io import load_model


@pytest.fixture
def tiny(tmp_path, make_tiny):
    make_tiny(tmp_path / "m")
    return tmp_path / "m"


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    """The update's path: the last hidden states, then the chunked head's logprobs of the next tokens."""
    mask = torch.ones_like(ids)
    hidden = lm_head.hidden_states(model, ids, mask)[:, :-1].reshape(-1, model.config.hidden_size)
    out = lm_head.token_logprobs(hidden, lm_head.output_weight(model), ids[:, 1:].reshape(-1), 0.7, chunk=16)
    return -(out.logprobs * torch.linspace(-1.0, 1.0, out.logprobs.numel())).mean()


def _mlp_calls(model) -> list[int]:
    # A submodule's pre-hooks fire in the recompute too (the layer's own do not: it calls forward directly; post
    # hooks may not: the recompute stops once it has what the backward needs).
    calls = [0]
    for layer in model.get_decoder().layers:
        layer.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_gradients_equal_and_every_layer_runs_again_in_the_backward(tiny):
    plain, wrapped = load_model(tiny), load_model(tiny)
    layers = len(wrapped.get_decoder().layers)
    assert checkpoint_layers(wrapped) == layers and checkpointed(wrapped) and not checkpointed(plain)
    assert checkpoint_layers(wrapped) == 0  # a second call wraps nothing more
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    ids = torch.randint(3, 100, (3, 40), generator=torch.Generator().manual_seed(0))
    calls = _mlp_calls(wrapped)
    losses = []
    for model in (plain, wrapped):
        loss = _loss(model, ids)
        loss.backward()
        losses.append(loss.item())
    assert calls[0] == 2 * layers  # forward, then the recompute of each layer inside the backward
    assert losses[0] == losses[1]
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        assert float((a.grad - b.grad).abs().max()) <= 1e-6 * float(a.grad.abs().max().clamp(min=1e-12)), name


def test_short_micro_batches_and_no_grad_forwards_keep_their_activations(tiny):
    model = load_model(tiny)
    layers = len(model.get_decoder().layers)
    checkpoint_layers(model, min_tokens=3 * 40)
    calls = _mlp_calls(model)
    _loss(model, torch.randint(3, 100, (2, 40))).backward()  # 80 positions: below the threshold
    assert calls[0] == layers
    calls[0] = 0
    _loss(model, torch.randint(3, 100, (3, 40))).backward()  # 120: at it
    assert calls[0] == 2 * layers
    calls[0] = 0
    with torch.no_grad():
        _loss(model, torch.randint(3, 100, (4, 40)))
    assert calls[0] == layers


def test_the_trainer_config_wraps_the_policy_as_asked(tiny, tmp_path):
    from services.trainer.config import TrainerServiceConfig
    from services.trainer.ranks import RankSetupError, build_policy, check_world

    for mode, expected in (("auto", 4096), ("on", 0), ("off", None)):
        config = TrainerServiceConfig(model_dir=str(tiny), memory={"activation_checkpointing": mode})
        model, _ = build_policy(config)
        layers = model.get_decoder().layers
        assert {getattr(layer, "_sparrow_checkpointed", None) for layer in layers} == {expected}
    offload = TrainerServiceConfig(model_dir=str(tiny), device="cuda", memory={"cpu_offload": True})
    with pytest.raises(RankSetupError, match="memory.cpu_offload offloads the FSDP2 shards of several"):
        check_world(offload, 1)
    check_world(offload, 2)
