"""Chain following: a context of `A B ;` pairs in random order, a query `? A k :`, and a worked solution
that lists every hop (`k A B ; k-1 B C ; ... 1 Y Z ;`) before the answer `\\boxed{ Z }`.

The pairs form one cycle over distinct one-token names. A chain of k <= pairs hops never revisits a
pair: every hop's next name must be looked up in the prompt, by matching the current name where it
stands as a key (right after a `;`). Longer chains go round the cycle again, so long solutions need
no more names than the prompt has (the model's name embeddings all stay trained); their lookups reach
back into the prompt or to the same hop one lap earlier. The hop number counts down so the model
knows when to stop.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

from sparrow.tasks.vocab import BOX_CLOSE, BOX_OPEN, COLON, MAX_HOPS, MAX_NAMES, NAMES, QUERY, SEP

SPLITS = ("train", "heldout")
# The names the delivered models were trained on; tasks draw from these unless told otherwise.
DEFAULT_NAME_POOL = 64
# One example in HELDOUT_MODULUS (by a hash of its prompt) is held out; training never emits those.
HELDOUT_MODULUS = 8


class TaskError(ValueError):
    """Impossible task settings (more pairs than names, more hops than pairs, ...)."""


@dataclass(frozen=True)
class Example:
    """One task instance: the model reads `prompt`, should write `solution`, and is scored on `answer`."""

    prompt: str
    solution: str
    answer: str
    pairs: int
    hops: int
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def text(self) -> str:
        """Prompt and solution as one training text."""
        return f"{self.prompt} {self.solution}"


@dataclass(frozen=True)
class ChainTask:
    """A difficulty of the chain task: `pairs` in the context (prompt length), hops drawn from
    [min_hops, max_hops] (solution length), names drawn from the first `name_pool` names
    (default: the DEFAULT_NAME_POOL names models are trained on, or `pairs` names if more are needed)."""

    pairs: int
    max_hops: int
    min_hops: int = 1
    name_pool: int | None = None

    def __post_init__(self) -> None:
        if not 2 <= self.pairs <= MAX_NAMES:
            raise TaskError(f"pairs must be in [2, {MAX_NAMES}], got {self.pairs}")
        if self.name_pool is None:
            object.__setattr__(self, "name_pool", max(DEFAULT_NAME_POOL, self.pairs))
        if not self.pairs <= self.name_pool <= MAX_NAMES:
            raise TaskError(f"name_pool must be in [pairs={self.pairs}, {MAX_NAMES}], got {self.name_pool}")
        if not 1 <= self.min_hops <= self.max_hops <= MAX_HOPS:
            raise TaskError(
                f"hops must satisfy 1 <= min_hops <= max_hops <= {MAX_HOPS}, got {self.min_hops}..{self.max_hops}"
            )

    @property
    def name(self) -> str:
        """A short label, e.g. `p64-h32` or `p64-h1..32`."""
        hops = f"{self.max_hops}" if self.min_hops == self.max_hops else f"{self.min_hops}..{self.max_hops}"
        return f"p{self.pairs}-h{hops}"

    def prompt_tokens(self) -> int:
        """Prompt length in tokens, BOS included (fixed for a difficulty, so batches need no left padding)."""
        return 1 + 3 * self.pairs + 4

    def sequence_tokens(self, hops: int | None = None) -> int:
        """Prompt plus a correct solution of `hops` (default max_hops) hops plus EOS: the KV length reached."""
        h = self.max_hops if hops is None else hops
        return self.prompt_tokens() + 4 * h + 3 + 1

    def sample(self, rng: random.Random) -> Example:
        """Draw one example (any split) from `rng`."""
        names = rng.sample(NAMES[: self.name_pool], self.pairs)
        # names[i] -> names[i+1], cyclically: one cycle, so no chain of <= pairs hops repeats a pair
        nxt = {names[i]: names[(i + 1) % self.pairs] for i in range(self.pairs)}
        keys = list(names)
        rng.shuffle(keys)
        hops = rng.randint(self.min_hops, self.max_hops)
        start = rng.choice(names)
        context = " ".join(f"{k} {nxt[k]} {SEP}" for k in keys)
        prompt = f"{context} {QUERY} {start} {hops} {COLON}"
        steps, cur = [], start
        for remaining in range(hops, 0, -1):
            steps.append(f"{remaining} {cur} {nxt[cur]} {SEP}")
            cur = nxt[cur]
        solution = f"{' '.join(steps)} {BOX_OPEN} {cur} {BOX_CLOSE}"
        return Example(prompt=prompt, solution=solution, answer=cur, pairs=self.pairs, hops=hops)


def split_of(example: Example) -> str:
    """The split an example belongs to, decided by its prompt's content so the splits can never overlap."""
    digest = hashlib.blake2b(example.prompt.encode(), digest_size=8).digest()
    return "heldout" if int.from_bytes(digest, "little") % HELDOUT_MODULUS == 0 else "train"


def split_seed(seed: int, split: str) -> int:
    """The RNG seed of a split: disjoint seed streams, on top of the content-based split."""
    if split not in SPLITS:
        raise TaskError(f"split must be one of {SPLITS}, got {split!r}")
    return seed * 2 + SPLITS.index(split)


def generate(task: ChainTask, count: int, seed: int = 0, split: str = "train") -> list[Example]:
    """`count` examples of `split`, deterministic for (task, seed, split)."""
    return list(ExampleStream(task, seed, split).take(count))


class ExampleStream:
    """An endless deterministic stream of one split's examples; the difficulty may change between draws."""

    def __init__(self, task: ChainTask, seed: int = 0, split: str = "train") -> None:
        self.task = task
        self.split = split
        self.rng = random.Random(split_seed(seed, split))

    def next(self, task: ChainTask | None = None) -> Example:
        """The next example of this split, at `task` (default: the stream's own task)."""
        task = task or self.task
        # tiny tasks have few distinct prompts; held-out ones may all be rare, so bound the search
        for _ in range(10_000):
            ex = task.sample(self.rng)
            if split_of(ex) == self.split:
                return ex
        raise TaskError(f"could not draw a {self.split} example of {task.name}")

    def take(self, count: int, task: ChainTask | None = None) -> list[Example]:
        """The next `count` examples."""
        return [self.next(task) for _ in range(count)]
