"""Delta sizes of real RL steps: the trainer's GRPO + TIS update of a project model at the trainer's defaults.

Each step samples prompt groups of the chain task from the current policy (the reference sampler),
rewards them, and runs `trainer.rl_update.grpo_update` with AdamW at the trainer's default settings
(services/trainer/config.py: lr 1e-6, betas 0.9/0.999); after each step the policy is saved in bf16
and in fp32 and the delta against the previous step's is written, as the trainer publishes them.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.trainer.config import TrainerServiceConfig
from sparrow.rewards import chain_reward
from sparrow.tasks import ChainTask, ExampleStream, encode_words
from sparrow.tasks.vocab import BOS, EOS, TOKEN_TO_ID
from sparrow.weight_delta import cast_state, write_delta
from trainer.batch import Rollout
from trainer.grpo import GRPOConfig, group_advantages
from trainer.model_io import load_model, load_tokenizer
from trainer.reference_generate import generate
from trainer.rl_update import UpdateConfig, dense_scores, grpo_update
from trainer.scoring import Scorer


def _rollouts(model, tokenizer, examples, n: int, temperature: float, max_new: int, seed: int):
    prompts = [[TOKEN_TO_ID[BOS], *encode_words(ex.prompt)] for ex in examples for _ in range(n)]
    gens = generate(
        model, prompts, None, max_new_tokens=max_new, seed=seed, eos_id=TOKEN_TO_ID[EOS], temperature=temperature
    )
    rollouts, rewards = [], []
    for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        rollouts.append(
            Rollout(
                group_id=f"g{i // n}",
                sample_index=i % n,
                prompt_ids=tuple(p),
                token_ids=tuple(g.tokens),
                logprobs=tuple(g.scores.logprobs.tolist()),
                top_ids=tuple(map(tuple, g.scores.top_ids.tolist())),
                top_logprobs=tuple(map(tuple, g.scores.top_logprobs.tolist())),
            )
        )
        rewards.append(
            chain_reward(tokenizer.decode(list(g.tokens), skip_special_tokens=True), examples[i // n].answer)
        )
    return rollouts, torch.tensor(rewards)


def real_step_deltas(
    model_dir: Path,
    steps: int,
    groups: int = 8,
    max_new_tokens: int = 128,
    seed: int = 0,
    task: tuple[int, int, int] = (24, 12, 20),
) -> dict:
    """Run `steps` real GRPO steps of `model_dir` on chain tasks of `task` = (pairs, min hops, max hops), hard
    enough that a group's rewards differ (else the step has no signal); per step the delta's share of elements
    and bytes, in bf16 and in fp32. Everything else is the trainer's default config."""
    defaults = TrainerServiceConfig.model_construct()
    o, s = defaults.optim, defaults.sampling
    model = load_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
    g = defaults.grpo
    update = UpdateConfig(
        grpo=GRPOConfig(clip_low=g.clip_low, clip_high=g.clip_high, tis_cap=g.tis_cap),
        temperature=s.temperature,
        micro_batch_size=o.micro_batch_size,
        max_grad_norm=o.max_grad_norm,
    )
    pairs, min_hops, max_hops = task
    stream = ExampleStream(ChainTask(pairs, max_hops, min_hops), seed=seed)
    rows = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sparrow-real-steps-") as tmp:
        root = Path(tmp)

        def save(step: int) -> None:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                folder = root / f"{name}-{step}"
                folder.mkdir()
                save_file(
                    {k: v.contiguous() for k, v in cast_state(state, dtype).items()}, str(folder / "m.safetensors")
                )

        save(0)
        for step in range(1, steps + 1):
            rollouts, rewards = _rollouts(
                model, tokenizer, stream.take(groups), s.n, s.temperature, max_new_tokens, seed + step
            )
            adv = torch.cat([group_advantages(rewards[i : i + s.n], s.n) for i in range(0, len(rollouts), s.n)])
            old = [d.logprobs for d in dense_scores(Scorer(model), rollouts, s.temperature, o.micro_batch_size)]
            stats = grpo_update(model, optimizer, rollouts, old, adv, update)
            save(step)
            row = {"step": step, "reward_mean": round(float(rewards.mean()), 3), "grad_norm": stats["grad_norm"]}
            for name in ("bf16", "fp32"):
                new, base = root / f"{name}-{step}", root / f"{name}-{step - 1}"
                d = write_delta(base, new, root / f"{name}-{step}.delta", step - 1, step)
                full = (new / "m.safetensors").stat().st_size
                row[name] = {
                    "changed_fraction": round(d.changed / d.elements, 5),
                    "delta_bytes": d.delta_bytes,
                    "full_bytes": full,
                    "delta_per_full": round(d.delta_bytes / full, 4),
                }
            rows.append(row)
    params = sum(p.numel() for p in model.parameters())
    return {
        "model": str(model_dir),
        "params": params,
        "lr": o.lr,
        "task": {"pairs": pairs, "min_hops": min_hops, "max_hops": max_hops},
        "groups_per_step": groups,
        "group_size": s.n,
        "steps": rows,
        "seconds": round(time.monotonic() - started, 1),
    }
