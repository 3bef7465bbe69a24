"""Chain following: a context of `A B ;` pairs in random order, a query `? A k :`, and a worked solution
that lists every hop (`k A B ; k-1 B C ; ... 1 Y Z ;`) before the answer `\\boxed{ Z }`.

The pairs form one cycle over distinct one-token names. A chain of k <= pairs hops never revisits a
pair: every hop's next name must be looked up in the prompt, by matching the current name where it
stands as a key (right after a `;`). Longer chains go round the cycle again, so long solutions need
no more names than the prompt has (the model's name embeddings all stay trained); their lookups reach
back into the prompt or to the same hop one lap earlier. The hop number counts down so the model
knows when to stop.

The long variant (`filler` > 0) writes a countdown `F ... 1` after every hop's pair: work that needs
only the last few tokens, so a solution reaches thousands of tokens while its decisions stay few
(one lookup per hop). A lap of the cycle then spans `pairs * hop_tokens` tokens, so every lookup's
evidence (the pair in the prompt, or the same hop one lap earlier) lies that far back or further:
`evidence_distances` says exactly how far, per decision.
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
# The long task (models/long): a countdown of 30 after each hop makes a hop 34 tokens, so one lap of the
# 64-name cycle spans 2,176 tokens and every lookup after the first ~55 hops reads evidence more than 2K
# tokens back; 256 hops reach 8,905 tokens of KV.
LONG_FILLER = 30
LONG_HOPS = 256


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
    filler: int = 0
    """countdown tokens written after each hop's pair (0: the plain chain task)"""

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
        if not 0 <= self.filler <= MAX_HOPS:
            raise TaskError(f"filler must be in [0, {MAX_HOPS}], got {self.filler}")

    @property
    def name(self) -> str:
        """A short label, e.g. `p64-h32` or `p64-h1..32`."""
        hops = f"{self.max_hops}" if self.min_hops == self.max_hops else f"{self.min_hops}..{self.max_hops}"
        return f"p{self.pairs}-h{hops}" + (f"-f{self.filler}" if self.filler else "")

    @property
    def hop_tokens(self) -> int:
        """Tokens of one hop: `k A B`, the filler countdown, `;`."""
        return 4 + self.filler

    def prompt_tokens(self) -> int:
        """Prompt length in tokens, BOS included (fixed for a difficulty, so batches need no left padding)."""
        return 1 + 3 * self.pairs + 4

    def sequence_tokens(self, hops: int | None = None) -> int:
        """Prompt plus a correct solution of `hops` (default max_hops) hops plus EOS: the KV length reached."""
        h = self.max_hops if hops is None else hops
        return self.prompt_tokens() + self.hop_tokens * h + 3 + 1

    def lookup_offsets(self, hops: int) -> list[int]:
        """Offsets, within the solution's tokens, of the looked-up name of each hop (the decisions)."""
        return [self.hop_tokens * j + 2 for j in range(hops)]

    def evidence_distances(self, example: Example) -> list[int]:
        """Per decision (looked-up name), how many tokens back its nearest evidence lies: the pair in the
        prompt, or the same pair written by an earlier hop. Distances are between the position that
        predicts the name and the first token of that evidence (the key name)."""
        words = example.prompt.split()
        key_pos = {words[i]: 1 + i for i in range(0, 3 * self.pairs, 3)}  # BOS is position 0
        start = 1 + len(words)
        sol = example.solution.split()
        out, last = [], {}
        for off in self.lookup_offsets(example.hops):
            key = sol[off - 1]
            here = start + off - 1  # the position whose output is the looked-up name
            near = last.get(key, key_pos[key])
            out.append(here - near)
            last[key] = start + off - 1
        return out

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
        filler = "".join(f" {i}" for i in range(self.filler, 0, -1))
        for remaining in range(hops, 0, -1):
            steps.append(f"{remaining} {cur} {nxt[cur]}{filler} {SEP}")
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
