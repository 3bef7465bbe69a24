"""The trainer service over several processes: rank 0 serves and decides, every other rank follows.

Under torchrun, rank 0 is the trainer service as in one process: gRPC, feeder, store, ledger,
metrics, publishing. Every rank (rank 0 too) holds its FSDP2 shard of the policy and of the
optimizer. The other ranks do only what takes every rank: each waits for rank 0's next order (one
broadcast) and carries it out:

    train       the step's batch (each rollout's tokens, rollout logprobs, top-k lists and budgets, and
                the advantages), its number and block rule (`TrainOrder`): `trainer.rl_update.learn` on
                this rank's share -- dense scores (the old logprobs), alpha (exact too with
                alpha = "exact") and the update, the loss normalised by the global token count -- then,
                with DistillSparse, the adapter's step on its share (probe included when due)
    publish     the gathers of the full weights, a tensor at a time, that rank 0 writes
    checkpoint  this rank's shards of the step's DCP checkpoint (and the adapter, whole on every rank)
    idle        nothing: rank 0 is waiting for rollouts, and says so well within the collective timeout
    stop        exit cleanly (rank 0 has checkpointed)

Rank 0 gives an order right before the collectives it starts, so every rank enters the same
collectives in the same order. A rank that dies makes the next collective fail on the others
within `distributed.timeout_s`, and torchrun ends the rest: the trainer exits non-zero and a
restart resumes from the last checkpoint (trained groups are in its meta, never trained twice).

DistillSparse's adapter lives outside the sharded policy, whole on every rank (trainer/lora.py): each
rank builds its own, from the same seed or checkpoint, and the summed gradients keep them identical.
The block rule of the step's sparse forwards (exact alpha, the adapter) is read by rank 0 from Redis,
as the generators read it, and travels in the train order. Rank 0 alone exports the adapter's
metrics and publishes it.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.common.exits import first_line
from services.trainer.config import TrainerServiceConfig
from trainer import distributed

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from services.trainer.distill_step import DistillStep
    from trainer.batch import Rollout
    from trainer.distill import BlockRule
    from trainer.exact_alpha import ExactAlpha
    from trainer.rl_update import UpdateConfig

log = logging.getLogger("sparrow.trainer.ranks")

TRAIN, PUBLISH, CHECKPOINT, IDLE, STOP = "train", "publish", "checkpoint", "idle", "stop"


class RankSetupError(ValueError):
    """The config cannot run on this many ranks; one line."""


@dataclass
class TrainOrder:
    """What every rank needs for one step: the batch, its advantages, the step's number and block rule."""

    rollouts: list[Rollout]
    advantages: torch.Tensor
    step: int = 0
    rule: BlockRule | None = None  # the sparse forwards' (exact alpha, DistillSparse); None: neither runs


def check_world(config: TrainerServiceConfig, world: int) -> None:
    """RankSetupError when `config` cannot train on `world` ranks (checked before any rank joins a group)."""
    if world < 1:
        raise RankSetupError(f"the trainer needs at least 1 process, got a world size of {world}")
    if world == 1 and config.memory.cpu_offload:  # one process holds a plain module, no shards to offload
        raise RankSetupError("memory.cpu_offload offloads the FSDP2 shards of several trainer processes; 1 was asked")
    samples = config.groups_per_step * config.sampling.n
    if config.distributed.even_shares and samples % world:
        raise RankSetupError(
            f"distributed.even_shares: a step's {samples} samples (groups_per_step {config.groups_per_step} x "
            f"sampling.n {config.sampling.n}) do not divide over {world} trainer processes"
        )


