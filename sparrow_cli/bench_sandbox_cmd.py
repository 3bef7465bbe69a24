"""`sparrow bench sandbox`: the code sandbox's throughput at 1, 2, 4 workers and its start-up overhead."""

from __future__ import annotations

import argparse

from sparrow_cli.errors import CliError, require_positive


def add_sandbox_parser(sub: argparse._SubParsersAction) -> None:
    """Register `sparrow bench sandbox`."""
    s = sub.add_parser("sandbox", help="programs/s through the jail at 1, 2, 4 workers; jail start-up overhead")
    s.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated (default 1,2,4)")
    s.add_argument("--trivial", type=int, default=40, help="trivial programs per worker count (default 40)")
    s.add_argument("--cpu", type=int, default=8, help="0.5 s CPU programs per worker at the largest count (8)")
    s.add_argument("--repeats", type=int, default=20, help="runs for the start-up medians (default 20)")
    s.add_argument("--json", action="store_true", help="print JSON")


def run_sandbox_bench(args: argparse.Namespace) -> int:
    """Measure and print."""
    import json

    require_positive(args, "trivial", "cpu", "repeats")
    try:
        workers = tuple(int(w) for w in args.workers.split(","))
    except ValueError:
        raise CliError(f"--workers must be comma-separated integers, got {args.workers!r}") from None
    if not workers or min(workers) < 1:
        raise CliError(f"--workers must be positive, got {args.workers!r}")
    from bench.sandbox import bench_sandbox
    from services.sandbox.jail import JailError

    try:
        result = bench_sandbox(workers, args.trivial, args.cpu, args.repeats)
    except JailError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print(json.dumps(result))
        return 0
    for name, rows in result["throughput"].items():
        for row in rows:
            print(
                f"{name:9s} {row['workers']} workers: {row['programs_per_s']:7.2f} programs/s (x{row['speedup_vs_1']})"
            )
    s = result["startup"]
    print(
        f"start-up: jailed {s['jailed_median_s'] * 1000:.1f} ms, unjailed {s['unjailed_median_s'] * 1000:.1f} ms, "
        f"overhead {s['overhead_s'] * 1000:.1f} ms (x{s['ratio']})"
    )
    return 0
