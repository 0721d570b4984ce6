"""The job's side of the helpers' background work: what each node's helper says about the persist and the
replication under way, what the job does about it (commit the durable checkpoint, restart failed helpers), and
the waits at the end of a job (:func:`drain`, :func:`finish`). Every call is collective."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tenplex_megatron import log as tlog
from tenplex_megatron.errors import Failure
from tenplex_megatron.execute.collective import all_gather_json, broadcast_json, gather_records, rank, run_phase
from tenplex_megatron.memory import node_dir, replication
from tenplex_megatron.memory.protocol import HELPER_EXITED, Copy, Persist
from tenplex_megatron.memory.state import MemoryTier, start_helpers
from tenplex_megatron.storage import directory, lease
from tenplex_megatron.storage.faults import maybe_fail

log = tlog.get("memory")
OPS = ("persist", "replicate")
NO_HELPER = "no_helper"  # the kind of the failure of an op on a node that has no helper process


@dataclass(frozen=True)
class Progress:
    """One node's word on one background op: ``done``, ``running`` or ``failed`` (with its failure)."""

    state: str
    error: Failure | None = None

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "error": None if self.error is None else self.error.to_json()}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Progress:
        error = d.get("error")
        return Progress(str(d["state"]), None if error is None else Failure.from_json(error))


@dataclass(frozen=True)
class NodeProgress:
    """One rank's word on its node's background work: each pending op's :class:`Progress` (none from ranks other
    than the node's first, or with nothing pending). Travels as ``{op: progress}``, or null when empty."""

    ops: Mapping[str, Progress] = field(default_factory=dict)

    def to_json(self) -> dict[str, dict[str, Any]] | None:
        return {op: p.to_json() for op, p in self.ops.items()} or None

    @classmethod
    def from_json(cls, d: dict[str, dict[str, Any]] | None) -> NodeProgress:
        return cls({str(op): Progress.from_json(p) for op, p in (d or {}).items()})


@dataclass(frozen=True)
class HelperCheck:
    """One rank's word after the answers are applied: whether its helpers must restart, and (its node's first
    rank) the words of its helper's death, if it died."""

    restart: bool
    exited: str | None

    def to_json(self) -> dict[str, Any]:
        return {"restart": self.restart, "exited": self.exited}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HelperCheck:
        return cls(bool(d["restart"]), d["exited"])


def node_progress(tier: MemoryTier, wait: float) -> NodeProgress:
    """This node's :class:`Progress` (to be gathered) on the pending persist and replication, asking its helper
    (waiting at most ``wait`` s); empty on ranks other than the node's first, or with nothing pending."""
    if not tier.leader or (tier.pending is None and tier.replicating is None):
        return NodeProgress()
    out = {}
    for op, it in (("persist", tier.pending), ("replicate", tier.replicating)):
        if it is None:
            continue
        if tier.helper is None:
            out[op] = Progress("failed", Failure(NO_HELPER, "no helper process on this node"))
            continue
        got = tier.helper.poll(op, it, wait)
        out[op] = Progress("running") if got is None else Progress("done") if got.ok else Progress("failed", got.error)
    return NodeProgress(out)


def settle(answers: list[NodeProgress], op: str) -> tuple[bool, Failure | None]:
    """From every node's :func:`node_progress`, about ``op``: (finished on every node, the failure that ended it)."""
    said = [a.ops[op] for a in answers if op in a.ops]
    if not said:
        return False, None
    errors = [p.error or Failure("failed", "failed") for p in said if p.state == "failed"]
    if errors:
        return False, errors[0]
    return all(p.state == "done" for p in said), None


def _replication_failed(tier: MemoryTier, what: str, error: Failure) -> None:
    if rank() == 0:
        log.warning("%s: replication of iteration %s failed: %s; the helpers restart", what, tier.replicating, error)
    tier.replicating = None


def _persist_failed(tier: MemoryTier, what: str, error: Failure) -> None:
    """A failed persist is logged and dropped; one fenced by a newer lease generation stops the job (every rank
    sees the same answers), as a fenced commit does."""
    if error.kind == lease.FencedError.kind:
        tier.pending = tier.pending_meta = None
        raise lease.FencedError(error.message)
    if rank() == 0:
        log.warning("%s: background persist of iteration %s failed: %s; its staging directory is removed by "
                    "the next persist", what, tier.pending, error)
    tier.pending = tier.pending_meta = None


def resolve(tier: MemoryTier, answers: list[NodeProgress], what: str) -> bool:
    """Apply every node's answers: replication done or failed (a failed helper: all helpers restart);
    returns whether the pending durable checkpoint can be committed now. Collective when helpers restart.

    A helper's death is reported one way whatever the timing: the work it leaves unanswered failed with
    :meth:`~tenplex_megatron.memory.helper.Helper.exited`'s words, whether its node's poll read the death
    (``answers``) or the process is found gone after its node said it was still working."""
    done, error = settle(answers, "replicate")
    restart = False
    if done:
        tier.replicated, tier.replicating = tier.replicating, None
    elif error is not None:
        _replication_failed(tier, what, error)
        restart = True
    commit, error = settle(answers, "persist")
    if error is not None:
        _persist_failed(tier, what, error)
        restart = restart or tier.replicates

    def local() -> HelperCheck:
        if done and tier.leader:  # the older snapshot the replicated one protected can go now
            node_dir.retain(tier.mem, tier.settings.keep, tier.protected(), tier.dispose, tier.fence)
        exited = tier.helper.exited() if tier.leader and tier.helper is not None else None
        return HelperCheck(restart or exited is not None, exited)

    checks = gather_records(f"{what}: checking the helper processes", local, HelperCheck)
    died = next((c.exited for c in checks if c.exited is not None), None)
    if died is not None:  # a helper died after its node's answer: what it had under way failed with it
        death = Failure(HELPER_EXITED, died)
        if tier.replicating is not None:
            _replication_failed(tier, what, death)
        if tier.pending is not None and not commit:
            _persist_failed(tier, what, death)
    if any(c.restart for c in checks):
        if rank() == 0 and (tier.replicating is not None or (tier.pending is not None and not commit)):
            log.warning("%s: the helper processes restart: the replication of iteration %s and the persist of "
                        "iteration %s under way are abandoned", what, tier.replicating, tier.pending)
        tier.replicating = None  # what the old helpers were doing is lost with them
        if not commit:
            tier.pending = tier.pending_meta = None
        start_helpers(tier)
    return commit


