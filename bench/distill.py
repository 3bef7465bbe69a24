"""DistillSparse on a small model under a fixed aggressive schedule: p5 per length bin before and after.

The policy stays fixed (no dense update), so whatever moves is the adapter's doing. Each training
step samples `groups` held-in prompts x `group_size` samples from the sparse actor (policy + current
adapter, block-sparse decode, the project's reference decode loop), rewards them with the chain
task's exact-match reward, and runs the adapter's update (trainer/distill.py: GRPO + TIS on the
sparse forward, plus lambda * k3 KL to the dense policy) under the budgets each position was
decoded with. Before and after, held-out prompts are sampled by the sparse actor and every
generated token is compared with the dense policy's distribution (exact alpha), giving the p5 and
mean per KV-length bin; after training the same tokens are also scored without the adapter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sparrow.acceptance import binned_stats
from sparrow.schedule import Schedule
from trainer.batch import Rollout
from trainer.distill import BlockRule, DistillConfig, DistillSparse, rollout_of

DEFAULT_BUDGETS = (64, 112, 160, 224)  # per 128-token bin; every layer sparse


@dataclass(frozen=True)
class DistillBenchSettings:
    """What the experiment runs; see `sparrow bench distill --help`."""

    model: str = "models/small"
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    bin_width: int = 128
    pairs: int = 64
    hops: int = 60
    steps: int = 30
    groups: int = 4
    group_size: int = 4
    heldout: int = 16
    seed: int = 0
    distill: DistillConfig = field(
        default_factory=lambda: DistillConfig(lr=1e-4, kl_coef=1.0, epochs=2, micro_batch_size=8, backend="auto")
    )

    def schedule(self) -> Schedule:
        """The fixed schedule: these budgets, every layer sparse (the small model's lookup lives in layers 0-1)."""
        return Schedule(budgets=self.budgets, bin_width=self.bin_width, dense_layers=(), name="distill-bench")


@dataclass
class DistillBenchResult:
    settings: dict[str, Any]
    # per bin: kv_start, tokens, p5, mean, lookups, lookups_failed (sparse actor, identity adapter)
    before: list[dict[str, Any]]
    after: list[dict[str, Any]]  # per bin: also p5_without, mean_without, lookups_failed_without (same tokens)
    reward_before: float
    reward_after: float
    steps: list[dict[str, float]]  # per training step: loss, kl, reward, ...
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Sampler:
    """Chain-task prompts, sparse sampling with the actor, rewards."""

    def __init__(self, s: DistillBenchSettings, tokenizer, schedule: Schedule) -> None:
        from sparrow.tasks import ChainTask, ExampleStream

        task = ChainTask(pairs=s.pairs, max_hops=s.hops, min_hops=s.hops)
        self.train = ExampleStream(task, seed=s.seed, split="train")
        self.heldout = ExampleStream(task, seed=s.seed, split="heldout").take(s.heldout)
        self.tokenizer, self.schedule, self.settings = tokenizer, schedule, s
        self.max_new = task.sequence_tokens() - task.prompt_tokens() + 4

    def sample(self, model, examples, n: int, seed: int) -> tuple[list[Rollout], list[float]]:
        from sparrow.rewards import chain_reward
        from sparrow.tasks.vocab import EOS, TOKEN_TO_ID
        from trainer.reference_generate import generate

        prompts = [list(self.tokenizer(e.prompt)["input_ids"]) for e in examples for _ in range(n)]
        gens = generate(
            model, prompts, self.schedule, self.max_new, seed=seed, eos_id=TOKEN_TO_ID[EOS],
            backend=self.settings.distill.backend,
        )  # fmt: skip
        answers = [e.answer for e in examples for _ in range(n)]
        rollouts, rewards = [], []
        for i, (p, g, answer) in enumerate(zip(prompts, gens, answers, strict=True)):
            rewards.append(chain_reward(self.tokenizer.decode(g.tokens, skip_special_tokens=True), answer))
            rollouts.append(rollout_of(p, g, f"g{i // n}", i % n))
        return rollouts, rewards


def _bins(alpha: torch.Tensor, kv: torch.Tensor, width: int) -> dict[int, tuple[int, float, float]]:
    return {b.index: (b.count, b.quantile, b.mean) for b in binned_stats(alpha, kv, width)}


# A looked-up name counts as failed when its alpha is below this: the sparse actor then puts most of
# its mass elsewhere than the dense policy does (alpha is bimodal on this task: near 0 or near 1).
LOOKUP_FAILED_BELOW = 0.5


def lookup_mask(rollouts: Sequence[Rollout]) -> torch.Tensor:
    """Bool per response token of `rollouts` (concatenated, the probe's order): the names a hop looks up.

    A hop is written `k A B ;`: B, two tokens after the countdown number k, is the name found in the
    prompt's pairs (or in an earlier lap of the solution).
    """
    from sparrow.tasks.vocab import NUMBERS, TOKEN_TO_ID

    numbers = {TOKEN_TO_ID[n] for n in NUMBERS}
    out = []
    for r in rollouts:
        ids = r.token_ids
        out += [t >= 2 and ids[t - 2] in numbers for t in range(len(ids))]
    return torch.tensor(out, dtype=torch.bool)


def _failed_lookups(alpha: torch.Tensor, kv: torch.Tensor, lookups: torch.Tensor, width: int) -> dict[int, tuple]:
    bins = torch.div(kv[lookups], width, rounding_mode="floor")
    failed = alpha[lookups] < LOOKUP_FAILED_BELOW
    return {int(b): (int((bins == b).sum()), int((failed & (bins == b)).sum())) for b in bins.unique()}


def _measure(distill: DistillSparse, sampler: _Sampler, rule: BlockRule, seed: int, both: bool) -> tuple:
    """Sample the held-out prompts with the actor; exact alpha per bin against dense (and without the adapter),
    and the share of looked-up names that fail (alpha < LOOKUP_FAILED_BELOW)."""
    with distill.adapter.on():
        rollouts, rewards = sampler.sample(distill.policy, sampler.heldout, 1, seed)
    width = sampler.settings.bin_width
    probe = distill.probe(rollouts, rule)
    lookups = lookup_mask(rollouts)
    with_bins = _bins(probe.with_adapter, probe.kv_lens, width)
    with_failed = _failed_lookups(probe.with_adapter, probe.kv_lens, lookups, width)
    without_bins = _bins(probe.without_adapter, probe.kv_lens, width) if both else {}
    without_failed = _failed_lookups(probe.without_adapter, probe.kv_lens, lookups, width) if both else {}
    rows = []
    for b, (count, p5, mean) in sorted(with_bins.items()):
        looked, failed = with_failed.get(b, (0, 0))
        row = {"bin": b, "kv_start": b * width, "tokens": count, "p5": p5, "mean": mean, "lookups": looked}
        row["lookups_failed"] = failed / looked if looked else None
        if both:
            row.update(p5_without=without_bins[b][1], mean_without=without_bins[b][2])
            looked, failed = without_failed.get(b, (0, 0))
            row["lookups_failed_without"] = failed / looked if looked else None
        rows.append(row)
    return rows, sum(rewards) / len(rewards)


def run_distill_bench(settings: DistillBenchSettings, log: Callable[[str], None] = print) -> DistillBenchResult:
    """Run the experiment; `log` receives one line per phase and per training step."""
    from trainer.grpo import group_advantages
    from trainer.model_io import load_model, load_tokenizer

    start = time.monotonic()
    schedule = settings.schedule()
    rule = BlockRule.of(schedule)
    policy = load_model(settings.model)
    distill = DistillSparse(policy, settings.distill)
    sampler = _Sampler(settings, load_tokenizer(settings.model), schedule)
    log(f"schedule {schedule.compact()} per {settings.bin_width}-token bin, every layer sparse")
    before, reward_before = _measure(distill, sampler, rule, settings.seed + 10_000, both=False)
    log("before: p5 per bin " + _text(before) + f"; reward {reward_before:.3f}")
    steps: list[dict[str, float]] = []
    for step in range(settings.steps):
        t0 = time.monotonic()
        examples = sampler.train.take(settings.groups)
        with distill.adapter.on():
            rollouts, rewards = sampler.sample(distill.policy, examples, settings.group_size, settings.seed + step)
        advantages = group_advantages(torch.tensor(rewards), settings.group_size)
        stats = distill.train_step(rollouts, advantages, rule)
        steps.append({"step": step + 1, "reward": sum(rewards) / len(rewards), **stats})
        log(
            f"step {step + 1}: reward {steps[-1]['reward']:.3f} loss {stats['loss']:.4f} kl {stats['kl']:.4f} "
            f"selection {stats['selection']:.4f} grad norm {stats['grad_norm']:.3f} ({time.monotonic() - t0:.1f} s)"
        )
    after, reward_after = _measure(distill, sampler, rule, settings.seed + 10_000, both=True)
    log("after:  p5 per bin " + _text(after) + f"; reward {reward_after:.3f}")
    d = asdict(settings)
    d["distill"]["grpo"] = asdict(settings.distill.grpo)
    return DistillBenchResult(d, before, after, reward_before, reward_after, steps, time.monotonic() - start)


def _text(rows: Sequence[dict[str, Any]]) -> str:
    def failed(r: dict[str, Any]) -> str:
        return "" if r["lookups_failed"] is None else f", lookups failed {r['lookups_failed']:.3f}"

    return ", ".join(
        f"{r['kv_start']}+: {r['p5']:.3f} (mean {r['mean']:.3f}, {r['tokens']} tokens{failed(r)})" for r in rows
    )


def plot(result: DistillBenchResult, path: str | Path) -> None:
    """PNG: p5 and mean alpha per bin before/after (and after without the adapter), and the training curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = result.settings["bin_width"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, stat in zip(axes[:2], ("p5", "mean"), strict=True):
        for rows, key, label, style in (
            (result.before, stat, "before (identity adapter)", {"color": "tab:gray", "marker": "o"}),
            (result.after, f"{stat}_without", "after, same tokens without adapter", {"color": "tab:blue", "ls": ":"}),
            (result.after, stat, "after (sparse + LoRA)", {"color": "tab:red", "marker": "s", "lw": 2}),
        ):
            ax.plot([r["kv_start"] + width / 2 for r in rows], [r[key] for r in rows], label=label, **style)
        ax.set_xlabel("KV length (tokens)")
        ax.set_ylabel(f"{'5th percentile' if stat == 'p5' else 'mean'} of exact alpha")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_title("tail acceptance (p5) per bin, held-out prompts")
    axes[1].set_title("mean acceptance per bin")
    axes[0].legend(fontsize=8)
    x = [s["step"] for s in result.steps]
    axes[2].plot(x, [s["kl"] for s in result.steps], label="k3 KL (sampled tokens)", color="tab:purple")
    axes[2].plot(x, [s["loss"] for s in result.steps], label="loss", color="tab:green", ls="--")
    if any(s.get("selection", 0.0) > 0 for s in result.steps):
        axes[2].plot(x, [s["selection"] for s in result.steps], label="selection loss", color="tab:orange")
    axes[2].set_xlabel("adapter step")
    axes[2].set_title("adapter training")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
