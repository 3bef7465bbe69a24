"""Reading a run's metrics history (RUN_DIR/metrics.jsonl), which the launcher writes while the run goes
(services/launcher/history.py: what a row holds and where its figures come from).

Step rows have no `kind`; evaluation rounds have rows of their own, `"kind": "eval"`. A trainer that resumed
from an older checkpoint trained some steps again: the file keeps every row, and `read_history` gives the run
as it stands.
"""

from __future__ import annotations

import json
from pathlib import Path

HISTORY_FILE = "metrics.jsonl"
EVAL_KIND = "eval"  # the kind of a history row of an evaluation round (step rows have no kind)


def read_history(run_dir: Path) -> list[dict]:
    """The step rows of a run's metrics history (a torn last line, or any line that is not a step record, is
    skipped; evaluation rows are `read_eval_history`'s).

    A trainer that resumes from a checkpoint older than its last step trains those steps again (paced
    checkpoints are not taken every step): the file keeps every row, and the history is the run as it
    stands, each step's last training, the rows it superseded left out.
    """
    rows: list[dict] = []
    for row in _rows(run_dir):
        if row.get("kind") is None:
            supersede(rows, row)
    return rows


def supersede(rows: list[dict], row: dict) -> None:
    """Append step `row` to `rows`, dropping the rows of its step and later ones that a resume trained again."""
    while rows and rows[-1]["step"] >= row["step"]:
        rows.pop()
    rows.append(row)


def read_eval_history(run_dir: Path) -> list[dict]:
    """The evaluation rows of a run's metrics history, in the order the rounds ended."""
    return [row for row in _rows(run_dir) if row.get("kind") == EVAL_KIND]


def _rows(run_dir: Path) -> list[dict]:
    rows = []
    path = run_dir / HISTORY_FILE
    if not path.exists():
        return rows
    for line in path.read_bytes().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows
