"""A client of the sandbox service for the trainer's reward workers: retries with backoff, never a silent 0.

A 429 (the pool is full), a 502/503/504 or a connection that fails (the service is down or restarting)
is retried with exponential backoff and jitter for up to `retry_s`, or until a caller's deadline (the
code reward's: its time budget in the trainer's reward pool); after that `SandboxUnavailable` is
raised, which the trainer's reward pool counts as an error of that sample. A request the service
refuses as malformed (any other 4xx) is not retried: `SandboxRequestError` with the service's message.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

import httpx

RETRY_STATUSES = (429, 502, 503, 504)


class SandboxUnavailable(RuntimeError):
    """The service did not answer within the retry budget."""


class SandboxRequestError(ValueError):
    """The service refused the request itself (a 4xx other than 429); retrying would not help."""


class SandboxClient:
    """POST /v1/run against one sandbox URL, retried while the service is busy or down."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        retry_s: float = 120.0,
        backoff_s: float = 0.25,
        max_backoff_s: float = 8.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.retry_s, self.backoff_s, self.max_backoff_s = retry_s, backoff_s, max_backoff_s
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._connect_timeout_s = connect_timeout_s
        self._http = httpx.Client(headers=headers)
        self.retries = 0
        """requests retried so far (for the reward's info and the tests)"""

    def run(self, body: dict[str, Any], read_timeout_s: float, deadline: float | None = None) -> dict[str, Any]:
        """The service's answer to `body`; waits and retries through 429s and outages up to `retry_s`, and
        never past `deadline` (time.monotonic()): no attempt's wait reaches beyond it."""
        start = time.monotonic()
        deadline = min(start + self.retry_s, deadline if deadline is not None else math.inf)
        budget = deadline - start
        delay = self.backoff_s
        last = ""
        while True:
            left = max(0.05, deadline - time.monotonic())
            timeout = httpx.Timeout(min(read_timeout_s, left), connect=min(self._connect_timeout_s, left))
            try:
                r = self._http.post(f"{self.url}/v1/run", json=body, timeout=timeout)
                if r.status_code == 200:
                    return r.json()
                if r.status_code not in RETRY_STATUSES:
                    raise SandboxRequestError(f"sandbox refused the request ({r.status_code}): {_detail(r)}")
                last = f"{r.status_code} {_detail(r)}"
            except httpx.TransportError as exc:  # refused, reset, timed out: down, restarting or overloaded
                last = f"{type(exc).__name__}: {exc}"
            left = deadline - time.monotonic()
            if left <= 0:
                raise SandboxUnavailable(f"sandbox at {self.url} did not answer within {budget:.1f} s ({last})")
            self.retries += 1
            time.sleep(min(left, delay * random.uniform(0.5, 1.0)))
            delay = min(delay * 2, self.max_backoff_s)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()


def _detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail", r.text))[:300]
    except ValueError:
        return r.text[:300]
