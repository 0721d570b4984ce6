"""Collective save of an adapter's chunks as a tenplex checkpoint.

The (tiny) chunk lists are all-gathered as JSON; a pure assignment picks one
writer per distinct chunk, balancing bytes over its replicas; each rank writes
and fsyncs its own safetensors file at once; rank 0 writes the metadata and
commits atomically. Every phase runs through :func:`run_phase`: a failure of
any kind on any rank is raised on every rank, naming each failing rank.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tenplex_megatron import log
from tenplex_megatron.engine import rng
from tenplex_megatron.engine.adapter import Adapter
from tenplex_megatron.engine.chunks import LocalChunk, chunk_name
from tenplex_megatron.engine.rank_local import rank_local_sections
from tenplex_megatron.engine.save_records import RankFile, RankHoldings
from tenplex_megatron.execute.collective import gather_records, rank, run_phase
from tenplex_megatron.plan.megatron_ckpt_flags import Retention
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, PTCError, StoredChunk, TensorMeta
from tenplex_megatron.plan.writers import Holding, assign_writers
from tenplex_megatron.storage import directory, lease
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata
from tenplex_megatron.storage.faults import maybe_fail
from tenplex_megatron.storage.safetensors_io import BLOCK_BYTES, write_safetensors

_log = log.get("save")


@dataclass(frozen=True)
class SaveResult:
    path: str
    iteration: int
    bytes_written: int  # by this rank
    total_bytes: int
    seconds: float
    removed: tuple[str, ...] = ()  # older checkpoints deleted by retention, stale partial saves cleaned up


def writer_assignment(gathered: list[RankHoldings]
                      ) -> tuple[list[Holding], dict[Chunk, int], dict[str, TensorMeta]]:
    """From every rank's chunk list: the holdings, one writer per distinct chunk, and every tensor's metadata
    (ranks that disagree on a tensor's are refused)."""
    holdings = []
    all_meta: dict[str, TensorMeta] = {}
    for r, rank_holdings in enumerate(gathered):
        for h in rank_holdings.held:
            holdings.append(Holding(r, h.chunk, h.main, h.nbytes))
            meta = h.meta
            prev = all_meta.setdefault(meta.key, meta)
            if prev != meta:
                raise PTCError(f"tensor {meta.key!r}: ranks disagree on its metadata ({prev} vs {meta})")
    return holdings, assign_writers(holdings), all_meta


#: an adapter's rank-local state (``Adapter.rank_local``): entry name -> (flat uint8 bytes, JSON record)
RankLocal = dict[str, tuple[torch.Tensor, dict[str, Any]]]


def describe_for_save(adapter: Adapter) -> tuple[list[LocalChunk], RankLocal]:
    """This rank's chunks and its rank-local state (the adapter's optional ``rank_local``; none without it)."""
    rank_local = getattr(adapter, "rank_local", None)  # optional: state only this rank can take back
    return adapter.describe(), (rank_local() if rank_local is not None else {})


def local_records(local: RankLocal) -> dict[str, Any]:
    """What a rank's save info carries of its rank-local state (``rank_info["rank_local"]``; empty: nothing)."""
    return {"rank_local": {name: rec for name, (_, rec) in local.items()}} if local else {}


def local_tensors(local: RankLocal) -> dict[str, torch.Tensor]:
    """The rank-local entries a rank's file holds: those with bytes (an empty one is its record alone)."""
    return {name: t for name, (t, _) in local.items() if t.numel()}


def rank_tensors(chunks: list[LocalChunk], writers: dict[Chunk, int], me: int,
                 local: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The flat tensors rank ``me`` writes to its file: each chunk the assignment gave it, once, by name, then its
    rank-local entries (:func:`local_tensors`)."""
    mine: dict[str, torch.Tensor] = {}
    for lc in chunks:
        if writers.get(lc.chunk) == me:
            mine.setdefault(chunk_name(lc.chunk), lc.data.reshape(-1))
    mine.update(local or {})
    return mine


def build_metadata(writers: dict[Chunk, int], infos: list[RankFile], all_meta: dict[str, TensorMeta],
                   layout: Mapping[str, Any], iteration: int, fields: Mapping[str, Any], path: str, *,
                   memory_job: str | None = None) -> CheckpointMetadata:
    """metadata.json of a save as its typed record: the PTC (each chunk at its writer's file, with its block CRCs),
    the files, every rank's RNG streams and rank-local sections, and ``fields``: the framework's own part."""
    stored = [
        StoredChunk(
            c,
            Location(directory.rank_file_name(w), chunk_name(c), w, infos[w].host,
                     block_crc32=tuple(infos[w].block_crc32[chunk_name(c)]),
                     block_bytes=infos[w].block_bytes),
        )
        for c, w in writers.items()
    ]
    return CheckpointMetadata.compose(
        path, iteration=iteration, layout=layout, fields=fields,
        ptc=PTC(tensors=all_meta, chunks=tuple(stored), layout=dict(layout)),
        files={i.file: i.size for i in infos if i.file}, rank_local=rank_local_sections(infos),
        rng={r: i.info["rng"] for r, i in enumerate(infos) if "rng" in i.info}, saved_at=time.time(),
        memory_job=memory_job)


def save_chunks(
    chunks: list[LocalChunk],
    save_dir: str,
    iteration: int,
    layout: Mapping[str, Any],
    rank_info: dict[str, Any],
    metadata: Callable[[list[dict[str, Any]]], Mapping[str, Any]],
    keep: int | Retention | None = None,
    local: dict[str, torch.Tensor] | None = None,
    fence: lease.Fence = lease.no_fence,
) -> SaveResult:
    """Collective: write every chunk once under ``save_dir/iter_NNNNNNN`` and commit it atomically.

    ``layout``: the job's layout as JSON. ``rank_info``: JSON this rank contributes (its RNG state under ``rng``,
    its rank-local records); ``metadata`` is called on rank 0 with every rank's and returns the framework's own
    part of metadata.json (its name under ``framework``, its adapter's record as JSON). ``keep``: after the commit, keep only the newest ``keep`` (or what a :class:`Retention` keeps).
    ``local``: this rank's rank-local entries (flat uint8, ``engine/rank_local.py``: :func:`local_tensors`),
    written in its own file; ``rank_info["rank_local"]`` holds their records (:func:`local_records`). ``fence``:
    the writer's lease, checked before every destructive step in ``save_dir`` (``storage/lease.py``).
    """
    t0 = time.perf_counter()
    me = rank()
    what = f"save of iteration {iteration} to {save_dir}"

    def local_holdings() -> RankHoldings:
        maybe_fail("save.gather", me, iteration)
        return RankHoldings.of(chunks)

    gathered = gather_records(f"{what}: gathering chunk lists", local_holdings, RankHoldings)
    removed: list[str] = []

    def prepare() -> tuple[list[Holding], dict[Chunk, int], dict[str, TensorMeta]]:
        assigned = writer_assignment(gathered)  # the same on every rank: a pure function of the gathered lists
        if me == 0:
            for stale in directory.partial_dirs(save_dir):  # left by a save that crashed
                if directory.remove_partial(stale, fence):
                    removed.append(stale)
                else:
                    _log.warning("%s: left in place: named like a staging directory of a tenplex save but "
                                 "holding other files", stale)
            directory.prepare_partial(save_dir, iteration, fence)
        return assigned

    holdings, writers, all_meta = run_phase(f"{what}: preparing the directory", prepare)

    def write() -> tuple[int, dict[str, tuple[int, ...]]]:
        mine = rank_tensors(chunks, writers, me, local)
        if not mine:
            return 0, {}
        return write_safetensors(
            os.path.join(directory.partial_dir(save_dir, iteration), directory.rank_file_name(me)),
            mine,
            after_write=lambda: maybe_fail("save.tensors", me, iteration),
            block_bytes=BLOCK_BYTES,
        )

    size, sums = run_phase(f"{what}: writing shards", write)

    def local_info() -> RankFile:
        fname = directory.rank_file_name(me) if sums else None
        return RankFile(rank_info, fname, size, socket.gethostname(), BLOCK_BYTES, sums)

    infos = gather_records(f"{what}: gathering file lists", local_info, RankFile)

    def commit() -> str:  # rank 0's work alone: every rank's shard is written and synced by now
        if me != 0:
            return os.path.join(save_dir, directory.iter_dir_name(iteration))
        maybe_fail("save.metadata_callback", me, iteration)
        target = os.path.join(save_dir, directory.iter_dir_name(iteration), directory.METADATA_FILE)
        meta = build_metadata(writers, infos, all_meta, layout, iteration,
                              metadata([dict(i.info) for i in infos]), target)
        path = directory.commit(save_dir, iteration, meta.to_json(), dict(meta.files or {}),
                                fault=lambda point: maybe_fail(point, me, iteration), fence=fence)
        if keep is not None:
            removed.extend(directory.apply_retention(save_dir, keep, fence))
        return path

    path = run_phase(f"{what}: commit", commit)
    total = sum(h.nbytes for h in holdings if writers.get(h.chunk) == h.rank)
    return SaveResult(path, iteration, size, total, time.perf_counter() - t0, tuple(removed))


def save(adapter: Adapter, save_dir: str, keep: int | Retention | None = None, *, rng_state: bool = True,
         fence: lease.Fence = lease.no_fence) -> SaveResult:
    """Collective: write the adapter's full state under ``save_dir/iter_NNNNNNN`` and commit it.

    The engine adds what every framework shares: the layout and every rank's RNG
    streams (none without ``rng_state``: ``--no-save-rng``, a load then re-seeds); the adapter adds its own
    non-tensor state (:meth:`Adapter.metadata`). ``fence``: the writer's lease (:func:`save_chunks`).
    """
    chunks, local = run_phase(f"save to {save_dir}: describing the job", lambda: describe_for_save(adapter))

    def metadata(infos: list[dict[str, Any]]) -> dict[str, Any]:
        return {"framework": adapter.framework, **adapter.metadata().to_json()}

    info = {**({"rng": rng.capture(tracker=adapter.rng_tracker)} if rng_state else {}), **local_records(local)}
    return save_chunks(chunks, save_dir, adapter.iteration(), adapter.layout().to_json(), info, metadata, keep,
                       local_tensors(local), fence)
