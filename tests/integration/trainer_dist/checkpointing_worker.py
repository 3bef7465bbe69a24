"""Two training steps with and without activation checkpointing, as one rank of several FSDP2 ranks (torchrun, gloo).

Every rank builds the same tiny model twice (before sharding), checkpoints the decoder layers of the
second (`trainer.activation_checkpoint`, from 0 positions on), shards both and runs
`trainer.rl_update.learn` on fixed rollouts and advantages, fp32. After each step rank 0 writes to
OUT the largest gradient difference relative to the largest gradient (full tensors, gathered), the
losses, and how often each model's MLPs ran (a pre-hook: the backward's recomputes count).
"""

from __future__ import annotations

import copy
import json
import sys

import torch

from tests.integration.trainer_dist.steps_worker import TEMP, TINY, rollouts
from trainer import distributed
from trainer.activation_checkpoint import checkpoint_layers
from trainer.model_io import load_model
from trainer.rl_update import UpdateConfig, learn
from trainer.scoring import Scorer


def main(out: str) -> None:
    torch.set_num_threads(1)
    plain = load_model(TINY)
    batch = rollouts(plain)
    wrapped = copy.deepcopy(plain)
    checkpoint_layers(wrapped)
    calls = [0, 0]
    for i, model in enumerate((plain, wrapped)):
        for layer in model.get_decoder().layers:
            layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    distributed.init_from_env("cpu", timeout_s=120)
    models = [distributed.shard(plain), distributed.shard(wrapped)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    grads: list[dict[str, torch.Tensor]] = [{}, {}]
    for i, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
        # Right before the step (learn lets go of the gradients after it), gathered: collectives, on every rank.
        optimizer.register_step_pre_hook(
            lambda *_, i=i, model=model: grads[i].update(
                {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
            )
        )
    config = UpdateConfig(temperature=TEMP, micro_batch_size=3, lm_head_chunk=8)
    advantages = torch.linspace(-1.0, 1.0, len(batch))
    steps = []
    for rows in (range(0, 8), range(2, 12)):
        picked = [batch[i] for i in rows]
        losses = []
        for model, optimizer in zip(models, optimizers, strict=True):
            _, _, stats = learn(model, optimizer, Scorer(model, chunk=8), picked, advantages[list(rows)], config)
            losses.append(stats["loss"])
        assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(plain.parameters()))
        worst = 0.0
        for name, ga in grads[0].items():
            gb = grads[1][name]
            worst = max(worst, float((ga - gb).abs().max() / ga.abs().max().clamp(min=1e-12)))
        steps.append({"losses": losses, "grad_rel_diff": worst, "mlp_calls": list(calls)})
        calls[:] = [0, 0]
    if distributed.rank() == 0:
        layers = len(wrapped.get_decoder().layers)
        with open(out, "w") as f:
            json.dump({"world_size": distributed.world_size(), "layers": layers, "steps": steps}, f)
    distributed.close()


if __name__ == "__main__":
    main(sys.argv[1])
