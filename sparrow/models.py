"""Model shapes the cost model needs, for the Qwen3 sizes of the paper or any local HF config.json."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelSpecError(ValueError):
    """An unknown model name or an unreadable config; one line naming the problem."""


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder (Qwen3 / Llama layout: GQA attention with q/k norms, SwiGLU MLP, RMSNorm, no biases)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool
    qk_norm: bool = True

    def __post_init__(self) -> None:
        for key in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelSpecError(f"{self.name}: {key} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelSpecError(
                f"{self.name}: {self.num_heads} attention heads do not split into {self.num_kv_heads} KV heads"
            )

    @property
    def kv_dim(self) -> int:
        """D: the K (equally V) dimension summed over layers, layers * kv_heads * head_dim."""
        return self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def gqa_ratio(self) -> int:
        """r: query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (2 * q_out + 2 * kv_out)  # q, k, v, o projections
        mlp = 3 * self.hidden_size * self.intermediate_size  # gate, up, down
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        return attention + mlp + norms

    @property
    def embedding_params(self) -> int:
        """Input embedding, plus the output head when it is not tied to it."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    @property
    def params(self) -> int:
        """Total parameter count (a tied output head counted once)."""
        return self.num_layers * self.layer_params + self.hidden_size + self.embedding_params

    @property
    def non_embedding_params(self) -> int:
        """Parameters outside the embedding and output head, the figure model cards also publish."""
        return self.params - self.embedding_params


def _qwen3(name: str, hidden: int, layers: int, heads: int, intermediate: int, tied: bool) -> ModelSpec:
    return ModelSpec(
        name=name,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=intermediate,
        vocab_size=151936,
        tie_embeddings=tied,
    )


# From the public config.json of each Qwen3 checkpoint. The model cards give total / non-embedding
# parameters of 1.7B / 1.4B, 4.0B / 3.6B, 8.2B / 6.95B and 14.8B / 13.2B; the 1.7B checkpoint also
# stores a copy of its tied output head, which is why hubs list it as 2.0B.
_PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _qwen3("qwen3-1.7b", hidden=2048, layers=28, heads=16, intermediate=6144, tied=True),
        _qwen3("qwen3-4b", hidden=2560, layers=36, heads=32, intermediate=9728, tied=True),
        _qwen3("qwen3-8b", hidden=4096, layers=36, heads=32, intermediate=12288, tied=False),
        _qwen3("qwen3-14b", hidden=5120, layers=40, heads=40, intermediate=17408, tied=False),
    )
}


def list_models() -> list[str]:
    """Names of the model presets."""
    return list(_PRESETS)


def get_model(name: str) -> ModelSpec:
    """The model preset `name` (case-insensitive)."""
    spec = _PRESETS.get(name.lower())
    if spec is None:
        close = difflib.get_close_matches(name.lower(), _PRESETS, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(_PRESETS)}"
        raise ModelSpecError(f"unknown model {name!r}; {hint}")
    return spec


def from_hf_config(config: dict[str, Any], name: str | None = None) -> ModelSpec:
    """A ModelSpec from the dict of a Hugging Face config.json (Qwen3, Qwen2, Llama field names)."""
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [key for key in required if key not in config]
    if missing:
        raise ModelSpecError(f"config is missing {', '.join(missing)}")
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    # Older configs omit these: KV heads then equal query heads, head_dim is hidden / heads.
    head_dim = config.get("head_dim") or (
        hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else 0
    )
    return ModelSpec(
        name=name or config.get("_name_or_path") or config.get("model_type") or "hf-model",
        hidden_size=hidden,
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=config.get("model_type", "qwen3") == "qwen3",
    )


def resolve_model(spec: str) -> ModelSpec:
    """A model preset by name, or a model described by a config.json path (or a folder holding one)."""
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or "/" in spec or path.exists():
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ModelSpecError(f"cannot read model config {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ModelSpecError(f"cannot read model config {path}: not UTF-8 text (byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise ModelSpecError(f"{path}: malformed JSON: {exc.msg} at line {exc.lineno}") from None
        except RecursionError:
            raise ModelSpecError(f"{path}: malformed JSON: nested too deeply") from None
        if not isinstance(data, dict):
            raise ModelSpecError(f"{path}: a model config must be a JSON object")
        return from_hf_config(data, name=path.parent.name or path.stem)
    return get_model(spec)
