"""The curriculum of the chain task and the batches it yields.

Lookup forms only on very short contexts with a small name pool (DESIGN.md section 3), so training
starts there, and the pool never grows: switching to 256 names after lookup formed dropped lookup
accuracy from 0.9 to 0.2 (untrained embeddings), so long solutions come from chains that go round
the cycle instead. Prompt and solution grow stage by stage whenever the teacher-forced lookup
accuracy of the current stage passes a threshold. Batches hold a roughly constant token count.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from sparrow.tasks import ChainTask, ExampleStream, encode_words
from sparrow.tasks.vocab import BOS, EOS, PAD, TOKEN_TO_ID


@dataclass(frozen=True)
class CurriculumConfig:
    """Stage list and advancement rule."""

    start_pairs: int = 4
    start_hops: int = 2
    name_pool: int = 64
    final_pairs: int = 64
    final_hops: int = 200
    final_min_hops: int = 1
    """fewest hops of the last stage: above 1, a continued build spends its steps on the long solutions"""
    pairs_growth: float = 1.25
    """pairs of stage s = min(final, ceil(start * growth**s))"""
    hops_growth: float = 1.45
    """maximum hops of stage s = min(final, ceil(start * growth**s)); hops are drawn from [1, max]"""
    advance_accuracy: float = 0.9
    """EMA of teacher-forced accuracy on looked-up names needed to leave a stage"""
    min_stage_steps: int = 20
    replay: float = 0.2
    """share of batches drawn from an earlier stage, so short contexts are not forgotten"""
    batch_tokens: int = 4096
    max_batch: int = 64
    """short contexts: more, smaller steps (lookup forms after enough updates, not enough tokens)"""
    filler: int = 0
    """the long task's countdown per hop (sparrow.tasks.chain), the same at every stage"""
    head_share: float = 0.0
    """share of the last stage's batches made of solution heads: examples cut to their first `head_tokens`
    tokens. A solution copies the query's hop count once, so full-length batches of the long task show that
    decision about once a step; heads show it `batch_tokens // head_tokens` times, at every hop count"""
    head_tokens: int = 384


def stage_tasks(cfg: CurriculumConfig) -> list[ChainTask]:
    """The stages, from the lookup-forming one to the final difficulty."""
    tasks, s = [], 0
    while not tasks or (tasks[-1].pairs, tasks[-1].max_hops) != (cfg.final_pairs, cfg.final_hops):
        pairs = min(cfg.final_pairs, math.ceil(cfg.start_pairs * cfg.pairs_growth**s - 1e-9))
        hops = min(cfg.final_hops, math.ceil(cfg.start_hops * cfg.hops_growth**s - 1e-9))
        tasks.append(ChainTask(pairs, hops, name_pool=cfg.name_pool, filler=cfg.filler))
        s += 1
    if cfg.final_min_hops > 1:
        last = tasks[-1]
        tasks[-1] = ChainTask(last.pairs, last.max_hops, min_hops=min(cfg.final_min_hops, last.max_hops),
                              name_pool=cfg.name_pool, filler=cfg.filler)  # fmt: skip
    return tasks


@dataclass
class Batch:
    """Token ids (right-padded), loss mask (solution tokens), lookup mask (looked-up names), stage index."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    lookup_mask: torch.Tensor
    stage: int
    head: bool = False
    """rows cut to the curriculum's head_tokens (not counted in the stage's lookup accuracy)"""


class Curriculum:
    """Stateful, deterministic for a seed: which stage we are at and the batches to train on."""

    def __init__(self, cfg: CurriculumConfig, seed: int, start_at_last: bool = False) -> None:
        self.cfg = cfg
        self.tasks = stage_tasks(cfg)
        # A model that already looks things up (a continued build) goes straight to the final difficulty.
        self.stage = len(self.tasks) - 1 if start_at_last else 0
        self.stage_steps = 0
        self.ema = 0.0
        self.rng = random.Random(seed)
        self.stream = ExampleStream(self.tasks[0], seed=seed, split="train")
        self.history: list[dict] = []

    def next_batch(self) -> Batch:
        """A batch from the current stage, or now and then from an earlier one."""
        stage = self.stage
        if stage > 0 and self.rng.random() < self.cfg.replay:
            stage = self.rng.randrange(1, stage + 1) if stage > 1 else 0
        task = self.tasks[stage]
        if stage == len(self.tasks) - 1 and self.cfg.head_share and self.rng.random() < self.cfg.head_share:
            size = min(self.cfg.max_batch, max(1, self.cfg.batch_tokens // self.cfg.head_tokens))
            return collate([self.stream.next(task) for _ in range(size)], stage, task, cut=self.cfg.head_tokens)
        size = min(self.cfg.max_batch, max(1, self.cfg.batch_tokens // task.sequence_tokens()))
        return collate([self.stream.next(task) for _ in range(size)], stage, task)

    def update(self, step: int, batch: Batch, lookup_accuracy: float) -> bool:
        """Record a training step's lookup accuracy; returns True when the curriculum advanced."""
        if batch.stage != self.stage or batch.head:
            return False
        self.stage_steps += 1
        self.ema = lookup_accuracy if self.stage_steps == 1 else 0.9 * self.ema + 0.1 * lookup_accuracy
        if (
            self.stage + 1 < len(self.tasks)
            and self.stage_steps >= self.cfg.min_stage_steps
            and self.ema >= self.cfg.advance_accuracy
        ):
            self.history.append({"stage": self.stage, "task": self.tasks[self.stage].name, "left_at_step": step})
            self.stage += 1
            self.stage_steps = 0
            return True
        return False


def collate(examples: list, stage: int, task: ChainTask | None = None, cut: int | None = None) -> Batch:
    """Right-pad token ids; mark solution tokens for the loss and looked-up names for the accuracy.
    `cut`: keep only each example's first `cut` tokens (a head; a causal model's targets there are the same)."""
    pad = TOKEN_TO_ID[PAD]
    rows, solution_starts, hops = [], [], []
    for ex in examples:
        prompt = [TOKEN_TO_ID[BOS]] + encode_words(ex.prompt)
        if cut is not None and cut <= len(prompt):
            raise ValueError(f"a head of {cut} tokens holds no solution token (the prompt has {len(prompt)})")
        rows.append((prompt + encode_words(ex.solution) + [TOKEN_TO_ID[EOS]])[:cut])
        solution_starts.append(len(prompt))
        hops.append(ex.hops)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    lookup_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        loss_mask[i, solution_starts[i] : len(row)] = True
        # hop j starts at solution offset hop_tokens * j; its B (offset 2) is the looked-up name
        for off in (task or ChainTask(2, 1)).lookup_offsets(hops[i]):
            if solution_starts[i] + off < len(row):
                lookup_mask[i, solution_starts[i] + off] = True
    return Batch(ids, loss_mask, lookup_mask, stage, head=cut is not None)
