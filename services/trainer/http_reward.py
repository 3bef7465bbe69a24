"""A reward served over HTTP (`--reward http://host:port/path`): one async client in the trainer.

Every call of the run goes through one `httpx.AsyncClient` on an event loop of its own thread, so
`max_concurrency` holds for the whole trainer (a limit could not hold across the reward pool's
worker processes). A call POSTs JSON `{"prompt", "response", "ground_truth", "extras"}` and reads
back a score or a dict with `score`; with `batch_size` > 1 a group's samples go `batch_size` at a
time as `{"items": [...]}`, answered with a list. A timeout, a refused connection, a 5xx or 429
is retried `retries` times with exponential backoff; what still fails, or answers garbage, scores 0
and is counted as a reward error by reason (the pool's counter), and never stops a step.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import Future
from urllib.parse import urlsplit

import httpx

from services.trainer.config import HttpRewardConfig
from services.trainer.reward_pool import RewardPool, RewardResult
from sparrow.reward_shapes import RewardInput, coerce_score, short

RETRIED_STATUSES = {429, 500, 502, 503, 504}


def is_http_reward(name: str) -> bool:
    """Whether a reward name is a URL."""
    return name.startswith(("http://", "https://"))


def check_http_reward(url: str, timeout_s: float = 5.0) -> str | None:
    """None when a server answers at the URL's host and port, else one line saying why not (for start checks)."""
    parts = urlsplit(url)
    if not parts.hostname:
        return f"reward {url}: not a URL with a host"
    try:
        httpx.get(f"{parts.scheme}://{parts.netloc}/", timeout=timeout_s)
    except httpx.HTTPError as exc:
        return f"reward {url}: no server answers at {parts.netloc} ({type(exc).__name__})"
    return None


class HttpRewards:
    """Calls reward servers; `submit_inputs` returns a Future of a RewardResult per input, like the pool's."""

    def __init__(self, config: HttpRewardConfig, pool: RewardPool) -> None:
        self.config = config
        self.pool = pool  # counts and logs failures, with the other rewards' errors
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="http-rewards", daemon=True)
        self._thread.start()
        headers = {"Authorization": f"Bearer {config.token}"} if config.token else {}
        self._client, self._limit = asyncio.run_coroutine_threadsafe(self._open(headers), self._loop).result()

    async def _open(self, headers: dict) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        limits = httpx.Limits(max_connections=self.config.max_concurrency)
        return httpx.AsyncClient(headers=headers, limits=limits), asyncio.Semaphore(self.config.max_concurrency)

    def submit_inputs(self, url: str, inputs: list[RewardInput]) -> Future:
        """Score `inputs` (in requests of batch_size); the Future resolves to a RewardResult per input."""
        return asyncio.run_coroutine_threadsafe(self._score(url, list(inputs)), self._loop)

    async def _score(self, url: str, inputs: list[RewardInput]) -> list[RewardResult]:
        size = self.config.batch_size
        chunks = [inputs[i : i + size] for i in range(0, len(inputs), size)]
        parts = await asyncio.gather(*(self._chunk(url, c) for c in chunks))
        return [r for part in parts for r in part]

    async def _chunk(self, url: str, inputs: list[RewardInput]) -> list[RewardResult]:
        items = [_body(i) for i in inputs]
        body = items[0] if self.config.batch_size == 1 else {"items": items}
        reason, detail, value = await self._post(url, body)
        if reason is not None:
            return self.pool.failed(url, reason, detail, len(inputs))
        values = [value] if self.config.batch_size == 1 else value
        if not isinstance(values, list) or len(values) != len(inputs):
            return self.pool.failed(url, "bad_value", f"answered {short(value)} for {len(inputs)} items", len(inputs))
        results = []
        for v in values:
            score, info, why = coerce_score(v)
            results += (
                [RewardResult(score, info)] if why is None else self.pool.failed(url, why, f"answered {short(v)}")
            )
        return results

    async def _post(self, url: str, body: dict) -> tuple[str | None, str, object]:
        c = self.config
        reason, detail = "unavailable", ""
        for attempt in range(c.retries + 1):
            if attempt:
                await asyncio.sleep(c.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._limit:
                    response = await self._client.post(url, json=body, timeout=c.timeout_s)
            except httpx.TimeoutException:
                reason, detail = "timeout", f"no answer within {c.timeout_s:g} s"
                continue
            except httpx.HTTPError as exc:
                reason, detail = "unavailable", f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code in RETRIED_STATUSES:
                reason, detail = "unavailable", f"HTTP {response.status_code}"
                continue
            if response.status_code >= 400:
                return "bad_value", f"HTTP {response.status_code}", None
            try:
                return None, "", response.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                return "bad_value", f"answered non-JSON {short(response.text)}", None
        return reason, f"{detail} after {c.retries + 1} tries", None

    def close(self) -> None:
        """Close the client and stop the loop."""
        try:
            asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


def _body(item: RewardInput) -> dict:
    extras = {k: v for k, v in item.extras.items() if k != "columns"}
    return {"prompt": item.prompt, "response": item.response, "ground_truth": item.ground_truth,
            "extras": extras, "columns": item.columns}  # fmt: skip
