"""`sparrow sandbox`: serve the code sandbox; `sparrow sandbox exec PROGRAM.py`: run one program in its jail."""

from __future__ import annotations

import argparse
import sys

from sparrow_cli.errors import CliError
from sparrow_cli.service_cmd import add_common_flags, run_service


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow sandbox` and `sparrow sandbox exec`."""
    p = subparsers.add_parser("sandbox", help="run model-written programs against tests, jailed (code rewards)")
    p.add_argument("--host", help="API address (api.host)")
    p.add_argument("--port", type=int, help="API port (api.port)")
    p.add_argument("--workers", type=int, help="programs run at once (pool.workers)")
    p.add_argument("--queue-limit", type=int, help="requests that may wait (pool.queue_limit)")
    add_common_flags(p, "services/sandbox/sandbox.toml")
    p.set_defaults(handler=run)
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    e = sub.add_parser("exec", help="run one program through the jail and report how it ended")
    e.add_argument("program", metavar="PROGRAM.py", help="the program's source file")
    e.add_argument("--input", metavar="FILE", help="file given to the program as stdin (default: none)")
    e.add_argument("--timeout-s", type=float, help="wall-clock seconds (default limits.timeout_s)")
    e.add_argument("--memory-mb", type=int, help="address-space limit, MiB (default limits.memory_mb)")
    e.add_argument("--language", default="python3", help="runtime (default python3)")
    e.add_argument("--json", action="store_true", help="print the outcome as JSON (output's first bytes inside)")
    e.add_argument("--config", metavar="FILE", help="TOML config file (its [jail] and [limits] apply)")
    e.set_defaults(handler=run_exec)


def run(args: argparse.Namespace) -> int:
    """Resolve the config and serve."""
    from services.sandbox.config import SandboxConfig

    flags = {
        "api.host": args.host,
        "api.port": args.port,
        "pool.workers": args.workers,
        "pool.queue_limit": args.queue_limit,
    }
    return run_service(args, SandboxConfig, flags, "services.sandbox.main")


def _read(flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise CliError(f"{flag} {path}: {exc.strerror or exc}") from None


def run_exec(args: argparse.Namespace) -> int:
    """Run the program once; exit 0 when it ended `ok`, 1 otherwise, 2 for a usage error."""
    from services.sandbox.config import SandboxConfig
    from services.sandbox.main import INSECURE_WARNING
    from sparrow.config import ConfigError, load_config

    try:
        config = load_config(SandboxConfig, args.config)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    limits = config.limits
    if args.timeout_s is not None and not 0 < args.timeout_s <= limits.max_timeout_s:
        raise CliError(
            f"--timeout-s must be in (0, {limits.max_timeout_s}] (limits.max_timeout_s), got {args.timeout_s}"
        )
    if args.memory_mb is not None and not 16 <= args.memory_mb <= limits.max_memory_mb:
        raise CliError(
            f"--memory-mb must be in [16, {limits.max_memory_mb}] (limits.max_memory_mb), got {args.memory_mb}"
        )
    source = _read("PROGRAM", args.program)
    stdin = _read("--input", args.input) if args.input else b""
    from services.sandbox.jail import Jail, JailError
    from services.sandbox.runtimes import get_runtime

    try:
        runtime = get_runtime(args.language)
        jail = Jail(config.jail.bwrap, config.jail.uid, config.jail.insecure_local, config.jail.proc)
        if jail.insecure_local:
            print(f"sparrow sandbox exec: warning: {INSECURE_WARNING}", file=sys.stderr)
        else:
            jail.check(runtime)
    except (ValueError, JailError) as exc:
        raise CliError(str(exc)) from None
    out = jail.run(runtime, source, stdin, limits.for_request(args.timeout_s, args.memory_mb))
    if args.json:
        from sparrow_cli.output import emit_json

        keep = limits.keep_bytes
        emit_json(
            {
                "status": out.status,
                "exit_code": out.exit_code,
                "signal": out.signal,
                "elapsed_s": round(out.elapsed_s, 4),
                "cpu_s": round(out.cpu_s, 4),
                "peak_memory_bytes": out.peak_memory_bytes,
                "stdout": out.stdout[:keep].decode("utf-8", "replace"),
                "stderr": out.stderr[:keep].decode("utf-8", "replace"),
                "stdout_bytes": len(out.stdout),
                "stderr_bytes": len(out.stderr),
                "detail": out.detail,
            }
        )
    else:
        sys.stdout.buffer.write(out.stdout)
        sys.stdout.flush()
        sys.stderr.buffer.write(out.stderr)
        detail = f" ({out.detail})" if out.detail else ""
        print(
            f"sparrow sandbox exec: {out.status}{detail}, exit code {out.exit_code}, {out.elapsed_s:.2f} s, "
            f"peak {out.peak_memory_bytes / 2**20:.0f} MiB",
            file=sys.stderr,
        )
    return 0 if out.status == "ok" else 1
