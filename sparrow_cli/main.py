"""The `sparrow` command: parses the command line and hands off to one command module, imported lazily.

Each command module exposes `add_parser(subparsers)` and `run(args) -> int`. Errors a user can
cause raise `CliError`; they are printed as one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from sparrow_cli.errors import CliError

# command name -> module. The heavy imports of a command happen inside its `run`;
# building the parser only calls each `add_parser`, so `sparrow --help` stays instant.
COMMANDS: dict[str, str] = {
    "schedule": "sparrow_cli.schedule_cmd",
    "cost": "sparrow_cli.cost_cmd",
    "bench": "sparrow_cli.bench_cmd",
    "selfcheck": "sparrow_cli.selfcheck_cmd",
    "model": "sparrow_cli.model_cmd",
    "controller": "sparrow_cli.controller_cmd",
    "calibrate": "sparrow_cli.calibrate_cmd",
    "trainer": "sparrow_cli.trainer_cmd",
    "generator": "sparrow_cli.generator_cmd",
    "up": "sparrow_cli.up_cmd",
    "report": "sparrow_cli.report_cmd",
    "sandbox": "sparrow_cli.sandbox_cmd",
    "task": "sparrow_cli.task_cmd",
    "export": "sparrow_cli.export_cmd",
}


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its usage errors on one line, as every other error of the command.

    Subcommand parsers are made of the parent's class, so the whole tree answers this way.
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sparrow",
        description="Sparrow Cluster: block-sparse rollouts for long-context RL, kept stable by tail acceptance.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, for a command that starts itself again
    try:
        return int(args.handler(args) or 0)
    except CliError as exc:
        print(f"sparrow {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sparrow {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
