"""The ``--tenplex-memory`` flags, their checks and the tier they open: one definition for both trainers.

``scripts/pretrain_gpt.py`` (``training/pretrain.py``) and the Megatron-LM hook
(``integrations/megatron_lm.py``) take the same host-memory flags with the same
meanings, checks and end-of-job rule (:func:`finish`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from tenplex_megatron import flags
from tenplex_megatron.engine import memory_save
from tenplex_megatron.engine.memory_load import MemoryLoadResult
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.storage import memory_tier


def add_memory_args(g: Any) -> None:
    """Add the host-memory flags to ``g`` (a parser or an argument group), as defined in ``tenplex_megatron/flags.py``."""
    flags.add_flags(g, flags.TRAINER, groups=("memory",))


def check_memory_args(args: Any) -> str | None:
    """The first problem with the host-memory flags (naming the flag), or None."""
    if args.tenplex_memory is not None and not args.tenplex:
        return "--tenplex-memory needs --tenplex"
    for flag in ("persist_interval", "replicas", "memory_keep"):
        if getattr(args, f"tenplex_{flag}") < 1:
            return f"--tenplex-{flag.replace('_', '-')} must be >= 1, got {getattr(args, f'tenplex_{flag}')}"
    if args.tenplex_replication_rate != "auto" and args.tenplex_replication_rate < 0:
        return f"--tenplex-replication-rate must be >= 0 (MB/s; 0: unlimited), got {args.tenplex_replication_rate}"
    if args.tenplex_memory_limit is not None and args.tenplex_memory_limit <= 0:
        return f"--tenplex-memory-limit must be > 0 (GB), got {args.tenplex_memory_limit}"
    return None


def open_memory(args: argparse.Namespace | Any) -> memory_save.MemoryTier | None:
    """Collective: the host-memory tier of ``--tenplex-memory`` (None without it), its helper processes started.
    The job's identity is its durable directory: another job's snapshots are never loaded."""
    if not (args.tenplex and args.tenplex_memory):
        return None
    job = os.path.abspath(args.save or args.load or args.tenplex_memory)
    limit = None if args.tenplex_memory_limit is None else int(args.tenplex_memory_limit * 1e9)
    memory_tier.say_huge_pages_hint(args.tenplex_memory)
    return memory_save.open_tier(args.tenplex_memory, job, args.save, start_helpers=True,
                                 persist_interval=args.tenplex_persist_interval,
                                 replicas=args.tenplex_replicas, keep=args.tenplex_memory_keep, limit=limit,
                                 fallback=args.tenplex_memory_fallback, durable_keep=args.tenplex_keep,
                                 **memory_save.replication_options(args.tenplex_replication_rate))



def finish(tier: memory_save.MemoryTier, over: bool, say: Callable[[str], None]) -> None:
    """Collective, when the job stops: :func:`memory_save.finish`, each durable checkpoint it committed said."""
    for path in memory_save.finish(tier, over):
        say(f"> tenplex: persisted {path} (background)")


def describe_snapshot(snap: memory_save.SnapshotResult, iteration: int) -> list[str]:
    """The lines a trainer prints for a save through the memory tier."""
    if snap.fallback is not None:
        return [f"> tenplex: snapshot did not fit in memory: saved iteration {iteration} to {snap.path} "
                f"in {snap.seconds:.2f} s"]
    return [f"> tenplex: snapshot of iteration {iteration} in host memory {snap.path} in {snap.seconds:.3f} s "
            f"(rank 0: {snap.bytes_written / 1e6:.2f} MB written, {snap.bytes_replicated / 1e6:.2f} MB replicated"
            f"{', persisting in the background' if snap.persisting else ''})",
            *(f"> tenplex: persisted {p} (background)" for p in snap.persisted),
            *(f"> tenplex: removed {p}" for p in snap.removed)]


def describe_memory_load(mres: MemoryLoadResult, layout: ParallelLayout) -> str:
    """The line a trainer prints for a restart from host memory at ``layout``."""
    res = mres.result
    return (f"> tenplex: loaded iteration {res.iteration} from host memory ({res.path}): layout "
            f"{ParallelLayout.from_json(res.source_layout)} -> {layout}, {res.tensors} tensors in {res.seconds:.2f} s; "
            f"rank 0: {res.bytes_read / 1e6:.2f} MB copied, {mres.bytes_received / 1e6:.2f} MB received from peers, "
            f"{mres.bytes_from_durable} bytes read from durable storage")
