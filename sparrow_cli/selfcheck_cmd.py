"""`sparrow selfcheck`: a short end-to-end check of an installation.

Prints a published schedule, the cost model's predicted speedup for it on an H200, checks that
the sparse decode path equals dense attention when the budget covers the context, and runs a
small dense-vs-sparse decode-attention benchmark on this machine.
"""

from __future__ import annotations

import argparse

DEFAULT_PRESET = "qwen3-1.7b-0.86"
DEFAULT_MODEL = "qwen3-1.7b"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow selfcheck`."""
    p = subparsers.add_parser("selfcheck", help="short check: a schedule, a cost prediction, a kernel benchmark")
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"schedule preset to show (default {DEFAULT_PRESET})")
    p.add_argument("--context", type=int, default=16384, help="benchmark KV length (default 16384)")
    p.add_argument("--budget", type=int, default=1024, help="benchmark sparse budget in tokens (default 1024)")
    p.add_argument("--batch", type=int, default=4, help="benchmark batch (default 4)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run the three checks; exit non-zero if the sparse path does not reproduce dense at full budget."""
    from bench.attention import run_attention_bench
    from sparrow.cost import predict
    from sparrow.hardware import get_hardware
    from sparrow.models import get_model, list_models
    from sparrow.presets import resolve_schedule
    from sparrow.schedule import ScheduleError
    from sparrow_cli.errors import CliError, require_positive

    require_positive(args, "context", "budget", "batch")
    try:
        schedule = resolve_schedule(args.preset)
    except ScheduleError as exc:
        raise CliError(str(exc)) from None
    # A preset is named after its model (qwen3-4b-0.86); any other schedule is priced on the default model.
    model_name = "-".join((schedule.name or "").split("-")[:2]).lower()
    model = get_model(model_name if model_name in list_models() else DEFAULT_MODEL)
    cost = predict(model, schedule, get_hardware("h200"), 512, 32768, 8)
    import torch

    torch.set_num_threads(1)  # as `sparrow bench attention` does by default: reproducible on a shared machine
    try:
        bench = run_attention_bench(context=args.context, budget=args.budget, batch=args.batch, iters=5)
    except (ValueError, RuntimeError) as exc:  # as `sparrow bench attention`: a bad shape is one line
        raise CliError(str(exc)) from None
    ok = bench.max_abs_diff_full_budget <= 1e-4

    if args.json:
        from sparrow_cli.output import emit_json

        emit_json(
            {
                "schedule": schedule.to_dict(),
                "cost": {"model": model.name, "hardware": "h200", "speedup": cost.speedup},
                "bench": bench.to_dict(),
                "ok": ok,
            }
        )
    else:
        print(f"schedule {schedule.name}: {schedule.compact()} (kept KV tokens per {schedule.bin_width}-token bin)")
        print(
            f"cost model, {model.name} on H200, prompt 512, 32768 generated, 8 samples: "
            f"predicted rollout speedup {cost.speedup:.2f}x"
        )
        print(
            f"decode attention here, {bench.batch} x {bench.context} tokens, budget {bench.budget}: dense "
            f"{bench.dense_ms:.1f} ms, sparse {bench.sparse_ms:.1f} ms ({bench.backend}), {bench.speedup:.2f}x "
            f"of a {bench.bound:.2f}x KV-bytes bound"
        )
        print(
            f"full-budget sparse equals dense: max abs diff {bench.max_abs_diff_full_budget:.1e} "
            f"({'ok' if ok else 'FAILED'})"
        )
    return 0 if ok else 1