def commit_durable(tier: MemoryTier, removed: list[str]) -> str:
    """Rank 0: commit the pending durable checkpoint (every node's files are in its staging directory)."""
    save_dir, it, meta = tier.settings.save_dir, tier.pending, tier.pending_meta
    assert save_dir is not None and meta is not None and it is not None
    path = directory.commit(save_dir, it, meta, meta["files"], fault=lambda point: maybe_fail(point, 0, it),
                            fence=tier.fence)
    if tier.settings.durable_keep is not None:
        removed.extend(directory.apply_retention(save_dir, tier.settings.durable_keep, tier.fence))
    return path


def start_persist(tier: MemoryTier, what: str) -> None:
    """Collective: hand the last snapshot's files of each node's own ranks to the node's helper process."""
    assert tier.last is not None and tier.settings.save_dir is not None
    it, meta, own = tier.last
    save_dir = tier.settings.save_dir
    if not tier.helpers_started:
        start_helpers(tier)
    tier.pending = it
    if rank() == 0:
        tier.pending_meta = meta
    if tier.save_lease is None:  # every node's helper writes for the lease rank 0 holds: fenced by a newer one
        mine = tier.leases.held(save_dir) if rank() == 0 and tier.leases is not None else None
        tier.save_lease = int(broadcast_json(mine.generation if mine is not None else 0, 0))

    def start() -> None:
        if not tier.leader:
            return
        assert tier.helper is not None
        src = node_dir.snapshot_dir(tier.mem, it)
        dst = directory.partial_dir(save_dir, it)
        tier.helper.request(Persist(it, tuple(Copy(os.path.join(src, f), os.path.join(dst, f)) for f in own),
                                    (save_dir, tier.save_lease) if tier.save_lease else None))

    run_phase(f"{what}: starting the background persist", start)


def busy(tier: MemoryTier) -> bool:
    """Collective: whether any node's helper is still replicating or persisting (nothing is waited for)."""
    return any(p.state == "running" for a in all_gather_json(node_progress(tier, 0.0).to_json())
               for p in NodeProgress.from_json(a).ops.values())


def drain(tier: MemoryTier) -> tuple[str, ...]:
    """Collective: wait for the pending replication and background persist; commit the persisted checkpoint;
    returns the durable path (if any)."""
    persisted: list[str] = []
    while tier.pending is not None or tier.replicating is not None:
        answers = gather_records("waiting for the helper processes", lambda: node_progress(tier, 0.5), NodeProgress)
        if resolve(tier, answers, "waiting for the helper processes"):
            persisted.append(run_phase("committing the persisted checkpoint",
                                       lambda: commit_durable(tier, []) if rank() == 0 else ""))
            tier.pending = tier.pending_meta = None
    return tuple(p for p in persisted if p)


def replicate_last(tier: MemoryTier) -> tuple[str, ...]:
    """Collective: make sure the last snapshot has all its replicas (the job stops: its restart relies on them);
    returns the durable checkpoints committed meanwhile."""
    done = drain(tier)
    if tier.last is None or tier.replicated == tier.last[0] or not tier.replicates:
        return done
    it = tier.last[0]
    replication.replicate(tier, tier.last_files, it, f"replicating iteration {it}", unpaced=True)
    return done + drain(tier)


def persist_last(tier: MemoryTier) -> tuple[str, ...]:
    """Collective: make the last snapshot durable now (the end of training) unless it is already; returns the
    durable checkpoints committed."""
    done = drain(tier)
    if tier.last is None or tier.settings.save_dir is None:
        return done
    it = tier.last[0]
    save_dir = tier.settings.save_dir

    def prepare() -> bool:
        already = directory.find_checkpoint(save_dir) is not None and directory.tracker_iteration(save_dir) == it
        if rank() == 0 and not already:
            for stale in directory.partial_dirs(save_dir):
                directory.remove_partial(stale, tier.fence)
            directory.prepare_partial(save_dir, it, tier.fence)
        return already

    if broadcast_json(run_phase(f"persisting iteration {it}: preparing", prepare), 0):
        return done
    start_persist(tier, f"persisting iteration {it}")
    return done + drain(tier)


def finish(tier: MemoryTier, *, over: bool) -> tuple[str, ...]:
    """Collective, when the job stops: the last snapshot replicated to K nodes (a restart finds it in memory) and,
    when training is ``over``, persisted; otherwise the background persist under way is awaited. A paced
    replication goes at full speed from here on (no training left to spare). Returns the durable checkpoints
    committed meanwhile."""
    if tier.leader and tier.helper is not None:
        tier.helper.hurry()
    done = replicate_last(tier)
    return done + (persist_last(tier) if over else drain(tier))
