"""Activation checkpointing per decoder layer: a layer keeps only its input for the backward, and recomputes the rest.

Without it every decoder layer holds its attention and MLP intermediates from the forward until
the backward (about 30 hidden-sized tensors per position and layer in a Qwen3 layer); with it each
layer holds its input only and runs its forward again inside the backward, one layer at a time:
the activation memory of a long sequence drops from all layers' intermediates to one layer's plus
every layer's input, for about a third more compute. This is what verl, prime-rl and torchtitan
do per decoder layer under FSDP2.

`checkpoint_layers` replaces each layer's `forward` on the instance (the module, its class and its
parameter names stay as they are, so FSDP2's hooks, DCP checkpoints and published weights see the
same model). The recompute runs inside the layer's own forward call, after FSDP2 has gathered the
layer's parameters for the backward, so it adds no collective. `min_tokens` keeps short
micro-batches (scoring-sized batches, the tiny models' steps) out of the recompute: a layer
checkpoints only when its input holds at least that many positions (rows x padded length), and
only when gradients are being recorded (a no-grad scoring forward never pays for it).

State that a forward depends on besides its arguments (the DistillSparse adapter switched on or off,
trainer/lora.py) is registered with `keep_state_for_recompute`: each checkpointed forward captures
it, and the recompute in the backward runs under the captured state, whatever it is by then.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch.utils.checkpoint import checkpoint

_STATES = "_sparrow_recompute_states"


def keep_state_for_recompute(model: torch.nn.Module, capture: Callable[[], AbstractContextManager]) -> None:
    """Make the recompute of `model`'s checkpointed layers run under the state `capture` saw at their forward.

    `capture()` is called at each checkpointed forward and returns a context that restores what it saw.
    """
    _states(model).append(capture)


def _states(model: torch.nn.Module) -> list:
    # A plain list on the instance (not a submodule or buffer): FSDP2, state dicts and names never see it.
    states = model.__dict__.get(_STATES)
    if states is None:
        states = []
        model.__dict__[_STATES] = states
    return states


def checkpoint_layers(model: torch.nn.Module, min_tokens: int = 0) -> int:
    """Checkpoint every decoder layer of `model` (a transformers causal LM) from `min_tokens` positions on.

    Returns the number of layers wrapped. Calling it twice on a model wraps nothing more.
    """
    wrapped = 0
    states = _states(model)
    for layer in model.get_decoder().layers:
        if getattr(layer, "_sparrow_checkpointed", None) is not None:
            continue
        original = layer.forward
        layer.forward = functools.partial(_checkpointed_forward, original, min_tokens, states)
        layer._sparrow_checkpointed = min_tokens
        wrapped += 1
    return wrapped


def checkpointed(model: torch.nn.Module) -> bool:
    """Whether `checkpoint_layers` has wrapped `model`'s decoder layers."""
    layers = model.get_decoder().layers
    return len(layers) > 0 and all(getattr(layer, "_sparrow_checkpointed", None) is not None for layer in layers)


def _checkpointed_forward(forward, min_tokens: int, states: list, *args, **kwargs):
    hidden = args[0] if args else kwargs.get("hidden_states")
    positions = hidden.shape[:-1].numel() if isinstance(hidden, torch.Tensor) else 0
    if not torch.is_grad_enabled() or positions < min_tokens:
        return forward(*args, **kwargs)
    # Non-reentrant: keyword arguments (masks, rotary embeddings) pass through, and inputs that need
    # no gradient still get the recomputed graph's gradients right. Its context_fn runs at this forward:
    # the registered states are captured now and put back around the recompute.
    return checkpoint(forward, *args, use_reentrant=False, context_fn=functools.partial(_contexts, states), **kwargs)


def _contexts(states: list) -> tuple[AbstractContextManager, AbstractContextManager]:
    return contextlib.nullcontext(), _replaying([capture() for capture in states])


@contextlib.contextmanager
def _replaying(replays: list[AbstractContextManager]):
    with contextlib.ExitStack() as stack:
        for replay in replays:
            stack.enter_context(replay)
        yield
