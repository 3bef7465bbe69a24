"""Rewards computed in worker processes as trajectories arrive, each call under a timeout.

A task is one call: one completion for the rewards that score one at a time, a whole group for the
batched shapes (sparrow/reward_shapes.py); its Future resolves to one RewardResult per completion.

A reward is user code (or math-verify, or a sandboxed code run): it may be slow, raise, hang or
return nonsense. Each worker process runs one call at a time in its main thread; a slot thread
per worker hands it the next task and waits at most `timeout_s`. A call that raises, returns no
finite score, or outlives its timeout (the worker is killed and a fresh one started) scores 0,
counted by reason (`sparrow_trainer_reward_errors_total{reason}`) and logged once per (reward,
reason). Nothing a reward does stalls or kills the step: every future resolves within the timeout
(plus a worker's start, when one had to be replaced). The timeout is per reward name (`timeout_for`:
the code reward waits on the sandbox longer than a math check takes), and each call is told it in
extras["time_budget_s"], so a reward that retries a service (the code reward) gives up in time and
says why instead of being killed.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from sparrow.reward_registry import BUDGET_KEY, REWARD_TIMEOUTS, load_reward, reward_timeout
from sparrow.reward_shapes import REWARD_ERROR_REASONS as REASONS
from sparrow.reward_shapes import RewardCaller, RewardInput, Signature

log = logging.getLogger("sparrow.trainer.rewards")

START_TIMEOUT_S = 60.0  # a worker imports the reward's modules (math-verify loads sympy) before its first call


@dataclass(frozen=True)
class RewardResult:
    """A score (0 on any error), the reward's extra number fields, and the error reason if one happened."""

    score: float
    info: dict[str, float] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class _Task:
    reward: str
    inputs: list[RewardInput]
    future: Future


def _worker_main(conn) -> None:
    """A worker process. ("load", reward) imports a reward, answered with an error text or None;
    ("call", reward, inputs) is answered with a (score, info, reason, detail) per input."""
    functions: dict[str, tuple[Any, Signature]] = {}
    caller = RewardCaller()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message[0] == "load":
            try:
                functions[message[1]] = load_reward(message[1])
                answer: Any = None
            except Exception as exc:
                answer = str(exc)
        else:
            fn, sig = functions[message[1]]
            answer = caller.score(fn, sig, message[2])
        try:
            conn.send(answer)
        except (OSError, ValueError):
            return


