"""`sparrow task export chain`: the built-in chain task as a dataset file in verl's row shape."""

from __future__ import annotations

import argparse
import json

from sparrow_cli.errors import CliError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow task`."""
    p = subparsers.add_parser("task", help="the built-in tasks as dataset files")
    sub = p.add_subparsers(dest="task_command", metavar="ACTION")
    sub.required = True
    e = sub.add_parser("export", help="write a task's examples as a dataset (verl's row shape)")
    e.add_argument("name", choices=["chain"], help="the task")
    e.add_argument("--out", metavar="FILE", required=True, help="output file (.parquet or .jsonl)")
    e.add_argument("--pairs", type=int, default=64, help="pairs in each prompt's context (64: sparrow up's default)")
    e.add_argument("--min-hops", type=int, default=16, help="fewest hops of a query")
    e.add_argument("--max-hops", type=int, default=64, help="most hops of a query")
    e.add_argument("--count", type=int, default=8192, help="rows to write")
    e.add_argument("--seed", type=int, default=0, help="seed of the examples")
    e.add_argument("--split", choices=["train", "heldout"], default="train", help="which split (never overlapping)")
    e.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Write the rows; one line on stdout saying what was written."""
    from pathlib import Path

    from sparrow.tasks import ChainTask, TaskError
    from sparrow.tasks.dataset import chain_rows, write_parquet

    out = Path(args.out)
    if out.suffix.lower() not in (".parquet", ".jsonl"):
        raise CliError(f"--out {out}: write .parquet or .jsonl")
    if args.count < 1:
        raise CliError(f"--count must be at least 1, got {args.count}")
    try:
        task = ChainTask(args.pairs, args.max_hops, args.min_hops)
        rows = chain_rows(task, args.count, args.seed, args.split)
    except TaskError as exc:
        raise CliError(str(exc)) from None
    try:
        if out.suffix.lower() == ".parquet":
            write_parquet(rows, out)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    except OSError as exc:
        raise CliError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(f"wrote {len(rows)} {args.split} rows of chain {task.name} to {out}")
    return 0
