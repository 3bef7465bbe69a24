"""Synthetic RLVR tasks whose answers need facts far back in the context (pure Python, no torch)."""

from sparrow.tasks.chain import (
    SPLITS,
    ChainTask,
    Example,
    ExampleStream,
    TaskError,
    generate,
    split_of,
)
from sparrow.tasks.vocab import VOCAB, encode_words

__all__ = [
    "SPLITS",
    "VOCAB",
    "ChainTask",
    "Example",
    "ExampleStream",
    "TaskError",
    "encode_words",
    "generate",
    "split_of",
]
