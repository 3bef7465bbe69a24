"""Checks a policy checkpoint or a LoRA adapter must pass before the vLLM engine loads it.

vLLM's worker loads what it can: a tensor missing, of another shape or unknown is skipped or fails
after earlier layers were overwritten, and an adapter for a narrower model is copied into a corner
of each layer's buffers. So everything is checked on the host first, against the checkpoint the
engine started from (file headers only), and refused in one line as EngineError.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from services.generator.engine import EngineError

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def checkpoint_layout(folder: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the .safetensors files of a checkpoint folder (headers only)."""
    return dict(_each(folder, f"checkpoint {folder}", lambda st, name: tuple(st.get_slice(name).get_shape())))


def check_policy(folder: Path, serving: dict[str, tuple[int, ...]], version: int) -> None:
    """Refuses a policy checkpoint that the worker would load only partly, before it touches a weight: the
    tensors of the serving checkpoint (`serving`, empty: unknown), each in its shape, and no others; and one
    with NaN or inf values."""
    what = f"policy v{version} in {folder}"
    layout = checkpoint_layout(folder)
    if not layout:
        raise EngineError(f"{what}: no .safetensors weights")
    _check_layout(layout, serving, what)
    _check_finite(folder, what)


def check_policy_names(tensors: dict[str, torch.Tensor], serving: dict[str, tuple[int, ...]], version: int) -> None:
    """Refuses host tensors (a streamed policy) that are not the serving checkpoint's tensors in their shapes."""
    what = f"policy v{version}"
    if not tensors:
        raise EngineError(f"{what}: no weights")
    _check_layout({name: tuple(t.shape) for name, t in tensors.items()}, serving, what)


def _check_layout(layout: dict[str, tuple[int, ...]], serving: dict[str, tuple[int, ...]], what: str) -> None:
    if serving and set(layout) != set(serving):
        odd = sorted(set(layout) ^ set(serving))
        kind = "missing" if odd[0] in serving else "unknown"
        raise EngineError(f"{what} does not fit the serving model: tensor {odd[0]} {kind} ({len(odd)} names differ)")
    for name, shape in layout.items():
        if serving and shape != serving[name]:
            raise EngineError(
                f"{what} does not fit the serving model: {name} is {list(shape)}, serving {list(serving[name])}"
            )


def _check_finite(folder: Path, what: str) -> None:
    """Refuses NaN or inf weights: every logprob of the new version would be NaN, served as if it were fine."""
    for name, t in _tensors(folder, what):
        _require_finite(name, t, what)


def _tensors(folder: Path, what: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every .safetensors file in `folder`; a damaged file is EngineError naming it."""
    return _each(folder, what, lambda st, name: st.get_tensor(name))


def _each(folder: Path, what: str, read: Callable[[Any, str], T]) -> Iterator[tuple[str, T]]:
    """(name, read(file, name)) for every tensor of the .safetensors files in `folder`, a damaged file being
    EngineError naming it (reads inside the file's scope, so a lazily read body that fails is caught too)."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118
                    yield name, read(st, name)
        except (OSError, SafetensorError) as exc:
            raise EngineError(f"{what}: cannot read {f.name}: {exc}") from None


def _require_finite(name: str, t: torch.Tensor, what: str) -> None:
    import torch

    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise EngineError(f"{what}: tensor {name} has NaN or inf values")


def check_adapter(folder: Path, max_rank: int, base: dict[str, tuple[int, ...]] | None = None) -> None:
    """Refuses an adapter folder that vLLM would misload: config, rank, every tensor finite, and each A/B pair
    in the shape of the layer it adapts in `base` (the serving checkpoint's layout; None: unknown)."""
    cfg_path = folder / "adapter_config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise EngineError(f"adapter {folder}: cannot read adapter_config.json: {exc}") from None
    rank = cfg.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise EngineError(f"adapter {folder}: rank {rank!r} is not in [1, {max_rank}] (the engine's max_lora_rank)")
    if not any(folder.glob("*.safetensors")):
        raise EngineError(f"adapter {folder}: no .safetensors weights")
    for name, t in _tensors(folder, f"adapter {folder}"):
        _require_finite(name, t, f"adapter {folder}")
        if "lora_A" in name and t.shape[0] != rank or "lora_B" in name and t.shape[-1] != rank:
            raise EngineError(f"adapter {folder}: tensor {name} shape {tuple(t.shape)} does not match rank {rank}")
        _check_adapted_layer(folder, name, tuple(t.shape), base or {})
    if not math.isfinite(float(cfg.get("lora_alpha", rank))):
        raise EngineError(f"adapter {folder}: lora_alpha is not finite")


def _check_adapted_layer(folder: Path, name: str, shape: tuple[int, ...], base: dict[str, tuple[int, ...]]) -> None:
    # vLLM copies A and B into buffers sized for the serving model, into their top-left corner: an
    # adapter for a narrower model would load and adapt only part of each layer.
    for part, dim, side in ((".lora_A.weight", 1, "in"), (".lora_B.weight", 0, "out")):
        if name.endswith(part):
            layer = name.removesuffix(part).removeprefix("base_model.model.") + ".weight"
            if layer in base and shape[dim] != base[layer][dim]:
                raise EngineError(
                    f"adapter {folder}: tensor {name} shape {shape} does not fit the model's {layer} "
                    f"{list(base[layer])} ({side} features {base[layer][dim]})"
                )
