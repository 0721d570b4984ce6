"""Host-memory checkpoints for DeepSpeed engines: the calls beside ``save_checkpoint`` / ``load_checkpoint``.

The same tier as ``--tenplex-memory`` (``tenplex_megatron/memory/``): a snapshot copies
each rank's ZeRO partitions into node-local shared memory, the nodes' helper processes replicate it to peers'
memory and persist it to the durable directory in the background, and a restart at any DP size loads the newest
snapshot that is whole in the live nodes' memory, receiving from peers what its own node lacks.
"""

from __future__ import annotations

import os
from typing import Any

from tenplex_megatron.engine.load import LoadResult
from tenplex_megatron.integrations.deepspeed import native
from tenplex_megatron.integrations.deepspeed.adapter import DeepSpeedAdapter, load_checkpoint
from tenplex_megatron.memory import background, mounts, restart, state
from tenplex_megatron.memory.restart import MemoryLoadResult
from tenplex_megatron.memory.settings import MemorySettings
from tenplex_megatron.memory.snapshot import SnapshotResult, snapshot
from tenplex_megatron.memory.state import MemoryTier


def open_memory(mem_dir: str, save_dir: str | None, job: str | None = None, **options: Any) -> MemoryTier:
    """Collective: this rank's host-memory tier in the node-local ``mem_dir``, its helper processes started.

    ``save_dir``: where snapshots are persisted (None: never). ``job``: the job's identity, by default its durable
    directory (another job's snapshots are never loaded). ``options``: those of ``--tenplex-memory``
    (``persist_interval``, ``replicas``, ``keep``, ``limit`` in bytes, ``fallback``, ``durable_keep``,
    ``replication_rate`` in MB/s or ``"auto"``): :class:`MemorySettings`, which checks them.
    """
    settings = MemorySettings(mem_dir, os.path.abspath(job or save_dir or mem_dir), save_dir, **options)
    mounts.say_huge_pages_hint(mem_dir)
    return state.open_tier(settings, start_helpers_now=True)


def save_snapshot(engine: Any, tier: MemoryTier, client_state: dict[str, Any] | None = None, *,
                  persist: bool | None = None) -> SnapshotResult:
    """Collective: snapshot the engine's full state (named after its global steps) into host memory.

    ``persist``: True forces a durable copy of this snapshot, False skips it, None follows ``persist_interval``.
    """
    return snapshot(DeepSpeedAdapter(engine, client_state=client_state), tier, persist=persist)


def load_latest(engine: Any, tier: MemoryTier, load_dir: str | None, *, verify: bool = True,
                seed: int = 1234) -> MemoryLoadResult | LoadResult | None:
    """Collective: load the newest state into ``engine``, re-sharded to its DP size: the newest snapshot whole in
    the live nodes' memory, else the durable checkpoint under ``load_dir`` (tenplex's or DeepSpeed's own); None
    when there is neither (and every older snapshot is discarded: the job starts afresh)."""
    choice = restart.choose(tier, load_dir)
    if choice is not None:
        return restart.load_snapshot(DeepSpeedAdapter(engine, seed, where=tier.mem), tier, choice, verify=verify)
    if not load_dir or (restart.durable_iteration(load_dir) is None
                        and not native.is_deepspeed_checkpoint_dir(load_dir)):
        return None
    return load_checkpoint(engine, load_dir, verify=verify, seed=seed)


def finish_memory(tier: MemoryTier, *, over: bool) -> tuple[str, ...]:
    """Collective, when the job stops: the last snapshot replicated to its peers and, when training is ``over``,
    persisted; then the helpers stop. Returns the durable checkpoints committed meanwhile."""
    try:
        return background.finish(tier, over=over)
    finally:
        state.close(tier)
