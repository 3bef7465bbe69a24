"""A LoRA adapter outside the policy's module tree, applied by forward hooks while it is switched on.

The adapter's A and B matrices live in a small module of their own (`LoraAdapter`), float32, one
full copy per process: under FSDP2 every rank holds the whole adapter (replicated, a few MB at rank
8), so its updates need no sharding, only an all-reduce of its gradients (trainer/distill.py).
Forward hooks on the target Linear modules of the one policy model (q/k/v/o_proj of every decoder
layer by default) add `scale * B(A(x))` to their output, but only inside `adapter.on()`: the dense
path (scoring, the GRPO update, the dense references) runs with the adapter off and is bit for bit
the plain policy, while its parameter names, optimizer, checkpoints and published weights are
exactly what they are without an adapter. `on(rows=...)` switches it on for some rows of the
batch only, so a micro-batch mixing rollouts served with and without the adapter runs one forward.

Activation checkpointing (trainer/activation_checkpoint.py) recomputes a layer's forward inside
the backward, after `on()` may have been left: the adapter registers the state it had at each
checkpointed forward with the model, and the recompute runs under that same state.

Precision: the product runs in the dtype of the Linear's input, the A and B master weights cast to
it (their gradients flow back to the float32 masters). Under FSDP2 with a bf16 compute dtype (or
bf16 autocast in one process) that is bf16, as the engines hold adapters in the model's dtype
(vLLM's LoRA weights are bf16 for a bf16 model); in float32 it is float32, the order of operations
being peft's, so the same A and B through these hooks and through peft agree to rounding.

Files stay peft's: `save` writes adapter_config.json (peft's own `LoraConfig` writer, the fields
peft writes for this adapter) and adapter_model.safetensors with peft's tensor names
(base_model.model.<module>.lora_A.weight), which peft's `PeftModel.from_pretrained` and vLLM load.
The in-memory names (`named_parameters`) are those peft gave the adapter in the policy's tree
(<module>.lora_A.default.weight), so checkpoints keep their keys. Initialisation is peft's default:
for each target module in the model's order, A then B are created as `nn.Linear` and A is drawn
again kaiming-uniform (a = sqrt 5), B set to zero, all under the config's seed (the random numbers
peft draws, in the same order), so the adapter starts as the identity.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

ADAPTER_NAME = "default"  # peft's name of the one adapter; part of the in-memory parameter names
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_FILE_PREFIX = "base_model.model."  # peft's prefix of the saved tensor names (PeftModel -> LoraModel -> model)


class LoraAdapter(nn.Module):
    """LoRA A/B matrices for the target Linear modules of `model`, hooked into it, active only inside `on()`."""

    def __init__(
        self,
        model: nn.Module,
        rank: int,
        alpha: float,
        target_modules: Sequence[str],
        seed: int = 0,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        if rank < 1 or not target_modules:
            raise ValueError("a LoRA adapter needs rank >= 1 and at least one target module")
        self.rank, self.alpha, self.target_modules = rank, float(alpha), tuple(target_modules)
        self.scale = self.alpha / rank
        self._active = False
        self._rows: torch.Tensor | None = None
        self._name_or_path = model.__dict__.get("name_or_path")
        self._base_class = _unwrapped_class(model)
        targets = [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and _matches(name, target_modules)
        ]
        if not targets:
            raise ValueError(f"the model has no Linear module named {', '.join(target_modules)}")
        self.targets: list[str] = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for name, linear in targets:
                # peft's creation order and draws: A, then B (each nn.Linear draws its default init), then A again.
                a = nn.Linear(linear.in_features, rank, bias=False)
                b = nn.Linear(rank, linear.out_features, bias=False)
                nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
                nn.init.zeros_(b.weight)
                _container(self, f"{name}.lora_A").add_module(ADAPTER_NAME, a)
                _container(self, f"{name}.lora_B").add_module(ADAPTER_NAME, b)
                self.targets.append(name)
        self.to(device=device if device is not None else _device_of(model), dtype=torch.float32)
        self._pairs = {name: (self._leaf(f"{name}.lora_A"), self._leaf(f"{name}.lora_B")) for name in self.targets}
        self._handles = [linear.register_forward_hook(self._hook(name)) for name, linear in targets]
        from trainer.activation_checkpoint import keep_state_for_recompute

        keep_state_for_recompute(model, self._replay)

    def _leaf(self, path: str) -> nn.Linear:
        return self.get_submodule(f"{path}.{ADAPTER_NAME}")

    # -- switching ------------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Whether forwards of the model apply the adapter now."""
        return self._active

    @contextlib.contextmanager
    def on(self, rows: torch.Tensor | None = None) -> Iterator[None]:
        """Apply the adapter in the model's forwards inside this context; `rows` [batch] bool: to those rows only."""
        before = (self._active, self._rows)
        self._active, self._rows = True, rows
        try:
            yield
        finally:
            self._active, self._rows = before

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """No adapter inside this context (even within `on()`): the plain policy."""
        before = (self._active, self._rows)
        self._active, self._rows = False, None
        try:
            yield
        finally:
            self._active, self._rows = before

    def _replay(self):
        """A context that puts back the state the adapter has now (for the recompute of a checkpointed forward)."""
        state = (self._active, self._rows)

        @contextlib.contextmanager
        def replay() -> Iterator[None]:
            before = (self._active, self._rows)
            self._active, self._rows = state
            try:
                yield
            finally:
                self._active, self._rows = before

        return replay()

    def _hook(self, name: str):
        def hook(_module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if not self._active:
                return None
            x = args[0]
            a, b = self._pairs[name]
            # In the input's dtype: bf16 under a bf16 FSDP2 policy or autocast, as the engines run it.
            delta = nn.functional.linear(nn.functional.linear(x, a.weight.to(x.dtype)), b.weight.to(x.dtype))
            delta = delta * self.scale
            if self._rows is not None:
                keep = self._rows.to(device=delta.device, dtype=torch.bool).view(-1, *([1] * (delta.dim() - 1)))
                delta = torch.where(keep, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))
            return output + delta.to(output.dtype)

        return hook

    def remove(self) -> None:
        """Take the hooks off the model (the adapter no longer applies, even inside `on()`)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- tensors and files ----------------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors by their in-memory name (<module>.lora_A.default.weight), detached."""
        return {n: p.detach() for n, p in self.named_parameters()}

    def peft_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as peft saves them: base_model.model.<module>.lora_A.weight, float32, on the CPU."""
        out = {}
        for name, p in self.named_parameters():
            key = _FILE_PREFIX + name.replace(f".{ADAPTER_NAME}.", ".")
            out[key] = p.detach().to(device="cpu", dtype=torch.float32).contiguous()
        return out

    def peft_config(self):
        """The adapter's `peft.LoraConfig`, as the peft model this adapter replaces was configured."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank, lora_alpha=self.alpha, target_modules=list(self.target_modules), lora_dropout=0.0
        )

    def save(self, folder: str | Path) -> None:
        """adapter_config.json and adapter_model.safetensors as peft's `save_pretrained` writes them."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(self.peft_tensors(), str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
        config = self.peft_config()
        config.base_model_name_or_path = self._name_or_path or None
        config.inference_mode = True
        config.target_modules = list(self.target_modules)  # peft keeps a set: its order would follow string hashing
        mapping = {"base_model_class": self._base_class.__name__, "parent_library": self._base_class.__module__}
        config.save_pretrained(str(folder), auto_mapping_dict=mapping)


def _matches(name: str, targets: Sequence[str]) -> bool:
    """peft's rule for a list of target names: the module's name is one of them or ends with '.' + one."""
    return any(name == t or name.endswith(f".{t}") for t in targets)


def _container(root: nn.Module, path: str) -> nn.Module:
    """The module at dotted `path` under `root`, made of empty modules where missing (names mirror the model's)."""
    node = root
    for part in path.split("."):
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    return node


def _unwrapped_class(model: nn.Module) -> type:
    """The model's own class, not FSDP2's subclass of it (peft's auto_mapping names the base model's class)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return type(model)
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def _device_of(model: nn.Module) -> torch.device:
    from trainer.distributed import compute_device

    return compute_device(model)
