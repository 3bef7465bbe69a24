"""The work ledger of a finished run: every prompt group on the stream, and what became of it.

Read at the end, before Redis stops: the prompt stream (every group the trainer enqueued, once
per delivery it made), the dead-letter stream, and the trainer's own record (the newest
checkpoint's trained and dropped groups, and its group ledger for those still waiting). Only this
run's groups count (their ids start with the trainer's run id), so a shared Redis holding other
runs' streams changes nothing. A group is `lost` when the stream had it and the trainer has no
trace of it; `trained_twice` lists groups two steps trained on. Both must be empty.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from sparrow.work import DEAD_LETTER_STREAM, GENERATOR_GROUP, PROMPTS_STREAM, PromptGroup, WorkItemError

WORK_FILE = "work.json"
EVAL_TAG = "eval"  # eval group ids: <run id>-eval<round>-<source>-<i>; training groups: <run id>-<8 digits>


def stream_group_ids(redis_client, stream: str) -> list[str]:
    """Group ids of every entry of `stream`, in order (a group enqueued twice appears twice)."""
    out, cursor = [], "-"
    while True:
        entries = redis_client.xrange(stream, min=cursor, count=1000)
        for _entry_id, fields in entries:
            gid = _group_id(fields)
            if gid is not None:
                out.append(gid)
        if len(entries) < 1000:
            return out
        last = entries[-1][0]
        cursor = "(" + (last.decode() if isinstance(last, bytes) else last)


def _group_id(fields: dict) -> str | None:
    decoded = {
        (k.decode() if isinstance(k, bytes) else k): (v.decode(errors="replace") if isinstance(v, bytes) else v)
        for k, v in fields.items()
    }
    try:
        return PromptGroup.from_fields(decoded).group_id
    except WorkItemError:
        return decoded.get("group_id")


def trainer_record(trainer_dir: Path) -> dict:
    """The trainer's side: groups per trained step and dropped (newest checkpoint), ledger groups and dead ones."""
    history, dropped = [], []
    checkpoints = sorted((trainer_dir / "checkpoints").glob("step-*/meta.json"))
    if checkpoints:
        meta = json.loads(checkpoints[-1].read_text())
        history, dropped = meta.get("history", []), meta.get("dropped", [])
    enqueued, dead = set(), set()
    ledger = trainer_dir / "groups.log"
    if ledger.exists():
        for line in ledger.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a torn last line
            if entry.get("kind") == "enqueued":
                enqueued.add(entry["group"]["group_id"])
            elif entry.get("kind") == "dead":
                dead.add(entry.get("group_id"))
    run_id = ""
    try:
        run_id = str(json.loads((trainer_dir / "run.json").read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no run id yet (the trainer never started): every group on the stream counts
    return {"history": history, "dropped": dropped, "ledger": enqueued, "dead": dead, "run_id": run_id}


def account(redis_client, trainer_dir: Path) -> dict:
    """What became of every group: counts plus the ids of any lost or trained twice."""
    record = trainer_record(trainer_dir)
    prefix = f"{record['run_id']}-" if record["run_id"] else ""
    everything = [g for g in stream_group_ids(redis_client, PROMPTS_STREAM) if g.startswith(prefix)]
    # Evaluation rounds' groups (services/trainer/evaluation.py) are scored, never trained: counted apart.
    evals = {g for g in everything if g[len(prefix) :].startswith(EVAL_TAG)}
    on_stream = [g for g in everything if g not in evals]
    ledger = {g for g in record["ledger"] if not g[len(prefix) :].startswith(EVAL_TAG)}
    dead_lettered = {g for g in stream_group_ids(redis_client, DEAD_LETTER_STREAM) if g.startswith(prefix)}
    try:
        pending = int(redis_client.xpending(PROMPTS_STREAM, GENERATOR_GROUP)["pending"])
    except Exception:  # no consumer group: nothing was ever read
        pending = 0
    trained = Counter(gid for step in record["history"] for gid in step)
    dropped = set(record["dropped"])
    finished = set(trained) | dropped
    known = finished | ledger | record["dead"] | dead_lettered
    groups = set(on_stream)
    waiting = sorted((groups | ledger) - finished - record["dead"] - dead_lettered)
    return {
        "groups_enqueued": len(groups),
        "stream_entries": len(on_stream),
        "groups_trained": len(trained),
        "groups_dropped_stale": len(dropped),
        "groups_dead": len(record["dead"] | dead_lettered),
        "groups_waiting": len(waiting),
        "pending_entries": pending,
        "lost": sorted(groups - known),
        "trained_twice": sorted(g for g, n in trained.items() if n > 1),
        "trained_and_dropped": sorted(set(trained) & dropped),
        "eval_groups": len(evals),
    }
