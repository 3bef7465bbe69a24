"""`sparrow bench rollout` and `sparrow bench parity`: the generator's vLLM engine, measured in one run."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from sparrow_cli.errors import CliError, require_positive


def _check(args: argparse.Namespace) -> None:
    if not (Path(args.model) / "config.json").is_file():
        raise CliError(f"--model {args.model}: no config.json there (build one with `sparrow model build`)")
    require_positive(args, "prompt_len", "gen_len", "batch", "prompts", "threads", "tensor_parallel_size")
    if getattr(args, "static_decode", False) and not args.compile:
        raise CliError("--static-decode captures CUDA graphs: add --compile")


def _schedule(spec: str):
    from sparrow.presets import resolve_schedule
    from sparrow.schedule import ScheduleError

    try:
        return resolve_schedule(spec)
    except (ScheduleError, OSError, ValueError) as exc:
        raise CliError(f"--schedule {spec}: {exc}") from None


def _run(args: argparse.Namespace):
    if args.bench == "rollout":
        from bench.rollout import run_rollout_bench

        return run_rollout_bench(
            args.model,
            _schedule(args.schedule),
            args.prompt_len,
            args.gen_len,
            args.batch,
            check_alpha=args.check_alpha,
            enforce_eager=not args.compile,
            static_decode=args.static_decode,
        )
    from bench.parity import run_parity_bench

    schedule = _schedule(args.schedule) if args.schedule else None
    tp = args.tensor_parallel_size
    return run_parity_bench(args.model, schedule, args.prompts, args.prompt_len, args.gen_len, tensor_parallel_size=tp)


def run_engine_bench(args: argparse.Namespace) -> int:
    """Validate, run the chosen engine benchmark, print text or JSON."""
    _check(args)
    os.environ.pop("SPARROW_ATTENTION", None)  # the plugin must be active
    import torch

    torch.set_num_threads(args.threads)
    from services.generator.engine import EngineError

    try:
        result = _run(args)
    except EngineError as exc:  # an engine this machine cannot build as asked: one line, not a traceback
        raise CliError(str(exc)) from None
    d = result.to_dict()
    if args.json:
        from sparrow_cli.output import emit_json

        emit_json(d)
        return 0
    if args.bench == "rollout":
        print(
            f"rollout {d['batch']} x ({d['prompt_len']} + {d['gen_len']}) tokens, {d['model']}, "
            f"schedule {d['schedule']}\n"
            f"  dense  {d['dense_tokens_per_s']:8.1f} tokens/s  ({d['dense_seconds']:.1f} s)\n"
            f"  sparse {d['sparse_tokens_per_s']:8.1f} tokens/s  ({d['sparse_seconds']:.1f} s)\n"
            f"  speedup {d['speedup']:.2f}x, attended KV {d['attended_kv_fraction']:.1%} of the context"
        )
        if d["alpha_p5_per_bin"]:
            print("  p5 of alpha per bin: " + ", ".join(f"{k}: {v:.3f}" for k, v in d["alpha_p5_per_bin"].items()))
    else:
        print(
            f"parity over {d['tokens']} generated tokens ({d['sparse_tokens']} decoded sparsely, mean attended KV "
            f"{d['attended_kv_fraction']:.1%}): max |engine - teacher-forced| = {d['max_abs_diff']:.2e}, "
            f"mean {d['mean_abs_diff']:.2e}; top-20 ids equal at {d['top_ids_equal_fraction']:.1%} of positions"
        )
    return 0
