"""One rank's share of a GPT state re-sharded into device memory at a TP change, and saved and snapshotted back,
against the machine's limits measured in the same run.

For each model (``plan/sim/models.json``) it writes, with the real writer, the
source chunks that destination rank ``--rank`` of ``--dst`` reads from a
checkpoint at ``--src`` (bf16 weights, fp32 main weights, Adam moments;
megatron-core's N-D optimizer layout), then loads that share into tensors on
``--device`` (each system its own, written once before: a model's tensors
exist before a load fills them), each system ``--reps`` times (round-robin),
from the page cache (warm) and after evicting the files from it (cold: from
storage):
  parallel  tenplex's parallel reader (TENPLEX_STAGING=parallel, the default: reader threads, preadv into one ring);
  staged    tenplex through staging buffers on one host thread (TENPLEX_STAGING=copy);
  direct    tenplex's per-piece copies from the file's map (TENPLEX_STAGING=direct);
  mcore     megatron-core dist_checkpointing (torch_dist) saving the same source chunks, loading the same share.
The limits, measured in the same run: a sequential read of the files from
storage; the reader threads' ``preadv`` of as many bytes of the files as the
destination holds, into one buffer of that size, from storage (cold) and from
the page cache (warm); pinned host-to-device and device-to-host copies
(on the CPU: host memory copies); write + fsync and a copy into /dev/shm by
the same threads. Then the loaded share is saved (safetensors, fsync) and
snapshotted into /dev/shm by each tenplex writer (``--no-writes``: not).
GB/s are destination bytes over the median time. Checksums are verified (as a
load does by default). Prints a table and ``RATIO`` lines: ``load_bandwidth_{warm,cold} <model>:<transition>
<system>/limit`` (warm: against the lower of the parallel page-cache read and host-to-device; cold: of the
parallel cold read and host-to-device; on the CPU, where nothing crosses to a device, the reads alone),
``load_time_... parallel/<peer>`` (below 1: parallel is faster) and
``{save,snapshot}_bandwidth ... <system>/limit`` (against write + fsync, and the copy into /dev/shm).

    python -m benchmarks.gpu_reshard                                  # GPU 0: gpt3-1.3b, 2.7b, 6.7b, TP2 -> TP4
    python -m benchmarks.gpu_reshard --device cuda:0 --models gpt3-1.3b gpt3-2.7b --reps 1   # scripts/gpu_check.sh
    python -m benchmarks.gpu_reshard --device cpu --models gpt3-350m --reps 3 --systems parallel staged direct mcore
    python -m benchmarks.gpu_reshard --models gpt3-6.7b --src 2,2,1 --dst 4,2,1   # less disk: one PP stage
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import statistics
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from benchmarks.kit.disk import evict_page_cache
from benchmarks.kit.report import machine, ratio_line
from tenplex_megatron.execute.executor import execute_plan, prepare_sources
from tenplex_megatron.memory import shm_write
from tenplex_megatron.plan.layout import ParallelLayout, padded_vocab_size, restart_padded_vocab_size
from tenplex_megatron.plan.planner import RankPlan, plan_reshard
from tenplex_megatron.plan.ptc import PTC, Chunk, StoredChunk, TensorMeta
from tenplex_megatron.plan.sim.gpt_catalogue import gpt_tensors, load_model
from tenplex_megatron.plan.sim.sharding import layout_chunks, resize_vocab, source_from_layout
from tenplex_megatron.storage.parallel_read import RUN_BYTES, default_threads
from tenplex_megatron.storage.safetensors_io import BLOCK_BYTES, TORCH_DTYPES, write_safetensors
from tenplex_megatron.storage.source_files import SourceFiles

MODELS = ["gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b"]
SYSTEMS = ["parallel", "staged", "direct", "mcore"]
GB = 1e9


def parse_device(text: str) -> torch.device:
    """``--device``: ``cpu``, or a CUDA device with an explicit index (``cuda`` means ``cuda:0``).

    ``torch.cuda.set_device`` and the CUDA calls after it want an index: a bare
    ``torch.device("cuda")`` made ``set_device`` raise. An index past the GPUs
    this machine has is refused here, by name.
    """
    try:
        device = torch.device(text.strip())
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda, cuda:N)") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r}: only cpu and cuda devices are benchmarked")
    device = torch.device("cuda", 0 if device.index is None else device.index)
    if torch.cuda.is_available() and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _layout(text: str) -> ParallelLayout:
    tp, pp, dp = (int(x) for x in text.split(","))
    return ParallelLayout(tp, pp, dp)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Share:
    """The source files written for one destination rank and that rank's plan."""

    root: str
    tensors: dict[str, TensorMeta]
    source: PTC
    plan: RankPlan
    sources: tuple[StoredChunk, ...]
    dst_bytes: int
    file_bytes: int


