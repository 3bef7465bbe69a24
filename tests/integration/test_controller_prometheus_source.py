"""The controller's Prometheus reader against a real Prometheus scraping an exporter that shows odd series.

The exporter serves whatever exposition text a test sets, so that series a trainer never writes (labels
that are no bin, values outside their range) reach the reader exactly as Prometheus hands them on.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.controller.prometheus_source import PrometheusSource, PrometheusUnavailable
from services.controller.readings import Snapshot
from sparrow import metrics_contract as mc
from tests.servers import prometheus_server, wait_until


@dataclass
class Exporter:
    """A /metrics endpoint serving `text` as it stands."""

    server: ThreadingHTTPServer
    text: str = ""

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture(scope="module")
def scraped() -> Iterator[tuple[Exporter, str]]:
    exporter = Exporter(ThreadingHTTPServer(("127.0.0.1", 0), None))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = exporter.text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    exporter.server.RequestHandlerClass = Handler
    thread = threading.Thread(target=exporter.server.serve_forever, daemon=True)
    thread.start()
    try:
        with prometheus_server([exporter.target]) as prom:
            yield exporter, prom.url
    finally:
        exporter.server.shutdown()
        exporter.server.server_close()


def _trainer(p5s: dict[str, float], steps: int, extra: str = "") -> str:
    """A trainer's exposition: p5 and tokens per bin label, its schedule version and step counter."""
    lines = [f'{mc.ALPHA_P5_GAUGE}{{bin="{b}"}} {p}' for b, p in p5s.items()]
    lines += [f'{mc.ALPHA_TOKENS_GAUGE}{{bin="{b}"}} 5000' for b in p5s]
    lines += [f"{mc.SCHEDULE_VERSION_GAUGE} 1", f"{mc.ALPHA_STEPS_COUNTER}_total {steps}"]
    return "\n".join(lines) + "\n" + extra


def _read(url: str, probes: bool = False) -> Snapshot:
    async def main() -> Snapshot:
        source = PrometheusSource(url, window_s=5, timeout_s=5, max_age_s=5, probes=probes)
        try:
            return await source.read(time.time())
        finally:
            await source.aclose()

    return asyncio.run(main())


def _show(exporter: Exporter, url: str, text: str, steps: int) -> None:
    """Serve `text` and wait until Prometheus has scraped it (its step counter reads `steps`)."""
    exporter.text = text

    def scraped_now() -> bool:
        series = asyncio.run(_query(url, f"{mc.ALPHA_STEPS_COUNTER}_total"))
        return series == [float(steps)]

    wait_until(scraped_now, 30, f"Prometheus scraped step {steps}")


async def _query(url: str, promql: str) -> list[float]:
    source = PrometheusSource(url, window_s=5, timeout_s=5, max_age_s=5)
    try:
        return [value for _, value in await source.query(promql)]
    finally:
        await source.aclose()


def test_series_whose_bin_label_is_no_bin_number_are_left_out(scraped):
    exporter, url = scraped
    # '²' passes str.isdigit but not int(); 5000 digits pass neither int() nor any schedule.
    odd = "".join(
        f'{mc.ALPHA_P5_GAUGE}{{bin="{label}"}} 0.5\n{mc.ALPHA_TOKENS_GAUGE}{{bin="{label}"}} 5000\n'
        for label in ("\u00b2", "9" * 5000, "x")
    )
    _show(exporter, url, _trainer({"0": 0.9, "1": 0.91}, steps=1, extra=odd), steps=1)
    snapshot = _read(url)
    assert set(snapshot.bins) == {0, 1}
    assert snapshot.bins[0].p5_exact == 0.9 and snapshot.bins[1].p5_exact == 0.91


def test_a_p5_outside_0_1_is_no_reading(scraped):
    exporter, url = scraped
    # A ratio can be neither: acted on, -0.5 doubled a bin's budget, 7.0 halved it, and 1e308 overflowed
    # the bin's running mean to inf, which failed every later tick until the memory forgot it.
    p5s = {"0": -0.5, "1": 7.0, "2": 1e308, "3": 0.9, "4": 0.0, "5": 1.0}
    probe = "".join(
        f'{mc.PROBE_P5_GAUGE}{{bin="{b}"}} {p}\n{mc.PROBE_TOKENS_GAUGE}{{bin="{b}"}} 5000\n'
        f'{mc.PROBE_BUDGET_GAUGE}{{bin="{b}"}} 512\n'
        for b, p in p5s.items()
    )
    _show(exporter, url, _trainer(p5s, steps=2, extra=probe), steps=2)
    snapshot = _read(url, probes=True)
    assert set(snapshot.bins) == {0, 1, 2, 3, 4, 5}
    assert [snapshot.bins[i].p5_exact for i in range(6)] == [None, None, None, 0.9, 0.0, 1.0]
    assert [snapshot.bins[i].probe_p5 for i in range(6)] == [None, None, None, 0.9, 0.0, 1.0]


