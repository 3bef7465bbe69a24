"""The `code` reward: the last fenced code block of a response, run against the row's tests in the sandbox.

It follows the trainer's reward signature `(response, ground_truth, extras) -> float | dict` and runs in
the trainer's reward worker processes (services/trainer/reward_pool.py), which call it concurrently as
trajectories arrive. The tests come from `extras["tests"]` or `extras["input_output"]` (a row's
extra_info) or else `ground_truth`: TACO/APPS input_output or LiveCodeBench cases, object or JSON text.
Settings come from `[reward.options.code]` (`extras["options"]`, fields of `CodeRewardOptions`), the
token from CODE_SANDBOX_TOKEN in the trainer's
environment (and the URL from CODE_SANDBOX_URL when the options name none; the Helm chart sets both).

A response without a code block scores 0 (not an error); a sandbox that is down or busy is waited for
and retried until shortly before the call's time budget in the trainer's reward pool ends
(extras["time_budget_s"]: `[reward] timeouts.code`, 180 s by default; `retry_s` can shorten it), then
the call raises, so the trainer counts an error instead of a silent 0 or a killed worker.
"""

from __future__ import annotations

import math
import os
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.sandbox.client import SandboxClient
from services.sandbox.testcases import parse_tests
from sparrow.reward_registry import BUDGET_KEY

# not SPARROW_*: that prefix names config fields of the process that reads it (here, the trainer's)
TOKEN_ENV = "CODE_SANDBOX_TOKEN"
URL_ENV = "CODE_SANDBOX_URL"
DEFAULT_URL = "http://127.0.0.1:8490"
_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*([\w+#.-]*)[^\n]*\n(.*?)^[ \t]*\1[ \t]*$", re.M | re.S)
_LANGUAGE_TAGS = {"python3": {"", "python", "python3", "py", "py3"}}


class CodeRewardOptions(BaseModel):
    """`[reward.options.code]`: where the sandbox is and how a program is scored."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str | None = Field(
        None, description="The sandbox service's base URL (default: CODE_SANDBOX_URL, else http://127.0.0.1:8490)."
    )
    language: str = Field("python3", description="Runtime the programs are written for.")
    score: Literal["fraction", "all"] = Field(
        "fraction", description="fraction: the pass fraction; all: 1 when every case passes, else 0."
    )
    stop_on_first_failure: bool | None = Field(
        None, description="Stop at the first case that does not pass (default: on for score = all)."
    )
    timeout_s: float | None = Field(None, gt=0, description="Seconds per case (default: the service's).")
    memory_mb: int | None = Field(
        None, ge=16, description="Address-space limit per case, MiB (default: the service's)."
    )
    float_tolerance: float | None = Field(None, ge=0, description="Numbers in outputs match within this.")
    retry_s: float | None = Field(
        None,
        ge=0,
        description="Most seconds a busy or down sandbox is waited for before an error (default: until shortly "
        "before the call's timeout in the trainer, [reward] timeouts.code, 180 s unless set).",
    )
    bare_code: bool = Field(
        False,
        description="Run a response with no fenced block whole, as the program (as verl's prime_code does, for "
        "models prompted to answer in bare code); off: it scores 0 without a run.",
    )


def last_code_block(response: str, language: str = "python3") -> str | None:
    """The last complete fenced block of `response` in `language` (or untagged); the answer after </think>."""
    if not isinstance(response, str):
        return None
    if "</think>" in response:
        response = response.rsplit("</think>", 1)[1]
    tags = _LANGUAGE_TAGS.get(language, {"", language})
    blocks = [m.group(3) for m in _FENCE.finditer(response) if m.group(2).lower() in tags]
    return blocks[-1] if blocks and blocks[-1].strip() else None


# Without a budget from the trainer (a direct call): as long as the trainer's default budget.
DEFAULT_RETRY_S = 180.0
_clients: dict[tuple[str, str | None], SandboxClient] = {}


def _client(options: CodeRewardOptions) -> SandboxClient:
    # One client (one connection pool) per worker process and sandbox.
    url = options.url or os.environ.get(URL_ENV) or DEFAULT_URL
    key = (url, os.environ.get(TOKEN_ENV))
    if key not in _clients:
        _clients[key] = SandboxClient(url, key[1], retry_s=math.inf)
    return _clients[key]


def _deadline(options: CodeRewardOptions, budget_s: float | None, start: float) -> float:
    """When to stop retrying: before the trainer's timeout kills the call (a margin to raise and answer)."""
    budget = DEFAULT_RETRY_S if budget_s is None else max(0.0, budget_s - min(2.0, 0.1 * budget_s))
    if options.retry_s is not None:
        budget = min(budget, options.retry_s)
    return start + budget


def code_score(response: str, ground_truth: str | None, extras: dict) -> dict[str, float]:
    """Score `response`'s program against the row's tests; {score, pass_fraction, passed, total, ...}."""
    start = time.monotonic()
    options = CodeRewardOptions.model_validate((extras or {}).get("options") or {})
    tests: Any = (extras or {}).get("tests") or (extras or {}).get("input_output") or ground_truth
    if tests is None:
        raise ValueError("the row has no tests (extra_info.tests, extra_info.input_output or ground_truth)")
    code = last_code_block(response, options.language)
    if code is None and options.bare_code and isinstance(response, str):
        code = response.rsplit("</think>", 1)[-1]
    if code is None or not code.strip():
        return {"score": 0.0, "no_code": 1.0}
    stop = options.stop_on_first_failure if options.stop_on_first_failure is not None else options.score == "all"
    body = {"code": code, "language": options.language, "tests": tests, "stop_on_first_failure": stop}
    for key in ("timeout_s", "memory_mb", "float_tolerance"):
        if getattr(options, key) is not None:
            body[key] = getattr(options, key)
    cases = len(parse_tests(tests).cases)  # a malformed test list raises here, before any request
    # The answer takes at most cases x the per-case timeout (the service's maximum is 30 s unless raised).
    read_timeout = (options.timeout_s or 30.0) * cases + 30.0
    client = _client(options)
    answer = client.run(body, read_timeout, _deadline(options, (extras or {}).get(BUDGET_KEY), start))
    fraction = float(answer["pass_fraction"])
    score = fraction if options.score == "fraction" else float(answer["passed"] == answer["total"])
    statuses = [c["status"] for c in answer["cases"]]
    return {
        "score": score,
        "pass_fraction": fraction,
        "passed": float(answer["passed"]),
        "total": float(answer["total"]),
        "compile_error": float("compile_error" in statuses),
        "timeouts": float(statuses.count("timeout")),
    }
