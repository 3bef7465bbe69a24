"""`sparrow trainer`: run the trainer service (trajectory intake, GRPO + TIS steps, policy publishing)."""

from __future__ import annotations

import argparse

from sparrow_cli.service_cmd import add_common_flags, run_service


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow trainer`."""
    p = subparsers.add_parser("trainer", help="train the policy on streamed rollouts and publish it (gRPC, /metrics)")
    p.add_argument("--run-dir", help="store, checkpoints and published policies (run_dir)")
    p.add_argument("--model-dir", help="HF model folder the run starts from (model_dir)")
    p.add_argument("--redis-url", help="Redis holding the prompt stream (redis_url)")
    p.add_argument("--grpc-address", help="host:port of the gRPC server (grpc.address)")
    p.add_argument("--metrics-port", type=int, help="port of /metrics (metrics.port)")
    p.add_argument("--steps", type=int, help="steps to train, 0 for until stopped (steps)")
    add_common_flags(p, "services/trainer/trainer.toml")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Resolve the config and serve until done or SIGTERM."""
    from services.trainer.config import TrainerServiceConfig

    flags = {
        "run_dir": args.run_dir,
        "model_dir": args.model_dir,
        "redis_url": args.redis_url,
        "grpc.address": args.grpc_address,
        "metrics.port": args.metrics_port,
        "steps": args.steps,
    }
    return run_service(args, TrainerServiceConfig, flags, "services.trainer.main")
