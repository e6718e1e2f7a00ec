"""Planning a node's aggregation hierarchy (pure logic, no I/O).

Within a node the hierarchy is a two-level k-ary tree (LIFL §5.2): leaves each fold up to
I client updates, one middle aggregator folds the leaves, and the top folds the nodes'
middles and installs the new global model. Warm instances are reused for any role (§5.3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LEAF, MIDDLE, TOP = "leaf", "middle", "top"
ROLES = (LEAF, MIDDLE, TOP)


@dataclass(frozen=True)
class RoundPlan:
    """How a node aggregates ``updates`` client updates with leaves of fan-in ``leaf_fan_in``."""

    updates: int
    leaf_fan_in: int

    def __post_init__(self) -> None:
        if self.updates < 1 or self.leaf_fan_in < 1:
            raise ValueError(f"a round needs updates >= 1 and leaf fan-in >= 1, got {self.updates}, {self.leaf_fan_in}")

    @property
    def leaves(self) -> int:
        return -(-self.updates // self.leaf_fan_in)

    @property
    def middle_fan_in(self) -> int:
        return self.leaves

    def leaf_of(self, arrival: int) -> tuple[int, int]:
        """(leaf index, that leaf's fan-in) for the arrival-th update of the round (0-based)."""
        if not 0 <= arrival < self.updates:
            raise ValueError(f"update {arrival} is outside a round of {self.updates}")
        index = arrival // self.leaf_fan_in
        return index, min(self.leaf_fan_in, self.updates - index * self.leaf_fan_in)


@dataclass(frozen=True)
class InstanceView:
    """What placement needs to know about a warm instance."""

    id: int
    tenant: str
    idle: bool
    last_used: float


def pick_warm(instances: Sequence[InstanceView], tenant: str, exclude: frozenset[int] = frozenset()) -> int | None:
    """The idle instance of ``tenant`` used most recently (its caches are warmest), if any."""
    best: InstanceView | None = None
    for inst in instances:
        if inst.idle and inst.tenant == tenant and inst.id not in exclude:
            if best is None or inst.last_used > best.last_used:
                best = inst
    return best.id if best else None


def expired(instances: Sequence[InstanceView], now: float, keep_warm: float) -> list[int]:
    """Idle instances past their keep-warm period, to be terminated (scale to zero)."""
    return [i.id for i in instances if i.idle and now - i.last_used >= keep_warm]
