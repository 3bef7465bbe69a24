"""`sparrow bench distill`: DistillSparse on a small model under a fixed aggressive schedule (bench/distill.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sparrow_cli.errors import CliError, require_output_file, require_positive


def _settings(args: argparse.Namespace):
    from bench.distill import DistillBenchSettings
    from sparrow.schedule import Schedule, ScheduleError, parse_compact
    from trainer.distill import DistillConfig

    if not (Path(args.model) / "config.json").is_file():
        raise CliError(f"--model {args.model}: no config.json there (build one with `sparrow model build`)")
    require_positive(
        args, "bin_width", "pairs", "hops", "steps", "groups", "group_size", "heldout", "rank", "epochs", "threads"
    )
    require_output_file("--out", args.out)
    require_output_file("--plot", args.plot)
    if args.group_size < 2:
        raise CliError("--group-size must be at least 2 (GRPO compares samples within a group)")
    try:
        budgets = tuple(parse_compact(args.budgets))
        Schedule(budgets=budgets, bin_width=args.bin_width, dense_layers=())
    except (ScheduleError, ValueError) as exc:
        raise CliError(f"--budgets {args.budgets}: {exc}") from None
    from sparrow.tasks import ChainTask, TaskError

    try:
        ChainTask(pairs=args.pairs, max_hops=args.hops, min_hops=args.hops)
    except TaskError as exc:
        raise CliError(f"--pairs/--hops: {exc}") from None
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    try:
        distill = DistillConfig(
            rank=args.rank,
            alpha=args.alpha,
            target_modules=targets,
            lr=args.lr,
            kl_coef=args.kl_coef,
            kl_estimator=args.kl_estimator,
            selection_coef=args.selection_coef,
            epochs=args.epochs,
            seed=args.seed,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return DistillBenchSettings(
        model=args.model,
        budgets=budgets,
        bin_width=args.bin_width,
        pairs=args.pairs,
        hops=args.hops,
        steps=args.steps,
        groups=args.groups,
        group_size=args.group_size,
        heldout=args.heldout,
        seed=args.seed,
        distill=distill,
    )


def run_distill(args: argparse.Namespace) -> int:
    """Validate the flags, run the experiment, print and write its report."""
    settings = _settings(args)
    import sys

    import torch

    from bench.distill import plot, run_distill_bench
    from sparrow.tasks import TaskError

    torch.set_num_threads(args.threads)
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    try:
        result = run_distill_bench(settings, log=say)
    except (TaskError, ValueError) as exc:
        raise CliError(str(exc)) from None
    if args.out:
        Path(args.out).write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    if args.json:
        from sparrow_cli.output import emit_json

        emit_json(result.to_dict())
        return 0
    print(f"done in {result.seconds:.0f} s; p5 per bin before -> after (after without the adapter, same tokens):")
    before = {r["bin"]: r for r in result.before}

    def share(value: float | None) -> str:
        return "  -  " if value is None else f"{value:.3f}"

    for r in result.after:
        b = before.get(r["bin"])
        was = f"{b['p5']:.3f}" if b else "  -  "
        print(
            f"  {r['kv_start']:>5}+  {was} -> {r['p5']:.3f} ({r['p5_without']:.3f})   "
            f"mean {b['mean'] if b else float('nan'):.3f} -> {r['mean']:.3f}   {r['tokens']} tokens   "
            f"lookups failed {share(b['lookups_failed'] if b else None)} -> {share(r['lookups_failed'])} "
            f"of {r['lookups']}"
        )
    print(f"  reward (sparse actor, held-out) {result.reward_before:.3f} -> {result.reward_after:.3f}")
    return 0
