"""Check a tenplex checkpoint without loading it: every stored byte against its CRC-32s, every file, every tensor.

``python -m tenplex_megatron verify`` runs this: no torch, no torch.distributed,
no model. It confines every file name the metadata uses, checks that the stored
chunks partition each tensor (no overlap, no gap), that every file is there at
its recorded size with a valid safetensors header holding each chunk at the
right dtype and size, and reads every stored chunk's bytes (and every rank-local
entry's: Transformer Engine's extra state) to check each block checksum. Files are memory-mapped and the CRC runs straight over the mapped
pages (no copy: warm, faster than a ``pread`` into a buffer here), in threads (the CRC
releases the GIL, page faults included), spans of up to 16 MiB in file order,
each announced to the kernel (``MADV_WILLNEED``) as it starts. Every problem
found is reported, naming the file and the tensor; nothing stops at the first.
A file truncated by someone else *while* it is being checked ends the process
with SIGBUS, as any memory-mapped read does.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from tenplex_megatron.plan.experts import ExpertSummary, expert_summary
from tenplex_megatron.plan.planner import partition_errors
from tenplex_megatron.plan.ptc import PTC, PTCError, StoredChunk, dtype_size
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata
from tenplex_megatron.storage.checksum import crc32
from tenplex_megatron.storage.confine import confine
from tenplex_megatron.storage.cpus import usable_cpus
from tenplex_megatron.storage.directory import (
    FORMAT_NAME,
    METADATA_FILE,
    read_checkpoint_metadata,
    tracker_iteration,
)
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.formats import load_metadata_json
from tenplex_megatron.storage.safetensors_header import TensorEntry, read_header

SPAN_BYTES = 16 << 20  # one task of a thread: whole blocks up to this size
_ITER_RE = re.compile(r"iter_([0-9]{7,})")


@dataclass(frozen=True)
class Damage:
    """One problem: the file (relative to the checkpoint; ``metadata.json`` for the metadata), the tensors it
    affects (stored name and tensor key) and why."""

    file: str
    tensors: tuple[str, ...]
    why: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "tensors": list(self.tensors), "why": self.why}


@dataclass(frozen=True)
class CheckReport:
    """What :func:`verify_checkpoint` checked in one checkpoint directory, and every problem it found."""

    path: str
    iteration: int | None
    files: int  # files the metadata names
    tensors: int
    chunks: int  # stored chunks
    bytes_stored: int  # bytes of every stored chunk
    bytes_checked: int  # bytes read and compared with a recorded checksum
    blocks: int  # checksums compared
    seconds: float
    threads: int
    damage: tuple[Damage, ...]
    experts: ExpertSummary | None = None  # a mixture of experts' count, EP / expert TP / expert DP, missing experts

    @property
    def ok(self) -> bool:
        return not self.damage

    @property
    def gb_per_s(self) -> float:
        return self.bytes_checked / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def damaged_files(self) -> list[str]:
        return sorted({d.file for d in self.damage})

    def damaged_tensors(self) -> list[str]:
        return sorted({t for d in self.damage for t in d.tensors})

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "iteration": self.iteration, "ok": self.ok, "files": self.files,
                "tensors": self.tensors, "chunks": self.chunks, "bytes_stored": self.bytes_stored,
                "bytes_checked": self.bytes_checked, "blocks": self.blocks, "seconds": self.seconds,
                "gb_per_s": self.gb_per_s, "threads": self.threads,
                "damaged_files": self.damaged_files(), "damaged_tensors": self.damaged_tensors(),
                "damage": [d.to_json() for d in self.damage],
                "experts": self.experts.to_json() if self.experts is not None else None}


@dataclass(frozen=True)
class _Span:
    """Consecutive checksum blocks of one stored chunk, read in one go: file offsets ``[start, stop)``."""

    file: str
    label: str  # "tensor 'name' (of 'key')"
    key: str
    start: int
    stop: int
    block_bytes: int  # a whole-chunk checksum (format 1): the chunk's size
    first_block: int  # index of the first block in the chunk; -1: one checksum of the whole chunk
    sums: tuple[int, ...]


def _label(sc: StoredChunk) -> str:
    return f"tensor {sc.location.name!r} (of {sc.chunk.key!r})"


def _spans(sc: StoredChunk, entry: TensorEntry, nbytes: int) -> list[_Span]:
    loc = sc.location
    if loc.block_crc32 is not None and loc.block_bytes is not None:
        size, sums = loc.block_bytes, loc.block_crc32
        per = max(1, SPAN_BYTES // size)
        return [_Span(loc.file, _label(sc), sc.chunk.key, entry.begin + i * size,
                      min(entry.begin + (i + per) * size, entry.end), size, i, tuple(sums[i : i + per]))
                for i in range(0, len(sums), per)]
    assert loc.crc32 is not None
    return [_Span(loc.file, _label(sc), sc.chunk.key, entry.begin, entry.end, max(nbytes, 1), -1, (loc.crc32,))]


def _check_span(m: mmap.mmap, sp: _Span) -> tuple[int, list[Damage]]:
    """Compare each block's CRC-32 in ``sp`` of mapped file ``m``; returns the bytes checked and the damage found."""
    page = mmap.PAGESIZE
    start = sp.start // page * page
    m.madvise(mmap.MADV_WILLNEED, start, sp.stop - start)
    bad: list[Damage] = []
    with memoryview(m) as mv:
        for i, expected in enumerate(sp.sums):
            a = sp.start + i * sp.block_bytes
            b = min(a + sp.block_bytes, sp.stop)
            with mv[a:b] as block:
                crc = crc32(block)
            if crc != expected:
                bad.append(Damage(sp.file, (sp.key,), _mismatch(sp, i, b - a, crc)))
    return sp.stop - sp.start, bad


