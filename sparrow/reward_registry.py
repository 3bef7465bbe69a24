"""Rewards by name: the built-in ones, and a user's `module:function` or `path/to/file.py:function`.

A reward is a plain function `(response: str, ground_truth: str | None, extras: dict) -> float | dict`:
`response` is the decoded completion (special tokens left out), `ground_truth` the row's answer
(`reward_model.ground_truth`, or `answer_key`), `extras` the row's `extra_info` plus `data_source`
and, under `"options"`, the reward's own settings from the config (`[reward.options.<name>]`), and
under `"time_budget_s"` the seconds the call has before the trainer gives up on it. A dict
result must hold `score`; its other number fields are kept as the sample's reward info. A reward
may be slow and do I/O (a sandboxed code run): the trainer calls it in a worker process with a
timeout (services/trainer/reward_pool.py), so it need not be thread-safe or fast.

Built-in names map to import paths (strings), so worker processes import them lazily; a new
built-in is one line in REWARDS.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RewardFn = Callable[[str, str | None, dict], Any]

REWARDS: dict[str, str] = {
    "chain": "sparrow.rewards:chain_score",
    "boxed": "sparrow.rewards:boxed_score",
    "math": "sparrow.rewards_math:math_verify_score",
    # Runs the response's code in the sandbox service (services/sandbox/); imported by name in the reward
    # workers only, so the core never loads the HTTP client.
    "code": "services.sandbox.reward:code_score",
}
DEFAULT_REWARD = "math"
# Seconds a call may take, for built-ins whose calls wait on a service: `code` covers a request at the
# sandbox's max_request_s (120 s) and a minute of waiting through a restarting or busy sandbox. Others:
# `[reward] timeout_s`; `[reward] timeouts` overrides both by name.
REWARD_TIMEOUTS: dict[str, float] = {"code": 180.0}
BUDGET_KEY = "time_budget_s"
"""extras[BUDGET_KEY]: the seconds a call has before the pool gives up on it (a reward that retries fits in it)"""


class RewardError(ValueError):
    """A reward that cannot be found, imported or called with the reward signature; one line."""


def reward_target(name: str) -> str:
    """The import target (`module:function` or `file.py:function`) of a reward name or target."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        raise RewardError(
            f"unknown reward {name!r}: use one of {', '.join(sorted(REWARDS))}, "
            "or module:function, or path/to/file.py:function"
        )
    return name


def reward_timeout(name: str, timeout_s: float, timeouts: dict[str, float] | None = None) -> float:
    """A call's timeout: `timeouts[name]`, else the built-in's own (REWARD_TIMEOUTS), else `timeout_s`."""
    if timeouts and name in timeouts:
        return timeouts[name]
    return REWARD_TIMEOUTS.get(name, timeout_s)


def resolve_reward(name: str) -> RewardFn:
    """The function of a reward name; RewardError (one line) when it cannot be imported or is not callable."""
    target = reward_target(name)
    module_name, _, attr = target.rpartition(":")
    if not module_name or not attr:
        raise RewardError(f"reward {name!r}: expected module:function or path/to/file.py:function")
    try:
        if module_name.endswith(".py"):
            module = _load_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
    except RewardError:
        raise
    except Exception as exc:  # anything the user's module raises at import
        raise RewardError(f"reward {name!r}: cannot import {module_name} ({type(exc).__name__}: {exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward {name!r}: {module_name} has no function {attr!r}")
    try:
        inspect.signature(fn).bind("", None, {})
    except TypeError:
        raise RewardError(
            f"reward {name!r}: {attr} must take (response, ground_truth, extras); it has {inspect.signature(fn)}"
        ) from None
    except ValueError:
        pass  # builtins without a signature: let the call decide
    return fn


def _load_file(path: Path):
    if not path.is_file():
        raise RewardError(f"reward file {path}: no such file")
    module_name = f"sparrow_user_reward_{abs(hash(str(path.resolve())))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardError(f"reward file {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


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
