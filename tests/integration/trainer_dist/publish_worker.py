"""Publish policy folders the way the trainer does, on one process or as one rank of several (run by torchrun).

`worker OUT MODEL_DIR DTYPE SHARD_BYTES [MODEL_DIR DTYPE SHARD_BYTES ...]`: for each triple, load the
model, move every parameter by a fixed amount (the same on every rank, before sharding; bf16 rounds
it), shard it by FSDP2 over gloo when torchrun started several ranks, and write it with
`services.trainer.weights.save_hf_policy` into OUT/<i> (rank 0; the other ranks only take part in the
gathers), then write OUT/<i>.done.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from services.trainer.weights import save_hf_policy
from trainer import distributed
from trainer.model_io import load_model


def moved(model_dir: str) -> torch.nn.Module:
    """The model in `model_dir` with every parameter moved by a fixed, element-dependent amount."""
    model = load_model(model_dir)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.sin(torch.arange(p.numel(), dtype=torch.float32) + i).reshape(p.shape) * 1e-3)
    return model


def main(out: str, *cases: str) -> None:
    torch.set_num_threads(1)
    if distributed.launched_by_torchrun():
        distributed.init_from_env("cpu", timeout_s=120)
    for i in range(0, len(cases), 3):
        model_dir, dtype, shard_bytes = cases[i], cases[i + 1], int(cases[i + 2])
        model = moved(model_dir)
        if distributed.active():
            distributed.shard(model)
        folder = Path(out) / str(i // 3) if distributed.rank() == 0 else None
        if folder is not None:
            folder.mkdir(parents=True)
        save_hf_policy(model, folder, model_dir, dtype, shard_bytes)
        if folder is not None:
            (Path(out) / f"{i // 3}.done").write_text(f"{distributed.world_size()}\n")
    if distributed.active():
        # Every rank past its last gather before any leaves: a gloo peer torn down while the other still
        # finishes a collective aborts that one ("terminate called without an active exception", seen in CI).
        torch.distributed.barrier()
    distributed.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
