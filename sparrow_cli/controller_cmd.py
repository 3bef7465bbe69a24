"""`sparrow controller`: run the closed-loop schedule controller (admin API, /metrics) until SIGTERM."""

from __future__ import annotations

import argparse

from sparrow_cli.errors import CliError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow controller`."""
    p = subparsers.add_parser("controller", help="retune the sparsity schedule from Prometheus tail metrics")
    p.add_argument("--config", metavar="FILE", help="controller TOML file (see services/controller/controller.toml)")
    p.add_argument("--redis-url", help="Redis holding the schedule (redis.url)")
    p.add_argument("--prometheus-url", help="Prometheus HTTP API base URL (prometheus.url)")
    p.add_argument("--host", help="admin API address (api.host)")
    p.add_argument("--port", type=int, help="admin API port (api.port)")
    p.add_argument("--interval", type=float, help="seconds between control ticks (interval_s)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Resolve the config and serve."""
    import logging

    from services.controller.config import ControllerConfig
    from sparrow.config import ConfigError, load_config

    flags = {
        "redis.url": args.redis_url,
        "prometheus.url": args.prometheus_url,
        "api.host": args.host,
        "api.port": args.port,
        "interval_s": args.interval,
    }
    try:
        config = load_config(ControllerConfig, args.config, {k: v for k, v in flags.items() if v is not None})
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    if args.print_config:
        print(config.dump())
        return 0
    level = getattr(logging, str(args.log_level).upper(), None)
    if not isinstance(level, int):
        raise CliError(f"unknown log level {args.log_level!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from services.controller.main import SetupError, serve

    try:
        serve(config)
    except SetupError as exc:
        raise CliError(str(exc)) from None
    return 0
