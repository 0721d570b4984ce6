"""The ``--tenplex-memory`` flags, their checks and the tier they open: one definition for both trainers.

``scripts/pretrain_gpt.py`` (``training/pretrain.py``) and the Megatron-LM hook
(``frontdoor/megatron_lm.py``) take the same host-memory flags with the same
meanings, checks and end-of-job rule (:func:`finish`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Callable
from typing import Any

from tenplex_megatron import flags
from tenplex_megatron.memory import background, mounts
from tenplex_megatron.memory.restart import MemoryLoadResult
from tenplex_megatron.memory.settings import MemorySettings
from tenplex_megatron.memory.snapshot import SnapshotResult
from tenplex_megatron.memory.state import MemoryTier, open_tier
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.storage.lease import LeaseSet


def add_memory_args(g: Any) -> None:
    """Add the host-memory flags to ``g`` (a parser or an argument group), as defined in ``tenplex_megatron/flags.py``."""
    flags.add_flags(g, flags.TRAINER, groups=("memory",))


def check_memory_args(args: Any) -> str | None:
    """The first problem with the host-memory flags (naming the flag), or None."""
    if args.tenplex_memory is not None and not args.tenplex:
        return "--tenplex-memory needs --tenplex"
    try:
        memory_settings(args)
    except ValueError as e:
        return str(e)
    return None


#: where ``--async-save`` keeps its snapshots on each node when ``--tenplex-memory`` names no directory
ASYNC_SAVE_ROOT = "/dev/shm"


def async_save_dir(save: str) -> str:
    """The node-local memory directory of an ``--async-save`` job without ``--tenplex-memory``: one per ``--save``
    directory (another job's is another), in ``/dev/shm``."""
    digest = hashlib.sha1(os.path.abspath(save).encode()).hexdigest()[:12]
    return os.path.join(ASYNC_SAVE_ROOT, f"tenplex-async-{digest}")


def memory_dir(args: Any) -> str | None:
    """The job's host-memory directory: ``--tenplex-memory``'s, else ``--async-save``'s default (with ``--save``),
    else None (no tier). Only with ``--tenplex``."""
    if not getattr(args, "tenplex", False):
        return None
    if getattr(args, "tenplex_memory", None):
        return args.tenplex_memory
    save = getattr(args, "save", None)
    return async_save_dir(save) if getattr(args, "async_save", False) and save else None


def memory_settings(args: argparse.Namespace | Any) -> MemorySettings:
    """The tier's settings from the flags (validated there: a bad value is a ValueError naming its flag). The
    job's identity is its durable directory: another job's snapshots are never loaded."""
    mem = memory_dir(args) or args.tenplex_memory or ""
    save = getattr(args, "save", None)  # Megatron-LM's own flags: absent where only the hook's are parsed
    limit = None if args.tenplex_memory_limit is None else int(args.tenplex_memory_limit * 1e9)
    return MemorySettings(mem, os.path.abspath(save or getattr(args, "load", None) or mem), save,
                          persist_interval=args.tenplex_persist_interval, replicas=args.tenplex_replicas,
                          keep=args.tenplex_memory_keep, limit=limit, fallback=args.tenplex_memory_fallback,
                          durable_keep=args.tenplex_keep, replication_rate=args.tenplex_replication_rate)


def open_memory(args: argparse.Namespace | Any) -> MemoryTier | None:
    """Collective: the host-memory tier of ``--tenplex-memory`` (None without it), its helper processes started."""
    if not (args.tenplex and args.tenplex_memory):
        return None
    return open_settings(memory_settings(args))


def open_settings(settings: MemorySettings, leases: LeaseSet | None = None, helpers: bool = True) -> MemoryTier:
    """Collective: the host-memory tier of ``settings`` (the flags', or DeepSpeed's ``open_memory``'s), its helper
    processes started (``helpers=False``: later, ``state.start_helpers`` or the first snapshot that needs them), its
    destructive steps fenced by the job's ``leases``; the node's huge-pages hint said first."""
    mounts.say_huge_pages_hint(settings.mem)
    return open_tier(settings, start_helpers_now=helpers, leases=leases)


def finish(tier: MemoryTier, *, over: bool, say: Callable[[str], None] | None = None) -> tuple[str, ...]:
    """Collective, when the job stops: :func:`background.finish`, each durable checkpoint it committed said
    (``say`` gets the line without the ``> tenplex:`` prefix); returns their paths."""
    done = background.finish(tier, over=over)
    for path in done if say is not None else ():
        say(f"persisted {path} (background)")
    return done


def describe_snapshot(snap: SnapshotResult, iteration: int) -> list[str]:
    """The lines a trainer says for a save through the memory tier (without the ``> tenplex:`` prefix)."""
    if snap.fallback is not None:
        return [f"snapshot did not fit in memory: saved iteration {iteration} to {snap.path} "
                f"in {snap.seconds:.2f} s"]
    return [f"snapshot of iteration {iteration} in host memory {snap.path} in {snap.seconds:.3f} s "
            f"(rank 0: {snap.bytes_written / 1e6:.2f} MB written, {snap.bytes_replicated / 1e6:.2f} MB replicated"
            f"{', persisting in the background' if snap.persisting else ''})",
            *(f"persisted {p} (background)" for p in snap.persisted),
            *(f"removed {p}" for p in snap.removed)]


def describe_memory_load(mres: MemoryLoadResult, layout: ParallelLayout) -> str:
    """The line a trainer says for a restart from host memory at ``layout`` (without the ``> tenplex:`` prefix)."""
    res = mres.result
    return (f"loaded iteration {res.iteration} from host memory ({res.path}): layout "
            f"{res.layout or ParallelLayout.from_json(res.source_layout)} -> {layout}, {res.tensors} tensors in {res.seconds:.2f} s; "
            f"rank 0: {res.bytes_read / 1e6:.2f} MB copied, {mres.bytes_received / 1e6:.2f} MB received from peers, "
            f"{mres.bytes_from_durable} bytes read from durable storage")
