"""argparse's own errors (a missing argument, a bad value, an unknown command) are one line and exit 2."""

import pytest

from tests.cli_runner import sparrow


@pytest.mark.parametrize(
    "argv, prog, fragment",
    [
        ((), "sparrow", "required: COMMAND"),
        (("nope",), "sparrow", "invalid choice: 'nope'"),
        (("schedule", "show"), "sparrow schedule show", "required: PRESET_OR_FILE"),
        (("cost", "--gen-len", "x"), "sparrow cost", "--gen-len: invalid int value: 'x'"),
        (("model", "build", "--size", "huge", "--out", "m"), "sparrow model build", "--size: invalid choice"),
        (("bench", "attention", "--no-such-flag"), "sparrow", "unrecognized arguments: --no-such-flag"),
    ],
)
def test_a_usage_error_is_one_line_naming_the_help(argv, prog, fragment):
    r = sparrow(*argv, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"{prog}: error: ") and fragment in lines[0], lines[0]
    assert lines[0].endswith(f"(see {prog} --help)")
    assert r.stdout == ""
