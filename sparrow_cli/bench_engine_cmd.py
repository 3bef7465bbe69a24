"""`sparrow bench rollout` and `sparrow bench parity`: the generator's vLLM engine, measured in one run."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from sparrow.speculative import MAX_DRAFTS, MIN_DRAFTS
from sparrow_cli.errors import CliError, require_positive


def _check(args: argparse.Namespace) -> None:
    if not (Path(args.model) / "config.json").is_file():
        raise CliError(f"--model {args.model}: no config.json there (build one with `sparrow model build`)")
    require_positive(args, "prompt_len", "gen_len", "batch", "prompts", "threads", "tensor_parallel_size")
    if getattr(args, "static_decode", False) and not args.compile:
        raise CliError("--static-decode captures CUDA graphs: add --compile")


DEFAULT_MODEL = "models/long"


def _rollout_schedule(args: argparse.Namespace) -> str:
    """`--schedule`, else the default model's calibrated schedule (another model needs its own)."""
    if args.schedule:
        return args.schedule
    if Path(args.model).resolve() != Path(DEFAULT_MODEL).resolve():
        raise CliError(f"--model {args.model}: name its --schedule (a preset name or a JSON file)")
    from services.launcher.config import LONG_SCHEDULE

    return str(LONG_SCHEDULE)


def _schedule(spec: str):
    from sparrow.presets import resolve_schedule
    from sparrow.schedule import ScheduleError

    try:
        return resolve_schedule(spec)
    except (ScheduleError, OSError, ValueError) as exc:
        raise CliError(f"--schedule {spec}: {exc}") from None


def _speculative(args: argparse.Namespace):
    from bench.speculative import run_speculative_bench

    _check_drafts(args)
    require_positive(args, "prompts", "samples")
    spec = _rollout_schedule(args)
    schedule = _schedule(spec)
    if len({layer for layer in schedule.dense_layers if layer < _layers(args.model)}) >= _layers(args.model):
        raise CliError(f"--schedule {spec}: no sparse layer on this model, so nothing to draft with")
    prompts, max_new, label = _task(args, args.prompts)
    return run_speculative_bench(args.model, schedule, prompts, max_new, args.samples, args.speculative_tokens, label)


def _task(args: argparse.Namespace, count: int) -> tuple[list, int, str]:
    """(`count` held-out chain-task prompts of the model, the longest response plus a margin, the task's label)."""
    from offline.calibrate import task_prompts
    from sparrow.tasks import ChainTask, TaskError
    from sparrow_cli.model_cmd import built_filler
    from trainer.model_io import ModelLoadError, load_tokenizer

    require_positive(args, "task_pairs", "task_min_hops", "task_hops")
    filler = built_filler(args.model)
    try:
        task = ChainTask(args.task_pairs, args.task_hops, args.task_min_hops, filler=filler)
        _, prompts, label = task_prompts(
            load_tokenizer(args.model), args.task_pairs, args.task_hops, 0, count, 0, task.min_hops, filler
        )
    except (TaskError, ModelLoadError, ValueError) as exc:
        raise CliError(f"--model {args.model}: {exc}") from None
    return prompts, task.sequence_tokens() - task.prompt_tokens() + 8, label


def _check_drafts(args: argparse.Namespace) -> None:
    if not MIN_DRAFTS <= args.speculative_tokens <= MAX_DRAFTS:
        raise CliError(f"--speculative-tokens must be in [{MIN_DRAFTS}, {MAX_DRAFTS}], got {args.speculative_tokens}")


