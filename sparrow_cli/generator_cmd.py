"""`sparrow generator`: run a rollout generator (work queue in, trajectories out) until SIGTERM."""

from __future__ import annotations

import argparse

from sparrow_cli.service_cmd import add_common_flags, run_service


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow generator`."""
    p = subparsers.add_parser(
        "generator", help="generate rollouts from the prompt stream and stream them to the trainer"
    )
    p.add_argument("--redis-url", help="Redis holding the prompt stream and the schedule (redis.url)")
    p.add_argument("--trainer", metavar="HOST:PORT", help="the trainer's RolloutService (trainer.address)")
    p.add_argument("--engine", choices=["vllm", "reference"], help="which engine generates (engine.kind)")
    p.add_argument("--model", metavar="DIR", help="starting policy checkpoint (engine.model_dir)")
    p.add_argument("--generator-id", help="name in Redis and at the trainer (generator_id; default hostname-pid)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (metrics.port)")
    p.add_argument("--control-port", type=int, help="GeneratorControl gRPC port (control.port)")
    add_common_flags(p, "services/generator/generator.toml")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Resolve the config and serve."""
    from services.generator.config import GeneratorConfig

    flags = {
        "redis.url": args.redis_url,
        "trainer.address": args.trainer,
        "engine.kind": args.engine,
        "engine.model_dir": args.model,
        "generator_id": args.generator_id,
        "metrics.port": args.metrics_port,
        "control.port": args.control_port,
    }
    return run_service(args, GeneratorConfig, flags, "services.generator.main")
