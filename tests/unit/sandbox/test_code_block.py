"""The code reward's extraction of the program from a response."""

from __future__ import annotations

from services.sandbox.reward import last_code_block


def test_the_last_complete_python_block_is_taken():
    text = "Try:\n```python\nprint(1)\n```\nBetter:\n```py\nprint(2)\n```\nOutput:\n```text\n2\n```\n"
    assert last_code_block(text) == "print(2)\n"
    assert last_code_block("```\nprint(3)\n```") == "print(3)\n"
    assert last_code_block("~~~python\nprint(4)\n~~~\n") == "print(4)\n"


def test_a_block_inside_thinking_or_cut_off_is_not_the_answer():
    assert last_code_block("<think>```python\nprint(1)\n```</think>no code after all") is None
    assert last_code_block("<think>draft</think>\n```python\nprint(2)\n```\n```python\nprint(3)") == "print(2)\n"
    assert last_code_block("```python\n\n```") is None
    assert last_code_block("no fences") is None and last_code_block(None) is None


def test_a_longer_fence_holds_a_shorter_one():
    text = "````python\ns = '''\n```\n'''\nprint(s)\n````\n"
    assert last_code_block(text) == "s = '''\n```\n'''\nprint(s)\n"
