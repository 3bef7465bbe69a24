"""`sparrow up`: a whole local cluster for an RL run (Redis, Prometheus, generators, trainer, controller)."""

from __future__ import annotations

import argparse
import json
import sys

from sparrow_cli.errors import CliError
from sparrow_cli.service_cmd import add_set_flag


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow up`."""
    p = subparsers.add_parser(
        "up", help="run a local cluster for an RL job, with a live view, a run folder and a report"
    )
    p.add_argument("--config", metavar="FILE", help="up TOML file (see services/launcher/up.toml)")
    p.add_argument("--model-size", choices=["tiny", "small", "long"], help="the own model to train (model_size)")
    p.add_argument("--model", metavar="DIR", help="HF-format policy folder to start from (model_dir)")
    p.add_argument("--steps", type=int, help="training steps (steps)")
    p.add_argument("--generators", type=int, help="generator processes (generators)")
    p.add_argument("--trainer-procs", type=int, help="trainer processes, torchrun ranks (trainer_procs)")
    p.add_argument("--no-controller", action="store_true", help="keep the starting schedule fixed (with_controller)")
    p.add_argument("--dense", action="store_true", help="dense rollouts, no schedule (generator.engine.decode = dense)")
    p.add_argument("--compare", action="store_true", help="run dense, then sparse, and compare them")
    p.add_argument("--engine", choices=["vllm", "reference"], help="generator engine (engine)")
    p.add_argument("--run-dir", metavar="DIR", help="the run folder, new or empty (run_dir)")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="carry on the run of this folder, with its own config (after a kill, or to more --steps)",
    )
    p.add_argument(
        "--data", metavar="FILE", action="append", help="training dataset, repeatable (trainer.data.train_files)"
    )
    p.add_argument(
        "--eval-data", metavar="FILE", action="append", help="held-out dataset, repeatable (trainer.data.eval_files)"
    )
    p.add_argument("--reward", metavar="NAME", help="chain, boxed, math, module:fn or file.py:fn (trainer.reward.name)")
    p.add_argument("--json", action="store_true", help="quiet: one JSON object per step, then a summary")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    add_set_flag(p, "trainer.optim.lr=2e-6 --set controller.interval_s=2")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check every service's config, the model, the ports and the trackers; print the plan; start nothing",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Resolve the config, check the input, run the cluster."""
    from services.launcher.config import UpConfig, service_schemas
    from sparrow.config import ConfigError, load_config
    from sparrow.config_set import parse_set_flags

    if args.compare and args.dense:
        raise CliError("--compare runs dense and sparse itself; drop --dense")
    flags = {
        "model_size": args.model_size,
        "model_dir": args.model,
        "steps": args.steps,
        "generators": args.generators,
        "trainer_procs": args.trainer_procs,
        "with_controller": False if args.no_controller else None,
        "generator.engine.decode": "dense" if args.dense else None,
        "engine": args.engine,
        "run_dir": args.run_dir,
        # Paths as the user typed them, from where sparrow up was started (the services start elsewhere).
        "trainer.data.train_files": _paths(args.data),
        "trainer.data.eval_files": _paths(args.eval_data),
        "trainer.reward.name": args.reward,
    }
    from services.launcher.plan import SetupError, make_plan

    try:
        sets = parse_set_flags(UpConfig, args.set, service_schemas())
        overrides = {k: v for k, v in flags.items() if v is not None} | sets
        if args.resume:
            config = _resumed_config(args, overrides)
        else:
            config = load_config(UpConfig, args.config, overrides)
    except (ConfigError, SetupError) as exc:
        raise CliError(str(exc)) from None
    resume = bool(args.resume)

    if args.print_config:
        # The launch's own checks, so that what prints is what would run (they write nothing).
        from services.launcher.compare import check_compare

        try:
            check_compare(config) if args.compare else make_plan(config, resume=resume)
        except (SetupError, ConfigError) as exc:
            raise CliError(str(exc)) from None
        print(json.dumps(config.dump_public(), sort_keys=True))
        return 0

    if args.dry_run:
        return _dry_run(config, args.json)

    from services.launcher.progress import JsonProgress, LiveProgress
    from services.launcher.run import run_up

    def progress(plan):
        if args.json:
            return JsonProgress(tag={"mode": plan.up.decode} if args.compare else None)
        return LiveProgress(plan.up.steps, str(plan.run_dir))

    try:
        if args.compare:
            from services.launcher.compare import run_compare

            code, summary = run_compare(config, progress)
        else:
            code, summary = run_up(config, progress, resume=resume)
    except (SetupError, ConfigError) as exc:
        raise CliError(str(exc)) from None
    if code == 1 and summary and summary.get("error"):
        print(f"sparrow up: error: {summary['error'].splitlines()[0]}", file=sys.stderr)
    if args.compare and code == 0:
        _print_compare(summary, args.json)
    return code


def _resumed_config(args: argparse.Namespace, overrides: dict):
    """The config of the run in --resume's folder, with the flags that may change on a resume."""
    from pathlib import Path

    from services.launcher.resume import saved_config

    for given, name in ((args.config, "--config"), (args.compare, "--compare"), (args.dry_run, "--dry-run")):
        if given:
            raise CliError(f"--resume carries on a run with its own config; drop {name}")
    run_dir = Path(args.resume).resolve()
    if args.run_dir and Path(args.run_dir).resolve() != run_dir:
        raise CliError("--resume names the run folder; drop --run-dir")
    overrides.pop("run_dir", None)
    return saved_config(run_dir, overrides)


def _dry_run(config, as_json: bool) -> int:
    from services.launcher.dry_run import DryRunError, dry_run, summary, text

    try:
        ctx = dry_run(config)
    except DryRunError as exc:
        raise CliError(str(exc)) from None
    print(json.dumps(summary(ctx)) if as_json else "\n".join(text(ctx)))
    return 0


def _paths(files: list[str] | None) -> list[str] | None:
    from pathlib import Path

    return [str(Path(f).resolve()) for f in files] if files else None


def _print_compare(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"type": "compare", **summary}), flush=True)
        return
    d, s = summary["dense"], summary["sparse"]

    def f(value, spec=".3f"):
        return "-" if value is None else format(value, spec)

    print(
        f"measured rollout speedup of sparse over dense: {f(summary['measured_rollout_speedup'], '.2f')}x "
        f"({f(d['mean_rollout_tokens_per_s'], '.0f')} -> {f(s['mean_rollout_tokens_per_s'], '.0f')} tok/s)"
    )
    print(f"mean accuracy: dense {f(d['mean_accuracy'])}, sparse {f(s['mean_accuracy'])}")
    print(f"report: {summary['report']}")
