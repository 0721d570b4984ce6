"""Fall back, never fail, while a good copy exists: a restart whose copy fails its checks tries the next copy.

The order: the chosen host-memory snapshot; the same snapshot with every damaged replica left out (after a
failure each node checks the files it holds: a restart that succeeds reads nothing twice), the rank files no good
replica is left of read from the durable checkpoint of the same iteration; then the durable checkpoints, newest
first (the same iteration, then the previous complete ones). Each damaged copy is named in one warning (rank 0).
Only when no complete copy is left does the restart fail, naming every copy tried (Megatron-LM #5281: a job
restored from a bad local replica looped on NaN with no fallback to the global checkpoint).
A copy is damaged when loading it fails with a checkpoint-file error on some rank (a checksum, a size, a missing
file: a failure whose kind is in :data:`DAMAGE_KINDS`): other failures (another model's checkpoint) are raised as
they are, since every copy would repeat them.
A failed attempt restores no non-tensor state (iteration, RNG, data position, the scheduler's steps) on any rank:
the engine restores it only once every rank has copied (``engine/load.py``). The parallel reader checks each
block as it reads it, so pieces read before a damaged block may already be in the tensors, and the next copy's
load writes every element of every tensor again (the plan covers each exactly once).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tenplex_megatron import log as tlog
from tenplex_megatron.engine.load import LoadResult
from tenplex_megatron.execute.collective import RankFailure, rank
from tenplex_megatron.memory import restart as memory_restart
from tenplex_megatron.memory.restart import MemoryLoadResult
from tenplex_megatron.memory.state import MemoryTier
from tenplex_megatron.plan.restart_policy import Choice
from tenplex_megatron.storage import directory
from tenplex_megatron.storage.copies import Copy, NoGoodCopyError
from tenplex_megatron.storage.files import CheckpointFileError, CheckpointNotFoundError
from tenplex_megatron.storage.lease import LeaseError

log = tlog.get("fallback")
#: the kinds of a rank's failure (:attr:`Failure.kind <tenplex_megatron.errors.Failure.kind>`) that mark the copy
#: it loaded as damaged
DAMAGE_KINDS = frozenset({CheckpointFileError.kind, CheckpointNotFoundError.kind, LeaseError.kind,
                          FileNotFoundError.__name__})


@dataclass(frozen=True)
class Restart:
    """What a restart loaded: the engine's result, the memory load's (None: from a durable checkpoint), and every
    copy skipped on the way, with why."""

    result: LoadResult
    memory: MemoryLoadResult | None
    skipped: tuple[str, ...] = ()


def damage(error: BaseException) -> str | None:
    """The failure naming the damaged copy (every failing rank's message) when some rank's is a checkpoint-file
    error, else None (another kind of failure)."""
    if isinstance(error, RankFailure):
        return str(error) if any(f.kind in DAMAGE_KINDS for f in error.failures.values()) else None
    return str(error) if isinstance(error, CheckpointFileError) else None


def durable_candidates(load_dir: str, first: str | None) -> Iterator[str]:
    """The durable checkpoints to try, in order: ``first`` (the one a restart chose), then every older complete
    one under ``load_dir``, newest first (``load_dir`` itself a checkpoint: only it). Lazy: the older ones are
    listed (their metadata read) only once ``first`` has failed."""
    if first is not None:
        yield first
        if os.path.abspath(first) == os.path.abspath(load_dir):
            return
    its = directory.committed_iterations(load_dir)
    top = directory.iteration_of(first) if first is not None else None  # by name: its metadata may be the damage
    yield from (os.path.join(load_dir, directory.iter_dir_name(it)) for it in reversed(its) if top is None or it < top)


def _skip(what: str, why: str, skipped: list[str]) -> None:
    skipped.append(f"{what}: {why}")
    if rank() == 0:
        log.warning("skipping a damaged copy, %s: %s (trying the next copy)", what, why)


def restart(load_memory: Callable[[Choice], MemoryLoadResult], load_durable: Callable[[str], LoadResult],
            tier: MemoryTier | None, choice: Choice | None, load_dir: str | None,
            durable: str | None, damaged: tuple[Copy, ...] = ()) -> Restart:
    """Collective: load ``choice`` (host memory) or else ``durable``, falling back in the module's order.
    ``damaged``: the durable copies newer than ``durable`` whose metadata did not read (``storage/copies.py``),
    each named in the one warning before anything is loaded."""
    skipped: list[str] = []
    for c in damaged:
        _skip(f"durable checkpoint {c.path}", c.why or "damaged", skipped)
    excluded: set[tuple[int, str, str]] = set()
    while choice is not None:
        assert tier is not None
        what = f"host-memory snapshot of iteration {choice.iteration}"
        try:
            got = load_memory(choice)
            return Restart(got.result, got, tuple(skipped))
        except RankFailure as e:
            why = damage(e)
            if why is None:
                raise
            _skip(what, why, skipped)
        bad = set(memory_restart.damaged_copies(tier, choice)) - excluded
        if not bad:  # nothing damaged in the nodes' memory: the durable files it mixed in, or what travelled
            break
        excluded |= bad
        choice = memory_restart.choose(tier, load_dir, exclude=excluded)
    first = durable if durable is not None else directory.find_checkpoint(load_dir) if load_dir else None
    for path in durable_candidates(load_dir, first) if load_dir else ([first] if first else []):
        try:
            res = load_durable(path)
        except RankFailure as e:
            why = damage(e)
            if why is None:
                raise
            _skip(f"durable checkpoint {path}", why, skipped)
            continue
        if tier is not None and skipped:  # snapshots newer than what was loaded: a timeline left behind
            memory_restart.discard_after(tier, res.iteration)
        return Restart(res, None, tuple(skipped))
    raise NoGoodCopyError("no complete copy of the job's state is left to restart from; copies tried:\n  "
                          + "\n  ".join(skipped))

