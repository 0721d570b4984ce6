"""Which host-memory snapshot a restart loads: a pure function of what every live node holds (no torch, no files).

Each node lists its snapshots (:class:`Snapshot`); the lists are gathered, and :func:`pick_snapshot` gives every
rank the same answer: the newest snapshot whose rank files the live nodes hold whole, unless the durable
checkpoint is newer, or one of the durable checkpoint's own iteration that the durable files complete. The
collective around it (listing, gathering, reading the chosen metadata) is ``memory/restart.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tenplex_megatron.errors import TenplexError

if TYPE_CHECKING:  # the type alone: the planner reads no files
    from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata


class ForeignSnapshotError(TenplexError, ValueError):
    """A node's memory holds a snapshot of another job: never loaded."""


@dataclass(frozen=True)
class Snapshot:
    """A committed snapshot as one node holds it: iteration, job, metadata digest, files expected and present."""

    node: str
    iteration: int
    job: str
    digest: str
    expected: dict[str, int]  # every rank file of the snapshot (from its metadata) -> size
    present: dict[str, int]  # the rank files this node holds -> size

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "iteration": self.iteration, "job": self.job, "digest": self.digest,
                "expected": self.expected, "present": self.present}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Snapshot:
        return Snapshot(d["node"], int(d["iteration"]), d["job"], d["digest"], dict(d["expected"]),
                        dict(d["present"]))


@dataclass(frozen=True)
class DurableListing:
    """The newest durable checkpoint as a restart sees it: iteration, metadata digest, rank files present -> size."""

    iteration: int
    digest: str
    present: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "digest": self.digest, "present": self.present}

    @staticmethod
    def from_json(d: dict[str, Any] | None) -> DurableListing | None:
        return None if d is None else DurableListing(int(d["iteration"]), str(d["digest"]), dict(d["present"]))


@dataclass(frozen=True)
class Choice:
    """The snapshot a restart loads from memory: its iteration, for each rank file the live nodes holding it, and
    the rank files no live node holds (``durable``), read from the durable checkpoint of the same iteration
    (``durable_dir``). ``metadata`` and ``durable_dir`` are filled in by the collective choice once it is made."""

    iteration: int
    holders: dict[str, tuple[str, ...]]
    expected: dict[str, int]
    durable: tuple[str, ...] = ()
    metadata: CheckpointMetadata | None = None  # the snapshot's metadata.json, checked
    durable_dir: str | None = None


def pick_snapshot(held: list[Snapshot], job: str, durable_iteration: int | None,
                  durable: DurableListing | None = None) -> Choice | None:
    """The newest snapshot complete on the live nodes (every file with a live copy of the recorded size), if it is
    at least as new as the durable checkpoint; None otherwise. The same answer on every rank.

    With ``durable`` (the newest durable checkpoint's listing), a snapshot of that same iteration and metadata that
    the live nodes hold only in part is chosen too: the rank files they lack are read from the durable checkpoint
    (the sources in order: the live nodes' memory, the durable checkpoint last). A snapshot of another job is an
    error (:class:`ForeignSnapshotError`, never loaded); nodes whose metadata differ for one iteration make that
    iteration incomplete.
    """
    for s in held:
        if s.job != job:
            raise ForeignSnapshotError(
                f"the memory directory of node {s.node} holds iteration {s.iteration} of job {s.job!r}, not of this "
                f"job ({job!r}): never loaded; remove it with `python -m tenplex_megatron clean-memory DIR`")
    for it in sorted({s.iteration for s in held}, reverse=True):
        if durable_iteration is not None and it < durable_iteration:
            return None
        mine = [s for s in held if s.iteration == it]
        if len({s.digest for s in mine}) != 1:
            continue
        expected = mine[0].expected
        live = _holders(mine, expected)
        missing = tuple(sorted(name for name in expected if name not in live))
        if expected and not missing:
            return Choice(it, live, expected)
        if (live and durable is not None and durable.iteration == it and durable.digest == mine[0].digest
                and all(durable.present.get(name) == expected[name] for name in missing)):
            return Choice(it, live, expected, missing)
    return None


def _holders(mine: list[Snapshot], expected: dict[str, int]) -> dict[str, tuple[str, ...]]:
    """For each rank file of one snapshot, the nodes holding a copy of the recorded size (in node order)."""
    holders: dict[str, list[str]] = {}
    for s in sorted(mine, key=lambda s: s.node):
        for name, size in s.present.items():
            if expected.get(name) == size and s.node not in holders.setdefault(name, []):
                holders[name].append(s.node)
    return {k: tuple(v) for k, v in holders.items() if k in expected and v}
