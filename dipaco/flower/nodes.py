"""The ServerApp's table of SuperNodes: each node's key and peer id (from its signed Hello), the
paths whose inner state it keeps, the modules and run files it has cached, and how its last
tasks went; which path each node should train next (affinity with its inner state); kept in
``flower_nodes.json`` so that a restarted ServerApp resumes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dipaco.fileio import write_json_atomic
from dipaco.protocols import messages as m

log = logging.getLogger(__name__)


@dataclass
class Node:
    """What the ServerApp knows of one SuperNode."""

    key: str = ""  # its dipaco key, from its signed Hello
    peer_id: str = ""
    paths: list[int] = field(default_factory=list)  # inner state it keeps, most recent first
    modules: dict[str, int] = field(default_factory=dict)  # module versions it has cached
    files: dict[str, str] = field(default_factory=dict)  # run files it holds: name -> SHA-256
    missed: int = 0  # rounds in a row it did not answer
    last: str = ""  # the core's answer to its last delta, told to it with its next task
    tasks: int = 0  # deltas the core accepted from it
    gave_up: int | None = None  # the path of its last failed or lost task: offered to others first


@dataclass
class Sent:
    node_id: int
    op: str
    task: m.TaskOffer | None = None


class NodeTable:
    """The nodes by Flower node id, saved to ``state_file`` (if any) after each round."""

    def __init__(self, state_file: Path | None = None) -> None:
        self.state_file = state_file
        self.nodes: dict[int, Node] = {}
        if state_file is not None and state_file.exists():
            try:
                saved = json.loads(state_file.read_text())
                self.nodes = {int(k): Node(**v) for k, v in saved.items()}
            except (ValueError, TypeError) as exc:
                log.warning("ignoring unreadable %s: %s", state_file, exc)

    def preferences(self, ready: list[int], free: set[int]) -> list[tuple[int, int | None]]:
        """Each ready node with the path it should train: one whose inner state it holds if
        such a path is open, else one no other node holds state for. Nodes with their own
        path claim first, so that paths stay where their optimizer state is."""
        free = set(free)
        held = {p: nid for nid, node in self.nodes.items() for p in node.paths}
        own, rest = [], []
        for nid in ready:
            node = self.nodes[nid]
            mine = next((p for p in node.paths if p in free and p != node.gave_up), None)
            if mine is not None:
                free.discard(mine)
                own.append((nid, mine))
            else:
                rest.append(nid)
        out = list(own)
        # A node whose last task failed picks last, and not that path while another is free:
        # a node that keeps failing on a path must not hold it by affinity.
        for nid in sorted(rest, key=lambda n: self.nodes[n].gave_up is not None):
            gave_up = self.nodes[nid].gave_up
            pick = next((p for p in sorted(free) if held.get(p, nid) == nid and p != gave_up), None)
            if pick is not None:
                free.discard(pick)
            out.append((nid, pick))
        return out

    def save(self) -> None:
        if self.state_file is not None:
            write_json_atomic(
                self.state_file, {str(k): asdict(v) for k, v in sorted(self.nodes.items())}
            )
