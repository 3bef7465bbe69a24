"""The trainer over many processes: torch.distributed set up from torchrun's environment, FSDP2 sharding.

`init_from_env` joins the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, ...):
NCCL on CUDA, gloo on CPU, with a collective timeout so that a dead or hung rank ends every other
rank within that time instead of never. `shard` applies FSDP2 (`fully_shard`) to every decoder
layer and to the root, with a mixed-precision policy (parameters cast to the compute dtype for the
forward and backward, float32 master weights and gradient reduction) and, where asked, FSDP2's CPU
offload: the float32 shards and their optimizer state live in pinned host memory, each layer's
parameters come to the GPU for its forward and backward only, and the optimizer steps on the CPU.
Per-layer activation checkpointing is trainer/activation_checkpoint.py (with or without FSDP2).
DistillSparse's adapter lives outside the sharded tree, whole on every rank (trainer/lora.py): its
step freezes the policy (`frozen`) and sums the adapter's gradients itself (`all_reduce_sum_`).

Every rank takes its share of a step's rollouts (`share`). Under FSDP each forward and backward is
a collective, so all ranks must run the same number of them: `max_over_ranks` tells each rank how
many micro-batches the busiest one runs, and the others pad with passes that add nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist


def active() -> bool:
    """Whether this process is one rank of an initialised process group."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 when not distributed)."""
    return dist.get_rank() if active() else 0


def world_size() -> int:
    """The number of ranks (1 when not distributed)."""
    return dist.get_world_size() if active() else 1


def launched_by_torchrun() -> bool:
    """Whether torchrun (or a launcher like it) started this process as one of several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_env(device: str = "cpu", timeout_s: float = 300.0) -> None:
    """Join the process group torchrun's environment describes: NCCL on CUDA, gloo on CPU.

    `timeout_s` bounds every collective: a rank that dies or hangs makes the others fail within it.
    """
    if active():
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store across the restarts of its ranks (--max-restarts): without a
        # prefix of the attempt, restarted ranks read the dead ones' addresses and cannot connect.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"sparrow/attempt-{restart}", store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
        return
    dist.init_process_group(backend, timeout=timeout)


def close() -> None:
    """Leave the process group (nothing when not distributed)."""
    if active():
        dist.destroy_process_group()


def shard(model: torch.nn.Module, dtype: torch.dtype | None = None, cpu_offload: bool = False) -> torch.nn.Module:
    """`model` (a transformers causal LM) sharded in place by FSDP2: each decoder layer, then the root.

    `dtype` is the compute dtype of the parameters in forward and backward (None: their own);
    gradients are reduced in float32 and kept with the float32 master weights. `cpu_offload` keeps
    the shards, their gradients and so the optimizer state in host memory (FSDP2's
    CPUOffloadPolicy); it needs CUDA (pinned memory), and ValueError says so on a CPU process group.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if cpu_offload and _device().type != "cuda":
        raise ValueError("CPU offload moves FSDP2 shards off a GPU; this process group runs on the CPU")
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for layer in model.get_decoder().layers:
        fully_shard(layer, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    return model


def gradient_scale() -> float:
    """What a rank's loss is multiplied by before its backward so that FSDP's reduction gives the global gradient.

    Each rank's loss is already its share of the global token mean (`trainer.grpo.global_token_count`),
    so the ranks' gradients must be summed; FSDP averages them (gloo has no pre-scaled sum to
    change that), hence the world size.
    """
    return float(world_size())


def share(items: Sequence[Any], of_rank: int | None = None, world: int | None = None) -> list[int]:
    """Indices of `items` this rank takes: every world-th from its rank on (rank 0 takes the first)."""
    r = rank() if of_rank is None else of_rank
    w = world_size() if world is None else world
    return list(range(r, len(items), w))


def max_over_ranks(value: int) -> int:
    """The largest of every rank's `value` (the value itself when not distributed)."""
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.long, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def sum_over_ranks(values: Sequence[float]) -> list[float]:
    """Each of `values` summed over ranks (float64; the values themselves when not distributed)."""
    if not active():
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_sum_(tensors: Sequence[torch.Tensor]) -> None:
    """Sum each of `tensors` (one dtype, one device) over the ranks, in place, in one collective; nothing alone."""
    if not active() or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(part.view_as(t))


@contextlib.contextmanager
def frozen(model: torch.nn.Module) -> Iterator[None]:
    """Inside, none of `model`'s parameters requires a gradient: a backward computes and reduces none of them.

    Under FSDP2 the parameters a forward uses are the unsharded ones, which take the sharded ones'
    `requires_grad` when they are gathered: every FSDP2 module is resharded on the way in (a root
    kept unsharded after its forward would otherwise keep its old flags) and on the way out.
    """
    _reshard(model)
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        _reshard(model)
        for p, flag in flags:
            p.requires_grad_(flag)


def _reshard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (on every rank)."""
    if not active():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank `src`'s `obj` on every rank (of `group`, by default all)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def control_group(timeout_s: float) -> Any:
    """A gloo group of every rank, apart from the one the model's collectives use; every rank calls it.

    Small Python objects travel on it (CPU, also beside NCCL), from another thread than the model's
    collectives, so neither waits for the other.
    """
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def _device() -> torch.device:
    return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")


def compute_device(model: torch.nn.Module) -> torch.device:
    """Where `model`'s forward runs: its parameters' device, or the GPU of FSDP2 shards offloaded to host memory."""
    param = next(model.parameters())
    mesh = getattr(param, "device_mesh", None)  # a DTensor shard of FSDP2
    if mesh is not None and mesh.device_type == "cuda" and param.device.type == "cpu":
        return torch.device("cuda", torch.cuda.current_device())
    return param.device
