"""`sparrow schedule`: list the published presets, show a schedule, validate a schedule file."""

from __future__ import annotations

import argparse

from sparrow_cli.errors import CliError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow schedule {list,show,validate}`."""
    parser = subparsers.add_parser("schedule", help="list, show and validate sparsity schedules")
    actions = parser.add_subparsers(dest="schedule_action", metavar="ACTION")
    actions.required = True

    p = actions.add_parser("list", help="names of the published presets")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = actions.add_parser("show", help="bins, budgets and settings of a preset or a JSON file")
    p.add_argument("schedule", metavar="PRESET_OR_FILE", help="a preset name (see `list`) or a schedule JSON file")
    p.add_argument("--json", action="store_true", help="print the schedule as JSON")

    p = actions.add_parser("validate", help="check a schedule JSON file; prints `ok` or one error line")
    p.add_argument("file", metavar="FILE", help="schedule JSON file")
    p.add_argument("--json", action="store_true", help="print JSON")

    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Carry out the chosen schedule action."""
    from sparrow.schedule import ScheduleError

    action = {"list": _list, "show": _show, "validate": _validate}[args.schedule_action]
    try:
        return action(args)
    except ScheduleError as exc:
        raise CliError(str(exc)) from None


def _list(args: argparse.Namespace) -> int:
    from sparrow.presets import get_preset, list_presets
    from sparrow_cli.output import emit_json, table

    schedules = [get_preset(name) for name in list_presets()]
    if args.json:
        emit_json([{"name": s.name, "budgets": list(s.budgets)} for s in schedules])
    else:
        print(table([[s.name or "", s.compact()] for s in schedules], ["preset", "kept KV tokens per 2K bin"]))
    return 0


def _show(args: argparse.Namespace) -> int:
    from sparrow.presets import resolve_schedule
    from sparrow_cli.output import emit_json, table

    schedule = resolve_schedule(args.schedule)
    if args.json:
        emit_json(schedule.to_dict())
        return 0
    rows = []
    for i, budget in enumerate(schedule.budgets):
        start, end = schedule.bin_range(i)
        kv = f"[{start}, {end})" if end is not None else f"[{start}, ...)"
        rows.append([str(i), kv, str(budget), str(budget // schedule.page_size)])
    print(_summary(schedule))
    print(table(rows, ["bin", "KV length", "budget tokens", "pages"]))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from sparrow.schedule import Schedule
    from sparrow_cli.output import emit_json

    schedule = Schedule.load(args.file)
    if args.json:
        emit_json({"ok": True, "schedule": schedule.to_dict()})
    else:
        print(f"ok: {_summary(schedule)}; budgets {schedule.compact()}")
    return 0


def _summary(schedule) -> str:
    dense = ", ".join(map(str, schedule.dense_layers)) or "none"
    return (
        f"{schedule.name or '(unnamed)'} v{schedule.version}: {schedule.num_bins} bins of {schedule.bin_width} tokens, "
        f"page {schedule.page_size}, sink {schedule.sink_blocks} / local {schedule.local_blocks} blocks, "
        f"dense layers {dense}"
    )