def _mismatch(sp: _Span, block: int, length: int, crc: int) -> str:
    expected = sp.sums[block]
    if sp.first_block < 0:
        return f"{sp.file}: {sp.label} fails its checksum (crc32 {crc:#010x}, recorded {expected:#010x})"
    b = sp.first_block + block
    start = b * sp.block_bytes
    return (f"{sp.file}: {sp.label} fails its checksum in block {b} (bytes {start}-{start + length} of the tensor, "
            f"crc32 {crc:#010x}, recorded {expected:#010x})")


class _Checker:
    """One checkpoint's checks, gathered as :class:`Damage` instead of raised."""

    def __init__(self, path: str):
        self.path = path
        self.damage: list[Damage] = []

    def bad(self, file: str, chunks: list[StoredChunk] | tuple[str, ...], why: str) -> None:
        tensors = chunks if isinstance(chunks, tuple) else tuple(sorted({sc.chunk.key for sc in chunks}))
        self.damage.append(Damage(file, tensors, why))

    def file_entries(self, name: str, path: str, recorded: int | None, chunks: list[StoredChunk], *,
                     needed: bool = False) -> tuple[dict[str, TensorEntry], int] | None:
        """Stat and parse one file; None (with the damage noted) when its chunks cannot be read. ``needed``: parse
        it even without chunks (it holds rank-local entries)."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self.bad(name, chunks, f"{name}: file is missing" + _holding(chunks))
            return None
        except OSError as e:
            self.bad(name, chunks, f"{name}: cannot be read ({e.strerror})")
            return None
        if not os.path.isfile(path):
            self.bad(name, chunks, f"{name}: not a regular file")
            return None
        if recorded is not None and st.st_size != recorded:
            self.bad(name, chunks, f"{name}: size {st.st_size} bytes, the metadata recorded {recorded} "
                                   "(damaged or truncated)")
        if not chunks and not needed:
            return None
        try:
            return read_header(path, allow_truncated=True)
        except (CheckpointFileError, OSError) as e:
            self.bad(name, chunks, f"{name}: {str(e).removeprefix(path + ': ')}" + _holding(chunks))
            return None

    def chunk_spans(self, name: str, entries: dict[str, TensorEntry], size: int, sc: StoredChunk, dtype: str,
                    require: bool) -> list[_Span]:
        """Check one stored chunk against its header entry; its read spans if its bytes are there."""
        loc, label = sc.location, _label(sc)
        entry = entries.get(loc.name)
        if entry is None:
            self.bad(name, [sc], f"{name}: {label} is not in the file")
            return []
        numel = math.prod(entry.shape)
        if entry.dtype != dtype or numel != sc.chunk.numel:
            self.bad(name, [sc], f"{name}: {label} is {entry.dtype} x {numel} in the file, the metadata says "
                                 f"{dtype} x {sc.chunk.numel}")
            return []
        if entry.end > size:
            self.bad(name, [sc], f"{name}: {label}: data ends at byte {entry.end} but the file has {size} "
                                 "(truncated file)")
            return []
        nbytes = entry.end - entry.begin
        if loc.block_crc32 is not None and loc.block_bytes is not None:
            want = -(-nbytes // loc.block_bytes)
            if len(loc.block_crc32) != want:
                self.bad(METADATA_FILE, [sc], f"{name}: {label}: the metadata records {len(loc.block_crc32)} block "
                                              f"checksums, its {nbytes} bytes make {want} blocks of {loc.block_bytes}")
                return []
        elif loc.crc32 is None:
            if require:
                self.bad(METADATA_FILE, [sc], f"{name}: {label}: no checksum recorded in the metadata")
            return []
        if nbytes == 0:
            if loc.crc32 not in (None, 0):
                self.bad(name, [sc], f"{name}: {label} is empty but its recorded crc32 is {loc.crc32:#010x}")
            return []
        return _spans(sc, entry, nbytes)


    def local_spans(self, name: str, entries: dict[str, TensorEntry], size: int, entry: _LocalEntry) -> list[_Span]:
        """Check one rank-local entry (Transformer Engine's extra state) against its header entry and recorded block
        CRC-32s; its read spans if its bytes are there. Nothing in it is unpickled."""
        label = f"rank {entry.rank}'s rank-local entry {entry.name!r}"
        found = entries.get(entry.name)
        if found is None:
            self.bad(name, (entry.name,), f"{name}: {label} is not in the file")
            return []
        nbytes = found.end - found.begin
        if found.dtype != "uint8" or nbytes != entry.nbytes:
            self.bad(name, (entry.name,), f"{name}: {label} is {found.dtype} x {math.prod(found.shape)} in the file, "
                                          f"the metadata says uint8 x {entry.nbytes}")
            return []
        if found.end > size:
            self.bad(name, (entry.name,), f"{name}: {label}: data ends at byte {found.end} but the file has {size} "
                                          "(truncated file)")
            return []
        want = -(-nbytes // entry.block_bytes)
        if len(entry.sums) != want:
            self.bad(METADATA_FILE, (entry.name,), f"{name}: {label}: the metadata records {len(entry.sums)} block "
                                                   f"checksums, its {nbytes} bytes make {want} blocks of "
                                                   f"{entry.block_bytes}")
            return []
        per = max(1, SPAN_BYTES // entry.block_bytes)
        return [_Span(name, label, entry.name, found.begin + i * entry.block_bytes,
                      min(found.begin + (i + per) * entry.block_bytes, found.end), entry.block_bytes, i,
                      entry.sums[i : i + per]) for i in range(0, len(entry.sums), per)]


@dataclass(frozen=True)
class _LocalEntry:
    """One rank-local entry as metadata.json's ``rank_local`` section records it."""

    rank: int
    name: str
    nbytes: int
    block_bytes: int
    sums: tuple[int, ...]


def _local_entries(meta: CheckpointMetadata) -> dict[str, list[_LocalEntry]]:
    """The rank-local entries with bytes, by file (each record checked when the metadata was read)."""
    out: dict[str, list[_LocalEntry]] = defaultdict(list)
    for rank, sec in sorted(meta.rank_local.items()):
        if sec.file is not None:
            out[sec.file].extend(_LocalEntry(rank, e.name, e.nbytes, sec.block_bytes, e.block_crc32)
                                 for _, e in sorted(sec.entries.items()) if e.nbytes > 0)
    return out


def _holding(chunks: list[StoredChunk]) -> str:
    return f" (it holds {len(chunks)} stored chunks)" if chunks else ""


def default_workers() -> int:
    """The CPUs this process may use (its affinity, capped by its cgroup's quota): the reads and checksums use them
    all."""
    return usable_cpus()


def _check_metadata(ck: _Checker, meta: CheckpointMetadata, ptc: PTC) -> ExpertSummary | None:
    """Report the PTC's partition errors and routed experts not stored in full; returns the experts' summary."""
    for key, why in partition_errors(ptc).items():
        ck.bad(METADATA_FILE, (key,), why)
    experts = expert_summary(ptc, None if meta.layout is None else dict(meta.layout))
    for key, pairs in (experts.missing if experts is not None else {}).items():
        if pairs:
            shown = ", ".join(f"layer {layer} expert {e}" for layer, e in pairs[:8])
            ck.bad(METADATA_FILE, (key,), f"tensor {key!r}: {len(pairs)} routed expert(s) not stored in full: {shown}"
                   + (", ..." if len(pairs) > 8 else ""))
    return experts


def _file_spans(ck: _Checker, path: str, meta: CheckpointMetadata, ptc: PTC, name: str, chunks: list[StoredChunk],
                local: list[_LocalEntry], maps: dict[str, mmap.mmap]) -> list[_Span]:
    """The spans to check in file ``name`` (its chunks' and its rank-local entries'), the file mapped into ``maps``
    when there are any; a file that cannot be confined, read or mapped is reported and yields none."""
    recorded = meta.files or {}
    try:
        full = confine(path, name)
    except CheckpointFileError as e:
        ck.bad(name, chunks, str(e).removeprefix(path + ": "))
        return []
    if name not in recorded and meta.checksums_required:
        ck.bad(METADATA_FILE, chunks, f"{name}: not in the metadata's 'files' (its size is not recorded)")
    got = ck.file_entries(name, full, recorded.get(name), chunks, needed=bool(local))
    if got is None:
        return []
    entries, size = got
    mine = [s for sc in chunks for s in ck.chunk_spans(name, entries, size, sc, ptc.tensors[sc.chunk.key].dtype,
                                                      meta.checksums_required)]
    mine += [s for e in local for s in ck.local_spans(name, entries, size, e)]
    if mine:
        try:
            with open(full, "rb") as f:
                maps[name] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            ck.bad(name, chunks, f"{name}: cannot be mapped ({e})")
            return []
        maps[name].madvise(mmap.MADV_SEQUENTIAL)
    return mine


def _check_spans(ck: _Checker, spans: list[_Span], maps: dict[str, mmap.mmap], workers: int,
                 progress: Callable[[int, int], None] | None) -> tuple[int, int]:
    """Check every span's checksums on ``workers`` threads, damage into ``ck``; returns the bytes and blocks
    checked."""
    total = sum(s.stop - s.start for s in spans)
    done = blocks = 0
    with ThreadPoolExecutor(min(workers, max(1, len(spans)))) as pool:
        futures = {pool.submit(_check_span, maps[s.file], s): s for s in spans}
        for fut in as_completed(futures):
            sp = futures[fut]
            try:
                nbytes, bad = fut.result()
            except OSError as e:
                nbytes, bad = 0, [Damage(sp.file, (sp.key,), f"{sp.file}: {sp.label}: read error ({e.strerror})")]
            ck.damage.extend(bad)
            done += nbytes
            blocks += len(sp.sums)
            if progress is not None:
                progress(done, total)
    return done, blocks


def verify_checkpoint(path: str, workers: int | None = None,
                      progress: Callable[[int, int], None] | None = None) -> CheckReport:
    """Check checkpoint directory ``path`` (see the module doc); ``progress(bytes_done, bytes_total)`` is called
    after each span. Never raises for a damaged checkpoint: the report lists every problem."""
    t0 = time.perf_counter()
    workers = max(1, workers or default_workers())
    ck = _Checker(path)

    def report(files: int = 0, tensors: int = 0, chunks: int = 0, stored: int = 0, checked: int = 0,
               blocks: int = 0, iteration: int | None = None, experts: ExpertSummary | None = None) -> CheckReport:
        return CheckReport(path, iteration, files, tensors, chunks, stored, checked, blocks,
                           time.perf_counter() - t0, workers, tuple(ck.damage), experts)

    try:
        meta = read_checkpoint_metadata(path)
        ptc = meta.require_ptc()
    except (CheckpointFileError, PTCError) as e:
        ck.bad(METADATA_FILE, (), str(e).removeprefix(os.path.join(path, METADATA_FILE) + ": "))
        return report()
    experts = _check_metadata(ck, meta, ptc)
    by_file: dict[str, list[StoredChunk]] = defaultdict(list)
    for sc in ptc.chunks:
        by_file[sc.location.file].append(sc)
    local = _local_entries(meta)
    names = sorted(set(meta.files or {}) | set(by_file) | set(local))
    spans: list[_Span] = []
    maps: dict[str, mmap.mmap] = {}
    stored = sum(sc.chunk.numel * dtype_size(ptc.tensors[sc.chunk.key].dtype) for sc in ptc.chunks)
    try:
        for name in names:
            spans.extend(_file_spans(ck, path, meta, ptc, name, by_file.get(name, []), local.get(name, []), maps))
        done, blocks = _check_spans(ck, spans, maps, workers, progress)
    finally:
        for m in maps.values():
            m.close()
    ck.damage.sort(key=lambda d: (d.file, d.why))
    return report(len(names), len(ptc.tensors), len(ptc.chunks), stored, done, blocks, meta.iteration, experts)


def checkpoints_in(path: str, every: bool) -> list[str]:
    """The checkpoint directories ``verify`` checks under ``path``.

    ``path`` itself if it is one (it holds a ``metadata.json``); else its real
    ``iter_NNNNNNN`` directories whose ``metadata.json`` is tenplex's or unreadable
    (a damaged copy: a load would skip it silently, ``verify`` reports it), all of
    them with ``every``, otherwise the tracker's, or the newest.
    """
    if os.path.lexists(os.path.join(path, METADATA_FILE)):  # a FIFO or a link out too: a damaged copy
        return [path]
    found: list[tuple[int, str]] = []
    if os.path.isdir(path):
        for name in os.listdir(path):
            m = _ITER_RE.fullmatch(name)
            full = os.path.join(path, name)
            if m and os.path.isdir(full) and not os.path.islink(full) and _ours_or_damaged(full):
                found.append((int(m.group(1)), full))
    found.sort()
    if every or not found:
        return [p for _, p in found]
    try:
        it = tracker_iteration(path)
    except CheckpointFileError:  # not a regular file: the newest copy instead
        it = None
    named = [p for i, p in found if i == it]
    return named or [found[-1][1]]


def _ours_or_damaged(ckpt: str) -> bool:
    """A tenplex checkpoint, or one whose ``metadata.json`` is unreadable (a damaged copy); not another format's."""
    if not os.path.lexists(os.path.join(ckpt, METADATA_FILE)):
        return False  # a save that never committed, or nothing of ours
    try:
        meta = load_metadata_json(ckpt)  # bounded: confined, a regular file, capped
    except (OSError, CheckpointFileError):
        return True
    # megatron-core's torch_dist writes a metadata.json too (naming its sharded backend): not ours; any other is a
    # tenplex copy, damaged unless it reads (``storage/copies.py`` counts the same ones)
    return not isinstance(meta, dict) or meta.get("format") == FORMAT_NAME or "sharded_backend" not in meta


__all__ = ["CheckReport", "Damage", "checkpoints_in", "default_workers", "verify_checkpoint"]
