"""Framework-neutral save and load of live tensor chunks as a tenplex checkpoint.

Both megatron-core jobs and DeepSpeed engines are described as LocalChunks
(a PTC chunk plus the live tensor behind it); this module is everything after
that. Save: the (tiny) chunk lists are all-gathered as JSON; a pure assignment
picks one writer per distinct chunk, balancing bytes over its replicas; each
rank writes and fsyncs its own safetensors file at once; rank 0 writes the
metadata and commits atomically. Load: each rank plans its own part (a pure
function of the saved PTC and its chunks), checks every file it will read,
then copies only the bytes it needs straight into the live tensors. Errors
from any rank are raised on every rank, listing each failing rank.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tenplex_megatron.execute.collective import all_gather_json, check_all
from tenplex_megatron.execute.executor import (
    ExecStats,
    SourceFiles,
    block_intervals,
    execute_plan,
    prepare_sources,
    verify_blocks,
)
from tenplex_megatron.plan.gc_pause import gc_paused
from tenplex_megatron.plan.planner import PlanError, plan_reshard
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, PTCError, StoredChunk, TensorMeta, dtype_size
from tenplex_megatron.plan.verify_share import share_blocks
from tenplex_megatron.plan.writers import Holding, assign_writers
from tenplex_megatron.storage import layout as ckpt_layout
from tenplex_megatron.storage.faults import maybe_fail
from tenplex_megatron.storage.safetensors_io import BLOCK_BYTES, CheckpointFileError, write_safetensors

LOAD_ERRORS = (OSError, ValueError, CheckpointFileError, KeyError, RuntimeError)


@dataclass
class LocalChunk:
    """A chunk this rank holds and the live tensor behind it (``main``: the replica that should write it)."""

    meta: TensorMeta
    chunk: Chunk
    data: torch.Tensor
    main: bool

    def flat_view(self) -> torch.Tensor | None:
        """A writable 1-D view of the chunk's elements, or None if the tensor is not contiguous."""
        t = self.data
        if t.numel() != self.chunk.numel:
            raise PTCError(f"tensor {self.chunk.key!r}: local data has {t.numel()} elements, chunk {self.chunk.numel}")
        return t.view(-1) if t.is_contiguous() else None


@dataclass(frozen=True)
class SaveResult:
    path: str
    iteration: int
    bytes_written: int  # by this rank
    total_bytes: int
    seconds: float
    removed: tuple[str, ...] = ()  # older checkpoints deleted by retention, stale partial saves cleaned up


@dataclass(frozen=True)
class Loaded:
    """What a collection load did on this rank, before the framework restores its own non-tensor state."""

    path: str
    metadata: dict[str, Any]
    stats: ExecStats
    tensors: int


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def chunk_name(c: Chunk) -> str:
    name = f"{c.key}@{','.join(map(str, c.offsets))}"
    return name + (f"#{c.flat[0]}-{c.flat[1]}" if c.flat is not None else "")


def tensor_table(chunks: list[LocalChunk]) -> dict[str, TensorMeta]:
    """Each tensor's metadata, checking that every chunk of it agrees."""
    tensors: dict[str, TensorMeta] = {}
    for lc in chunks:
        prev = tensors.setdefault(lc.meta.key, lc.meta)
        if prev != lc.meta:
            raise PTCError(f"tensor {lc.meta.key!r}: inconsistent metadata {prev} vs {lc.meta}")
    return tensors


def _holdings_json(chunks: list[LocalChunk]) -> list[Any]:
    return [
        [lc.chunk.to_json(), lc.main, lc.chunk.numel * dtype_size(lc.meta.dtype), lc.meta.to_json()]
        for lc in chunks
    ]


