"""Collective load of a checkpoint into an adapter's live chunks, re-sharded to the job's layout.

Each rank plans its own part (a pure function of the saved PTC and its own
chunks), checks every file it will read, has the checksum blocks it reads
verified (each block once per host), then copies only the bytes it needs
straight into the live tensors; once every rank has copied, the adapter restores
its non-tensor state and the engine applies the RNG policy. Every phase runs through
:func:`run_phase`: a failure of any kind on any rank is raised on every rank
before any rank copies a byte (or, after copying, on every rank at once).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from tenplex_megatron.engine import rank_local, rng
from tenplex_megatron.engine.adapter import Adapter, LayoutRecord
from tenplex_megatron.engine.chunks import LocalChunk, tensor_table
from tenplex_megatron.errors import TenplexError
from tenplex_megatron.execute.collective import gather_records, rank, run_phase
from tenplex_megatron.execute.executor import (
    ExecStats,
    block_intervals,
    execute_plan,
    parallel_blocks,
    plain_ops,
    prepare_sources,
    verify_blocks,
)
from tenplex_megatron.plan.gc_pause import gc_paused
from tenplex_megatron.plan.megatron_ckpt_flags import LoadScope
from tenplex_megatron.plan.planner import PlanError, plan_reshard
from tenplex_megatron.plan.ptc import PTC
from tenplex_megatron.plan.verify_share import Interval, blocks, share_blocks
from tenplex_megatron.storage import directory
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata
from tenplex_megatron.storage.faults import maybe_fail
from tenplex_megatron.storage.files import CheckpointNotFoundError
from tenplex_megatron.storage.source import Metadata, Opened
from tenplex_megatron.storage.source_files import SourceFiles
from tenplex_megatron.storage.steps import checkpoint_at


class LoadScopeError(TenplexError, ValueError):
    """A load asks for what the checkpoint does not hold (the optimizer of a weights-only checkpoint, weights of one
    without a model); the message names the checkpoint and the flag."""


class OtherFrameworkError(TenplexError, ValueError):
    """A checkpoint another framework wrote (megatron-core's loaded into DeepSpeed, or the reverse)."""


@dataclass(frozen=True)
class LoadResult:
    """What a load did on this rank (the same type for every framework): ``extra`` (a read-only view of what the
    save was given as ``extra``: DeepSpeed's ``client_state``) and ``layout`` (the saved layout, typed; None where
    a foreign checkpoint records no layout of the job's type) are typed; ``metadata`` is the raw document."""

    path: str
    iteration: int  # the step the job resumes from (DeepSpeed: global steps)
    source_layout: dict[str, Any]  # the saved layout as JSON (megatron: tp/pp/dp; DeepSpeed: + zero_stage); typed: layout
    bytes_read: int  # by this rank: copied into its tensors
    bytes_filled: int  # zero-filled (new vocabulary padding rows)
    tensors: int
    seconds: float
    rng_exact: bool  # the saved RNG streams came back (same layout); else re-seeded from (seed, iteration)
    bytes_verified: int = 0  # stored bytes whose block checksums this rank checked
    bytes_unverified: int = 0  # bytes copied that no checksum covered (``verify=False``, foreign formats)
    bytes_fetched: int = 0  # read out of files by this rank, checked here, by a peer of its host or not at all
    source_format: str = "tenplex"  # or the foreign format read in place ("deepspeed")
    consumed_samples: int = 0  # the data position to resume from (DeepSpeed: global samples)
    metadata: dict[str, Any] | None = None  # raw: the checkpoint's metadata document as read (kept for compatibility)
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # what the save got as ``extra``
    layout: LayoutRecord | None = None  # the saved layout, of the job's layout type (ParallelLayout; DeepSpeed: DeepSpeedLayout)


def open_tenplex(load_dir: str, iteration: int | None, *, verify: bool,
                 metadata: CheckpointMetadata | None = None) -> Opened:
    """The newest complete tenplex checkpoint under ``load_dir`` (or ``iteration``'s: else an error listing the
    iterations there), checked and opened; ``metadata``: ``load_dir`` is the checkpoint and this is its record,
    read and checked already (by the restart's query: never found or read twice)."""
    if metadata is not None:
        path, meta = load_dir, metadata
    else:
        path = directory.find_checkpoint(load_dir) if iteration is None else checkpoint_at(load_dir, iteration)
        if path is None:
            raise CheckpointNotFoundError(f"no complete tenplex checkpoint under {load_dir}")
        meta = directory.read_checkpoint_metadata(path)  # every field checked: a malformed one is a damaged copy
    source = meta.require_ptc()
    # every file name the metadata uses is confined to the checkpoint here, before anything is read
    files = SourceFiles(path, {k: m.dtype for k, m in source.tensors.items()},
                        None if meta.files is None else dict(meta.files), verify,
                        require_checksums=meta.checksums_required,  # format 2 records block CRCs for every chunk
                        names=(sc.location.file for sc in source.chunks))
    return Opened(path, meta, source, files)


def check_scope(meta: Metadata, scope: LoadScope, where: str) -> None:
    """Refuse, before anything is copied, a load that asks for what the checkpoint does not hold: the optimizer of
    a weights-only checkpoint (``--no-save-optim``), or weights from a checkpoint without any. A foreign format
    records neither: its tensors are checked against the model's by the planner's coverage proof."""
    if not isinstance(meta, CheckpointMetadata):
        return
    if scope.optimizer and meta.weights_only:
        raise LoadScopeError(f"{where}: the checkpoint of iteration {meta.iteration} holds the weights only (saved "
                         "with --no-save-optim): load it with --no-load-optim (fresh optimizer) or --finetune")
    if scope.finetune and meta.ptc is not None and all(k.startswith("optimizer.") for k in meta.ptc.tensors):
        raise LoadScopeError(f"{where}: --finetune: the checkpoint of iteration {meta.iteration} holds no model "
                         "weights")


@dataclass(frozen=True)
class ChunksLoaded:
    """What :func:`load_chunks` did on this rank, before the engine applies the RNG policy."""

    path: str
    metadata: Metadata
    ptc: PTC
    stats: ExecStats
    tensors: int  # chunks filled


@dataclass(frozen=True)
class RankReads:
    """What one rank of a load reads, gathered before any copy: the tensors it fills (the strict check that every
    stored tensor has a reader), its host, and the shareable checksum blocks it needs (one rank per host checks each)."""

    tensors: tuple[str, ...]
    host: str | None
    blocks: tuple[Interval, ...]

    def to_json(self) -> dict[str, Any]:
        return {"tensors": list(self.tensors), "host": self.host, "blocks": [list(b) for b in self.blocks]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankReads:
        return cls(tuple(d["tensors"]), d["host"], tuple((s, lo, hi) for s, lo, hi in d["blocks"]))


@dataclass
class _Prepared:
    """One rank's state between the phases of a load."""

    opened: Opened
    chunks: list[LocalChunk]
    plan: Any
    sources: Any
    todo: list
    dst: list[torch.Tensor]
    back: list[tuple[torch.Tensor, torch.Tensor]]  # non-contiguous destinations: (live tensor, contiguous copy)
    parallel: list[Interval]  # the blocks the parallel reader would check (ranks of a host split them)
    peer_checked: frozenset[tuple[int, int]] = frozenset()  # of those, the (source, block) another rank checks


def _plan_rank(opened: Opened, describe: Callable[[Metadata], list[LocalChunk]], me: int,
               host: str) -> tuple[list[LocalChunk], Any, Any]:
    """This rank's chunks, its part of the re-sharding plan and the plan's sources: a pure function of the PTC."""
    chunks = describe(opened.metadata)
    tensors = tensor_table(chunks)
    full = plan_reshard(opened.ptc, tensors, {me: [lc.chunk for lc in chunks]}, hosts={me: host}, strict=False)
    return chunks, full.ranks[me], full.sources


def _destinations(chunks: list[LocalChunk]) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """A flat destination per chunk, plus (live tensor, contiguous copy) for those without a flat view: copied back
    after the plan runs."""
    dst: list[torch.Tensor] = []
    back: list[tuple[torch.Tensor, torch.Tensor]] = []
    for lc in chunks:
        view = lc.flat_view()
        if view is None:
            tmp = torch.empty(lc.chunk.numel, dtype=lc.data.dtype, device=lc.data.device)
            back.append((lc.data, tmp))
            view = tmp
        dst.append(view)
    return dst, back


def _open_sources(opened: Opened, chunks: list[LocalChunk], mine: Any, sources: Any, me: int) -> _Prepared:
    """Open every file this rank will read and find the blocks the parallel reader would check, before any copy."""
    maybe_fail("load.read", me)
    with plain_ops():
        todo = prepare_sources(mine, sources, opened.files, check=False)  # open every file it will read
        parallel = parallel_blocks(mine, sources, opened.files)
    dst, back = _destinations(chunks)
    return _Prepared(opened, chunks, mine, sources, todo, dst, back, parallel)


def _check_unused(p: _Prepared, ranks: list[RankReads], strict: bool, left_out: tuple[str, ...]) -> None:
    """With ``strict``, refuse a checkpoint holding tensors that no rank of this job reads (bar ``left_out``)."""
    needed = {k for r in ranks for k in r.tensors}
    unused = sorted(k for k in set(p.opened.ptc.tensors) - needed if not (left_out and k.startswith(left_out)))
    if strict and unused:
        raise PlanError(f"{p.opened.path}: the checkpoint has tensors no rank of this job holds: "
                        f"{', '.join(unused[:8])}")


def _verify_share(p: _Prepared, ranks: list[RankReads], me: int) -> None:
    """Check this rank's share of the checksum blocks its host reads (each block by one rank of the host) before
    any copy; record which of the parallel reader's blocks a peer checks instead."""
    maybe_fail("load.verify", me)
    needs = {r: list(x.blocks) for r, x in enumerate(ranks)}
    share = share_blocks(needs, {r: x.host for r, x in enumerate(ranks)}, me)
    with plain_ops():
        verify_blocks(p.opened.files, p.todo, share)
    p.peer_checked = frozenset(blocks(p.parallel)) - frozenset(blocks(share))  # the reader checks the rest


def _read_local(p: _Prepared, me: int,
                local: Callable[[Metadata, Callable[[str], torch.Tensor]], Callable[[], None] | None] | None,
                ) -> Callable[[], None] | None:
    """Read this rank's rank-local state through ``local`` (if any) before any byte is copied; returns what to call
    after ``restore``."""
    if local is None:
        return None
    files = p.opened.files  # tenplex's own files (a memory snapshot's included) read through their source
    raw = files.entry if isinstance(files, SourceFiles) else None
    return local(p.opened.metadata, rank_local.reader(p.opened.path, p.opened.metadata.rank_local, me, raw))


def _copy(p: _Prepared, me: int) -> ExecStats:
    """Run this rank's plan into its live tensors (non-contiguous ones through their copies), then close the
    files."""
    maybe_fail("load.copy", me)
    with plain_ops(), torch.no_grad():
        stats = execute_plan(p.plan, p.sources, p.opened.files, p.dst, p.peer_checked)
        for data, tmp in p.back:
            data.copy_(tmp.view(data.shape))
    p.opened.files.close()
    return stats


def _restore_state(p: _Prepared, me: int, restore: Callable[[Metadata], None],
                   apply_local: Callable[[], None] | None) -> None:
    """Restore the framework's non-tensor state, then the rank-local state read before the copy."""
    maybe_fail("load.restore", me)
    restore(p.opened.metadata)
    if apply_local is not None:
        apply_local()


def load_chunks(
    load_dir: str,
    iteration: int | None,
    describe: Callable[[Metadata], list[LocalChunk]],
    restore: Callable[[Metadata], None],
    *,
    strict: bool = True,
    verify: bool = True,
    opener: Callable[[], Opened] | None = None,
    host: str | None = None,
    fetch: Callable[[Any, tuple, Any], None] | None = None,
    local: Callable[[Metadata, Callable[[str], torch.Tensor]], Callable[[], None] | None] | None = None,
    left_out: tuple[str, ...] = (),
    metadata: CheckpointMetadata | None = None,
) -> ChunksLoaded:
    """Collective: fill this rank's live chunks from the newest complete checkpoint under ``load_dir``.

    ``describe(metadata)`` checks compatibility, allocates what must exist and
    returns the chunks to fill; ``restore(metadata)`` restores the framework's
    non-tensor state after the copy. ``strict``: refuse a checkpoint with
    tensors that no rank of this job holds. ``opener``: read another
    framework's checkpoint (default: a tenplex one). ``host``: what ranks
    sharing the stored bytes have in common (default: the host name; a node's
    memory directory for host-memory snapshots). ``fetch(plan, sources,
    files)``: a collective step between planning and opening the sources
    (host-memory snapshots: receive what other nodes hold). ``local(metadata, read)``: decides whether this
    rank's rank-local state applies and reads it (``engine/rank_local.py``) before any byte is copied; returns
    what to call after ``restore`` (or None). ``left_out``: key prefixes of stored tensors the job does not take
    back on purpose (``optimizer.`` for a weights-only load), exempt from ``strict``. ``metadata``: ``load_dir``'s
    record, read already (:func:`open_tenplex`).
    """
    me = rank()
    host = host or socket.gethostname()

    def plan() -> tuple[Opened, list[LocalChunk], Any, Any]:
        with gc_paused():  # metadata JSON, PTC and plan objects: no full collections over the job's heap meanwhile
            opened = opener() if opener is not None else open_tenplex(load_dir, iteration, verify=verify,
                                                                      metadata=metadata)
            return (opened, *_plan_rank(opened, describe, me, host))

    opened, chunks, mine, sources = run_phase(f"load from {load_dir}: planning", plan)
    if fetch is not None:
        fetch(mine, sources, opened.files)
    p = run_phase(f"load from {load_dir}: opening sources", lambda: _open_sources(opened, chunks, mine, sources, me))
    path = p.opened.path
    tensors = sorted({lc.meta.key for lc in p.chunks})
    ranks = gather_records(f"load from {path}: gathering what each rank reads",
                           lambda: RankReads(tuple(tensors), host, tuple(block_intervals(p.todo) + p.parallel)),
                           RankReads)

    def check_and_verify() -> Callable[[], None] | None:
        _check_unused(p, ranks, strict, left_out)
        _verify_share(p, ranks, me)  # checksums of every block read, before any copy
        return _read_local(p, me, local)

    apply_local = run_phase(f"load from {path}: verifying checksums", check_and_verify)
    stats = run_phase(f"load from {path}: copying", lambda: _copy(p, me))
    # only once every rank has copied: the parallel reader finds a damaged block while it copies, so a rank whose
    # share was sound would otherwise restore the non-tensor state of a copy the fallback then leaves (a learning-
    # rate scheduler's load_state_dict adds its steps: restored twice, the steps counted twice)
    run_phase(f"load from {path}: restoring state", lambda: _restore_state(p, me, restore, apply_local))
    return ChunksLoaded(path, p.opened.metadata, p.opened.ptc, stats, len(p.dst))


def load(adapter: Adapter, load_dir: str, iteration: int | None = None, *, strict: bool = True, verify: bool = True,
         opener: Callable[[], Opened] | None = None, source_format: str = "tenplex", host: str | None = None,
         fetch: Callable[[Any, tuple, Any], None] | None = None, scope: LoadScope | None = None,
         metadata: CheckpointMetadata | None = None) -> LoadResult:
    """Collective: load the newest complete checkpoint under ``load_dir`` into the adapter, re-sharded.

    ``verify``: check the CRC-32 of every stored block this rank reads from
    (only those blocks, not whole chunks). ``opener``: read a foreign format in
    place. ``host``, ``fetch``: see :func:`load_chunks`. Then the RNG policy: exact on the same layout,
    re-seeded otherwise. ``scope``: which iteration and which state (the adapter was made with the same scope:
    it leaves out the optimizer where asked); without the RNG, the job's own streams are left alone. ``metadata``:
    ``load_dir`` is the checkpoint and this its record, read already (never read twice).
    """
    t0 = time.perf_counter()
    scope = scope or LoadScope()
    iteration = scope.iteration if iteration is None else iteration

    def describe(meta: Metadata) -> list[LocalChunk]:
        found = meta.framework if isinstance(meta, CheckpointMetadata) else None
        if opener is None and found is not None and found != adapter.framework:
            raise OtherFrameworkError(f"{load_dir}: checkpoint was written by {found!r}, not by {adapter.framework!r}")
        check_scope(meta, scope, load_dir)
        return adapter.describe_for_load(meta)

    with gc_paused():  # no full collections over the job's heap while the load allocates views and plan objects
        loaded = load_chunks(load_dir, iteration, describe, adapter.restore,
                             strict=strict, verify=verify, opener=opener,
                             host=host, fetch=fetch, local=getattr(adapter, "prepare_rank_local", None),
                             left_out=() if scope.optimizer else ("optimizer.",), metadata=metadata)
    meta, stats = loaded.metadata, loaded.stats
    run_phase(f"load from {loaded.path}: finishing", lambda: adapter.after_load(meta))
    job_layout = adapter.layout()
    exact = run_phase(f"load from {loaded.path}: restoring RNG", lambda: rng.apply_policy(
        meta, job_layout.to_json(), rank(), adapter.seed, adapter.iteration(), adapter.rng_tracker)) if scope.rng else False
    source_layout = dict(meta.layout or loaded.ptc.layout)
    return LoadResult(
        path=loaded.path,
        iteration=adapter.iteration(),
        source_layout=source_layout,
        bytes_read=stats.bytes_read,
        bytes_filled=stats.bytes_filled,
        tensors=loaded.tensors,
        seconds=time.perf_counter() - t0,
        rng_exact=exact,
        bytes_verified=stats.bytes_verified,
        bytes_unverified=stats.bytes_unverified,
        bytes_fetched=stats.bytes_fetched,
        source_format=source_format,
        consumed_samples=meta.data_position,
        metadata=dict(meta.raw),
        extra=MappingProxyType(dict(meta.record("extra") or {})),
        layout=saved_layout(type(job_layout), source_layout),
    )


def saved_layout(kind: type[LayoutRecord], recorded: Mapping[str, Any]) -> LayoutRecord | None:
    """The recorded layout as ``kind`` (the job's layout type), None where it is not one (a foreign checkpoint's
    layout without the degrees the type needs)."""
    try:
        return kind.from_json(recorded)
    except (TenplexError, KeyError, TypeError, ValueError):
        return None
