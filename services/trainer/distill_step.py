"""DistillSparse in the trainer service: after each dense update, train the adapter, probe it, publish it.

Per step (StepRunner calls `run` once the dense policy has stepped):
  - rollouts whose budgets the teacher-forced forward cannot reproduce (not multiples of 16 tokens)
    are left out of the adapter's batch, counted and logged; the step itself goes on;
  - on a probe step (every `probe_every` steps, from the first), `probe_samples` rollouts are held
    out of the adapter's batch and scored three ways (dense, sparse with and without the adapter):
    exact alpha per token, p5 per KV-length bin, exported both ways;
  - the adapter trains on the rest (trainer/distill.py), under the block rule of the schedule the
    generators read from Redis (sink, local, dense layers; the budgets come from each rollout).
The service then publishes the adapter (`publish`) right after the policy it was trained against,
and checkpoints it with the model: this object is the checkpoint's "distill" part (DCP Stateful).

Under torchrun every rank holds one of these and runs `run` on the same batch with the same block
rule (`StepRule`: rank 0 reads it and sends it with the step's order), each training and probing its
share; the adapter is whole and identical on every rank. Rank 0 alone exports the metrics, logs,
and publishes.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Gauge

from services.trainer.config import DistillSection
from services.trainer.weights import ADAPTER, WeightStore
from sparrow import metrics_contract as mc
from sparrow.acceptance import DEFAULT_QUANTILE, binned_stats
from sparrow.budget import PAGE_SIZE, reproducible
from trainer import distributed
from trainer.batch import Rollout
from trainer.distill import BlockRule, DistillConfig, DistillSparse
from trainer.grpo import GRPOConfig
from trainer.lm_head import DEFAULT_CHUNK

log = logging.getLogger("sparrow.trainer.distill")

CHECKPOINT_PART = "distill"
SIDECAR = "sparrow_adapter.json"  # which policy version and step an adapter was trained against


class DistillMetrics:
    """The adapter's Prometheus metrics, on the trainer's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.loss = Gauge(
            "sparrow_trainer_distill_loss",
            "Adapter loss L_PPO + lambda * k3 (+ selection_coef * selection loss), last step.",
            registry=r,
        )
        self.kl = Gauge(
            "sparrow_trainer_distill_kl",
            "k3 estimate of KL(sparse+LoRA || dense) per sampled token, last step, before its update.",
            registry=r,
        )
        self.selection = Gauge(
            "sparrow_trainer_distill_selection_loss",
            "Selection loss of the adapter's last step (0 when selection_coef is 0): how far page scores rank "
            "the pages from the attention mass they hold.",
            registry=r,
        )
        self.adapter_version = Gauge("sparrow_trainer_adapter_version", "Latest published adapter version.", registry=r)
        self.with_adapter = Gauge(
            "sparrow_trainer_alpha_probe_with_adapter_p5",
            "p5 of exact alpha, sparse+LoRA vs dense, on the last probe's held-out rollouts.",
            [mc.BIN_LABEL],
            registry=r,
        )
        self.without_adapter = Gauge(
            "sparrow_trainer_alpha_probe_without_adapter_p5",
            "p5 of exact alpha, sparse without the adapter vs dense, on the same rollouts.",
            [mc.BIN_LABEL],
            registry=r,
        )
        self._bins: set[int] = set()

    def show_probe(self, with_adapter: dict[int, float], without_adapter: dict[int, float]) -> None:
        """Set both p5 gauges per bin; a bin seen before and absent now reads NaN (no stale value)."""
        self._bins |= set(with_adapter)
        for b in sorted(self._bins):
            label = {mc.BIN_LABEL: mc.bin_label(b)}
            self.with_adapter.labels(**label).set(with_adapter.get(b, math.nan))
            self.without_adapter.labels(**label).set(without_adapter.get(b, math.nan))


def read_block_rule(client: Any, fallback: BlockRule) -> BlockRule:
    """The block rule of the schedule in Redis (the one the generators follow), or `fallback` without one."""
    from sparrow.schedule import Schedule

    try:
        raw = client.get(mc.SCHEDULE_KEY)
        if raw is None:
            return fallback
        return BlockRule.of(Schedule.from_json(raw.decode() if isinstance(raw, bytes) else raw))
    except Exception as exc:  # Redis down or a schedule it cannot parse: train on, with the configured rule
        log.warning("cannot read the schedule's block rule from Redis (%s); using the configured one", exc)
        return fallback


