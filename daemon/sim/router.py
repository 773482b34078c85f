"""Which node a request goes to: the least loaded, or the one holding the longest prefix of
it in memory among those not much busier than the least loaded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

POLICIES = ("least-loaded", "prefix-affinity")


class RoutedNode(Protocol):
    def load(self) -> int: ...
    def cached_prefix(self, keys: list[bytes]) -> int: ...


def route(policy: str, nodes: Sequence[RoutedNode], keys: list[bytes], slack: float = 2.0) -> int:
    """The node's index. prefix-affinity: among nodes whose load is at most `slack` times the
    least (plus one), the longest in-memory prefix of `keys`; ties go to the less loaded."""
    loads = [n.load() for n in nodes]
    if policy == "least-loaded" or len(nodes) == 1:
        return min(range(len(nodes)), key=lambda i: loads[i])
    if policy != "prefix-affinity":
        raise ValueError(f"unknown routing policy {policy!r}; use one of {POLICIES}")
    bound = slack * min(loads) + 1
    candidates = [i for i in range(len(nodes)) if loads[i] <= bound]
    return max(candidates, key=lambda i: (nodes[i].cached_prefix(keys), -loads[i], -i))