def build_policy(config: TrainerServiceConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The policy (FSDP2-sharded over the ranks when distributed) and its AdamW, as every rank builds them.

    Its decoder layers checkpoint their activations as `[trainer.memory]` says, in one process too.
    """
    from trainer.activation_checkpoint import checkpoint_layers
    from trainer.model_io import load_model

    model = load_model(config.model_dir, config.device)
    m = config.memory
    if m.activation_checkpointing != "off":
        checkpoint_layers(model, m.checkpoint_min_tokens if m.activation_checkpointing == "auto" else 0)
    if distributed.active():
        dtype = getattr(torch, config.dtype)
        distributed.shard(model, None if dtype == torch.float32 else dtype, cpu_offload=m.cpu_offload)
    o = config.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
    return model, optimizer


def update_config(config: TrainerServiceConfig) -> UpdateConfig:
    """How every rank's update runs: the loss's knobs, temperature, micro-batches, LM-head chunk, dtype."""
    from trainer.grpo import GRPOConfig
    from trainer.rl_update import UpdateConfig

    g, o = config.grpo, config.optim
    return UpdateConfig(
        grpo=GRPOConfig(clip_low=g.clip_low, clip_high=g.clip_high, tis_cap=g.tis_cap),
        temperature=config.sampling.temperature,
        micro_batch_size=o.micro_batch_size,
        max_grad_norm=o.max_grad_norm,
        max_tokens_per_microbatch=o.max_tokens_per_microbatch,
        lm_head_chunk=o.lm_head_chunk,
        dtype=getattr(torch, config.dtype),
    )


def build_distill(
    config: TrainerServiceConfig, model: torch.nn.Module, registry: CollectorRegistry, rule: Callable[[], BlockRule]
) -> DistillStep:
    """The DistillSparse step over `model` (its adapter seeded by the config: the same on every rank)."""
    from services.trainer.distill_step import DistillStep

    return DistillStep(
        config.distill, model, registry, update_config(config).grpo, config.sampling.temperature,
        config.metrics.bin_width, config.metrics.num_bins, rule, lm_head_chunk=config.optim.lm_head_chunk,
        dtype=getattr(torch, config.dtype),
    )  # fmt: skip


def build_exact_alpha(
    config: TrainerServiceConfig, model: torch.nn.Module, rule: Callable[[], BlockRule], distill: DistillStep | None
) -> ExactAlpha:
    """The exact-alpha pass over `model`, through the DistillSparse adapter for rollouts served with one."""
    from trainer.exact_alpha import ExactAlpha

    return ExactAlpha(
        model, rule, config.sampling.temperature, config.optim.lm_head_chunk, getattr(torch, config.dtype),
        config.distill.backend, distill.distill.adapter if distill is not None else None,
    )  # fmt: skip


def apply_optim_settings(config: TrainerServiceConfig, optimizer: torch.optim.Optimizer) -> None:
    """The config's optimizer settings over a resumed checkpoint's (on every rank alike)."""
    o = config.optim
    for group in optimizer.param_groups:
        group.update(lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)


class Leader:
    """Rank 0's side: each order goes to every other rank right before the collectives it starts.

    Orders travel on a group of their own (`trainer.distributed.control_group`). While rank 0 waits
    for rollouts or scores rewards, a thread of its own sends idle orders every quarter of the
    timeout, so the others' wait for the next order never times out while rank 0 lives, and the
    model's collectives keep the short timeout. One process (not distributed): every call does nothing.
    """

    def __init__(self, timeout_s: float) -> None:
        self.group = distributed.control_group(timeout_s) if distributed.active() else None
        self.idle_every_s = timeout_s / 4
        self._lock = threading.Lock()  # one broadcast at a time on the group, in order
        self._stopped = threading.Event()
        if self.group is not None:
            threading.Thread(target=self._idle, name="rank-orders-idle", daemon=True).start()

    def order(self, kind: str, payload: object = None) -> None:
        """Tell every other rank what comes next (stop: the last order)."""
        if self.group is None:
            return
        with self._lock:
            if self._stopped.is_set():
                raise RuntimeError(f"order {kind!r} after stop")
            if kind == STOP:
                self._stopped.set()
            distributed.broadcast_object((kind, payload), group=self.group)

    def _idle(self) -> None:
        while not self._stopped.wait(self.idle_every_s):
            try:
                with self._lock:
                    if self._stopped.is_set():
                        return
                    distributed.broadcast_object((IDLE, None), group=self.group)
            except Exception as exc:  # a rank is gone: the step's next collective fails on it too
                log.error("a rank no longer takes orders (%s); the trainer ends at its next step", first_line(exc))
                return


class _Orders:
    """A rank's incoming orders: a thread takes each broadcast as it comes (idle ones dropped)."""

    def __init__(self, group) -> None:
        self.group = group
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._take, name="rank-orders", daemon=True).start()

    def _take(self) -> None:
        while True:
            try:
                kind, payload = distributed.broadcast_object(None, group=self.group)
            except Exception as exc:  # rank 0 is gone (or silent past the timeout)
                self.queue.put((_LOST, first_line(exc)))
                return
            if kind != IDLE:
                self.queue.put((kind, payload))
            if kind == STOP:
                return

    def next(self) -> tuple[str, object]:
        return self.queue.get()


