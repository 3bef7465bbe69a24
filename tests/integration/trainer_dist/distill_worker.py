"""Three RL steps with DistillSparse and exact alpha on fixed sparse rollouts, on one process or as one rank of several.

Every rank samples the same rollouts from the tiny model under a block-sparse schedule (same seed, before any
sharding; every other rollout marked as served with the adapter), then per step runs `trainer.rl_update.learn`
with the exact-alpha pass and the service's DistillSparse step (`services.trainer.distill_step.DistillStep.run`:
a probe on steps 1 and 3, the adapter's update on the rest), fp32, every decoder layer under activation
checkpointing. Under torchrun the model is FSDP2-sharded over gloo. While the adapter trains, a hook records
whether the policy's gathered parameters require a gradient (they must not: no base gradient is computed).
Rank 0 writes each step's figures, the full policy parameters and the adapter to OUT.

`worker OUT [FIRST LAST [CKPT_OUT] [CKPT_IN]]` runs steps FIRST..LAST - 1 only, resuming the policy, its
optimizer and the adapter with its optimizer from the DCP checkpoint CKPT_IN and saving one to CKPT_OUT after.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

TINY = Path(__file__).resolve().parents[3] / "models" / "tiny"
TEMP = 1.0


def rollouts(model):
    from sparrow.schedule import Schedule
    from trainer.distill import rollout_of
    from trainer.reference_generate import generate

    # 3 pages kept (sink, local and one chosen) over prompts of 4 to 6 pages: selection at every decode step.
    schedule = Schedule(budgets=(48,), bin_width=4096, dense_layers=(1,), name="dist-distill")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (60 + 4 * i,), generator=g).tolist() for i in range(10)]
    gens = generate(model, prompts, schedule, 16, TEMP, seed=1, backend="torch")
    out = [rollout_of(p, gen, f"g{i // 2}", i % 2) for i, (p, gen) in enumerate(zip(prompts, gens, strict=True))]
    return [dataclasses.replace(r, adapter_version=i % 2) for i, r in enumerate(out)]


def main(out: str, first: int = 0, last: int = 3, ckpt_out: str = "", ckpt_in: str = "") -> None:
    from prometheus_client import CollectorRegistry
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from services.trainer.checkpoint import CheckpointManager, TrainState
    from services.trainer.config import DistillSection
    from services.trainer.distill_step import CHECKPOINT_PART, DistillStep
    from trainer import distributed, lm_head
    from trainer.activation_checkpoint import checkpoint_layers
    from trainer.distill import BlockRule
    from trainer.exact_alpha import ExactAlpha
    from trainer.grpo import GRPOConfig
    from trainer.model_io import load_model
    from trainer.rl_update import UpdateConfig, learn
    from trainer.scoring import Scorer

    torch.set_num_threads(1)
    model = load_model(TINY)
    batch = rollouts(model)  # before sharding: the same on every rank
    if distributed.launched_by_torchrun():
        distributed.init_from_env("cpu", timeout_s=120)
    checkpoint_layers(model, 0)
    if distributed.active():
        distributed.shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rule = BlockRule(1, 2, frozenset({1}))
    section = DistillSection(
        enabled=True, rank=4, alpha=8.0, lr=1e-3, kl_coef=1.0, backend="torch", dense_layers=[1], probe_every=2,
        probe_samples=2, micro_batch_size=2,
    )  # fmt: skip
    distill = DistillStep(section, model, CollectorRegistry(), GRPOConfig(), TEMP, 32, 4, lambda: rule, 8)
    exact = ExactAlpha(model, lambda: rule, TEMP, chunk=8, backend="torch", adapter=distill.distill.adapter)
    if ckpt_in:
        resumed = CheckpointManager(Path(ckpt_in), 1).load_latest(model, optimizer, {CHECKPOINT_PART: distill})
        assert resumed is not None and resumed.step == first, resumed

    seen: list[tuple[bool, bool, bool]] = []  # (adapter on, a layer's weight requires grad, the head's does)

    def record(module, args, output):
        if torch.is_grad_enabled():
            seen.append((distill.distill.adapter.active, module.weight.requires_grad,
                         lm_head.output_weight(model).requires_grad))  # fmt: skip

    model.get_decoder().layers[2].self_attn.q_proj.register_forward_hook(record)
    config = UpdateConfig(temperature=TEMP, micro_batch_size=2, lm_head_chunk=8)
    scorer = Scorer(model, chunk=8)
    advantages = torch.linspace(-1.0, 1.0, len(batch))
    steps = []
    for step, rows in enumerate((range(0, 8), range(2, 10), range(0, 9))):
        if not first <= step < last:
            continue
        picked = [batch[i] for i in rows]
        adv = advantages[list(rows)]
        seen.clear()
        _, acc, stats = learn(model, optimizer, scorer, picked, adv, config, exact)
        report = distill.run(step + 1, picked, adv)
        steps.append(
            {
                "step": step,
                "loss": stats["loss"],
                "grad_norm": stats["grad_norm"],
                "exact": acc.exact.tolist(),
                "distill": report,
                "base_grads": any(p.grad is not None for p in model.parameters()),
                "adapter_forwards_frozen": [not w and not h for on, w, h in seen if on],
                "dense_forwards_trainable": [w and h for on, w, h in seen if not on],
            }
        )
    if ckpt_out:
        # Rank 0 alone publishes adapters: the others' version is stale, and the checkpoint must hold rank 0's.
        distill.adapter_version = last if distributed.rank() == 0 else 0
        state = TrainState(run_id="dist-distill", step=last)
        CheckpointManager(Path(ckpt_out), 1).save(model, optimizer, state, {CHECKPOINT_PART: distill})
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if distributed.rank() == 0:
        Path(out).write_text(json.dumps({"world_size": distributed.world_size(), "steps": steps,
                                         "adapter_version": distill.adapter_version}))  # fmt: skip
        adapter = {k: v.detach().cpu().clone() for k, v in distill.distill.adapter_tensors().items()}
        torch.save({"params": {k: v.detach().clone() for k, v in full.items()}, "adapter": adapter}, out + ".pt")
    if distributed.active():
        torch.distributed.barrier()  # every rank done before any leaves (see publish_worker.py)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], *(int(a) for a in args[1:3]), *args[3:5])
