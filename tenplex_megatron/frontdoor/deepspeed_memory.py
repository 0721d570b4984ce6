"""Host-memory checkpoints for DeepSpeed engines (``tenplex_megatron.deepspeed``): the calls beside
``save_checkpoint`` / ``load_checkpoint``.

The same tier as ``--tenplex-memory`` (``tenplex_megatron/memory/``): a snapshot copies
each rank's ZeRO partitions into node-local shared memory, the nodes' helper processes replicate it to peers'
memory and persist it to the durable directory in the background, and a restart at any DP size loads the newest
snapshot that is whole in the live nodes' memory, receiving from peers what its own node lacks. The tier is owned
by a :class:`~tenplex_megatron.frontdoor.checkpointer.Checkpointer`, as behind the other front doors:
``open_memory`` builds it, ``finish_memory`` closes it (helpers stopped, shared memory handles closed).
"""

from __future__ import annotations

import os
from typing import Any

from tenplex_megatron.engine.load import LoadResult
from tenplex_megatron.flags import FlagError
from tenplex_megatron.frontdoor.checkpointer import Checkpointer
from tenplex_megatron.frontdoor.deepspeed import PROG, load_checkpoint
from tenplex_megatron.integrations.deepspeed.adapter import DeepSpeedAdapter
from tenplex_megatron.memory import restart
from tenplex_megatron.memory.restart import MemoryLoadResult
from tenplex_megatron.memory.settings import MemorySettings
from tenplex_megatron.memory.snapshot import SnapshotResult
from tenplex_megatron.memory.state import MemoryTier
from tenplex_megatron.storage import formats


def open_memory(mem_dir: str, save_dir: str | None, job: str | None = None, **options: Any) -> Checkpointer:
    """Collective: the Checkpointer of this rank's host-memory tier in the node-local ``mem_dir``, the tier opened
    and its helper processes started (its ``tier`` attribute).

    ``save_dir``: where snapshots are persisted (None: never). ``job``: the job's identity, by default its durable
    directory (another job's snapshots are never loaded). ``options``: those of ``--tenplex-memory``
    (``persist_interval``, ``replicas``, ``keep``, ``limit`` in bytes, ``fallback``, ``durable_keep``,
    ``replication_rate`` in MB/s or ``"auto"``): :class:`MemorySettings`, which checks them.
    """
    settings = MemorySettings(mem_dir, os.path.abspath(job or save_dir or mem_dir), save_dir, **options)
    memory = Checkpointer.for_api(PROG, memory=settings)
    memory.memory()
    return memory


def _tier(memory: Checkpointer) -> MemoryTier:
    """The open tier of ``memory`` (a closed Checkpointer is refused, naming the program)."""
    tier = memory.memory()
    if tier is None:
        raise FlagError(f"{PROG}: {memory!r} has no host-memory tier: build it with open_memory")
    return tier


def save_snapshot(engine: Any, memory: Checkpointer, client_state: dict[str, Any] | None = None, *,
                  persist: bool | None = None) -> SnapshotResult:
    """Collective: snapshot the engine's full state (named after its global steps) into host memory.

    ``persist``: True forces a durable copy of this snapshot, False skips it, None follows ``persist_interval``.
    """
    return memory.snapshot(DeepSpeedAdapter(engine, client_state=client_state), persist=persist)


def load_latest(engine: Any, memory: Checkpointer, load_dir: str | None, *, verify: bool = True,
                seed: int = 1234) -> MemoryLoadResult | LoadResult | None:
    """Collective: load the newest state into ``engine``, re-sharded to its DP size: the newest snapshot whole in
    the live nodes' memory, else the durable checkpoint under ``load_dir`` (tenplex's or DeepSpeed's own); None
    when there is neither. Once decided, the snapshots of a timeline the job left are discarded (every one for a
    fresh start or DeepSpeed's own files: the job never jumps back to them)."""
    tier = _tier(memory)
    choice = restart.choose(tier, load_dir)
    if choice is not None:
        got = restart.load_snapshot(DeepSpeedAdapter(engine, seed, where=tier.mem), tier, choice, verify=verify)
        restart.discard_after(tier, choice.iteration)
        return got
    if not load_dir or (restart.durable_iteration(load_dir) is None
                        and not formats.is_deepspeed_checkpoint_dir(load_dir)):
        restart.discard_after(tier, None)
        return None
    res = load_checkpoint(engine, load_dir, verify=verify, seed=seed, checkpointer=memory)
    restart.discard_after(tier, res.iteration if res.source_format == "tenplex" else None)
    return res


def finish_memory(memory: Checkpointer, *, over: bool) -> tuple[str, ...]:
    """Collective, when the job stops: the last snapshot replicated to its peers and, when training is ``over``,
    persisted; then the Checkpointer is closed (the helpers stop). Returns the durable checkpoints committed
    meanwhile."""
    try:
        return memory.finish(over=over)
    finally:
        memory.close()
