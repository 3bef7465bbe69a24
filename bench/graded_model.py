"""A bench model whose sparse-vs-dense disagreement is graded: `small`'s shape, untrained weights.

`small` looks names up: a token's alpha is ~1 when the page holding its key is selected and ~0
when not, so a bin's p5 reads 0 or 1 at every budget and no controller can hold it in
[tau, tau + 0.05]. Untrained weights drawn with a moderate spread (std 0.1) attend diffusely: the
less of the context a token attends to, the further its distribution moves. The token embedding
(tied to the output head) is then scaled by `--embed-scale` (4): the output distributions become
peaked enough that the trainer's top-20 bound on alpha is close to the exact value (with the
embedding as drawn, top-20 holds about 15% of the mass and the bound says little), and attention
moves them by degrees. p5 then falls with length at a fixed budget and rises smoothly with the
budget while the mean stays above 0.9, as the paper describes for its models (`sparrow calibrate
--model DIR --budgets 48,96,160,256,352 --bin-width 128 --task-hops 64 --num-prompts 16
--max-new-tokens 300 --dense-layers none`, top-20 p5 of bins 128+ / 256+ / 384+: 0.33 / 0.37 /
0.21 at 48 tokens, 0.77 / 0.80 / 0.70 at 96, 0.87 / 0.92 / 0.79 at 160, 0.97 / 0.93 / 0.93 at 256).

It is not a policy: it answers no task (rewards are 0, so GRPO leaves it where it is), which keeps
its curves still while the controller works on them. It runs in `sparrow up --model DIR` like any
model folder of the task's vocabulary.

    python -m bench.graded_model --out runs/graded-model [--std 0.1] [--embed-scale 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def write(out: Path, std: float, embed_scale: float, seed: int) -> dict:
    """Writes the model folder (HF files, the task tokenizer, build.json); returns build.json's content."""
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    from offline.model_build import qwen3_config
    from offline.tokenizer import save_tokenizer

    cfg = qwen3_config("small")
    cfg.initializer_range = std
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embed_scale)  # tied: the output head too
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(out)
    info = {
        "command": [
            "python",
            "-m",
            "bench.graded_model",
            "--out",
            str(out),
            "--std",
            str(std),
            "--embed-scale",
            str(embed_scale),
            "--seed",
            str(seed),
        ],  # fmt: skip
        "kind": "untrained bench model (graded disagreement); not a policy",
        "size": "small",
        "init_std": std,
        "embed_scale": embed_scale,
        "seed": seed,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.graded_model", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="model folder to write")
    parser.add_argument("--std", type=float, default=0.1, help="standard deviation of the weights (default 0.1)")
    parser.add_argument("--embed-scale", type=float, default=4.0, help="factor on the token embedding (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for flag, value in (("--std", args.std), ("--embed-scale", args.embed_scale)):
        if not 0 < value <= 100:
            print(f"error: {flag} must be in (0, 100], got {value}", file=sys.stderr)
            return 2
    if args.out.exists() and any(args.out.iterdir()):
        print(f"error: {args.out} exists and is not empty", file=sys.stderr)
        return 2
    info = write(args.out, args.std, args.embed_scale, args.seed)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
