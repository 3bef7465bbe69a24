"""What `sparrow up` shows while it runs: a live view (rich), plain lines when not on a terminal, or JSON.

Everything shown comes from the history rows (history.py) and the launcher's own events.
`--json` prints exactly one object per line on stdout: `{"type": "step", ...row}` per step and a
final `{"type": "summary", ...}` (with `--compare`: each run's, tagged `"mode"`, then one
`{"type": "compare", ...}`); everything else goes to the launcher's log.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text


def _num(value, fmt: str = ".3f", missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def p5_table(row: dict) -> Table:
    """One line per length bin: its KV range, budget, exact and PromQL p5, tokens, and whether p5 holds tau;
    with probe sequences in the step, also the p5 of their tokens (at the controller's probe budgets)."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    probes = row.get("probe_p5") or {}
    columns = ["bin", "KV tokens", "budget", "p5", "PromQL p5", "tokens", f"vs tau {row['tau']:g}"]
    if probes:
        columns.append(f"probe p5 ({row.get('probe_samples', 0)} samples)")
    for col in columns:
        table.add_column(col, justify="right")
    budgets, width = row.get("schedule_budgets"), row.get("bin_width")
    for b in sorted(row.get("p5", {}), key=int):
        i, p5 = int(b), row["p5"][b]
        budget = "dense" if not budgets else str(budgets[min(i, len(budgets) - 1)])
        span = f"{i * width}+" if width else "-"
        ok = p5 >= row["tau"]
        mark = Text("holds" if ok else "below", style="green" if ok else "bold red")
        promql = row.get("p5_promql", {}).get(b)
        cells = [b, span, budget, f"{p5:.3f}", _num(promql), str(row.get("alpha_tokens", {}).get(b, "")), mark]
        if probes:
            cells.append(_num(probes.get(b)))
        table.add_row(*cells)
    return table


def step_lines(row: dict, steps: int) -> list[str]:
    """The step's headline figures as short lines of text."""
    gens = ", ".join(f"{name} v{v}" for name, v in sorted(row.get("generator_policy_versions", {}).items()))
    schedule = f"v{row['schedule_version']}" if row.get("schedule_budgets") else "dense"
    adapters = sorted({v for v in row.get("generator_adapter_versions", {}).values() if v})
    adapter = ", ".join(f"v{v}" for v in adapters) or "none"
    return [
        f"step {row['step']}/{steps}  reward {_num(row['reward'])}  accuracy {_num(row['accuracy'], '.2f')}  "
        f"response {_num(row['response_length'], '.1f')} tokens  alpha mean {_num(row.get('alpha_mean'), '.4f')}",
        f"rollout {_num(row.get('rollout_tokens_per_s'), '.0f')} tok/s while generating, "
        f"{_num(row.get('tokens_per_s'), '.0f')} tok/s wall  sparse tokens {_pct(row.get('sparse_token_fraction'))}  "
        f"attended KV {_pct(row.get('attended_kv_fraction'))}",
        f"predicted speedup {_num(row.get('predicted_speedup'), '.2f')}x (cost model; measured: sparrow up --compare)",
        f"versions: policy v{row.get('published_version')} published, generators {gens or '-'}, schedule {schedule}, "
        f"adapter {adapter}",
    ]


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


class JsonProgress:
    """`--json`: one JSON object per step, then the summary; `tag` is added to each (the run of a comparison)."""

    def __init__(self, out: TextIO | None = None, tag: dict | None = None) -> None:
        self.out = out or sys.stdout
        self.tag = tag or {}

    def event(self, message: str) -> None:
        pass  # events go to the launcher's log only: stdout stays machine-readable

    def step(self, row: dict) -> None:
        self._emit({"type": "step", **row})

    def finished(self, summary: dict) -> None:
        self._emit({"type": "summary", **summary})

    def close(self) -> None:
        pass

    def _emit(self, obj: dict) -> None:
        self.out.write(json.dumps({**obj, **self.tag}) + "\n")
        self.out.flush()


class LiveProgress:
    """A live panel on a terminal; elsewhere (CI, a pipe) one plain block per step."""

    def __init__(self, steps: int, run_dir: str, console: Console | None = None) -> None:
        self.steps = steps
        self.run_dir = run_dir
        self.console = console or Console()
        self.started = time.monotonic()
        self.last: dict | None = None
        self.events: list[str] = []
        self.live = (
            Live(self._render(), console=self.console, refresh_per_second=2) if self.console.is_terminal else None
        )
        if self.live is not None:
            self.live.start()

    def event(self, message: str) -> None:
        self.events = [*self.events[-4:], message]
        if self.live is not None:
            self.live.update(self._render())
        else:
            self.console.print(message, highlight=False, soft_wrap=True)  # a pipe gets whole lines

    def step(self, row: dict) -> None:
        self.last = row
        if self.live is not None:
            self.live.update(self._render())
        else:
            for line in step_lines(row, self.steps):
                self.console.print(line, highlight=False, soft_wrap=True)
            self.console.print(p5_table(row))

    def finished(self, summary: dict) -> None:
        self.close()
        for line in summary_lines(summary):
            self.console.print(line, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def _render(self) -> Group:
        elapsed = time.monotonic() - self.started
        head = Text(f"sparrow up  {self.run_dir}  {elapsed:.0f} s", style="bold")
        parts: list = [head]
        if self.last is None:
            parts.append(Text("waiting for the first step ..."))
        else:
            parts += [Text(line) for line in step_lines(self.last, self.steps)]
            parts.append(p5_table(self.last))
        parts += [Text(e, style="dim") for e in self.events]
        return Group(*parts)


def summary_lines(summary: dict) -> list[str]:
    """The end of a run in a few lines: where the report is and the headline figures."""
    work = summary.get("work", {})
    lines = [
        f"run {summary.get('outcome')}: {summary.get('steps_done')} steps in {summary.get('elapsed_s', 0):.0f} s",
        f"final reward {_num(summary.get('final_reward'))}  accuracy {_num(summary.get('final_accuracy'), '.2f')}  "
        f"mean rollout {_num(summary.get('mean_rollout_tokens_per_s'), '.0f')} tok/s  "
        f"min p5 {_num(summary.get('final_min_p5'))} (tau {summary.get('tau')})",
    ]
    procs = summary.get("run", {}).get("trainer_procs")
    if procs:
        lines.append(f"trainer: {procs} process(es)")
    if work:
        lines.append(
            f"groups: {work.get('groups_enqueued')} enqueued, {work.get('groups_trained')} trained, "
            f"{work.get('groups_dropped_stale')} dropped stale, {work.get('groups_waiting')} waiting, "
            f"{len(work.get('lost', []))} lost"
        )
    if summary.get("report"):
        lines.append(f"report: {summary['report']}")
    return lines