class StepRule:
    """The block rule of the step in progress: one value for the exact-alpha pass and the adapter, on every rank.

    Rank 0 reads it once per step (`refresh`, from Redis: `read_block_rule`) before it orders the step,
    and sends it with the order; the other ranks take it from there (`set`). Called, it gives the step's
    rule (read now when no step has set one).
    """

    def __init__(self, read: Callable[[], BlockRule]) -> None:
        self._read = read
        self._rule: BlockRule | None = None

    def refresh(self) -> BlockRule:
        """Read the rule for the step about to run."""
        self._rule = self._read()
        return self._rule

    def set(self, rule: BlockRule) -> None:
        """The rule rank 0 read for this step."""
        self._rule = rule

    def __call__(self) -> BlockRule:
        return self._rule if self._rule is not None else self.refresh()


def fallback_rule(config: DistillSection) -> BlockRule:
    """The configured block rule, for when Redis holds no schedule."""
    return BlockRule(config.sink_blocks, config.local_blocks, frozenset(config.dense_layers))


class DistillStep:
    """The adapter of one trainer: training, probes, metrics, publishing and its checkpoint state."""

    def __init__(
        self,
        config: DistillSection,
        model: torch.nn.Module,
        registry: CollectorRegistry,
        grpo: GRPOConfig,
        temperature: float,
        bin_width: int,
        num_bins: int | None,
        rule_source: Callable[[], BlockRule] | None = None,
        lm_head_chunk: int = DEFAULT_CHUNK,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.config = config
        self.fallback = fallback_rule(config)
        self.rule_source = rule_source or (lambda: self.fallback)
        self.distill = DistillSparse(
            model,
            DistillConfig(
                rank=config.rank,
                alpha=config.alpha,
                target_modules=tuple(config.target_modules),
                lr=config.lr,
                weight_decay=config.weight_decay,
                max_grad_norm=config.max_grad_norm,
                kl_coef=config.kl_coef,
                kl_clamp=config.kl_clamp,
                kl_estimator=config.kl_estimator,
                selection_coef=config.selection_coef,
                epochs=config.epochs,
                micro_batch_size=config.micro_batch_size,
                temperature=temperature,
                grpo=grpo,
                backend=config.backend,
                seed=config.seed,
                max_tokens_per_microbatch=config.max_tokens_per_microbatch,
                lm_head_chunk=lm_head_chunk,
                dtype=dtype,
            ),
        )
        self.metrics = DistillMetrics(registry)
        self.bin_width, self.num_bins = bin_width, num_bins
        self.adapter_version = 0  # the last one published (0: none yet)

    # -- one step -------------------------------------------------------------------------------------

    def run(self, step: int, rollouts: Sequence[Rollout], advantages: torch.Tensor) -> dict[str, Any]:
        """Train the adapter on the step's rollouts (after the dense update); probe when due. Returns figures."""
        rows = [i for i, r in enumerate(rollouts) if reproducible(r.kv_budgets, len(r.token_ids))]
        skipped = len(rollouts) - len(rows)
        lead = distributed.rank() == 0  # the others train alike and stay quiet
        if skipped and lead:
            log.warning(
                "step %d: %d rollout(s) with budgets that are not multiples of %d left out", step, skipped, PAGE_SIZE
            )
        rule = self.rule_source()
        report: dict[str, Any] = {"skipped": skipped}
        c = self.config
        if c.probe_every and (step - 1) % c.probe_every == 0 and len(rows) > 1:
            held, rows = rows[: min(c.probe_samples, len(rows) - 1)], rows[min(c.probe_samples, len(rows) - 1) :]
            report["probe"] = self._probe([rollouts[i] for i in held], rule)
        if not rows:
            return report
        stats = self.distill.train_step([rollouts[i] for i in rows], advantages[rows], rule)
        self._check_replicas(step)
        keys = ("loss", "ppo_loss", "kl", "selection", "grad_norm", "tis_clip_fraction", "tokens")
        report.update({k: stats[k] for k in keys})
        if not lead:
            return report
        self.metrics.loss.set(stats["loss"])
        self.metrics.kl.set(stats["kl"])
        self.metrics.selection.set(stats["selection"])
        log.info(
            "step %d: adapter loss %.4f (ppo %.4f, kl %.4f, selection %.4f) on %d tokens, grad norm %.3f",
            step, stats["loss"], stats["ppo_loss"], stats["kl"], stats["selection"], int(stats["tokens"]),
            stats["grad_norm"],
        )  # fmt: skip
        return report

    def _check_replicas(self, step: int) -> None:
        """Our invariant: every rank's copy of the adapter is the same, bit for bit (same start, same summed
        gradients, same AdamW). A rank that resumed another adapter would otherwise train on unnoticed."""
        if distributed.world_size() == 1:
            return
        mine = [(float(t.double().sum()), float(t.double().abs().sum())) for t in self.distill.lora_params]
        if any(other != mine for other in distributed.gather_objects(mine)):
            raise RuntimeError(f"step {step}: the ranks' copies of the DistillSparse adapter differ")

    def _probe(self, rollouts: list[Rollout], rule: BlockRule) -> list[dict[str, Any]]:
        probe = self.distill.probe(rollouts, rule)
        q = DEFAULT_QUANTILE
        both = zip(
            binned_stats(probe.with_adapter, probe.kv_lens, self.bin_width, q, self.num_bins),
            binned_stats(probe.without_adapter, probe.kv_lens, self.bin_width, q, self.num_bins),
            strict=True,
        )
        rows = [
            {"bin": w.index, "kv_start": w.kv_start, "tokens": w.count, "p5_with": w.quantile, "p5_without": o.quantile}
            for w, o in both
        ]
        if distributed.rank() != 0:
            return rows
        self.metrics.show_probe({r["bin"]: r["p5_with"] for r in rows}, {r["bin"]: r["p5_without"] for r in rows})
        log.info(
            "adapter probe, p5 with/without per bin: %s",
            " ".join(f"{r['bin']}:{r['p5_with']:.3f}/{r['p5_without']:.3f}" for r in rows),
        )
        return rows

    # -- publishing -----------------------------------------------------------------------------------

    def publish(self, weights: WeightStore, policy_version: int, step: int) -> int:
        """Publish the adapter as the next adapter version, trained against `policy_version`; returns the version.

        An adapter holding NaN or infinite values is not published (generators would refuse it
        anyway): the previous version keeps serving, and the returned version is that one.
        """
        bad = [n for n, t in self.distill.adapter_tensors().items() if not bool(torch.isfinite(t).all())]
        if bad:
            log.error("step %d: adapter tensor %s is not finite; adapter v%d stays", step, bad[0], self.adapter_version)
            return self.adapter_version
        version = max(weights.latest(ADAPTER), self.adapter_version) + 1
        self._publish(weights, version, policy_version, step)
        return version

    def publish_start(self, weights: WeightStore, policy_version: int, step: int) -> None:
        """At start: make the adapter generators load the one this trainer continues from.

        Adapters published after the checkpoint died with the crash; the checkpoint's adapter goes out
        under a version above every published one. A run that never published one publishes nothing.
        """
        latest = weights.latest(ADAPTER)
        if latest == self.adapter_version:
            return
        version = max(latest + 1, self.adapter_version)
        log.warning("adapter versions up to %d were published after the checkpoint; continuing as %d", latest, version)
        self._publish(weights, version, policy_version, step)

    def _publish(self, weights: WeightStore, version: int, policy_version: int, step: int) -> None:
        c = self.config

        def write(out: Path) -> None:
            self.distill.save_adapter(out)
            # peft adds a model card naming the base model's folder; generators need only config and tensors.
            (out / "README.md").unlink(missing_ok=True)
            meta = {"adapter_version": version, "policy_version": policy_version, "step": step}
            (out / SIDECAR).write_text(json.dumps(meta) + "\n")

        weights.publish(ADAPTER, version, write, c.rank, tuple(c.target_modules))
        self.adapter_version = version
        self.metrics.adapter_version.set(version)

    # -- checkpoint (torch.distributed.checkpoint Stateful) --------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Adapter, its optimizer and the last published adapter version."""
        return {"adapter": self.distill.state_dict(), "adapter_version": torch.tensor(self.adapter_version)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.distill.load_state_dict(state["adapter"])
        self.adapter_version = int(state["adapter_version"])
        self.metrics.adapter_version.set(self.adapter_version)
