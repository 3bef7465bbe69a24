"""The `code` reward against a real sandbox service: TACO problems scored, the modes, a sandbox that is down."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.sandbox import reward
from services.sandbox.client import SandboxUnavailable
from services.sandbox.reward import code_score
from tests.integration.sandbox.service import TOKEN, sandbox_service
from tests.servers import free_port

# A stdin/stdout problem and a call-based one, TACO's input_output shape.
SUM = {"inputs": ["1 2\n", "5 5\n", "10 -3\n"], "outputs": ["3\n", "10\n", "7\n"]}
LONGEST = json.dumps({"fn_name": "longest", "inputs": [[["a", "bbb", "cc"]], [["x"]]], "outputs": [["bbb"], ["x"]]})


def fenced(code: str) -> str:
    return f"<think>first try:\n```python\nprint('draft')\n```\n</think>\nHere it is:\n```python\n{code}```\n"


CASES = [
    (fenced("a, b = map(int, input().split())\nprint(a + b)\n"), None, {"tests": SUM}, 1.0),
    (fenced("a, b = map(int, input().split())\nprint(a * b)\n"), None, {"tests": SUM}, 0.0),
    (fenced("a, b = map(int, input().split())\nprint(a + b if b > 0 else 0)\n"), None, {"tests": SUM}, 2 / 3),
    (fenced("def longest(words):\n    return max(words, key=len)\n"), LONGEST, {}, 1.0),
    (fenced("def longest(words):\n    return words[0]\n"), LONGEST, {}, 0.5),
    (fenced("def longest(words:\n"), LONGEST, {}, 0.0),
    ("I cannot solve this.", LONGEST, {}, 0.0),
]


@pytest.fixture(scope="module")
def url():
    with sandbox_service("--workers", "2") as server:
        yield server.url


@pytest.fixture(autouse=True)
def token(monkeypatch):
    monkeypatch.setenv(reward.TOKEN_ENV, TOKEN)


@pytest.mark.parametrize(("response", "truth", "extra", "score"), CASES)
def test_taco_problems_score_correct_1_incorrect_0_partial_their_fraction(url, response, truth, extra, score):
    result = code_score(response, truth, {**extra, "options": {"url": url}})
    assert result["score"] == pytest.approx(score)


def test_all_or_nothing_and_stop_at_the_first_failure(url):
    first_fails = fenced("a, b = map(int, input().split())\nprint(a + b if a != 1 else 0)\n")
    result = code_score(first_fails, None, {"tests": SUM, "options": {"url": url, "score": "all"}})
    assert (result["score"], result["passed"], result["total"]) == (0.0, 0.0, 3.0)  # stopped at case 1
    options = {"url": url, "score": "all", "stop_on_first_failure": False}
    result = code_score(first_fails, None, {"tests": SUM, "options": options})
    assert result["score"] == 0.0 and result["pass_fraction"] == pytest.approx(2 / 3)
    result = code_score(CASES[0][0], None, {"tests": SUM, "options": {"url": url, "score": "all"}})
    assert result["score"] == 1.0


def test_rewards_called_concurrently_each_get_their_own_score(url):
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda c: code_score(c[0], c[1], {**c[2], "options": {"url": url}})["score"], CASES * 2))
    assert got == pytest.approx([c[3] for c in CASES] * 2)


def test_a_bad_row_raises_instead_of_scoring(url):
    with pytest.raises(ValueError, match="no tests"):
        code_score(CASES[0][0], None, {"options": {"url": url}})
    with pytest.raises(ValueError, match="needs 'inputs' and 'outputs'"):
        code_score(CASES[0][0], '{"inputs": []}', {"options": {"url": url}})
    with pytest.raises(ValueError, match="extra"):
        code_score(CASES[0][0], LONGEST, {"options": {"url": url, "retries": 3}})


def test_a_sandbox_that_is_down_is_waited_for_and_the_score_arrives_once_it_is_back():
    port = free_port()
    options = {"url": f"http://127.0.0.1:{port}", "retry_s": 90}
    results: list = []
    caller = threading.Thread(
        target=lambda: results.append(code_score(CASES[0][0], None, {"tests": SUM, "options": options}))
    )
    caller.start()
    time.sleep(2.0)  # the reward is retrying against nothing
    assert caller.is_alive() and not results
    with sandbox_service("--workers", "1", port=port):
        caller.join(timeout=60)
    assert results and results[0]["score"] == 1.0
    assert reward._client(reward.CodeRewardOptions(**options)).retries >= 1


def test_a_sandbox_down_past_the_retry_budget_is_an_error_not_a_score():
    options = {"url": f"http://127.0.0.1:{free_port()}", "retry_s": 1.5}
    start = time.monotonic()
    with pytest.raises(SandboxUnavailable, match=r"did not answer within 1\.\d s"):
        code_score(CASES[0][0], None, {"tests": SUM, "options": options})
    assert time.monotonic() - start < 5
