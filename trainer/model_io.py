"""Loading a model folder written by `sparrow model build`, or any HF-format Qwen3 checkpoint a user brings.

Checks before loading what transformers would otherwise paper over: a missing tensor it would fill
with random values, a tensor of the wrong shape, an extra one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from trainer import sparse_attention

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


class ModelLoadError(ValueError):
    """A missing or unreadable model folder, or weights that do not fit its config; one line naming the problem."""


def load_model(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The causal LM in folder `path` (HF format, safetensors), in `dtype`, eval mode, block-sparse attention installed.

    float32 (the default) is what the trainer holds whatever the checkpoint's dtype: its master
    weights and optimizer state; a bf16 run computes in bf16 from them (`[trainer] dtype`, autocast
    or FSDP2's mixed precision). A scoring-only caller may load in bf16 to halve the memory.

    Raises ModelLoadError (one line) for a missing folder, config or weights, or weights that do not
    fit the config (a missing, extra or differently shaped tensor); transformers itself would fill a
    missing tensor with random values and carry on.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # Its per-tensor progress bar would interleave with command output and service logs.
    hf_logging.disable_progress_bar()

    folder = Path(path)
    model_shapes(folder)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation=sparse_attention.register(), output_loading_info=True
        )
    except Exception as exc:
        raise ModelLoadError(f"{folder}: cannot load the model: {_one_line(exc)}") from None
    for kind in ("missing_keys", "mismatched_keys"):
        if info.get(kind):
            raise ModelLoadError(f"{folder}: weights do not fit the config ({kind}: {sorted(info[kind])[:3]})")
    return model.to(device).eval()


def model_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The state-dict names and shapes of the model in folder `path`, built on the meta device (no weights read).

    Raises ModelLoadError (one line) for a missing folder or config, a config transformers cannot read or has
    no causal-LM class for, and weight files that do not fit the config (their headers only are read).
    """
    return _meta_shapes(Path(path))[1]


def model_positions(path: str | Path) -> int | None:
    """The positions the model in folder `path` was built for (config.json's max_position_embeddings), or None;
    ModelLoadError when config.json is missing or does not read."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(Path(path))
    except Exception as exc:  # missing file, JSON errors, unknown model types: many types
        raise ModelLoadError(f"{path}/config.json: cannot read the config: {_one_line(exc)}") from None
    return getattr(config, "max_position_embeddings", None)


def _meta_shapes(folder: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: no such model folder")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder}: missing config.json")
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as exc:  # JSON errors, unknown model types, failed validators: many types
        raise ModelLoadError(f"{folder}/config.json: cannot read the config: {_one_line(exc)}") from None
    stored = _stored_shapes(folder)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # a config class without a causal LM, a model that cannot be built from it
        raise ModelLoadError(f"{folder}/config.json: no causal LM of this config: {_one_line(exc)}") from None
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    _check_weights_fit(folder, stored, wanted, getattr(config, "tie_word_embeddings", False))
    return config, wanted


def load_tokenizer(path: str | Path):
    """The tokenizer saved in model folder `path`; ModelLoadError when its files are missing or unreadable."""
    from transformers import AutoTokenizer

    folder = Path(path)
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise ModelLoadError(f"{folder}: missing tokenizer files (tokenizer.json / tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise ModelLoadError(f"{folder}: cannot load the tokenizer: {_one_line(exc)}") from None


def _stored_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    if (folder / WEIGHT_FILES[0]).is_file():
        files = [folder / WEIGHT_FILES[0]]
    elif (folder / WEIGHT_FILES[1]).is_file():
        try:
            weight_map = json.loads((folder / WEIGHT_FILES[1]).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{folder}/{WEIGHT_FILES[1]}: not a safetensors index ({_one_line(exc)})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{folder}: missing weight shard {f.name} named in {WEIGHT_FILES[1]}")
    else:
        raise ModelLoadError(f"{folder}: missing model weights ({' or '.join(WEIGHT_FILES)})")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except Exception as exc:
            raise ModelLoadError(f"{f}: not a readable safetensors file ({_one_line(exc)})") from None
    return shapes


def _check_weights_fit(folder: Path, stored: dict, wanted: dict, tied: bool) -> None:
    if tied:  # a tied output head is the embedding; checkpoints often leave it out
        stored.setdefault("lm_head.weight", wanted.get("lm_head.weight"))
    wrong = [k for k in wanted if k in stored and stored[k] != wanted[k]]
    if wrong:
        k = wrong[0]
        raise ModelLoadError(
            f"{folder}: weights do not fit config.json: {k} is {list(stored[k])} in the weights but the config "
            f"makes it {list(wanted[k])}" + (f" ({len(wrong) - 1} more tensors differ)" if len(wrong) > 1 else "")
        )
    missing = sorted(set(wanted) - set(stored))
    if missing:
        raise ModelLoadError(f"{folder}: the weights lack {len(missing)} tensor(s) the config needs, e.g. {missing[0]}")
    extra = sorted(set(stored) - set(wanted))
    if extra:
        raise ModelLoadError(
            f"{folder}: the weights hold {len(extra)} tensor(s) the config has no place for, e.g. {extra[0]}"
        )


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def check_model_folder(path: str | Path) -> str:
    """What `load_model` and `load_tokenizer` would refuse, found without loading the weights (safetensors headers
    only): ModelLoadError (one line), else a one-line summary of the folder."""
    folder = Path(path)
    config, wanted = _meta_shapes(folder)
    tokenizer = load_tokenizer(folder)
    params = sum(math.prod(shape) for shape in wanted.values())
    return (
        f"{getattr(config, 'model_type', '?')}, {params / 1e6:.1f}M parameters, "
        f"{getattr(config, 'num_hidden_layers', '?')} layers, vocabulary {len(tokenizer)}"
    )
