"""The committed models and chain-task prompts the tiny model answers, for the generator's tests."""

import random
from pathlib import Path

from sparrow.tasks.chain import ChainTask
from sparrow.tasks.vocab import encode_words

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "models" / "tiny"
SMALL = ROOT / "models" / "small"  # the same architecture as tiny, other weights: a "new policy version"
BOS = 1


def chain_prompt(pairs: int = 8, hops: int = 4, seed: int = 1) -> list[int]:
    """Token ids (BOS first) of a chain-task prompt (3 * pairs + 5 tokens) the tiny model answers, ending with EOS."""
    return [BOS, *encode_words(ChainTask(pairs, hops, hops).sample(random.Random(seed)).prompt)]