def save_chunks(
    chunks: list[LocalChunk],
    save_dir: str,
    iteration: int,
    layout: dict[str, Any],
    rank_info: dict[str, Any],
    metadata: Callable[[list[dict[str, Any]]], dict[str, Any]],
    keep: int | None = None,
) -> SaveResult:
    """Collective: write every chunk once under ``save_dir/iter_NNNNNNN`` and commit it atomically.

    ``rank_info``: JSON this rank contributes (its RNG state, say); ``metadata``
    is called on rank 0 with every rank's and returns the framework's own part
    of metadata.json. ``keep``: after the commit, keep only the newest ``keep``.
    """
    t0 = time.perf_counter()
    me = rank()
    gathered = all_gather_json(_holdings_json(chunks))
    holdings = []
    all_meta: dict[str, TensorMeta] = {}
    for r, items in enumerate(gathered):
        for cj, main, nbytes, mj in items:
            chunk = Chunk.from_json(cj)
            holdings.append(Holding(r, chunk, bool(main), int(nbytes)))
            meta = TensorMeta.from_json(mj)
            prev = all_meta.setdefault(meta.key, meta)
            if prev != meta:
                raise PTCError(f"tensor {meta.key!r}: ranks disagree on its metadata ({prev} vs {meta})")
    writers = assign_writers(holdings)

    error: BaseException | None = None
    removed: list[str] = []
    if me == 0:
        try:
            for stale in ckpt_layout.partial_dirs(save_dir):  # left by a save that crashed
                shutil.rmtree(stale)
                removed.append(stale)
            ckpt_layout.prepare_partial(save_dir, iteration)
        except OSError as e:
            error = e
    check_all(error, f"save of iteration {iteration}: preparing {save_dir}")

    mine: dict[str, torch.Tensor] = {}
    for lc in chunks:
        if writers.get(lc.chunk) == me:
            mine.setdefault(chunk_name(lc.chunk), lc.data.reshape(-1))
    fname = ckpt_layout.rank_file_name(me)
    size = 0
    sums: dict[str, tuple[int, ...]] = {}
    try:
        if mine:
            size, sums = write_safetensors(
                os.path.join(ckpt_layout.partial_dir(save_dir, iteration), fname),
                mine,
                after_write=lambda: maybe_fail("save.tensors", me, iteration),
                block_bytes=BLOCK_BYTES,
            )
    except (OSError, RuntimeError) as e:
        error = e
    check_all(error, f"save of iteration {iteration}: writing shards")

    info = {"info": rank_info, "file": fname if mine else None, "size": size, "host": socket.gethostname(),
            "block_bytes": BLOCK_BYTES, "block_crc32": {name: list(crcs) for name, crcs in sums.items()}}
    infos = all_gather_json(info)
    path = os.path.join(save_dir, ckpt_layout.iter_dir_name(iteration))
    if me == 0:
        try:
            stored = [
                StoredChunk(
                    c,
                    Location(ckpt_layout.rank_file_name(w), chunk_name(c), w, infos[w]["host"],
                             block_crc32=tuple(infos[w]["block_crc32"][chunk_name(c)]),
                             block_bytes=int(infos[w]["block_bytes"])),
                )
                for c, w in writers.items()
            ]
            ptc = PTC(tensors=all_meta, chunks=tuple(stored), layout=layout)
            meta = {
                "format": ckpt_layout.FORMAT_NAME,
                "format_version": ckpt_layout.FORMAT_VERSION,
                "iteration": iteration,
                "layout": layout,
                **metadata([i["info"] for i in infos]),
                "files": {i["file"]: i["size"] for i in infos if i["file"]},
                "saved_at": time.time(),
                "ptc": ptc.to_json(),
            }
            path = ckpt_layout.commit(save_dir, iteration, meta, meta["files"],
                                      fault=lambda point: maybe_fail(point, me, iteration))
            if keep is not None:
                removed.extend(ckpt_layout.apply_retention(save_dir, keep))
        except (OSError, ValueError, RuntimeError) as e:
            error = e
    check_all(error, f"save of iteration {iteration}: commit")
    total = sum(h.nbytes for h in holdings if writers.get(h.chunk) == h.rank)
    return SaveResult(path, iteration, size, total, time.perf_counter() - t0, tuple(removed))


class Source(Protocol):
    """Hands out each stored chunk as a flat tensor (tenplex's safetensors shards, or another framework's files)."""

    readers: dict[str, Any]

    def flat(self, sc: StoredChunk) -> torch.Tensor: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Opened:
    """A checkpoint found and opened for reading: its directory, metadata, PTC and chunk source."""

    path: str
    metadata: dict[str, Any]
    ptc: PTC
    files: Source


