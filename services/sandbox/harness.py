"""The program that runs a call-based solution inside the jail: defines it, calls `fn_name`, prints the result.

The solution's source travels as a string literal of the harness; the arguments come on stdin as JSON.
The return value is written after a marker line on stdout, so a solution that also prints stays
readable. `fn_name` may be a module-level function or a method of a LeetCode-style `Solution` class.
"""

from __future__ import annotations

import json

MARKER = "\x1e__sparrow_result__"

_TEMPLATE = """import json as _j, sys as _s
_src = {source!r}
_ns = {{"__name__": "__main__"}}
try:
    _code = compile(_src, "solution.py", "exec")
except (SyntaxError, ValueError) as _e:
    _s.stderr.write(f"SyntaxError: {{_e}}\\n")
    _s.exit(1)
_args = _j.loads(_s.stdin.read())
exec(_code, _ns)
_f = _ns.get({fn!r})
if _f is None and isinstance(_ns.get("Solution"), type):
    _f = getattr(_ns["Solution"](), {fn!r}, None)
if not callable(_f):
    _s.stderr.write("NameError: the solution defines no function {fn}\\n")
    _s.exit(1)
_r = _f(*_args)
if isinstance(_r, tuple):
    _r = list(_r)
try:
    _out = _j.dumps(_r)
except (TypeError, ValueError):
    _out = _j.dumps(repr(_r))
_s.stdout.flush()
_s.stdout.write("\\n" + {marker!r} + "\\n" + _out + "\\n")
"""


def call_program(source: str, fn_name: str) -> str:
    """The harness source that defines `source` and calls `fn_name` with the JSON arguments on stdin."""
    return _TEMPLATE.format(source=source, fn=fn_name, marker=MARKER)


def call_input(args: list) -> bytes:
    """The stdin of one call: its arguments as JSON."""
    return json.dumps(args).encode()


def call_result(stdout: str) -> tuple[bool, object]:
    """(a result was written, the decoded return value) from the harness's stdout."""
    head, sep, tail = stdout.rpartition(MARKER + "\n")
    if not sep:
        return False, None
    try:
        return True, json.loads(tail)
    except ValueError:
        return False, None
