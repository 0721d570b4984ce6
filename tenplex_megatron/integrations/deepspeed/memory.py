"""Host-memory checkpoints for DeepSpeed engines: the calls beside ``save_checkpoint`` / ``load_checkpoint``.

The same tier as ``--tenplex-memory`` (``engine/memory_save.py``, ``engine/memory_load.py``): a snapshot copies
each rank's ZeRO partitions into node-local shared memory, the nodes' helper processes replicate it to peers'
memory and persist it to the durable directory in the background, and a restart at any DP size loads the newest
snapshot that is whole in the live nodes' memory, receiving from peers what its own node lacks.
"""

from __future__ import annotations

import os
from typing import Any

from tenplex_megatron.engine import memory_load, memory_save
from tenplex_megatron.engine.load import LoadResult
from tenplex_megatron.engine.memory_load import MemoryLoadResult
from tenplex_megatron.engine.memory_save import MemoryTier, SnapshotResult
from tenplex_megatron.integrations.deepspeed import native
from tenplex_megatron.integrations.deepspeed.adapter import DeepSpeedAdapter, load_checkpoint
from tenplex_megatron.storage import memory_tier


def open_memory(mem_dir: str, save_dir: str | None, job: str | None = None, **options: Any) -> MemoryTier:
    """Collective: this rank's host-memory tier in the node-local ``mem_dir``, its helper processes started.

    ``save_dir``: where snapshots are persisted (None: never). ``job``: the job's identity, by default its durable
    directory (another job's snapshots are never loaded). ``options``: those of ``--tenplex-memory``
    (``persist_interval``, ``replicas``, ``keep``, ``limit`` in bytes, ``fallback``, ``durable_keep``,
    ``replication_rate`` in MB/s or ``"auto"``).
    """
    identity = os.path.abspath(job or save_dir or mem_dir)
    if "replication_rate" in options:
        options.update(memory_save.replication_options(options["replication_rate"]))
    memory_tier.say_huge_pages_hint(mem_dir)
    return memory_save.open_tier(mem_dir, identity, save_dir, start_helpers=True, **options)


def save_snapshot(engine: Any, tier: MemoryTier, client_state: dict[str, Any] | None = None,
                  persist: bool | None = None) -> SnapshotResult:
    """Collective: snapshot the engine's full state (named after its global steps) into host memory.

    ``persist``: True forces a durable copy of this snapshot, False skips it, None follows ``persist_interval``.
    """
    return memory_save.snapshot(DeepSpeedAdapter(engine, client_state=client_state), tier, persist)


def load_latest(engine: Any, tier: MemoryTier, load_dir: str | None, verify: bool = True,
                seed: int = 1234) -> MemoryLoadResult | LoadResult | None:
    """Collective: load the newest state into ``engine``, re-sharded to its DP size: the newest snapshot whole in
    the live nodes' memory, else the durable checkpoint under ``load_dir`` (tenplex's or DeepSpeed's own); None
    when there is neither (and every older snapshot is discarded: the job starts afresh)."""
    choice = memory_load.choose(tier, load_dir)
    if choice is not None:
        return memory_load.load_snapshot(DeepSpeedAdapter(engine, seed, where=tier.mem), tier, choice, verify)
    if not load_dir or (memory_load.durable_iteration(load_dir) is None
                        and not native.is_deepspeed_checkpoint_dir(load_dir)):
        return None
    return load_checkpoint(engine, load_dir, verify=verify, seed=seed)


def finish_memory(tier: MemoryTier, over: bool) -> tuple[str, ...]:
    """Collective, when the job stops: the last snapshot replicated to its peers and, when training is ``over``,
    persisted; then the helpers stop. Returns the durable checkpoints committed meanwhile."""
    try:
        return memory_save.finish(tier, over)
    finally:
        memory_save.close(tier)
