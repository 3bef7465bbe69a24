"""`sparrow controller`: run the closed-loop schedule controller (admin API, /metrics) until SIGTERM."""

from __future__ import annotations

import argparse

from sparrow_cli.service_cmd import add_common_flags, run_service


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow controller`."""
    p = subparsers.add_parser("controller", help="retune the sparsity schedule from Prometheus tail metrics")
    p.add_argument("--redis-url", help="Redis holding the schedule (redis.url)")
    p.add_argument("--prometheus-url", help="Prometheus HTTP API base URL (prometheus.url)")
    p.add_argument("--host", help="admin API address (api.host)")
    p.add_argument("--port", type=int, help="admin API port (api.port)")
    p.add_argument("--interval", type=float, help="seconds between control ticks (interval_s)")
    add_common_flags(p, "services/controller/controller.toml")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Resolve the config and serve."""
    from services.controller.config import ControllerConfig

    flags = {
        "redis.url": args.redis_url,
        "prometheus.url": args.prometheus_url,
        "api.host": args.host,
        "api.port": args.port,
        "interval_s": args.interval,
    }
    return run_service(args, ControllerConfig, flags, "services.controller.main")
