"""Save a megatron-core job as a tenplex checkpoint, and load one at any new TP/PP/DP layout.

Save: every rank describes its chunks; the (tiny) chunk lists are all-gathered
as JSON; a pure assignment picks one writer per distinct chunk, balancing
bytes over its replicas; each rank writes and fsyncs its own safetensors file
at once; rank 0 writes the metadata and commits atomically.

Load: each rank plans its own part (a pure function of the saved PTC and its
chunks), checks every file it will read, then copies only the bytes it needs
straight into the live model and optimizer tensors. Errors from any rank are
raised on every rank, listing each failing rank.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tenplex_megatron.execute.collective import all_gather_json, check_all
from tenplex_megatron.execute.executor import SourceFiles, execute_plan
from tenplex_megatron.integrations import rng
from tenplex_megatron.integrations.describe import LocalChunk, describe_job
from tenplex_megatron.integrations.optimizer_state import allocate_state, optimizer_state_json, restore_optimizer_state
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.planner import PlanError, plan_reshard
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, PTCError, StoredChunk, TensorMeta, dtype_size
from tenplex_megatron.plan.writers import Holding, assign_writers
from tenplex_megatron.storage import layout as ckpt_layout
from tenplex_megatron.storage.faults import maybe_fail
from tenplex_megatron.storage.safetensors_io import CheckpointFileError, write_safetensors


@dataclass(frozen=True)
class SaveResult:
    path: str
    iteration: int
    bytes_written: int  # by this rank
    total_bytes: int
    seconds: float
    removed: tuple[str, ...] = ()  # older checkpoints deleted by retention, stale partial saves cleaned up


@dataclass(frozen=True)
class LoadResult:
    path: str
    iteration: int
    source_layout: ParallelLayout
    bytes_read: int  # by this rank
    bytes_filled: int
    tensors: int
    seconds: float
    rng_exact: bool


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _chunk_name(c: Chunk) -> str:
    name = f"{c.key}@{','.join(map(str, c.offsets))}"
    return name + (f"#{c.flat[0]}-{c.flat[1]}" if c.flat is not None else "")


def _holdings_json(rank: int, chunks: list[LocalChunk]) -> list[Any]:
    return [
        [lc.chunk.to_json(), lc.main, lc.chunk.numel * dtype_size(lc.meta.dtype), lc.meta.to_json()]
        for lc in chunks
    ]


def save_checkpoint(job: Any, save_dir: str, extra: dict[str, Any] | None = None, keep: int | None = None) -> SaveResult:
    """Collective: write the job's full state under ``save_dir/iter_NNNNNNN`` and commit it.

    ``keep``: after the commit, delete all but the newest ``keep`` complete checkpoints.
    """
    t0 = time.perf_counter()
    rank = _rank()
    iteration = job.iteration
    tensors, chunks = describe_job(job)
    gathered = all_gather_json(_holdings_json(rank, chunks))
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
    if rank == 0:
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
        if writers.get(lc.chunk) == rank:
            mine.setdefault(_chunk_name(lc.chunk), lc.data.reshape(-1))
    fname = ckpt_layout.rank_file_name(rank)
    size = 0
    sums: dict[str, int] = {}
    try:
        if mine:
            size, sums = write_safetensors(
                os.path.join(ckpt_layout.partial_dir(save_dir, iteration), fname),
                mine,
                after_write=lambda: maybe_fail("save.tensors", rank, iteration),
            )
    except (OSError, RuntimeError) as e:
        error = e
    check_all(error, f"save of iteration {iteration}: writing shards")

    info = {"rng": rng.capture(), "file": fname if mine else None, "size": size, "host": socket.gethostname(),
            "crc32": sums}
    infos = all_gather_json(info)
    path = os.path.join(save_dir, ckpt_layout.iter_dir_name(iteration))
    if rank == 0:
        try:
            stored = [
                StoredChunk(
                    c,
                    Location(ckpt_layout.rank_file_name(w), _chunk_name(c), w, infos[w]["host"],
                             infos[w]["crc32"][_chunk_name(c)]),
                )
                for c, w in writers.items()
            ]
            ptc = PTC(tensors=all_meta, chunks=tuple(stored), layout=job.layout.to_json())
            metadata = {
                "format": ckpt_layout.FORMAT_NAME,
                "format_version": ckpt_layout.FORMAT_VERSION,
                "iteration": iteration,
                "consumed_samples": job.consumed_samples,
                "layout": job.layout.to_json(),
                "model": job.spec.to_json(),
                "padded_vocab_size": job.padded_vocab_size,
                "use_distributed_optimizer": job.use_distributed_optimizer,
                "optimizer": optimizer_state_json(job.optimizer),
                "scheduler": job.scheduler.state_dict(),
                "rng": {str(r): i["rng"] for r, i in enumerate(infos)},
                "files": {i["file"]: i["size"] for i in infos if i["file"]},
                "saved_at": time.time(),
                "extra": extra or {},
                "ptc": ptc.to_json(),
            }
            path = ckpt_layout.commit(save_dir, iteration, metadata, metadata["files"],
                                      fault=lambda point: maybe_fail(point, rank, iteration))
            if keep is not None:
                removed.extend(ckpt_layout.apply_retention(save_dir, keep))
        except (OSError, ValueError, RuntimeError) as e:
            error = e
    check_all(error, f"save of iteration {iteration}: commit")
    total = sum(h.nbytes for h in holdings if writers.get(h.chunk) == h.rank)
    return SaveResult(path, iteration, size, total, time.perf_counter() - t0, tuple(removed))


def load_checkpoint(
    job: Any, load_dir: str, iteration: int | None = None, strict: bool = True, verify: bool = True
) -> LoadResult:
    """Collective: load the newest complete checkpoint under ``load_dir`` re-sharded to ``job``'s layout.

    ``verify``: check the CRC-32 of every stored chunk this rank reads (whole chunks are read for it).
    """
    t0 = time.perf_counter()
    rank = _rank()
    error: BaseException | None = None
    meta: dict[str, Any] = {}
    plan = None
    dst: list[torch.Tensor] = []
    back: list[tuple[torch.Tensor, torch.Tensor]] = []
    path = ckpt_layout.find_checkpoint(load_dir, iteration)
    files = None
    try:
        if path is None:
            raise FileNotFoundError(f"no complete tenplex checkpoint under {load_dir}")
        meta = ckpt_layout.read_metadata(path)
        source = PTC.from_json(meta["ptc"])
        allocate_state(job.optimizer)
        tensors, chunks = describe_job(job)
        full = plan_reshard(source, tensors, {rank: [lc.chunk for lc in chunks]}, hosts={rank: socket.gethostname()}, strict=False)
        plan = full.ranks[rank]
        files = SourceFiles(path, {k: m.dtype for k, m in source.tensors.items()}, meta.get("files"), verify)
        maybe_fail("load.read", rank)
        for slot in sorted({p.source for p in plan.pieces}):  # every file, entry, checksum it will read
            files.flat(full.sources[slot])
        for lc in chunks:
            view = lc.flat_view()
            if view is None:
                tmp = torch.empty(lc.chunk.numel, dtype=lc.data.dtype, device=lc.data.device)
                back.append((lc.data, tmp))
                view = tmp
            dst.append(view)
    except (OSError, ValueError, CheckpointFileError, KeyError, RuntimeError) as e:
        error = e
    check_all(error, f"load from {load_dir}: planning")
    assert plan is not None and files is not None
    needed = {k for keys in all_gather_json(sorted(tensors)) for k in keys}
    unused = sorted(set(source.tensors) - needed)
    if strict and unused:
        raise PlanError(f"{path}: the checkpoint has tensors no rank of this model holds: {', '.join(unused[:8])}")
    try:
        stats = execute_plan(plan, full.sources, files, dst)
        with torch.no_grad():
            for data, tmp in back:
                data.copy_(tmp.view(data.shape))
        files.close()
        restore_optimizer_state(job.optimizer, meta["optimizer"])
        job.scheduler.load_state_dict(meta["scheduler"])
        job.iteration = int(meta["iteration"])
        job.consumed_samples = int(meta["consumed_samples"])
    except (OSError, ValueError, CheckpointFileError, KeyError, RuntimeError) as e:
        error = e
    check_all(error, f"load from {path}: copying")
    src_layout = ParallelLayout.from_json(meta["layout"])
    exact = src_layout == job.layout and str(rank) in meta["rng"]
    if exact:
        rng.restore(meta["rng"][str(rank)])
    else:
        rng.reseed(job.spec.seed, job.iteration)
    return LoadResult(
        path=path or load_dir,
        iteration=job.iteration,
        source_layout=src_layout,
        bytes_read=stats.bytes_read,
        bytes_filled=stats.bytes_filled,
        tensors=len(dst),
        seconds=time.perf_counter() - t0,
        rng_exact=exact,
    )
