"""`sparrow calibrate`: measure tail acceptance per length bin at fixed budgets, fit and validate a schedule."""

from __future__ import annotations

import argparse
import sys

from sparrow_cli.errors import CliError, require_output_file


def _layers(text: str) -> tuple[int, ...]:
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"dense layers: comma-separated integers or 'none', got {text!r}") from None


def _budgets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"budgets must be comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one budget")
    return values


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow calibrate`."""
    p = subparsers.add_parser("calibrate", help="fit a sparsity schedule offline: p5 of alpha per bin at fixed budgets")
    p.add_argument("--model", required=True, help="model folder (HF format: config.json, safetensors, tokenizer)")
    p.add_argument("--budgets", required=True, type=_budgets, help="fixed KV budgets in tokens, e.g. 64,128,256")
    p.add_argument("--bin-width", type=int, default=2000, help="KV-length bin width in tokens (default 2000)")
    p.add_argument("--tau", type=float, default=0.86, help="p5 target per bin (default 0.86)")
    p.add_argument("--plot", required=True, help="PNG to write: p5 vs KV length per budget and for the fit")
    p.add_argument("--out", required=True, help="schedule JSON to write")
    p.add_argument("--prompts", help="prompt file (.jsonl or .parquet, field 'prompt'); default: the chain task")
    p.add_argument("--on-bad-row", choices=("stop", "skip"), default="stop", help="bad prompt-file rows (stop)")
    p.add_argument("--num-prompts", type=int, default=32, help="calibration prompts (default 32)")
    p.add_argument("--num-heldout", type=int, default=None, help="held-out prompts (default: --num-prompts)")
    p.add_argument("--task-pairs", type=int, default=64, help="chain task: pairs in the context (default 64)")
    p.add_argument("--task-hops", type=int, default=128, help="chain task: most hops (default 128)")
    p.add_argument("--task-min-hops", type=int, default=1, help="chain task: fewest hops (default 1)")
    p.add_argument(
        "--task-filler", type=int, default=None, help="chain task: countdown per hop (default: the model's, build.json)"
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: a full task solution, or 512")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling and scoring temperature (default 1.0)")
    p.add_argument("--min-bin-tokens", type=int, default=100, help="fewer tokens: bin reported, not trusted (100)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences generated together (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompt draws and sampling (default 0)")
    p.add_argument("--backend", choices=("auto", "torch", "cpu", "triton"), default="auto", help="kernels (auto)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--dense-layers",
        type=_layers,
        default=(0, 1),
        help="layers that stay dense, comma-separated, or 'none' (default 0,1 as in the paper)",
    )
    p.add_argument("--sink-blocks", type=int, default=1, help="blocks always kept at the start (default 1)")
    p.add_argument(
        "--local-blocks", type=int, default=2, help="last blocks always kept, the current partial one included (2)"
    )
    p.add_argument("--json", action="store_true", help="print the whole table and the fitted schedule as JSON")
    p.set_defaults(handler=run)


def _check(args: argparse.Namespace) -> None:
    for flag, value in (
        ("--bin-width", args.bin_width),
        ("--num-prompts", args.num_prompts),
        ("--num-heldout", args.num_heldout if args.num_heldout is not None else 1),
        ("--min-bin-tokens", args.min_bin_tokens),
        ("--batch-size", args.batch_size),
        ("--threads", args.threads),
        ("--max-new-tokens", args.max_new_tokens if args.max_new_tokens is not None else 1),
    ):
        if value < 1:
            raise CliError(f"{flag} must be >= 1, got {value}")
    if not 0.0 < args.tau < 1.0:
        raise CliError(f"--tau must be in (0, 1), got {args.tau}")
    if not args.temperature > 0:
        raise CliError(f"--temperature must be > 0, got {args.temperature}")
    if not args.plot.lower().endswith(".png"):
        raise CliError(f"--plot must name a .png file, got {args.plot}")
    require_output_file("--out", args.out)
    require_output_file("--plot", args.plot)


def run(args: argparse.Namespace) -> int:
    """Calibrate, write the schedule and the plot, print the tables."""
    _check(args)
    import torch

    from offline import calibrate as cal
    from sparrow.data import DataError, load_prompts
    from sparrow.schedule import Schedule, ScheduleError
    from sparrow.tasks import TaskError
    from trainer.model_io import ModelLoadError, load_model, load_tokenizer
    from trainer.scoring import Scorer

    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA GPU is visible")
    torch.set_num_threads(args.threads)
    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    heldout = args.num_heldout or args.num_prompts
    try:
        for b in args.budgets:
            Schedule(budgets=(b,), sink_blocks=args.sink_blocks, local_blocks=args.local_blocks)  # one clear message
        model = load_model(args.model, device=args.device)
        tokenizer = load_tokenizer(args.model)
        if args.prompts:
            prompt_set = load_prompts(args.prompts, on_bad_row=args.on_bad_row)
            for bad in prompt_set.skipped:
                print(f"sparrow calibrate: skipped {args.prompts} {bad}", file=sys.stderr)
            calib, held = cal.split_prompts(tokenizer, prompt_set.prompts, args.num_prompts, heldout, args.seed)
            source, max_new = str(args.prompts), args.max_new_tokens or 512
        else:
            from sparrow.tasks import ChainTask
            from sparrow_cli.model_cmd import built_filler

            filler = built_filler(args.model) if args.task_filler is None else args.task_filler
            task = ChainTask(args.task_pairs, args.task_hops, args.task_min_hops, filler=filler)
            calib, held, source = cal.task_prompts(
                tokenizer, args.task_pairs, args.task_hops, args.num_prompts, heldout, args.seed, task.min_hops, filler
            )
            max_new = args.max_new_tokens or task.sequence_tokens() - task.prompt_tokens() + 8
        settings = cal.Settings(
            budgets=tuple(sorted(set(args.budgets))),
            bin_width=args.bin_width,
            tau=args.tau,
            max_new_tokens=max_new,
            temperature=args.temperature,
            seed=args.seed,
            min_bin_tokens=args.min_bin_tokens,
            batch_size=args.batch_size,
            backend=args.backend,
            template=Schedule(
                budgets=(args.budgets[0],),
                dense_layers=args.dense_layers,
                sink_blocks=args.sink_blocks,
                local_blocks=args.local_blocks,
            ),
        )
        if any(layer >= model.config.num_hidden_layers for layer in args.dense_layers):
            raise CliError(f"--dense-layers {args.dense_layers}: the model has {model.config.num_hidden_layers} layers")
    except (ScheduleError, ModelLoadError, DataError, TaskError, ValueError) as exc:
        raise CliError(str(exc)) from None
    log(f"calibrating {args.model} on {source}: {len(calib)} prompts, {len(held)} held out, budgets {settings.budgets}")
    with torch.no_grad():
        report = cal.calibrate(Scorer(model, backend=args.backend), calib, held, settings, tokenizer.eos_token_id, log)
    report["model"] = args.model
    report["prompts"]["source"] = source
    if args.prompts:
        report["prompts"]["skipped_rows"] = [str(b) for b in prompt_set.skipped]
    try:
        report["schedule"].save(args.out)
        cal.plot(report, args.plot)
    except OSError as exc:
        raise CliError(f"cannot write the outputs: {exc.strerror or exc}") from None
    report["out"], report["plot"] = args.out, args.plot
    if args.json:
        from sparrow_cli.output import emit_json

        emit_json(cal.report_json(report))
        return 0
    _print_tables(report)
    return 0


def _print_tables(report: dict) -> None:
    from sparrow_cli.output import table

    runs = report["fixed_budgets"]
    index = sorted({r["index"] for run in runs for r in run["bins"]})
    header = ["KV bin", "tokens"] + [f"B={run['budget']} p5/mean" for run in runs]
    rows = []
    for i in index:
        cells = {run["budget"]: next((r for r in run["bins"] if r["index"] == i), None) for run in runs}
        first = next(c for c in cells.values() if c is not None)
        row = [f"{first['kv_start']}+", str(first["tokens"])]
        for run in runs:
            c = cells[run["budget"]]
            row.append("-" if c is None else f"{c['p5']:.3f}/{c['mean']:.3f}{'' if c['trusted'] else ' ?'}")
        rows.append(row)
    print(table(rows, header))
    print("(? = fewer tokens than --min-bin-tokens: reported, not used by the fit)")
    rows = [
        [str(run["budget"]), str(s["sequences"]), f"{s['mean_tokens']:.0f}", f"{s['acceptance_mean']:.3f}",
         f"{s['acceptance_per_1k']:.3f}"]
        for run in runs
        if (s := run["sequences"])["sequences"]
    ]  # fmt: skip
    print("whole sequences, prod_t alpha_t (what p5 per token cannot see):")
    print(table(rows, ["budget", "sequences", "mean tokens", "acceptance", "per 1K tokens"]))
    schedule = report["schedule"]
    print(f"fitted schedule, bin width {schedule.bin_width}, tau {report['settings']['tau']:g}: {schedule.compact()}")
    val = report["validation"]["bins"]
    rows = [
        [f"{r['kv_start']}+", str(r["tokens"]), str(r["budget"]), f"{r['p5']:.3f}", f"{r['mean']:.3f}",
         ("yes" if r["in_band"] else "no") + ("" if r["trusted"] else " ?")]
        for r in val
    ]  # fmt: skip
    print("held-out prompts with the fitted schedule:")
    print(table(rows, ["KV bin", "tokens", "budget", "p5", "mean", "p5 in [tau-0.03, tau+0.05]"]))
    # The tail beyond p5, exact (full distributions) and the top-20 bound side by side.
    rows = [
        [f"{r['kv_start']}+", f"{r['p5']:.3f} / {r['p5_topk']:.3f}", f"{r['p1']:.3f} / {r['p1_topk']:.3f}",
         f"{r['under_half']:.4f} / {r['under_half_topk']:.4f}"]
        for r in val
    ]  # fmt: skip
    print("held-out tail, exact / top-20 bound:")
    print(table(rows, ["KV bin", "p5", "p1", "share alpha < 0.5"]))
    print(f"wrote {report['out']} and {report['plot']}")