_LOST = "lost"


def follow(config: TrainerServiceConfig) -> int:
    """A rank other than 0: build its shard, resume it, carry out rank 0's orders until stop. Returns the steps."""
    from prometheus_client import CollectorRegistry

    from services.trainer.checkpoint import CheckpointManager, TrainState
    from services.trainer.distill_step import CHECKPOINT_PART, StepRule, fallback_rule
    from services.trainer.weights import save_hf_policy
    from trainer.rl_update import learn
    from trainer.scoring import Scorer

    # Rank 0 decides when to stop (after its checkpoint, which takes this rank too); torchrun passes
    # SIGTERM on to every rank, and this one must not leave before that checkpoint.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    me = distributed.rank()
    orders = _Orders(distributed.control_group(config.distributed.timeout_s))  # as rank 0's Leader, first
    torch.set_num_threads(config.threads)
    model, optimizer = build_policy(config)
    rule = StepRule(lambda: fallback_rule(config.distill))  # each train order sets rank 0's rule
    # Its metrics go nowhere: rank 0 exports the adapter's.
    distill = build_distill(config, model, CollectorRegistry(), rule) if config.distill.enabled else None
    exact = build_exact_alpha(config, model, rule, distill) if config.alpha == "exact" else None
    parts = {CHECKPOINT_PART: distill} if distill is not None else {}
    checkpoints = CheckpointManager(Path(config.run_dir) / "checkpoints", config.checkpoint.keep)
    resumed = checkpoints.load_latest(model, optimizer, parts)
    apply_optim_settings(config, optimizer)
    update = update_config(config)
    scorer = Scorer(model, chunk=update.lm_head_chunk, dtype=update.dtype)
    steps = 0
    start = resumed.step if resumed else 0
    log.info("rank %d of %d follows rank 0 (from step %d)", me, distributed.world_size(), start)
    while True:
        kind, payload = orders.next()
        if kind == TRAIN:
            order: TrainOrder = payload  # type: ignore[assignment]
            if order.rule is not None:
                rule.set(order.rule)
            learn(model, optimizer, scorer, order.rollouts, order.advantages, update, exact)
            if distill is not None:
                distill.run(order.step, order.rollouts, order.advantages)
            steps += 1
        elif kind == PUBLISH:
            dtype, shard_bytes = payload
            save_hf_policy(model, None, config.model_dir, dtype, shard_bytes)  # rank 0 writes each gathered tensor
        elif kind == CHECKPOINT:
            checkpoints.save(model, optimizer, TrainState(run_id="", step=int(payload)), parts)
        elif kind == STOP:
            log.info("rank %d stops after %d step(s)", me, steps)
            return steps
        elif kind == _LOST:
            raise RuntimeError(f"rank {me}: rank 0 gave no order within the timeout ({payload})")
        else:
            raise RuntimeError(f"rank {me}: unknown order {kind!r} from rank 0")
