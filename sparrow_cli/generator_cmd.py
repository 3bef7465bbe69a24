"""`sparrow generator`: run a rollout generator (work queue in, trajectories out) until SIGTERM."""

from __future__ import annotations

import argparse

from sparrow_cli.errors import CliError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow generator`."""
    p = subparsers.add_parser(
        "generator", help="generate rollouts from the prompt stream and stream them to the trainer"
    )
    p.add_argument("--config", metavar="FILE", help="generator TOML file (see services/generator/generator.toml)")
    p.add_argument("--redis-url", help="Redis holding the prompt stream and the schedule (queue.url)")
    p.add_argument("--trainer", metavar="HOST:PORT", help="the trainer's RolloutService (trainer.address)")
    p.add_argument("--engine", choices=["vllm", "reference"], help="which engine generates (engine.kind)")
    p.add_argument("--model", metavar="DIR", help="starting policy checkpoint (engine.model_dir)")
    p.add_argument("--generator-id", help="name in Redis and at the trainer (generator_id; default hostname-pid)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (metrics.port)")
    p.add_argument("--control-port", type=int, help="GeneratorControl gRPC port (control.port)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Resolve the config and serve."""
    import logging

    from services.generator.config import GeneratorConfig
    from sparrow.config import ConfigError, load_config

    flags = {
        "queue.url": args.redis_url,
        "trainer.address": args.trainer,
        "engine.kind": args.engine,
        "engine.model_dir": args.model,
        "generator_id": args.generator_id,
        "metrics.port": args.metrics_port,
        "control.port": args.control_port,
    }
    try:
        config = load_config(GeneratorConfig, args.config, {k: v for k, v in flags.items() if v is not None})
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    if args.print_config:
        print(config.dump())
        return 0
    level = getattr(logging, str(args.log_level).upper(), None)
    if not isinstance(level, int):
        raise CliError(f"unknown log level {args.log_level!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from services.generator.main import SetupError, serve

    try:
        serve(config)
    except SetupError as exc:
        raise CliError(str(exc)) from None
    return 0
