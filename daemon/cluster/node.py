"""What a node says about itself to the cluster: identity, role, model fingerprint, load."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

Role = Literal["unified", "prefill", "decode", "router", "encoder"]
ROLES: tuple[str, ...] = get_args(Role)
# this process's epoch: later starts of a node get larger ones (wall-clock nanoseconds), so
# a peer tells a restarted node (whose KV state is gone) from the process it knew
PROCESS_EPOCH = time.time_ns()

_CAPACITY_KEYS = ("kv_blocks", "max_num_seqs")
_LOAD_KEYS = ("running", "waiting", "kv_blocks_free", "draining")  # draining: 0 or 1


class NodeInfoError(ValueError):
    """A node description that is not valid (the registration's 400)."""


@dataclass
class NodeInfo:
    node_id: str
    role: Role
    fingerprint: str
    url: str  # base, e.g. http://127.0.0.1:8101
    epoch: int  # grows with each process start of the same node id
    served_model: str  # the name clients put in "model"
    capacity: dict[str, int] = field(default_factory=dict)  # kv_blocks, max_num_seqs
    load: dict[str, int] = field(default_factory=dict)  # running, waiting, kv_blocks_free, draining

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "role": self.role,
            "fingerprint": self.fingerprint,
            "url": self.url,
            "epoch": self.epoch,
            "served_model": self.served_model,
            "capacity": dict(self.capacity),
            "load": dict(self.load),
        }

    @classmethod
    def from_json(cls, d: Any) -> NodeInfo:
        """Checked: every field present with its type; NodeInfoError names the one at fault."""
        if not isinstance(d, dict):
            raise NodeInfoError("a node must be a JSON object")
        for key in ("node_id", "role", "fingerprint", "url", "served_model"):
            if not isinstance(d.get(key), str) or not d[key]:
                raise NodeInfoError(f"{key}: must be a non-empty string")
        if d["role"] not in ROLES:
            raise NodeInfoError(f"role: {d['role']!r} is not one of {', '.join(ROLES)}")
        if not d["url"].startswith(("http://", "https://")):
            raise NodeInfoError("url: must be an http:// or https:// base URL")
        epoch = d.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise NodeInfoError("epoch: must be a non-negative integer")
        return cls(
            node_id=d["node_id"],
            role=cast(Role, d["role"]),
            fingerprint=d["fingerprint"],
            url=d["url"].rstrip("/"),
            epoch=epoch,
            served_model=d["served_model"],
            capacity=counts(d.get("capacity", {}), "capacity", _CAPACITY_KEYS),
            load=counts(d.get("load", {}), "load", _LOAD_KEYS),
        )


def counts(d: Any, name: str, keys: tuple[str, ...] = _LOAD_KEYS) -> dict[str, int]:
    """{key: non-negative int} for the known `keys` present in `d`; others are dropped."""
    if not isinstance(d, dict):
        raise NodeInfoError(f"{name}: must be an object")
    out: dict[str, int] = {}
    for key in keys:
        if key not in d:
            continue
        value = d[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise NodeInfoError(f"{name}.{key}: must be a non-negative integer")
        out[key] = value
    return out
