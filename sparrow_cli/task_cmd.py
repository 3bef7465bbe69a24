"""`sparrow task export chain`: the built-in chain task as a dataset file in verl's row shape;
`sparrow task evidence chain`: how far back each of its decisions must look."""

from __future__ import annotations

import argparse
import json

from sparrow.tasks.chain import LONG_FILLER
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
    _filler_argument(e)
    e.set_defaults(handler=run)
    v = sub.add_parser("evidence", help="how far back each decision's evidence lies (JSON)")
    v.add_argument("name", choices=["chain"], help="the task")
    v.add_argument("--pairs", type=int, default=64, help="pairs in each prompt's context")
    v.add_argument("--min-hops", type=int, default=96, help="fewest hops of a query")
    v.add_argument("--max-hops", type=int, default=128, help="most hops of a query")
    _filler_argument(v, default=LONG_FILLER)
    v.add_argument("--far", type=int, default=2048, help="a decision is far-back past this many tokens (2048)")
    v.add_argument("--count", type=int, default=256, help="examples measured (default 256)")
    v.add_argument("--seed", type=int, default=0, help="seed of the examples")
    v.set_defaults(handler=run_evidence)


def _filler_argument(p: argparse.ArgumentParser, default: int = 0) -> None:
    p.add_argument(
        "--filler", type=int, default=default, help=f"countdown tokens after each hop (the long task: {LONG_FILLER})"
    )


def run_evidence(args: argparse.Namespace) -> int:
    """Print, as JSON, the share of decisions (looked-up names) whose nearest evidence lies more than --far
    tokens back, with the KV lengths and the distances' quantiles."""
    from sparrow.tasks import ChainTask, TaskError, generate
    from sparrow_cli.output import emit_json

    if args.count < 1 or args.far < 1:
        raise CliError("--count and --far must be at least 1")
    try:
        task = ChainTask(args.pairs, args.max_hops, args.min_hops, filler=args.filler)
    except TaskError as exc:
        raise CliError(str(exc)) from None
    distances, kv = [], []
    for ex in generate(task, args.count, args.seed, "heldout"):
        distances += task.evidence_distances(ex)
        kv.append(task.sequence_tokens(ex.hops))
    distances.sort()
    emit_json(
        {
            "task": task.name,
            "examples": args.count,
            "decisions": len(distances),
            "decisions_per_example": round(len(distances) / args.count, 1),
            "far_tokens": args.far,
            "far_share": round(sum(d > args.far for d in distances) / len(distances), 4),
            "distance_p5": distances[len(distances) // 20],
            "distance_median": distances[len(distances) // 2],
            "distance_max": distances[-1],
            "kv_mean": round(sum(kv) / len(kv), 1),
            "kv_max": max(kv),
        }
    )
    return 0


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
        task = ChainTask(args.pairs, args.max_hops, args.min_hops, filler=args.filler)
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
