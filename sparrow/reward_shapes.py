"""The reward function shapes users bring, told apart by their parameter names, and called the way each expects.

- `sparrow`: `(response, ground_truth, extras)`, one sample a call.
- `verl`: `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`, one sample a
  call, by keyword; the reward's options (`[reward.options.<name>]`) go in as keywords, as verl's
  `reward_kwargs` do.
- `verl_batch`: `(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)`, a whole group a call,
  returning a list.
- `trl`: `(prompts, completions, **kwargs)`, a whole group a call, with `completion_ids` and every other
  column of the row as keyword lists (one item per completion), returning a list. Chat prompts come as
  messages and completions as `[{"role": "assistant", "content": text}]`, as TRL passes conversational data.
- `verifiers`: any of `prompt, completion, answer, info, task, state`, one sample a call.

Any of them may be `async def` (or return an awaitable): it is awaited. A function whose parameters fit none
of these, or more than one, is refused (`RewardError`, one line naming the shapes): never guessed.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class RewardError(ValueError):
    """A reward that cannot be found, imported or called with one of the reward shapes; one line."""


SPARROW, VERL, VERL_BATCH, TRL, VERIFIERS = "sparrow", "verl", "verl_batch", "trl", "verifiers"
# Why a reward call scored 0: the caller's own (raised, non_finite, bad_value) and the worker pool's (timeout,
# crashed, unavailable); the values of `sparrow_trainer_reward_errors_total{reason}`.
REWARD_ERROR_REASONS = ("timeout", "raised", "non_finite", "bad_value", "crashed", "unavailable")
BATCHED = (VERL_BATCH, TRL)  # shapes that score a whole group in one call
TRL_OWN = frozenset({"prompts", "completions", "completion_ids"})  # what TRL passes beside the row's columns


@dataclass(frozen=True)
class _Shape:
    name: str
    key: str  # the parameter that identifies the shape
    takes: frozenset[str]  # every parameter name the shape passes
    open_names: bool = False  # any other named parameter is a row column (TRL passes columns as keywords)
    usage: str = ""


SHAPES = (
    _Shape(
        SPARROW, "response", frozenset({"response", "ground_truth", "extras"}), usage="(response, ground_truth, extras)"
    ),
    _Shape(
        VERL,
        "solution_str",
        frozenset({"data_source", "solution_str", "ground_truth", "extra_info"}),
        usage="verl's (data_source, solution_str, ground_truth, extra_info)",
    ),
    _Shape(
        VERL_BATCH,
        "solution_strs",
        frozenset({"data_sources", "solution_strs", "ground_truths", "extra_infos"}),
        usage="verl's batch (data_sources, solution_strs, ground_truths, extra_infos)",
    ),
    _Shape(
        TRL,
        "completions",
        TRL_OWN,
        open_names=True,
        usage="TRL's (prompts, completions, **kwargs)",
    ),
    _Shape(
        VERIFIERS,
        "",
        frozenset({"prompt", "completion", "answer", "info", "task", "state"}),
        usage="the verifiers library's any of (prompt, completion, answer, info)",
    ),
)
ACCEPTED = "; ".join(s.usage for s in SHAPES)


@dataclass(frozen=True)
class RewardInput:
    """One completion to score and everything a shape may pass about it."""

    response: str  # the decoded completion, special tokens left out
    ground_truth: str | None
    extras: dict[str, Any]  # Sparrow's extras: extra_info, data_source, options, time_budget_s, columns
    prompt: str | list[dict[str, str]] = ""  # the row's prompt: text, or chat messages
    data_source: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, Any] = field(default_factory=dict)  # the row's fields other than its prompt
    completion_ids: tuple[int, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Signature:
    """A reward function's shape, and which keywords it takes (None: any, it has **kwargs)."""

    shape: str
    names: frozenset[str] | None
    known: bool = True  # False: no signature to read (a builtin); called positionally, as a Sparrow reward
    required: frozenset[str] = frozenset()  # parameters without a default

    def missing_columns(self, columns: set[str]) -> list[str]:
        """A TRL reward's required parameters that are neither its own nor a column of the rows (sorted)."""
        if self.shape != TRL:
            return []
        return sorted(self.required - TRL_OWN - columns)

    @property
    def batched(self) -> bool:
        return self.shape in BATCHED

    def keywords(self, offered: dict[str, Any]) -> dict[str, Any]:
        """The offered keywords the function takes."""
        if self.names is None:
            return offered
        return {k: v for k, v in offered.items() if k in self.names}


