"""A word-level tokenizer over the task vocabulary, built offline and saved in HF format.

The prompt format is plain text (no chat template): `<s>` + the prompt's words; the model continues
with the solution and `</s>`.
"""

from __future__ import annotations

import json
from pathlib import Path

from sparrow.tasks.vocab import BOS, EOS, PAD, TOKEN_TO_ID, UNK, VOCAB


def build_tokenizer():
    """A `tokenizers.Tokenizer` whose ids equal `sparrow.tasks.vocab.TOKEN_TO_ID` and that prepends BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(vocab=dict(TOKEN_TO_ID), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, TOKEN_TO_ID[BOS])]
    )
    tok.add_special_tokens([PAD, BOS, EOS, UNK])
    return tok


def save_tokenizer(out_dir: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json so AutoTokenizer loads them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
        **specials,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def vocab_size() -> int:
    """Number of tokens (the model's embedding rows)."""
    return len(VOCAB)