def open_tenplex(load_dir: str, iteration: int | None, verify: bool) -> Opened:
    """The newest complete tenplex checkpoint under ``load_dir`` (or ``iteration``'s), checked and opened."""
    path = ckpt_layout.find_checkpoint(load_dir, iteration)
    if path is None:
        raise FileNotFoundError(f"no complete tenplex checkpoint under {load_dir}")
    meta = ckpt_layout.read_metadata(path)
    source = PTC.from_json(meta["ptc"])
    files = SourceFiles(path, {k: m.dtype for k, m in source.tensors.items()}, meta.get("files"), verify,
                        require_checksums=meta["format_version"] >= 2)  # format 2 records block CRCs for every chunk
    return Opened(path, meta, source, files)


def load_chunks(
    load_dir: str,
    iteration: int | None,
    describe: Callable[[dict[str, Any]], list[LocalChunk]],
    restore: Callable[[dict[str, Any]], None],
    strict: bool = True,
    verify: bool = True,
    opener: Callable[[], Opened] | None = None,
) -> Loaded:
    """Collective: fill this rank's live chunks from the newest complete checkpoint under ``load_dir``.

    ``describe(metadata)`` checks compatibility, allocates what must exist and
    returns the chunks to fill; ``restore(metadata)`` restores the framework's
    non-tensor state after the copy. An error on any rank is raised on all.
    ``strict``: refuse a checkpoint with tensors that no rank of this job holds.
    ``opener``: read another framework's checkpoint (default: a tenplex one).
    """
    me = rank()
    error: BaseException | None = None
    meta: dict[str, Any] = {}
    plan = full = files = None
    path = None
    tensors: dict[str, TensorMeta] = {}
    dst: list[torch.Tensor] = []
    back: list[tuple[torch.Tensor, torch.Tensor]] = []
    todo: list = []
    host = socket.gethostname()
    try:
        with gc_paused():  # metadata JSON, PTC and plan objects: no full collections over the job's heap meanwhile
            opened = opener() if opener is not None else open_tenplex(load_dir, iteration, verify)
            path, meta, source, files = opened.path, opened.metadata, opened.ptc, opened.files
            chunks = describe(meta)
            tensors = tensor_table(chunks)
            full = plan_reshard(source, tensors, {me: [lc.chunk for lc in chunks]}, hosts={me: host}, strict=False)
            plan = full.ranks[me]
            maybe_fail("load.read", me)
            todo = prepare_sources(plan, full.sources, files, check=False)  # open every file and entry it will read
        for lc in chunks:
            view = lc.flat_view()
            if view is None:
                tmp = torch.empty(lc.chunk.numel, dtype=lc.data.dtype, device=lc.data.device)
                back.append((lc.data, tmp))
                view = tmp
            dst.append(view)
    except (*LOAD_ERRORS, PTCError) as e:
        error = e
    check_all(error, f"load from {load_dir}: planning")
    assert plan is not None and full is not None and files is not None and path is not None
    ranks = all_gather_json({"tensors": sorted(tensors), "host": host, "blocks": block_intervals(todo)})
    needed = {k for r in ranks for k in r["tensors"]}
    unused = sorted(set(source.tensors) - needed)
    if strict and unused:
        raise PlanError(f"{path}: the checkpoint has tensors no rank of this job holds: {', '.join(unused[:8])}")
    try:  # checksums of every block read, each checked by one rank of the host that reads it, before any copy
        needs = {r: [(s, lo, hi) for s, lo, hi in x["blocks"]] for r, x in enumerate(ranks)}
        verify_blocks(files, todo, share_blocks(needs, {r: x["host"] for r, x in enumerate(ranks)}, me))
    except LOAD_ERRORS as e:
        error = e
    check_all(error, f"load from {path}: verifying checksums")
    stats = None
    try:
        stats = execute_plan(plan, full.sources, files, dst)
        with torch.no_grad():
            for data, tmp in back:
                data.copy_(tmp.view(data.shape))
        files.close()
        restore(meta)
    except LOAD_ERRORS as e:
        error = e
    check_all(error, f"load from {path}: copying")
    assert stats is not None
    return Loaded(path, meta, stats, len(dst))
