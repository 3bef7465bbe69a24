"""Seconds per scheduling scope of the suite (tests/durations.json), read from a pytest log's slowest-tests list.

`tests/conftest.py` hands the scopes to the two xdist workers heaviest first, so that no long file starts
last while the other worker idles. Regenerate after the suite's shape changes:

    scripts/test --durations=0 | tee suite.log
    python -m tests.durations suite.log

A scope missing from the file counts 0 and keeps its place in collection order.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

FILE = Path(__file__).with_name("durations.json")
_LINE = re.compile(r"^\s*([0-9.]+)s (?:call|setup|teardown)\s+(\S+?)::")


def scope_of(path: str, jail_prefixes: tuple[str, ...]) -> str:
    """The scheduling scope of a test file: the file, or "jail" for the files that run in the sandbox's jail."""
    return "jail" if path.startswith(jail_prefixes) else path


def from_log(text: str, jail_prefixes: tuple[str, ...]) -> dict[str, float]:
    """Seconds per scope summed over the log's duration lines, heaviest first, rounded to 0.1 s."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            scope = scope_of(m.group(2), jail_prefixes)
            totals[scope] = totals.get(scope, 0.0) + float(m.group(1))
    return {k: round(v, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def load() -> dict[str, float]:
    """The committed seconds per scope; empty when the file is missing or unreadable (collection order then)."""
    try:
        data = json.loads(FILE.read_text())
        return {str(k): float(v) for k, v in data.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def main(argv: list[str]) -> int:
    from tests.conftest import JAIL_FILES

    if len(argv) != 1:
        print("usage: python -m tests.durations PYTEST_LOG", file=sys.stderr)
        return 2
    totals = from_log(Path(argv[0]).read_text(), JAIL_FILES)
    if not totals:
        print(f"no duration lines in {argv[0]} (run pytest with --durations=0)", file=sys.stderr)
        return 1
    FILE.write_text(json.dumps(totals, indent=1) + "\n")
    print(f"{len(totals)} scopes, {sum(totals.values()):.0f} s in all -> {FILE.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