def test_a_probe_budget_below_one_token_is_no_probe(scraped):
    exporter, url = scraped
    # A negative budget reached the bin's curve, whose log2 then failed every tick until the memory forgot it.
    budgets = {"0": -16, "1": 0.5, "2": 0, "3": 768}
    probe = "".join(
        f'{mc.PROBE_P5_GAUGE}{{bin="{b}"}} 0.9\n{mc.PROBE_TOKENS_GAUGE}{{bin="{b}"}} 5000\n'
        f'{mc.PROBE_BUDGET_GAUGE}{{bin="{b}"}} {budget}\n'
        for b, budget in budgets.items()
    )
    _show(exporter, url, _trainer(dict.fromkeys(budgets, 0.9), steps=3, extra=probe), steps=3)
    snapshot = _read(url, probes=True)
    assert [snapshot.bins[i].probe_budget for i in range(4)] == [None, None, None, 768]


VECTOR = b'{"status": "success", "data": {"resultType": "vector", "result": %s}}'


@contextmanager
def _answering(status: int, body: bytes) -> Iterator[str]:
    """A stand-in for Prometheus's HTTP API answering every query with `status` and `body`; yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (200, b"[]"),
        (200, b"null"),
        (500, b'["oops"]'),
        (200, b'{"status": "success", "data": []}'),
        (200, VECTOR % b'[{"metric": {}}]'),
        (200, VECTOR % b'[{"metric": {}, "value": [1, "x"]}]'),
        (200, VECTOR % b'[{"metric": [], "value": [1, "1"]}]'),
        (200, VECTOR % b'[{"metric": {"bin": 0}, "value": [1, "1"]}]'),
        (200, VECTOR % b"5"),
    ],
    ids=[
        "list",
        "null",
        "error-list",
        "data-list",
        "no-value",
        "value-text",
        "metric-list",
        "label-number",
        "result-number",
    ],
)
def test_an_answer_that_is_json_but_no_query_result_is_prometheus_unavailable(status, body):
    # Anything else escaped the tick as a traceback, and the controller did not report itself blind.
    async def main() -> None:
        with _answering(status, body) as url:
            source = PrometheusSource(url, window_s=5, timeout_s=5, max_age_s=5)
            try:
                with pytest.raises(PrometheusUnavailable):
                    await source.read(time.time())
            finally:
                await source.aclose()

    asyncio.run(main())


def test_an_answer_trickling_in_past_the_timeout_is_prometheus_unavailable():
    # Each byte arrives well within the timeout of one socket read; the whole answer does not. The query
    # held the tick, and with it the lock an override waits on, for as long as the answer took.
    body = b" " * 60 + VECTOR % b"[]"
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for i in range(len(body)):
                if stop.wait(0.1 if i < 60 else 0):
                    return
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def main() -> None:
        source = PrometheusSource(f"http://127.0.0.1:{server.server_address[1]}", 5, timeout_s=1, max_age_s=5)
        try:
            with pytest.raises(PrometheusUnavailable, match="within 1"):
                await source.query("up")
        finally:
            await source.aclose()

    try:
        asyncio.run(main())
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def test_a_token_count_past_any_step_is_no_count(scraped):
    exporter, url = scraped
    # Weighted by 1e308 tokens, a bin's running mean overflowed to NaN, and its curve then failed every tick.
    text = _trainer({"0": 0.9, "1": 0.9}, steps=4).replace(
        f'{mc.ALPHA_TOKENS_GAUGE}{{bin="0"}} 5000', f'{mc.ALPHA_TOKENS_GAUGE}{{bin="0"}} 1e308'
    )
    probe = "".join(
        f'{mc.PROBE_P5_GAUGE}{{bin="{b}"}} 0.9\n{mc.PROBE_TOKENS_GAUGE}{{bin="{b}"}} {n}\n'
        f'{mc.PROBE_BUDGET_GAUGE}{{bin="{b}"}} 512\n'
        for b, n in (("0", 1e308), ("1", 3000))
    )
    _show(exporter, url, text + probe, steps=4)
    snapshot = _read(url, probes=True)
    assert [snapshot.bins[i].tokens_exact for i in range(2)] == [0.0, 5000.0]
    assert [snapshot.bins[i].probe_tokens for i in range(2)] == [0.0, 3000.0]
