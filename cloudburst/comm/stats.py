"""What every transport counts: bytes moved (split by whether they crossed nodes) and seconds
blocked waiting on peers (:class:`CommStats`), and how a collective is counted."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

#: Counters renamed (unit as a suffix); checkpoints may hold the old names.
RENAMED = {"bytes_sent": "sent_bytes", "bytes_received": "received_bytes"}


@dataclass
class CommStats:
    """Counters every transport keeps: bytes moved and seconds blocked waiting on peers."""

    sent_bytes: int = 0
    received_bytes: int = 0
    wait_s: float = 0.0
    messages_rejected: int = 0
    # Bytes moved by collectives/messages whose group spans nodes, and by the rest (both are
    # also in sent_bytes/received_bytes); collectives counted as a ring all-reduce moves them.
    inter_node_bytes: int = 0
    intra_node_bytes: int = 0
    emulated_link_s: float = 0.0  # time the emulated inter-node link held this rank back
    # Device <-> pinned host copies of a GPU replica's θ and Δ (GPU A-SGD's staging).
    staging_s: float = 0.0
    staging_bytes: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        """The counters, for a checkpoint (a resumed run's totals continue)."""
        return {
            f.name: (dict(v) if isinstance(v := getattr(self, f.name), dict) else v)
            for f in fields(self)
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = {f.name for f in fields(self)}
        for key, value in state.items():
            key = RENAMED.get(key, key)  # a checkpoint written before the renaming
            if key in names:
                setattr(self, key, dict(value) if isinstance(value, dict) else value)

    def as_dict(self) -> dict[str, float]:
        d = {
            "sent_bytes": self.sent_bytes,
            "received_bytes": self.received_bytes,
            "comm_wait_s": round(self.wait_s, 6),
            "messages_rejected": self.messages_rejected,
            "inter_node_bytes": self.inter_node_bytes,
            "intra_node_bytes": self.intra_node_bytes,
        }
        if self.emulated_link_s:
            d["emulated_link_s"] = round(self.emulated_link_s, 6)
        if self.staging_bytes:
            d["staging_s"] = round(self.staging_s, 6)
            d["staging_bytes"] = self.staging_bytes
        return d


def ring_bytes(numel: int, element_size: int, group_size: int) -> int:
    """Bytes each rank sends (and receives) in a ring all-reduce of the tensor."""
    return int(2 * (group_size - 1) / group_size * numel * element_size)


def count_collective(stats: CommStats, moved: int, spans_nodes: bool) -> None:
    stats.sent_bytes += moved
    stats.received_bytes += moved
    if spans_nodes:
        stats.inter_node_bytes += moved
    else:
        stats.intra_node_bytes += moved
