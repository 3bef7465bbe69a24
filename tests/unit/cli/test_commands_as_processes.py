"""Every `sparrow` command as a user starts it, in a process of its own: the unit tests call the commands in
their own process (tests/cli_runner.py), so these are the smoke tests of the real entry point."""

import json

import pytest

from sparrow_cli.main import COMMANDS
from tests.cli_runner import sparrow, sparrow_process


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_starts_in_a_process_of_its_own(command):
    r = sparrow_process(command, "--help", timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(f"usage: sparrow {command}") and r.stderr == ""


def test_a_command_answers_the_same_in_a_process_and_in_the_tests_process():
    argv = ("cost", "--model", "qwen3-1.7b", "--schedule", "qwen3-1.7b-0.86", "--json")
    child, here = sparrow_process(*argv, timeout=60), sparrow(*argv)
    assert child.returncode == here.returncode == 0, child.stderr + here.stderr
    assert json.loads(child.stdout) == json.loads(here.stdout) and child.stderr == here.stderr == ""


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (("cost", "--gen-len", "x"), "sparrow cost: error: argument --gen-len: invalid int value: 'x'"),
        (("schedule", "show", "no-such-preset"), "sparrow schedule: error: "),
    ],
)
def test_an_error_is_one_line_and_exit_2_in_a_process_too(argv, fragment):
    child, here = sparrow_process(*argv, timeout=60), sparrow(*argv)
    assert child.returncode == here.returncode == 2
    assert child.stderr == here.stderr and len(child.stderr.strip().splitlines()) == 1
    assert child.stderr.startswith(fragment), child.stderr