def write_share(root: str, model: str, src: ParallelLayout, dst: ParallelLayout, rank: int) -> Share:
    """Write (random bytes, real writer, block CRCs) every source chunk the destination rank reads."""
    dims = load_model(model)
    saved = padded_vocab_size(dims.vocab_size, 128, src.tp)
    tensors = gpt_tensors(dims, saved)
    full = source_from_layout(tensors, src, False)
    dst_tensors = resize_vocab(tensors, restart_padded_vocab_size(dims.vocab_size, 128, dst.tp, saved))
    want = layout_chunks(dst_tensors, dst, False)[rank]
    plan = plan_reshard(full, dst_tensors, {rank: want}, strict=False)
    used = {plan.sources[p.source] for p in plan.ranks[rank].pieces}
    by_file: dict[str, list[StoredChunk]] = defaultdict(list)
    for sc in used:
        by_file[sc.location.file].append(sc)
    pattern = torch.randint(0, 256, (1 << 24,), dtype=torch.uint8)
    stored = []
    for fname, scs in sorted(by_file.items()):
        blobs = {}
        for sc in scs:
            t = torch.empty(sc.chunk.numel, dtype=TORCH_DTYPES[tensors[sc.chunk.key].dtype])
            raw = t.view(torch.uint8)
            for lo in range(0, raw.numel(), pattern.numel()):
                n = min(pattern.numel(), raw.numel() - lo)
                raw[lo : lo + n] = pattern[:n]
            blobs[sc.location.name] = t
        _, sums = write_safetensors(os.path.join(root, fname), blobs)
        del blobs
        for sc in scs:
            loc = dataclasses.replace(sc.location, block_crc32=sums[sc.location.name], block_bytes=BLOCK_BYTES)
            stored.append(StoredChunk(sc.chunk, loc))
    written = {sc.chunk: sc for sc in stored}  # the rest of the checkpoint stays unwritten: the plan never reads it
    source = PTC(tensors, tuple(written.get(sc.chunk, sc) for sc in full.chunks), full.layout)
    plan = plan_reshard(source, dst_tensors, {rank: want}, strict=False)
    rp = plan.ranks[rank]
    if any(plan.sources[p.source].location.block_crc32 is None for p in rp.pieces):
        raise RuntimeError("the plan reads a chunk that was not written")
    dst_bytes = sum(c.numel * TORCH_DTYPES[dst_tensors[c.key].dtype].itemsize for c in rp.chunks)
    files = sum(os.path.getsize(os.path.join(root, f)) for f in by_file)
    return Share(root, dst_tensors, source, rp, plan.sources, dst_bytes, files)


def destination(share: Share, device: torch.device) -> list[torch.Tensor]:
    """One flat tensor per destination chunk, its memory written once (a model's tensors exist before a load
    fills them: no load is timed faulting in fresh pages)."""
    return [torch.zeros(c.numel, dtype=TORCH_DTYPES[share.tensors[c.key].dtype], device=device)
            for c in share.plan.chunks]


def tenplex_load(share: Share, device: torch.device, mode: str) -> Callable[[], list[torch.Tensor]]:
    """The timed load of the share through ``TENPLEX_STAGING=mode`` into the system's own destination tensors."""
    out = destination(share, device)

    def run() -> list[torch.Tensor]:
        os.environ["TENPLEX_STAGING"] = mode
        files = SourceFiles(share.root, {k: m.dtype for k, m in share.tensors.items()}, verify=True)
        try:
            prepare_sources(share.plan, share.sources, files)  # checksums first, as engine.load does
            execute_plan(share.plan, share.sources, files, out)
            _sync(device)
        finally:
            files.close()
        return out
    return run


