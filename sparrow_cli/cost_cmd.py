"""`sparrow cost`: predicted dense vs sparse rollout cost (eFLOPs) and speedup for a model and schedule."""

from __future__ import annotations

import argparse

from sparrow_cli.errors import CliError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow cost`."""
    p = subparsers.add_parser("cost", help="predict rollout eFLOPs and speedup of a schedule (paper's cost model)")
    p.add_argument("--model", required=True, help="qwen3-1.7b|qwen3-4b|qwen3-8b|qwen3-14b, or a HF config.json")
    p.add_argument("--schedule", required=True, help="a schedule preset name or a schedule JSON file")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--gen-len", type=int, default=32768, help="generated tokens per sample (default 32768)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt, N (default 8)")
    p.add_argument("--hardware", default="h200", help="h200|h100|cpu (cpu measures this machine; default h200)")
    p.add_argument(
        "--price-dense-layers",
        action="store_true",
        help="price the schedule's dense layers as dense (the paper prices every layer as sparse)",
    )
    p.add_argument(
        "--step-overhead",
        type=float,
        default=0.0,
        help="a decode forward's cost per sequence beyond the paper's terms, in multiples of 2P (default 0, the "
        "paper's model; `sparrow bench rollout` measures it as cost.implied_step_overhead)",
    )
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        help="also predict lossless speculative decoding with k sparse drafts per dense verify (1..16)",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=None,
        help="speculative: acceptance of one draft, sum min(p, q) (the generator's sparrow_generator_draft_alpha)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print the prediction."""
    from sparrow.cost import predict, predict_speculative
    from sparrow.hardware import HardwareError, get_hardware
    from sparrow.models import ModelSpecError, resolve_model
    from sparrow.presets import resolve_schedule
    from sparrow.schedule import ScheduleError

    for flag, value, least in (
        ("--prompt-len", args.prompt_len, 0),
        ("--gen-len", args.gen_len, 1),
        ("--samples", args.samples, 1),
    ):
        if value < least:
            raise CliError(f"{flag} must be >= {least}, got {value}")
    if not 0 <= args.step_overhead < float("inf"):
        raise CliError(f"--step-overhead must be a finite number >= 0, got {args.step_overhead}")
    k, alpha = args.speculative_tokens, args.alpha
    if (alpha is None) != (k == 0):
        raise CliError("--speculative-tokens and --alpha go together (the speculative prediction needs both)")
    if k and not 1 <= k <= 16:
        raise CliError(f"--speculative-tokens must be in [1, 16], got {k}")
    if alpha is not None and not 0.0 <= alpha <= 1.0:
        raise CliError(f"--alpha must be in [0, 1], got {alpha}")
    try:
        model = resolve_model(args.model)
        schedule = resolve_schedule(args.schedule)
        hardware = get_hardware(args.hardware)
        result = predict(
            model, schedule, hardware, args.prompt_len, args.gen_len, args.samples, args.price_dense_layers,
            args.step_overhead,
        )  # fmt: skip
    except (ModelSpecError, ScheduleError, HardwareError) as exc:
        raise CliError(str(exc)) from None
    spec = predict_speculative(result, k, alpha) if k else None

    if args.json:
        from sparrow_cli.output import emit_json

        emit_json(
            {
                "model": model.name,
                "params": model.params,
                "kv_dim": model.kv_dim,
                "gqa_ratio": model.gqa_ratio,
                "schedule": schedule.name,
                "schedule_version": schedule.version,
                "hardware": hardware.name,
                "flops_per_byte": hardware.flops_per_byte,
                "bytes_per_element": hardware.bytes_per_element,
                "prompt_len": args.prompt_len,
                "gen_len": args.gen_len,
                "samples": args.samples,
                "dense_layers_priced": result.dense_layers_priced,
                "step_overhead": result.step_overhead,
                "dense": {"compute": result.dense.compute, "memory": result.dense.memory, "total": result.dense.total},
                "sparse": {
                    "compute": result.sparse.compute,
                    "memory": result.sparse.memory,
                    "total": result.sparse.total,
                },
                "mean_kept_tokens": result.mean_kept_tokens,
                "speedup": result.speedup,
                **({"speculative": _speculative_json(spec)} if spec else {}),
            }
        )
        return 0
    from sparrow_cli.output import table

    print(
        f"model {model.name} (P {model.params / 1e9:.2f}B, D {model.kv_dim}, r {model.gqa_ratio}), "
        f"schedule {schedule.name or args.schedule} v{schedule.version}, "
        f"hardware {hardware.name} (I {hardware.flops_per_byte:.1f} FLOP/byte, {hardware.bytes_per_element} B/element)"
    )
    print(
        f"prompt {args.prompt_len}, generated {args.gen_len}, samples {args.samples}; "
        f"mean kept KV {result.mean_kept_tokens:.0f} tokens"
        + (f"; step overhead {result.step_overhead:g} x 2P per forward" if result.step_overhead else "")
    )
    rows = [
        [side, f"{c.compute:.3e}", f"{c.memory:.3e}", f"{c.total:.3e}"]
        for side, c in (("dense", result.dense), ("sparse", result.sparse))
    ]
    print(table(rows, ["", "compute eFLOPs", "memory eFLOPs", "total eFLOPs"]))
    print(f"predicted speedup {result.speedup:.2f}x")
    if spec:
        print(
            f"speculative (lossless), k {spec.speculative_tokens}, alpha {spec.alpha:g}: "
            f"{spec.tokens_per_cycle:.2f} tokens per cycle of {k} sparse steps + 1 dense verify, "
            f"total {spec.cost.total:.3e} eFLOPs, predicted speedup {spec.speedup:.2f}x"
        )
    return 0


def _speculative_json(spec) -> dict:
    return {
        "speculative_tokens": spec.speculative_tokens,
        "alpha": spec.alpha,
        "tokens_per_cycle": spec.tokens_per_cycle,
        "verify": {"compute": spec.verify.compute, "memory": spec.verify.memory, "total": spec.verify.total},
        "compute": spec.cost.compute,
        "memory": spec.cost.memory,
        "total": spec.cost.total,
        "speedup": spec.speedup,
    }
