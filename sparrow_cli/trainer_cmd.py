"""`sparrow trainer`: run the trainer service (trajectory intake, GRPO + TIS steps, policy publishing)."""

from __future__ import annotations

import argparse

from sparrow_cli.errors import CliError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow trainer`."""
    p = subparsers.add_parser("trainer", help="train the policy on streamed rollouts and publish it (gRPC, /metrics)")
    p.add_argument("--config", metavar="FILE", help="trainer TOML file (see services/trainer/trainer.toml)")
    p.add_argument("--run-dir", help="store, checkpoints and published policies (run_dir)")
    p.add_argument("--model-dir", help="HF model folder the run starts from (model_dir)")
    p.add_argument("--redis-url", help="Redis holding the prompt stream (redis_url)")
    p.add_argument("--grpc-address", help="host:port of the gRPC server (grpc.address)")
    p.add_argument("--metrics-port", type=int, help="port of /metrics (metrics.port)")
    p.add_argument("--steps", type=int, help="steps to train, 0 for until stopped (steps)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Resolve the config and serve until done or SIGTERM."""
    import logging

    from services.trainer.config import TrainerServiceConfig
    from sparrow.config import ConfigError, load_config

    flags = {
        "run_dir": args.run_dir,
        "model_dir": args.model_dir,
        "redis_url": args.redis_url,
        "grpc.address": args.grpc_address,
        "metrics.port": args.metrics_port,
        "steps": args.steps,
    }
    try:
        config = load_config(TrainerServiceConfig, args.config, {k: v for k, v in flags.items() if v is not None})
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    if args.print_config:
        print(config.dump())
        return 0
    level = getattr(logging, str(args.log_level).upper(), None)
    if not isinstance(level, int):
        raise CliError(f"unknown log level {args.log_level!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from services.trainer.main import SetupError, serve

    try:
        serve(config)
    except SetupError as exc:
        raise CliError(str(exc)) from None
    return 0
