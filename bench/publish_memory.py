"""Peak resident memory of publishing one policy version on rank 0: the whole-state path against a tensor at a time.

    python -m bench.publish_memory [--layers 14] [--ranks 1,2] [--out FILE]

A random Qwen3-shaped model (Qwen3-0.6B's widths and 151,936-entry vocabulary, tied head; `--layers`
decoder layers: 14 make 376M parameters, 1.50 GB in fp32) is published in bf16 into a fresh folder,
on one process and on 2 gloo ranks under torchrun (FSDP2, as `sparrow trainer` shards it), each
variant in fresh processes:

- `whole`: the path the trainer had: `get_model_state_dict(full_state_dict, cpu_offload)` (every full
  tensor on rank 0's host), a cast copy in bf16, `save_pretrained(state_dict=...)`;
- `streamed`: `services.trainer.weights.save_hf_policy` (trainer/hf_checkpoint.py): a tensor at a
  time, cast where its shard lies, gathered, written.

The model is built on the meta device and materialised after sharding, so that each rank's memory
before publishing is its shard alone (no freed full copy for the publish to reuse unseen). Then the
peak resident memory is reset (Linux /proc/self/clear_refs) and the figure is the peak during the
publish above the memory before it, per rank. Prints one JSON object (`--out` writes it too).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

QWEN3_06B = dict(
    vocab_size=151_936,
    hidden_size=1024,
    intermediate_size=3072,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
)
REPO = Path(__file__).resolve().parents[1]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _model(layers: int):
    """The random model, sharded by FSDP2 when this process is one of several ranks; only its shard is resident."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer import distributed

    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, **QWEN3_06B))
    if distributed.active():
        distributed.shard(model)
    model.to_empty(device="cpu")
    if not distributed.active():
        model.tie_weights()  # to_empty gives each name a tensor of its own; FSDP2 keeps the tie as one DTensor
    gen = torch.Generator().manual_seed(distributed.rank())
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0.0, 0.02, generator=gen)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _publish(model, variant: str, out: Path | None) -> None:
    import torch

    from services.trainer.weights import DEFAULT_SHARD_BYTES, save_hf_policy

    if variant == "streamed":
        save_hf_policy(model, out, REPO / "models" / "tiny", "bfloat16", DEFAULT_SHARD_BYTES)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from sparrow.weight_delta import cast_state

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state = cast_state(state, torch.bfloat16)
    if out is not None:
        model.save_pretrained(out, state_dict=state, safe_serialization=True)


def worker(variant: str, layers: int, result: str) -> None:
    """One variant in this process (or as one rank under torchrun): writes this rank's figures to `result`.<rank>."""
    import torch

    from trainer import distributed

    torch.set_num_threads(1)
    if distributed.launched_by_torchrun():
        distributed.init_from_env("cpu", timeout_s=1800)
    model = _model(layers)
    params = sum(p.numel() for p in model.parameters())
    gc.collect()
    before = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) if distributed.rank() == 0 else None
        _publish(model, variant, out)
        peak = _rss_kib("VmHWM")
        written = sum(f.stat().st_size for f in out.glob("*.safetensors")) if out else 0
    figures = {
        "variant": variant,
        "rank": distributed.rank(),
        "world_size": distributed.world_size(),
        "parameters": params,
        "model_fp32_bytes": 4 * params,
        "rss_before_bytes": before * 1024,
        "peak_above_before_bytes": (peak - before) * 1024,
        "written_bytes": written,
    }
    Path(f"{result}.{distributed.rank()}").write_text(json.dumps(figures))
    distributed.close()


def _run(variant: str, ranks: int, layers: int, tmp: Path) -> list[dict]:
    result = tmp / f"{variant}-{ranks}"
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd = [*launcher, "-m", "bench.publish_memory", "--worker", variant, "--layers", str(layers)]
    cmd += ["--result", str(result)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} on {ranks} rank(s) failed:\n{done.stderr[-3000:]}")
    return [json.loads(Path(f"{result}.{r}").read_text()) for r in range(ranks)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.publish_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=14, help="decoder layers (14: 376M parameters, 1.50 GB fp32)")
    parser.add_argument("--ranks", default="1,2", help="world sizes to run, comma-separated")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--worker", choices=["whole", "streamed"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.layers, args.result)
        return {}
    report: dict = {"layers": args.layers, "serving_dtype": "bfloat16", "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (int(r) for r in args.ranks.split(",")):
            for variant in ("whole", "streamed"):
                per_rank = _run(variant, ranks, args.layers, Path(tmp))
                rank0 = per_rank[0]
                report["runs"].append(
                    {
                        "variant": variant,
                        "world_size": ranks,
                        "rank0_peak_above_before_bytes": rank0["peak_above_before_bytes"],
                        "rank0_peak_over_model_fp32": round(
                            rank0["peak_above_before_bytes"] / rank0["model_fp32_bytes"], 3
                        ),
                        "ranks": per_rank,
                    }
                )
                print(json.dumps(report["runs"][-1] | {"ranks": None}), file=sys.stderr, flush=True)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