class _Slot:
    """One worker process and the thread that feeds it."""

    def __init__(self, pool: RewardPool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.process = None
        self.conn = None
        self.loaded: set[str] = set()  # rewards the current worker process has imported
        self.doing = "starting"  # what the slot is doing now, for `RewardPool.describe`
        self.thread = threading.Thread(target=self._loop, name=f"reward-{index}", daemon=True)

    def _start(self) -> None:
        parent, child = self.pool.context.Pipe()
        self.process = self.pool.context.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.conn = parent

    def _kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join(5)
        if self.conn is not None:
            self.conn.close()
        self.process = self.conn = None
        self.loaded: set[str] = set()

    def _loop(self) -> None:
        for reward in self.pool.preload:  # before the first task: the first step must not wait on a spawn
            try:
                self._load(reward)  # a failure here is found again, and reported, by the first call
            except Exception:
                self._kill()
        while True:
            self.doing = "idle"
            task = self.pool.tasks.get()
            if task is None:
                self._kill()
                return
            self.doing = f"calling {task.reward}"
            task.future.set_result(self._call(task))

    def _load(self, reward: str) -> tuple[str, str] | None:
        """A live worker with `reward` imported, or (reason, detail) of why not. Raises EOFError/OSError
        when the worker dies meanwhile."""
        if self.process is None or not self.process.is_alive():
            self._kill()
            self._start()
        if reward not in self.loaded:
            # Importing the reward (math-verify loads sympy) is not the call's time.
            self.doing = f"importing {reward}"
            self.conn.send(("load", reward))
            if not self.conn.poll(START_TIMEOUT_S):
                self._kill()
                return "timeout", f"not imported within {START_TIMEOUT_S:g} s"
            error = self.conn.recv()
            if error is not None:
                return "raised", error
            self.loaded.add(reward)
        return None

    def _call(self, task: _Task) -> list[RewardResult]:
        n = len(task.inputs)
        try:
            failure = self._load(task.reward)
            if failure is not None:
                return self.pool.failed(task.reward, *failure, n)
            timeout = self.pool.timeout_for(task.reward)
            inputs = [replace(i, extras={**i.extras, BUDGET_KEY: timeout}) for i in task.inputs]
            self.conn.send(("call", task.reward, inputs))
            if not self.conn.poll(timeout):
                self._kill()
                return self.pool.failed(task.reward, "timeout", f"no score within {timeout:g} s", n)
            answers = self.conn.recv()
            if not isinstance(answers, list) or len(answers) != n:
                raise ValueError(f"the worker answered {type(answers).__name__} for {n} inputs")
        except (EOFError, OSError) as exc:
            self._kill()
            return self.pool.failed(task.reward, "crashed", f"the worker process died ({type(exc).__name__})", n)
        except Exception as exc:  # the answer did not unpickle, or the task did not pickle
            self._kill()
            return self.pool.failed(task.reward, "bad_value", f"{type(exc).__name__}: {exc}", n)
        results = []
        for score, info, reason, detail in answers:
            results += [RewardResult(score, info)] if reason is None else self.pool.failed(task.reward, reason, detail)
        return results


class RewardPool:
    """`workers` reward processes; `submit` returns a Future that always resolves to a RewardResult."""

    def __init__(
        self,
        workers: int,
        timeout_s: float,
        errors_counter=None,
        timeouts: dict[str, float] | None = None,
        preload: tuple[str, ...] = (),
    ) -> None:
        """`preload`: rewards every worker starts and imports at once, in the background (the run's rewards,
        so that the first step's scores do not wait for worker processes to spawn and import)."""
        self.timeout_s = timeout_s
        self.preload = tuple(preload)
        self.timeouts = dict(timeouts or {})
        self.context = mp.get_context("spawn")  # the trainer holds torch threads and gRPC: never fork it
        self.tasks: queue.Queue[_Task | None] = queue.Queue()
        self.errors = errors_counter
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._signatures: dict[str, Signature] = {}
        self.error_counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.slots = [_Slot(self, i) for i in range(workers)]
        for slot in self.slots:
            slot.thread.start()

    def timeout_for(self, reward: str) -> float:
        """Seconds one call of `reward` may take (sparrow.reward_registry.reward_timeout)."""
        return reward_timeout(reward, self.timeout_s, self.timeouts)

    def signature(self, reward: str) -> Signature:
        """The shape a reward declares, read in this process (RewardError when it cannot be loaded)."""
        with self._lock:
            if reward not in self._signatures:
                self._signatures[reward] = load_reward(reward)[1]
            return self._signatures[reward]

    def submit_inputs(self, reward: str, inputs: list[RewardInput]) -> Future:
        """Queue one reward call over `inputs` (one, or a group for a batched reward); its Future resolves to
        a RewardResult per input, in order (score 0 on any failure)."""
        future: Future = Future()
        self.tasks.put(_Task(reward, list(inputs), future))
        return future

    def submit(self, reward: str, response: str, ground_truth: str | None, extras: dict[str, Any]) -> Future:
        """Queue one call for one completion; its Future resolves to a RewardResult (score 0 on any failure)."""
        one: Future = Future()
        item = RewardInput(response, ground_truth, extras, data_source=str(extras.get("data_source", "")),
                           extra_info=extras, options=dict(extras.get("options") or {}))  # fmt: skip
        self.submit_inputs(reward, [item]).add_done_callback(lambda f: one.set_result(f.result()[0]))
        return one

    def describe(self) -> str:
        """What the workers are doing and how many calls wait for one, e.g. "2 idle, 2 importing chain; 0 queued"."""
        doing: dict[str, int] = {}
        for slot in self.slots:
            doing[slot.doing] = doing.get(slot.doing, 0) + 1
        busy = ", ".join(f"{n} {what}" for what, n in sorted(doing.items()))
        return f"{busy}; {self.tasks.qsize()} queued"

    def failed(self, reward: str, reason: str, detail: str, n: int = 1) -> list[RewardResult]:
        """Count and (once per reward and reason) log a failure of `n` completions; each scores 0."""
        with self._lock:
            self.error_counts[reason] = self.error_counts.get(reason, 0) + n
            first = (reward, reason) not in self._logged
            self._logged.add((reward, reason))
        if self.errors is not None:
            self.errors.labels(reason=reason).inc(n)
        if first:
            log.warning("reward %s: %s (%s); scored 0, counted, logged once", reward, reason, detail)
        return [RewardResult(0.0, {}, reason)] * n

    def close(self) -> None:
        """Stop every worker (tasks still queued resolve first)."""
        for _ in self.slots:
            self.tasks.put(None)
        longest = max([self.timeout_s, *self.timeouts.values(), *REWARD_TIMEOUTS.values()])
        for slot in self.slots:
            slot.thread.join(longest + 10)
