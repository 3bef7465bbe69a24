"""What the three service commands (`sparrow controller|trainer|generator`) share: config, logging, serving."""

from __future__ import annotations

import argparse
import importlib

from sparrow_cli.errors import CliError


def add_common_flags(p: argparse.ArgumentParser, config_example: str) -> None:
    """--config, --set, --log-level and --print-config, the same on every service command."""
    p.add_argument("--config", metavar="FILE", help=f"TOML config file (see {config_example})")
    add_set_flag(p, "optim.lr=2e-6")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")


def add_set_flag(p: argparse.ArgumentParser, example: str) -> None:
    """--set KEY=VALUE, repeatable: one config field by its dotted key, typed by the config's schema."""
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"set one config field by its dotted key (repeatable; over the file, the environment and the flags), "
        f"e.g. --set {example}",
    )


def run_service(args: argparse.Namespace, config_cls: type, flags: dict, main_module: str) -> int:
    """Resolve `config_cls` (defaults < file < environment < the flags given), then `main_module.serve` it.

    Bad config, an unknown log level or the service's SetupError are one line (CliError).
    """
    config = resolve_service_config(args, config_cls, flags)
    if config is None:
        return 0
    main = importlib.import_module(main_module)
    try:
        main.serve(config)
    except main.SetupError as exc:
        raise CliError(str(exc)) from None
    return 0


def resolve_service_config(args: argparse.Namespace, config_cls: type, flags: dict):
    """The resolved config, with logging set up; None after --print-config printed it. CliError for bad input."""
    import logging

    from sparrow.config import ConfigError, load_config
    from sparrow.config_set import parse_set_flags

    try:
        overrides = {k: v for k, v in flags.items() if v is not None} | parse_set_flags(config_cls, args.set)
        config = load_config(config_cls, args.config, overrides)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    if args.print_config:
        print(config.dump())
        return None
    level = getattr(logging, str(args.log_level).upper(), None)
    if not isinstance(level, int):
        raise CliError(f"unknown log level {args.log_level!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return config
