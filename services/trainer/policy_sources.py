"""Which source each generator fetches a policy version from: the trainer for the first few, then peers.

The first `trainer_fanout` generators to ask for a version get the trainer; each later one gets a
peer that holds the version or is fetching it (a relay answers a fetch of a version it is still
fetching once it holds it), holders first, then the earliest to ask, up to `peer_fanout` children
each. Asked in arrival order, this builds a tree of fan-out `peer_fanout` under `trainer_fanout`
roots, so the bytes leaving the trainer per version stay at `trainer_fanout` copies however many
generators join; a generator that joins mid-run is just one more caller. A caller that reports a
failed source gets that source dropped (for everyone, for this version) and, since a peer still
fetching might be waiting on the caller itself, only a peer that reported holding the version, or
the trainer. Every answer ends with the trainer ("").
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

TRAINER = ""


@dataclass
class _VersionPlan:
    relays: dict[str, str] = field(default_factory=dict)  # generator id -> relay address
    order: dict[str, int] = field(default_factory=dict)  # generator id -> arrival rank
    assigned: dict[str, str] = field(default_factory=dict)  # generator id -> source address
    holding: set[str] = field(default_factory=set)  # generator ids that reported holding the version
    failed: set[str] = field(default_factory=set)  # relay addresses dropped for this version
    children: Counter = field(default_factory=Counter)  # source address -> callers assigned to it


class SourcePlanner:
    """Assigns policy sources per version; thread-safe. Keeps the plans of the newest `keep` versions."""

    def __init__(self, trainer_fanout: int = 2, peer_fanout: int = 2, keep: int = 4) -> None:
        if trainer_fanout < 1 or peer_fanout < 1:
            raise ValueError("trainer_fanout and peer_fanout must be >= 1")
        self.trainer_fanout, self.peer_fanout, self.keep = trainer_fanout, peer_fanout, keep
        self._plans: dict[int, _VersionPlan] = {}
        self._lock = threading.Lock()

    def _plan(self, version: int) -> _VersionPlan:
        plan = self._plans.get(version)
        if plan is None:
            plan = self._plans[version] = _VersionPlan()
            for old in sorted(self._plans)[: -self.keep]:
                del self._plans[old]
        return plan

    def report(self, generator_id: str, version: int, relay_address: str) -> None:
        """`generator_id` holds `version` (verified) and relays it at `relay_address` ("": it does not)."""
        with self._lock:
            plan = self._plan(version)
            plan.holding.add(generator_id)
            if relay_address:
                plan.relays[generator_id] = relay_address
                plan.order.setdefault(generator_id, len(plan.order))
                plan.failed.discard(relay_address)

    def assign(self, generator_id: str, version: int, relay_address: str, failed: list[str]) -> list[str]:
        """The sources `generator_id` should try for `version`, best first, the trainer last."""
        with self._lock:
            plan = self._plan(version)
            plan.failed |= {f for f in failed if f}
            retry = generator_id in plan.assigned
            if retry:
                plan.children[plan.assigned[generator_id]] -= 1
            if relay_address:
                plan.relays[generator_id] = relay_address
            plan.order.setdefault(generator_id, len(plan.order))
            peers = []
            for other, address in plan.relays.items():
                holds = other in plan.holding
                if other == generator_id or address in plan.failed or address == relay_address:
                    continue
                if (retry and not holds) or plan.children[address] >= self.peer_fanout:
                    continue
                peers.append((not holds, plan.order[other], address))
            peers.sort()
            if not retry and plan.children[TRAINER] < self.trainer_fanout or not peers:
                choice = TRAINER
            else:
                choice = peers[0][2]
            plan.assigned[generator_id] = choice
            plan.children[choice] += 1
            alternates = [p[2] for p in peers if p[2] != choice and not p[0]][:1]  # a holder, if any
            return [choice, *alternates, TRAINER] if choice != TRAINER else [TRAINER]

    def sources_of(self, version: int) -> dict[str, str]:
        """generator id -> source assigned for `version` (for tests and the bench)."""
        with self._lock:
            return dict(self._plans.get(version, _VersionPlan()).assigned)
