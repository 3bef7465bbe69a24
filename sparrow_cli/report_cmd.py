"""`sparrow report RUN_DIR`: rebuild a run's report (Markdown and PNG plots) from its metrics history."""

from __future__ import annotations

import argparse

from sparrow_cli.errors import CliError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow report`."""
    p = subparsers.add_parser("report", help="rebuild the report of a `sparrow up` run folder")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a folder written by `sparrow up` (or `sparrow up --compare`)")
    p.add_argument("--json", action="store_true", help="print the report's path and headline figures as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Rebuild the report and say where it is."""
    from pathlib import Path

    from report.compare import build_any_report
    from report.run_report import ReportError
    from sparrow_cli.output import emit_json

    try:
        path, head = build_any_report(Path(args.run_dir))
    except ReportError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:  # a file of the run folder that cannot be read, or the report that cannot be written
        raise CliError(f"{exc.filename}: {exc.strerror or exc}") from None
    if args.json:
        emit_json({"report": str(path), **head})
    else:
        print(path)
    return 0
