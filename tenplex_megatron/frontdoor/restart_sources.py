"""Where a restart loads from, in one order for both front doors, and how it loads (``memory/fallback.py``).

The order: the newest host-memory snapshot (``--tenplex-memory``); else, with ``--tenplex``, tenplex's newest
complete checkpoint under the load directory (``storage/copies.py``: a directory whose copies are all damaged
stops the job here, naming each); else Megatron's own checkpoint there (adopted with ``--tenplex``); else nothing
(a fresh start, or ``--tenplex-init-from-hf``). A job without ``--tenplex`` whose load directory holds tenplex
checkpoints stops, naming ``export-megatron`` (the way to Megatron's own format).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from tenplex_megatron.engine.adapter import Adapter
from tenplex_megatron.engine.load import LoadResult
from tenplex_megatron.errors import TenplexError
from tenplex_megatron.memory import fallback
from tenplex_megatron.memory import restart as memory_restart
from tenplex_megatron.memory.state import MemoryTier
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.restart_policy import Choice
from tenplex_megatron.storage import copies
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata
from tenplex_megatron.storage.directory import (
    find_checkpoint,
    find_megatron_checkpoint,
    iter_dir_name,
    tracker_iteration,
)


@dataclass(frozen=True)
class Sources:
    """The copies a restart may load, at most one of the first two set: a host-memory snapshot, tenplex's durable
    checkpoint, and Megatron's own checkpoint (only when neither of the others exists)."""

    memory: Choice | None
    tenplex: str | None
    megatron: str | None
    damaged: tuple[copies.Copy, ...] = ()  # tenplex copies newer than ``tenplex`` that cannot be loaded, and why
    tenplex_meta: CheckpointMetadata | None = None  # ``tenplex``'s metadata, read and checked once by the query

    @property
    def ours(self) -> bool:
        """Whether tenplex's own state (memory or durable) is there to restart from."""
        return self.memory is not None or self.tenplex is not None


class TenplexCheckpointWithoutFlag(TenplexError, ValueError):
    """A job without ``--tenplex`` whose load directory holds a tenplex checkpoint Megatron's loader would meet."""


def tenplex_checkpoint_met(load_dir: str) -> str | None:
    """The tenplex checkpoint a load without ``--tenplex`` would meet under ``load_dir``: the one the tracker names
    (or ``load_dir`` itself), or the newest when there is no Megatron checkpoint there to load instead."""
    ckpt = find_checkpoint(load_dir)
    if ckpt is None:
        return None
    it = tracker_iteration(load_dir)
    named = it is not None and os.path.realpath(ckpt) == os.path.realpath(os.path.join(load_dir, iter_dir_name(it)))
    return ckpt if named or os.path.realpath(ckpt) == os.path.realpath(load_dir) \
        or find_megatron_checkpoint(load_dir) is None else None


def without_flag_message(ckpt: str) -> str:
    """What a job without ``--tenplex`` says when its ``--load`` holds the tenplex checkpoint ``ckpt``."""
    return (f"--load: {ckpt} is a tenplex checkpoint, which Megatron's own loader cannot read: run with --tenplex, "
            f"or write it as Megatron's torch_dist checkpoint with `tenplex-megatron export-megatron {ckpt} OUT "
            "--to tp=..,pp=..,dp=..` (the layout this job runs at) and --load OUT")


def find_sources(tier: MemoryTier | None, load_dir: str | None, *, tenplex: bool) -> Sources:
    """The load-source order (module docstring) over ``load_dir`` and the host-memory ``tier``. Without ``tenplex``,
    a tenplex checkpoint where Megatron's loader would look raises :class:`TenplexCheckpointWithoutFlag` (neither a
    traceback from Megatron's loader nor a silent fresh start)."""
    if load_dir and not tenplex and (met := tenplex_checkpoint_met(load_dir)) is not None:
        raise TenplexCheckpointWithoutFlag(without_flag_message(met))
    memory = memory_restart.choose(tier, load_dir) if tier is not None else None
    copy, damaged = copies.choose(load_dir) if (load_dir and tenplex and memory is None) else (None, ())
    ckpt = copy.path if copy is not None else None
    mck = find_megatron_checkpoint(load_dir) if (load_dir and memory is None and ckpt is None) else None
    return Sources(memory, ckpt, mck, damaged, copy.metadata if copy is not None else None)


def restart(adapter: Callable[[], Adapter], load_durable: Callable[..., LoadResult], tier: MemoryTier | None,
            sources: Sources, load_dir: str | None, *, verify: bool) -> fallback.Restart:
    """Collective: load ``sources``' snapshot (through a fresh ``adapter()``) or durable checkpoint (``load_durable``
    of its path, and of its metadata where the query read it: never read twice) into the job, re-sharded; a damaged
    copy falls back to the next (``memory/fallback.py``). The engine comes in as an adapter and a loader, so that
    every front door shares this order."""
    def durable(path: str) -> LoadResult:
        if sources.tenplex_meta is not None and path == sources.tenplex:
            return load_durable(path, metadata=sources.tenplex_meta)
        return load_durable(path)

    return fallback.restart(
        lambda c: memory_restart.load_snapshot(adapter(), tier, c, verify=verify),
        durable, tier, sources.memory, load_dir, sources.tenplex, sources.damaged)


def loaded_line(res: LoadResult, layout: ParallelLayout) -> str:
    """The line a trainer says for a restart from a durable checkpoint (tenplex's or Megatron's) at ``layout``
    (without the ``> tenplex:`` prefix: the logger or the trainer adds it)."""
    return (f"loaded iteration {res.iteration} from {res.path}: layout "
            f"{res.layout or ParallelLayout.from_json(res.source_layout)} -> {layout}, {res.tensors} tensors, "
            f"{res.bytes_read / 1e6:.2f} MB read on rank 0 in {res.seconds:.2f} s")