def _layers(model: str) -> int:
    import json

    return int(json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"])


def _run(args: argparse.Namespace):
    if args.bench == "rollout" and args.decode == "speculative" and args.engine == "reference":
        return _speculative(args)
    if args.bench == "rollout":
        from bench.rollout import run_rollout_bench

        speculative = args.decode == "speculative"
        if speculative:
            _check_drafts(args)
        require_positive(args, "greedy_check")
        task = _task(args, args.batch) if args.task else None

        return run_rollout_bench(
            args.model,
            _schedule(_rollout_schedule(args)),
            args.prompt_len,
            args.gen_len if task is None else task[1],
            args.batch,
            check_alpha=args.check_alpha,
            enforce_eager=not args.compile,
            static_decode=args.static_decode,
            speculative_tokens=args.speculative_tokens if speculative else 0,
            greedy_check=args.greedy_check,
            task_prompts=None if task is None else task[0],
            task_label="" if task is None else task[2],
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
    if args.bench == "rollout" and args.decode == "speculative" and args.engine == "reference":
        _print_speculative(d)
    elif args.bench == "rollout":
        print(
            f"rollout {d['batch']} x ({d['prompt_len']} + {d['gen_len']}) tokens, {d['prompts']} prompts, "
            f"{d['model']}, schedule {d['schedule']}\n"
            f"  dense  {d['dense_tokens_per_s']:8.1f} tokens/s  ({d['dense_seconds']:.1f} s)\n"
            f"  sparse {d['sparse_tokens_per_s']:8.1f} tokens/s  ({d['sparse_seconds']:.1f} s)\n"
            f"  speedup {d['speedup']:.2f}x, attended KV {d['attended_kv_fraction']:.1%} of the context"
        )
        if d["alpha_p5_per_bin"]:
            print("  p5 of alpha per bin: " + ", ".join(f"{k}: {v:.3f}" for k, v in d["alpha_p5_per_bin"].items()))
        if s := d["speculative"]:
            same = "yes" if s["speculative_identical_to_dense"] else f"no, from {s['greedy_first_difference']}"
            print(
                f"  speculative {s['tokens_per_s']:8.1f} tokens/s  ({s['seconds']:.1f} s), {s['ratio_to_dense']:.2f}x "
                f"dense, lossless; k = {s['speculative_tokens']}, acceptance {s['acceptance']:.3f}, "
                f"{s['tokens_per_cycle']:.2f} tokens a cycle\n"
                f"  greedy speculative identical to dense over {s['greedy_tokens_compared']} tokens: {same}"
            )
        if (c := d["cost"]) and "error" not in c:
            overhead = c["implied_step_overhead"]
            line = f"  cost model ({c['hardware']}): paper's terms {c['paper_speedup']:.2f}x sparse"
            if overhead is not None:
                line += f"; measured with a step overhead of {overhead:.1f} x 2P per forward"
                line += " (controller cost.step_overhead)"
            if "speculative_predicted" in c:
                line += f", which predicts speculative {c['speculative_predicted']:.2f}x"
            print(line)
            if "cycle_step_overhead" in c:
                print(f"  the speculative engine's timed cycles imply a step overhead of {c['cycle_step_overhead']:.1f}"
                      f" x 2P (what the lossless controller prices), which predicts speculative "
                      f"{c['speculative_predicted_from_cycles']:.2f}x")  # fmt: skip
    else:
        print(
            f"parity over {d['tokens']} generated tokens ({d['sparse_tokens']} decoded sparsely, mean attended KV "
            f"{d['attended_kv_fraction']:.1%}): max |engine - teacher-forced| = {d['max_abs_diff']:.2e}, "
            f"mean {d['mean_abs_diff']:.2e}; top-20 ids equal at {d['top_ids_equal_fraction']:.1%} of positions"
        )
    return 0


def _print_speculative(d: dict) -> None:
    print(
        f"rollout {d['prompts']} prompt(s) x {d['samples']} sample(s), {d['task']}, {d['model']}, "
        f"schedule {d['schedule']}, k = {d['speculative_tokens']} ({d['engine']} engine)"
    )
    for mode in ("dense", "sparse", "speculative"):
        ratio = "" if mode == "dense" else f"  {d['ratio_to_dense'][mode]:.2f}x dense"
        print(
            f"  {mode:<11} {d['tokens_per_s'][mode]:8.1f} tokens/s  ({d['seconds'][mode]:.1f} s, "
            f"{d['mean_response_tokens'][mode]:.0f} tokens a response){ratio}"
        )
    print(f"  draft acceptance {d['acceptance']:.4f}, {d['tokens_per_cycle']:.2f} tokens per cycle")
    for b, v in d["acceptance_per_bin"].items():
        print(f"    bin {b}: alpha {v['alpha_mean']:.4f}, accepted {v['accepted_share']:.3f}, "
              f"{v['tokens_per_cycle']:.2f} tokens/cycle ({v['drafts']} drafts)")  # fmt: skip
    same = "yes" if d["speculative_identical_to_dense"] else f"no ({d['greedy_differing_prompts']} prompt(s) differ)"
    print(f"  greedy speculative identical to dense: {same}")
