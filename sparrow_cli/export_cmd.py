"""`sparrow export RUN_DIR --out DIR [--version N]`: a trained policy as an HF folder (transformers, vLLM)."""

from __future__ import annotations

import argparse
import json

from sparrow_cli.errors import CliError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow export`."""
    p = subparsers.add_parser("export", help="write a run's policy version as an HF model folder")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a `sparrow up` run folder (or a trainer's run_dir)")
    p.add_argument("--out", metavar="DIR", required=True, help="output folder, new or empty")
    p.add_argument("--version", type=int, default=0, help="policy version (default: the latest)")
    p.add_argument(
        "--dtype", default="auto", help="bfloat16, float16, float32 or auto (the dtype of the model the run began with)"
    )
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Export; one line (or JSON) saying what was written."""
    from services.trainer.export import ExportError, export_policy

    if args.version < 0:
        raise CliError(f"--version must be positive, got {args.version}")
    try:
        result = export_policy(args.run_dir, args.out, args.version, args.dtype)
    except ExportError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print(json.dumps(result))
    else:
        print(f"exported policy v{result['version']} ({result['dtype']}) to {result['out']}")
    return 0
