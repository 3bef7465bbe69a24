"""The closed vocabulary of the synthetic tasks: special tokens, symbols, hop numbers and one-token names.

Every task text is whitespace-separated words from this list, so a word-level tokenizer covers it
exactly and the model never sees a name split into pieces (one-token names make lookup a single match).
"""

from __future__ import annotations

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
SEP, QUERY, COLON, BOX_OPEN, BOX_CLOSE = ";", "?", ":", "\\boxed{", "}"
SYMBOLS: tuple[str, ...] = (SEP, QUERY, COLON, BOX_OPEN, BOX_CLOSE)
MAX_NAMES = 256
MAX_HOPS = 256

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _make_names(count: int) -> tuple[str, ...]:
    # consonant-vowel-consonant words: pronounceable, never digits or symbols, so never another token
    names = [c1 + v + c2 for c1 in _CONSONANTS for v in _VOWELS for c2 in _CONSONANTS]
    # interleave so that a small pool (the first n names) is still varied to the eye
    stride = 97
    assert len(names) % stride != 0
    order = [names[(i * stride) % len(names)] for i in range(len(names))]
    return tuple(order[:count])


NAMES: tuple[str, ...] = _make_names(MAX_NAMES)
NUMBERS: tuple[str, ...] = tuple(str(i) for i in range(1, MAX_HOPS + 1))
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + SYMBOLS + NUMBERS + NAMES
TOKEN_TO_ID: dict[str, int] = {tok: i for i, tok in enumerate(VOCAB)}


def encode_words(text: str) -> list[int]:
    """Token ids of a task text (no BOS/EOS added); raises KeyError on a word outside the vocabulary."""
    return [TOKEN_TO_ID[w] for w in text.split()]
