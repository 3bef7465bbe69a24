"""`sparrow bench weights`: policy versions to generator processes on loopback, per mode (bench/weights.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sparrow_cli.errors import CliError, require_output_file, require_positive


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `sparrow bench weights`."""
    w = sub.add_parser("weights", help="policy versions to N generator processes: bytes off the trainer, seconds")
    # The default shape finishes in about 3 minutes on a 2-core machine; Qwen3-0.6B's own is --layers 28
    # --vocab 151936 (8 generators of it hold about 40 GB of versions in the temp folder).
    w.add_argument("--layers", type=int, default=2, help="decoder layers of the Qwen3-0.6B shape (2; its own 28)")
    w.add_argument("--vocab", type=int, default=32768, help="vocabulary of the shape (default 32768; Qwen3's 151936)")
    w.add_argument("--generators", type=int, default=8, help="generator processes (default 8)")
    w.add_argument("--versions", type=int, default=3, help="versions published per mode, the first whole (3)")
    w.add_argument("--lr", type=float, default=1e-6, help="the step each element moves per version (1e-6)")
    w.add_argument(
        "--modes",
        default="fp32-trainer,bf16-trainer,bf16-streamed,bf16-relay,bf16-relay-delta",
        help="modes to run (empty with --real-steps: only those)",
    )
    w.add_argument("--real-steps", type=int, default=0, help="also: delta sizes of N real GRPO steps of --model (0)")
    w.add_argument("--model", default="models/tiny", help="model of --real-steps (default models/tiny)")
    w.add_argument("--out", default=None, help="write the whole report here (JSON)")
    w.add_argument("--json", action="store_true", help="print JSON")


def run_weights(args: argparse.Namespace) -> int:
    """Run `sparrow bench weights` and print its table (or JSON)."""
    from bench.weights import MODES, run

    require_positive(args, "layers", "vocab", "generators", "versions")
    require_output_file("--out", args.out)
    if not args.lr > 0:
        raise CliError("--lr must be positive")
    if args.real_steps < 0:
        raise CliError("--real-steps must be >= 0")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not (modes or args.real_steps):
        raise CliError(f"--modes: unknown {unknown or 'none given'}; known: {', '.join(MODES)}")
    if args.real_steps and not (Path(args.model) / "config.json").is_file():
        raise CliError(f"--model {args.model}: no config.json there")
    result = run(args.layers, args.generators, args.versions, args.lr, modes, vocab=args.vocab) if modes else {}
    if args.real_steps:
        from bench.weight_real_steps import real_step_deltas

        result["real_steps"] = real_step_deltas(Path(args.model), args.real_steps)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    for row in result.get("real_steps", {}).get("steps", []):
        b, f = row["bf16"], row["fp32"]
        print(
            f"real step {row['step']}: bf16 {b['changed_fraction']:.2%} of elements changed, delta "
            f"{b['delta_per_full']:.2%} of the weights; fp32 {f['changed_fraction']:.2%}, {f['delta_per_full']:.2%}"
        )
    if not modes:
        return 0
    s = result["shape"]
    print(
        f"{result['generators']} generators, Qwen3 shape {s['layers']} layers x hidden {s['hidden']}, vocab "
        f"{s['vocab']} ({s['params'] / 1e6:.0f}M params, one bf16 copy {result['bf16_copy_bytes'] / 2**20:.0f} MiB)"
    )
    print(f"{'mode':18} {'off trainer/version':>20} {'per bf16 copy':>14} {'s until all serve':>18} {'peak RSS':>9}")
    for m in result["modes"]:
        secs = m["steady_seconds_until_all_serve"]
        print(
            f"{m['mode']:18} {m['steady_bytes_left_trainer_per_version'] / 2**20:17.1f} MiB "
            f"{m['steady_bytes_per_bf16_copy']:14.3f} {secs if secs is not None else float('nan'):18.1f} "
            f"{m['peak_rss_bytes_per_generator_max'] / 2**30:6.2f} GiB"
            + ("" if m["all_identical"] else "  NOT ALL IDENTICAL")
        )
    return 0