def _rank_offsets(c: Chunk, meta: TensorMeta) -> list[tuple[int, int, int]] | None:
    out = []
    for axis, (o, n, g) in enumerate(zip(c.offsets, c.shape, meta.global_shape)):
        if n != g:
            if g % n or o % n:
                return None
            out.append((axis, o // n, g // n))
    return out


def _sharded(chunks: list[Chunk], tensors: dict[str, TensorMeta], make: Callable[[Chunk], torch.Tensor]) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    sd: dict[str, Any] = {}
    for i, c in enumerate(chunks):
        offs = _rank_offsets(c, tensors[c.key])
        if c.flat is not None or offs is None:
            raise ValueError(f"{c.key}: a chunk megatron-core cannot describe by rank offsets")
        sd[f"{c.key}.{i}"] = ShardedTensor.from_rank_offsets(c.key, make(c), *offs, replica_id=0)
    return sd


def mcore_setup(share: Share, root: str, device: torch.device) -> Callable[[], list[torch.Tensor]]:
    """Save the share's source chunks with megatron-core dist_checkpointing; return the timed load of the share."""
    from megatron.core import dist_checkpointing

    files = SourceFiles(share.root, {k: m.dtype for k, m in share.tensors.items()}, verify=False)
    written = {sc.chunk: sc for sc in share.source.chunks if sc.location.block_crc32 is not None}
    sd = _sharded(list(written), share.tensors, lambda c: files.flat(written[c]).view(c.shape))
    os.makedirs(root, exist_ok=True)
    with _no_cuda_sync(device):
        dist_checkpointing.save(sd, root, validate_access_integrity=False)
    files.close()

    chunks = list(share.plan.chunks)
    mine = [t.view(c.shape) for t, c in zip(destination(share, device), chunks)]

    def run() -> list[torch.Tensor]:
        dst = iter(mine)  # _sharded makes the chunks' tensors in order
        want = _sharded(chunks, share.tensors, lambda c: next(dst))
        with _no_cuda_sync(device):
            got = dist_checkpointing.load(want, root, validate_access_integrity=False)
        _sync(device)
        return [got[f"{c.key}.{i}"].reshape(-1) for i, c in enumerate(chunks)]
    return run


@contextlib.contextmanager
def _no_cuda_sync(device: torch.device) -> Iterator[None]:
    """On the CPU, megatron-core's save calls ``torch.cuda.synchronize()`` and ``current_device()``: redirected for
    the call (nothing else is, unlike the trainer's ``cpu_shim``, whose torch-function mode would slow every other system)."""
    if device.type == "cuda":
        yield
        return
    real = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = real  # type: ignore[assignment]


def seq_read(root: str) -> tuple[float, int]:
    """Seconds to read every file under ``root`` sequentially from storage (page cache evicted), and the bytes."""
    total = evict_page_cache(root)
    buf = bytearray(64 << 20)
    t0 = time.perf_counter()
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            continue
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0, total


def h2d(device: torch.device, nbytes: int, reps: int = 5) -> float:
    """GB/s of a pinned host buffer copied to the device (on the CPU: into another host buffer)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda").fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dev.copy_(host, non_blocking=True)
    _sync(device)
    return reps * nbytes / (time.perf_counter() - t0) / GB


def parallel_read_gbps(root: str, threads: int, cold: bool, nbytes: int, chunk: int = RUN_BYTES) -> float:
    """GB/s of the first ``nbytes`` of the files under ``root`` (the destination's size: the bytes a load must
    move) read by ``threads`` threads with ``os.preadv`` of ``chunk`` bytes into one host buffer of that size,
    written once before (memory, not a few buffers the CPU's caches hold), from storage (``cold``: page cache
    evicted) or the page cache (after one untimed read): the machine's limit for the parallel reader."""
    paths = sorted(os.path.join(root, n) for n in os.listdir(root) if os.path.isfile(os.path.join(root, n)))
    tasks, at = [], 0  # (file, offset in it, bytes, offset in the buffer)
    for p in paths:
        for off in range(0, os.path.getsize(p), chunk):
            n = min(chunk, os.path.getsize(p) - off, nbytes - at)
            if n > 0:
                tasks.append((p, off, n, at))
                at += n
    buf = np.ones(at, dtype=np.uint8)
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}

    def worker(k: int) -> None:
        view = memoryview(buf)
        for path, off, n, to in tasks[k::threads]:
            got = 0
            while got < n:
                r = os.preadv(fds[path], [view[to + got : to + n]], off + got)
                if r == 0:
                    break
                got += r

    try:
        def once() -> float:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(worker, range(threads)))
            return time.perf_counter() - t0
        if cold:
            evict_page_cache(root)
        else:
            once()
        secs = once()
    finally:
        for fd in fds.values():
            os.close(fd)
    return at / secs / GB