def signature_of(fn: Callable, label: str) -> Signature:
    """The shape `fn` declares; RewardError (one line, naming the accepted shapes) when none or several fit."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: only the positional Sparrow call can work
        return Signature(SPARROW, None, known=False)
    kinds = inspect.Parameter
    named = [p for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
    blocked = [p for p in params if p.kind == kinds.POSITIONAL_ONLY and p.default is p.empty]
    names = {p.name for p in named}
    required = {p.name for p in named if p.default is p.empty}
    any_keywords = any(p.kind == kinds.VAR_KEYWORD for p in params)
    fits = []
    for s in SHAPES:
        if blocked or (s.key and s.key not in names) or not (names & s.takes):
            continue
        if s.open_names or required <= s.takes:
            fits.append(s)
    if len(fits) != 1:
        why = f"fits {' and '.join(s.name for s in fits)} alike" if fits else "fits none"
        raise RewardError(
            f"reward {label}: {getattr(fn, '__name__', 'the function')} must take {ACCEPTED}; "
            f"it has {_text(fn)}, which {why}"
        )
    return Signature(fits[0].name, None if any_keywords else frozenset(names), required=frozenset(required))


def _text(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


class RewardCaller:
    """Calls reward functions by their shape, awaiting async ones on one event loop kept for the process."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def _wait(self, value: Any) -> Any:
        if not inspect.isawaitable(value):
            return value
        if self._loop is None:
            self._loop = asyncio.new_event_loop()  # kept: an async client the reward caches stays on one loop
        return self._loop.run_until_complete(_awaited(value))

    def score(
        self, fn: Callable, sig: Signature, inputs: list[RewardInput]
    ) -> list[tuple[float, dict, str | None, str]]:
        """(score, extra numbers, error reason or None, detail) per input; never raises for the reward's faults."""
        if sig.batched:
            try:
                values = self._wait(fn(**_batch_keywords(sig, inputs)))
            except BaseException as exc:  # a reward's own bug; SystemExit and KeyboardInterrupt too
                return [(0.0, {}, "raised", _raised(exc))] * len(inputs)
            if not isinstance(values, list | tuple) or len(values) != len(inputs):
                got = f"{len(values)} scores" if isinstance(values, list | tuple) else short(values)
                return [(0.0, {}, "bad_value", f"returned {got} for {len(inputs)} completions")] * len(inputs)
            return [_coerced(v) for v in values]
        out = []
        for item in inputs:
            try:
                value = self._wait(_call_one(fn, sig, item))
            except BaseException as exc:
                out.append((0.0, {}, "raised", _raised(exc)))
                continue
            out.append(_coerced(value))
        return out


async def _awaited(value: Any) -> Any:
    return await value


def _call_one(fn: Callable, sig: Signature, item: RewardInput) -> Any:
    if sig.shape == SPARROW:
        if not sig.known:
            return fn(item.response, item.ground_truth, item.extras)
        offered = {"response": item.response, "ground_truth": item.ground_truth, "extras": item.extras}
        return fn(**sig.keywords(offered))
    if sig.shape == VERL:
        offered = {
            **item.options,
            "data_source": item.data_source,
            "solution_str": item.response,
            "ground_truth": item.ground_truth,
            "extra_info": item.extra_info,
        }
        return fn(**sig.keywords(offered))
    chat = not isinstance(item.prompt, str)
    offered = {
        "prompt": item.prompt,
        "completion": [{"role": "assistant", "content": item.response}] if chat else item.response,
        "answer": item.ground_truth if item.ground_truth is not None else "",
        "info": item.extra_info,
        "task": item.data_source,
        "state": {},
    }
    return fn(**sig.keywords(offered))


def _batch_keywords(sig: Signature, inputs: list[RewardInput]) -> dict[str, Any]:
    if sig.shape == VERL_BATCH:
        offered = {
            **inputs[0].options,
            "data_sources": [i.data_source for i in inputs],
            "solution_strs": [i.response for i in inputs],
            "ground_truths": [i.ground_truth for i in inputs],
            "extra_infos": [i.extra_info for i in inputs],
        }
        return sig.keywords(offered)
    columns: dict[str, list] = {}
    for name in sorted({k for i in inputs for k in i.columns}):
        columns[name] = [i.columns.get(name) for i in inputs]
    offered = {
        **columns,
        "prompts": [i.prompt for i in inputs],
        "completions": [
            i.response if isinstance(i.prompt, str) else [{"role": "assistant", "content": i.response}] for i in inputs
        ],
        "completion_ids": [list(i.completion_ids) for i in inputs],
    }
    return sig.keywords(offered)


def _raised(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:]
    where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _coerced(value: Any) -> tuple[float, dict, str | None, str]:
    score, info, reason = coerce_score(value)
    return score, info, reason, "" if reason is None else f"returned {short(value)}"


def short(value: Any) -> str:
    """A value's repr cut to 80 characters, for a log line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def coerce_score(value: Any) -> tuple[float, dict[str, float], str | None]:
    """(score, info, error reason or None) of what a reward returned: a number, or a dict with `score`."""
    info: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            return 0.0, {}, "bad_value"
        info = {
            str(k): float(v)
            for k, v in value.items()
            if k != "score" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
        value = value["score"]
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, int | float):
        return 0.0, {}, "bad_value"
    try:
        score = float(value)
    except OverflowError:
        return 0.0, {}, "non_finite"
    if not math.isfinite(score):
        return 0.0, {}, "non_finite"
    return score, info, None
