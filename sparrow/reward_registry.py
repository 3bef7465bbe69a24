"""Rewards by name: the built-in ones, those registered or installed as entry points, and a user's
`module:function` or `path/to/file.py:function`.

A reward is a plain function of one of the shapes in sparrow/reward_shapes.py, told apart by its
parameter names: Sparrow's own `(response, ground_truth, extras) -> float | dict`, verl's
`compute_score(data_source, solution_str, ground_truth, extra_info)` and its batch form, TRL's
`(prompts, completions, **kwargs) -> list`, or the verifiers library's. In Sparrow's shape,
`response` is the decoded completion (special tokens left out), `ground_truth` the row's answer
(`reward_model.ground_truth`, or `answer_key`), `extras` the row's `extra_info` plus `data_source`,
under `"columns"` the row's other fields, under `"options"` the reward's own settings from the
config (`[reward.options.<name>]`), and under `"time_budget_s"` the seconds the call has before the
trainer gives up on it. A dict result must hold `score`; its other number fields are kept as the
sample's reward info (exported per field). A reward may be slow and do I/O: the trainer calls it
in a worker process with a timeout (services/trainer/reward_pool.py), so it need not be thread-safe
or fast.

Names map to import paths (strings), so worker processes import them lazily. The core's built-ins
are REWARDS; other packages add names by `register_reward` (safe to call twice) or by an entry point
in the `sparrow.rewards` group whose value is the import path (`code = "pkg.module:fn"`), which
every process of the environment finds, the reward workers included.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from sparrow.reward_shapes import RewardError, Signature, coerce_score, signature_of

__all__ = ["RewardError", "coerce_score", "load_reward", "register_reward", "resolve_reward", "reward_target"]

log = logging.getLogger("sparrow.rewards")

RewardFn = Callable[..., Any]
ENTRY_POINT_GROUP = "sparrow.rewards"

REWARDS: dict[str, str] = {
    "chain": "sparrow.rewards:chain_score",
    "boxed": "sparrow.rewards:boxed_score",
    "math": "sparrow.rewards_math:math_verify_score",
}
DEFAULT_REWARD = "math"
# Seconds a call may take, for registered rewards whose calls wait on a service (register_reward's timeout_s).
# Others: `[reward] timeout_s`; `[reward] timeouts` overrides both by name.
REWARD_TIMEOUTS: dict[str, float] = {}
BUDGET_KEY = "time_budget_s"
"""extras[BUDGET_KEY]: the seconds a call has before the pool gives up on it (a reward that retries fits in it)"""

_registered: dict[str, str] = {}


def register_reward(name: str, target: str, timeout_s: float | None = None) -> None:
    """Make `name` a reward resolving to `target` (`module:function`); the same again is a no-op, another
    target for a taken name a ValueError. `timeout_s`: the name's default call timeout."""
    taken = REWARDS.get(name) or _registered.get(name)
    if taken is not None and taken != target:
        raise ValueError(f"reward name {name!r} is taken by {taken}")
    _registered[name] = target
    if timeout_s is not None:
        REWARD_TIMEOUTS[name] = timeout_s


def reward_names() -> list[str]:
    """Every name a reward can be given by: built-in, registered, or installed as an entry point."""
    return sorted({*REWARDS, *_registered, *_entry_points()})


def _entry_points() -> dict[str, str]:
    try:
        return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    except Exception as exc:  # a broken distribution's metadata must not stop a start over other names
        log.warning("cannot read the %s entry points (%s)", ENTRY_POINT_GROUP, exc)
        return {}


def reward_target(name: str) -> str:
    """The import target (`module:function` or `file.py:function`) of a reward name or target."""
    if name in REWARDS:
        return REWARDS[name]
    if name in _registered:
        return _registered[name]
    if ":" not in name:
        installed = _entry_points()
        if name in installed:
            return installed[name]
        raise RewardError(
            f"unknown reward {name!r}: use one of {', '.join(reward_names())}, "
            "or module:function, or path/to/file.py:function"
        )
    return name


def reward_timeout(name: str, timeout_s: float, timeouts: dict[str, float] | None = None) -> float:
    """A call's timeout: `timeouts[name]`, else the built-in's own (REWARD_TIMEOUTS), else `timeout_s`."""
    if timeouts and name in timeouts:
        return timeouts[name]
    return REWARD_TIMEOUTS.get(name, timeout_s)


def resolve_reward(name: str) -> RewardFn:
    """The function of a reward name; RewardError (one line) when it cannot be imported, is not callable,
    or takes none of the reward shapes."""
    return load_reward(name)[0]


def load_reward(name: str) -> tuple[RewardFn, Signature]:
    """The function of a reward name and the shape it declares; RewardError (one line) as resolve_reward."""
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
    return fn, signature_of(fn, repr(name))


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