def write_limit(root: str, nbytes: int, threads: int, fsync: bool, reps: int = 3) -> float:
    """GB/s of ``nbytes`` from a host buffer written into a new file under ``root`` by ``threads`` threads with
    ``os.pwrite`` of :data:`RUN_BYTES` and, with ``fsync``, one fsync, the median of ``reps`` (timed as the
    writers are): the machine's limit for a save (storage) or a snapshot (``root`` in node memory)."""
    buf = torch.ones(min(nbytes, 256 << 20), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    view = memoryview(buf.numpy())
    path = os.path.join(root, f"limit-{os.getpid()}.bin")
    tasks = [(off, min(RUN_BYTES, nbytes - off)) for off in range(0, nbytes, RUN_BYTES)]

    def worker(fd: int, k: int) -> None:
        for off, n in tasks[k::threads]:
            src = off % len(view)
            n = min(n, len(view) - src)
            done = 0
            while done < n:
                done += os.pwrite(fd, view[src + done : src + n], off + done)

    times = []
    try:
        for _ in range(max(1, reps)):
            t0 = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(worker, [fd] * threads, range(threads)))
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            times.append(time.perf_counter() - t0)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return nbytes / statistics.median(times) / GB


def bench_writes(out: list[torch.Tensor], root: str, device: torch.device, systems: list[str], reps: int,
                 row: dict[str, Any]) -> None:
    """The share's loaded tensors saved (safetensors, fsync) under ``root`` and snapshotted into /dev/shm by each
    writer (``parallel``: writer threads; ``staged``: the staging ring; ``direct``: a write per tensor), beside the
    limits; the files each writes are compared byte for byte."""
    tensors = {f"t{i}": t for i, t in enumerate(out)}
    nbytes = sum(t.numel() * t.element_size() for t in out)
    threads = default_threads()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else root
    row["write_fsync_gbps"] = write_limit(root, nbytes, threads, fsync=True, reps=reps)
    row["shm_copy_gbps"] = write_limit(shm, nbytes, threads, fsync=False, reps=reps)
    row["save_bytes"] = nbytes
    digests: dict[str, dict[str, Any]] = {"save": {}, "snapshot": {}}
    for system in [s for s in systems if s in ("parallel", "staged", "direct")]:
        os.environ["TENPLEX_STAGING"] = {"staged": "copy"}.get(system, system)
        for kind, where in (("save", root), ("snapshot", shm)):
            path = os.path.join(where, f"bench-{kind}-{system}-{os.getpid()}.safetensors")
            times = []
            try:
                for _ in range(max(1, reps)):
                    t0 = time.perf_counter()
                    if kind == "save":
                        write_safetensors(path, tensors)
                    else:
                        shm_write.write_tensors(path, tensors, BLOCK_BYTES)
                    times.append(time.perf_counter() - t0)
                with open(path, "rb") as f:
                    digests[kind][system] = hashlib.sha256(f.read()).hexdigest()
            except Exception as e:
                row[f"{kind}_{system}_error"] = f"{type(e).__name__}: {e}"
                continue
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            row[f"{kind}_{system}_gbps"] = nbytes / statistics.median(times) / GB
    for kind, got in digests.items():
        names = list(got)
        row.setdefault("identical", {}).update(
            {f"{kind} {n}=={names[0]}": got[n] == got[names[0]] for n in names[1:]})


def d2h(device: torch.device, nbytes: int, reps: int = 5) -> float:
    """GB/s of a device buffer copied to pinned host memory (on the CPU: into another host buffer)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host.copy_(dev, non_blocking=True)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        host.copy_(dev, non_blocking=True)
    _sync(device)
    return reps * nbytes / (time.perf_counter() - t0) / GB


def time_round_robin(runs: dict[str, Callable[[], Any]], reps: int, cold_dirs: dict[str, str | None],
                     row: dict[str, Any]) -> dict[str, float]:
    """Median seconds of each system, repetitions round-robin over the systems (the order rotating each time), so
    a change of the machine's load hits all alike. ``cold_dirs[s]``: evicted from the page cache before each of
    ``s``'s runs (None: warm, after one untimed run). A system that fails is reported in ``row`` and dropped."""
    live = dict(runs)
    times: dict[str, list[float]] = {name: [] for name in runs}

    def one(name: str, timed: bool) -> None:
        try:
            cold = cold_dirs[name]
            if cold is not None:
                evict_page_cache(cold)
            t0 = time.perf_counter()
            live[name]()
            if timed:
                times[name].append(time.perf_counter() - t0)
        except Exception as e:
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"
            live.pop(name)

    for name in list(live):
        if cold_dirs[name] is None:
            one(name, False)
    for rep in range(reps):
        names = list(live)
        for name in names[rep % max(1, len(names)):] + names[: rep % max(1, len(names))]:
            if name in live:
                one(name, True)
    return {name: statistics.median(ts) for name, ts in times.items() if ts and name in live}


def identical(runs: dict[str, Callable[[], list[torch.Tensor]]]) -> dict[str, bool]:
    """Whether each system loaded the same bytes as the first one (one system's share in memory at a time)."""
    names = list(runs)
    if len(names) < 2:
        return {}
    ref = [t.cpu() for t in runs[names[0]]()]
    out = {}
    for name in names[1:]:
        try:
            got = runs[name]()
        except Exception:
            continue  # its error is already reported
        out[f"{name}=={names[0]}"] = all(torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))
                                         for a, b in zip(ref, got))
        del got
    return out


def bench_model(model: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    src, dst = _layout(args.src), _layout(args.dst)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        t0 = time.perf_counter()
        share = write_share(root, model, src, dst, args.rank)
        row: dict[str, Any] = {"model": model, "transition": f"tp{src.tp}pp{src.pp}-tp{dst.tp}pp{dst.pp}",
                               "dst_bytes": share.dst_bytes, "file_bytes": share.file_bytes,
                               "write_s": time.perf_counter() - t0}
        secs, nbytes = seq_read(root)
        row["storage_read_gbps"] = nbytes / secs / GB
        threads = default_threads()
        row["read_threads"] = threads
        row["parallel_cold_read_gbps"] = parallel_read_gbps(root, threads, cold=True, nbytes=share.dst_bytes)
        row["parallel_warm_read_gbps"] = parallel_read_gbps(root, threads, cold=False, nbytes=share.dst_bytes)
        size = min(256 << 20, max(share.dst_bytes, 1 << 20))
        row["h2d_gbps"] = h2d(device, size)
        row["d2h_gbps"] = d2h(device, size)
        runs: dict[str, Callable[[], list[torch.Tensor]]] = {}
        for system in args.systems:
            if system in ("parallel", "staged", "direct"):
                runs[system] = tenplex_load(share, device, {"staged": "copy"}.get(system, system))
        mdir = os.path.join(args.dir or tempfile.gettempdir(), f"mcore-{os.getpid()}")
        try:
            if "mcore" in args.systems:
                try:
                    runs["mcore"] = mcore_setup(share, mdir, device)
                except Exception as e:  # report why, measure the rest
                    row["mcore_error"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
            for temp in ("warm", "cold"):
                cold = {name: None if temp == "warm" else (mdir if name == "mcore" else root) for name in runs}
                for system, secs in time_round_robin(runs, args.reps, cold, row).items():
                    row[f"{system}_{temp}_s"] = secs
                    row[f"{system}_{temp}_gbps"] = share.dst_bytes / secs / GB
            runs = {name: fn for name, fn in runs.items() if f"{name}_error" not in row}
            row["identical"] = identical(runs)
            if args.writes and runs:
                bench_writes(next(iter(runs.values()))(), root, device, args.systems, args.reps, row)
        finally:
            import shutil

            shutil.rmtree(mdir, ignore_errors=True)
    return row


LIMITS = (("storage_read_gbps", "seq read"), ("parallel_cold_read_gbps", "par cold"),
          ("parallel_warm_read_gbps", "par warm"), ("h2d_gbps", "h2d"), ("d2h_gbps", "d2h"))


def report(rows: list[dict[str, Any]], device: str) -> None:
    cols = ["model", "transition", "dst GB", *(name for _, name in LIMITS)]
    systems = [s for s in SYSTEMS if any(f"{s}_warm_gbps" in r for r in rows)]
    cols += [f"{s} {t}" for s in systems for t in ("warm", "cold")]
    print(f"device: {device}; GB/s of destination bytes (seq read: one thread reading the files from storage; par "
          "cold / par warm: the reader threads' preadv of the files from storage / the page cache; h2d, d2h: "
          "pinned host-device copies, on the CPU a memory copy)")
    print(" | ".join(cols))
    for r in rows:
        vals = [r["model"], r["transition"], f"{r['dst_bytes'] / GB:.3f}"]
        vals += [f"{r[k]:.2f}" if k in r else "-" for k, _ in LIMITS]
        vals += [f"{r[f'{s}_{t}_gbps']:.2f}" if f"{s}_{t}_gbps" in r else "-" for s in systems for t in ("warm", "cold")]
        print(" | ".join(vals))
        writes = [f"{k} {s_}: {r[f'{k}_{s_}_gbps']:.2f}" for k in ("save", "snapshot") for s_ in SYSTEMS
                  if f"{k}_{s_}_gbps" in r]
        if writes:
            print(f"  writes of {r['save_bytes'] / GB:.3f} GB: write+fsync limit {r['write_fsync_gbps']:.2f}, "
                  f"/dev/shm copy limit {r['shm_copy_gbps']:.2f}; " + ", ".join(writes))
        for k in sorted(r):
            if k.endswith("_error"):
                print(f"  {k}: {r[k]}")
        for k, same in r.get("identical", {}).items():
            print(f"  check {r['model']}: {k}: {'identical bytes' if same else 'DIFFERENT BYTES'}")
    for r in rows:
        target = f"{r['model']}:{r['transition']}"
        h2d = math.inf if device == "cpu" else r["h2d_gbps"]  # on the CPU nothing crosses to a device
        limits = {"warm": min(r.get("parallel_warm_read_gbps", r["h2d_gbps"]), h2d),
                  "cold": min(r.get("parallel_cold_read_gbps", r["storage_read_gbps"]), h2d)}
        for temp, limit in limits.items():
            for system in ("parallel", "staged"):
                got = r.get(f"{system}_{temp}_gbps")
                if got is not None:
                    print(ratio_line(f"load_bandwidth_{temp} {target} {system}/limit", got / limit))
            for system, peers in (("parallel", ("staged", "direct", "mcore")), ("staged", ("direct", "mcore"))):
                for peer in peers:
                    if f"{system}_{temp}_s" in r and f"{peer}_{temp}_s" in r:
                        print(ratio_line(f"load_time_{temp} {target} {system}/{peer}",
                                         r[f"{system}_{temp}_s"] / r[f"{peer}_{temp}_s"]))
        for kind, limit in (("save", "write_fsync_gbps"), ("snapshot", "shm_copy_gbps")):
            for system in ("parallel", "staged", "direct"):
                if f"{kind}_{system}_gbps" in r:
                    print(ratio_line(f"{kind}_bandwidth {target} {system}/limit", r[f"{kind}_{system}_gbps"] / r[limit]))


def _init_process_group(device: torch.device) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--device", type=parse_device, default="cuda:0" if torch.cuda.is_available() else "cpu",
                    help="cpu, cuda or cuda:N (cuda: cuda:0; default cuda:0 where there is a GPU)")
    ap.add_argument("--src", default="2,1,1", help="source layout tp,pp,dp (default 2,1,1)")
    ap.add_argument("--dst", default="4,1,1", help="destination layout tp,pp,dp (default 4,1,1)")
    ap.add_argument("--rank", type=int, default=0, help="the destination rank whose share is loaded")
    ap.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-writes", dest="writes", action="store_false",
                    help="measure loads only (not the save from the device and the snapshot into /dev/shm)")
    ap.add_argument("--dir", default=None, help="where to write the files (default: the temp directory)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    device = args.device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            ap.error(f"--device {device}: torch {torch.__version__} sees no CUDA device here")
        torch.cuda.set_device(device)
    args.device = str(device)  # as recorded in --out
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if "mcore" in args.systems:
        _init_process_group(device)
    old = os.environ.get("TENPLEX_STAGING")
    rows: list[dict[str, Any]] = []
    try:
        for model in args.models:
            rows.append(bench_model(model, args, device))
            if args.out:  # after each model: a run stopped on a clock keeps the models it finished
                write_out(args.out, name, args, rows)
    finally:
        if old is None:
            os.environ.pop("TENPLEX_STAGING", None)
        else:
            os.environ["TENPLEX_STAGING"] = old
    report(rows, name)


def write_out(path: str, device: str, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The ``--out`` JSON (machine, device, arguments, one row per model), replaced whole."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"machine": machine(), "device": device, "args": vars(args), "rows": rows}, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
