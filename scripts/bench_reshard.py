"""Re-sharding benchmark: tenplex against megatron-core dist_checkpointing and a centralized baseline, same run.

For each model (shapes from tenplex_megatron/plan/sim/models.json) and transition A -> B it
launches two torchrun jobs on this machine: one at layout A that trains one
step (so optimizer state exists) and then saves with every system, one at
layout B that loads with every system. Systems:
  tenplex   every rank writes its own chunks; every rank at B reads only what it needs
            (``tenplex_noverify``: the same load without checksum verification);
  mcore     megatron-core dist_checkpointing, torch_dist + fully_reshardable, fully
            parallel save/load wrappers (integrations/mcore_dist_ckpt.py, as Megatron-LM);
  central   the Tenplex paper's "Central": rank 0 gathers every tensor at A and writes one
            file; at B every rank reads that whole file and slices its part out of it.
Repetitions run round-robin over the systems (the order rotates each repetition).
Each figure is timed inside the workers around the save/load call only, between
barriers; a repetition's time is the max over ranks and the table shows the
median. Peak RSS is sampled (psutil) during the call on every rank; "growth" is
that peak minus the RSS just before. After the last load of each system the
state is checked: the model and optimizer are zeroed before that load, and
afterwards one more training step and one forward pass must reproduce the
losses the job at A got (within 1e-4 relative; only reduction order differs).
Loads are timed twice: with the checkpoint in the page cache (warm), and
``*_cold`` after evicting its files from the page cache (posix_fadvise
DONTNEED, no root needed), so they read from storage, as a restart on other
machines does. Bytes: on disk after a save; read from storage by a load
(tenplex: the CRC blocks it verified plus what it copied unverified, next to
the destination bytes it needed; issue #4's target is at most 1.05x). Save
memory: each rank's own shard (the state it holds) plus its RSS growth during
the save, over its own shard (issue #4: at most 1.25x). Physical limits, timed
in the load job between the loads in the same way (every rank its share, max
over ranks, median): a sequential read of the tenplex checkpoint's files from
storage (page cache evicted: the raw read that cold loads are compared with),
the same read from the page cache (readinto, and a copy out of an mmap), and a
memory copy of those bytes (what warm loads are compared with).

Prints a table, then `RATIO <metric> <model>:<transition> tenplex/<peer> = X.XX`
lines (below 1: tenplex is better; for bytes_read tenplex/destination and
load_bandwidth the peer is the limit), writes JSON (--out) and a PNG (next to
it) if matplotlib is importable.

    python scripts/bench_reshard.py --quick                    # gpt3-125m, dp2-tp2, 3 reps
    python scripts/bench_reshard.py --models gpt3-350m --transitions tp2-dp2 dp2-tp2 tp2-pp2
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tenplex_megatron._optional import MissingExtraError, require  # noqa: E402

TRANSITIONS: dict[str, tuple[tuple[int, int, int], tuple[int, int, int]]] = {  # (tp, pp, dp) at A, at B
    "tp2-dp2": ((2, 1, 1), (1, 1, 2)),
    "dp2-tp2": ((1, 1, 2), (2, 1, 1)),
    "tp2-pp2": ((2, 1, 1), (1, 2, 1)),
    "pp2-tp2": ((1, 2, 1), (2, 1, 1)),
    "dp2-dp1": ((1, 1, 2), (1, 1, 1)),
    "tp2-tp1": ((2, 1, 1), (1, 1, 1)),
    "pp2-pp1": ((1, 2, 1), (1, 1, 1)),
}
SAVE_SYSTEMS = ("tenplex", "mcore", "central")
LOAD_SYSTEMS = ("tenplex", "tenplex_noverify", "mcore", "central")
COLD_LOAD_SYSTEMS = ("tenplex_cold", "mcore_cold", "central_cold")  # the same loads after evicting the page cache
# each tenplex load's bandwidth over its physical limit: (load, RATIO metric, limit in the row, limit's name)
BANDWIDTH_LIMITS = (("tenplex_cold", "load_bandwidth", "raw_read_GBps", "raw_read"),
                    ("tenplex", "load_bandwidth", "memory_copy_GBps", "memory_copy"),
                    ("tenplex_noverify", "load_bandwidth_noverify", "memory_copy_GBps", "memory_copy"))
CHECK_RTOL = 1e-4


# ----------------------------------------------------------------------------------------------- worker


class PeakRSS:
    """This process's RSS just before the block and its peak during it (sampled every 5 ms by a thread).

    Also the anonymous part (RSS less file-backed and shared pages): memory the process allocated, without the
    page-cache pages of files it maps, which the kernel can drop at any time (a load through mmap counts the
    shard pages it touches in its RSS, not in its anonymous memory).
    """

    def __enter__(self) -> PeakRSS:
        import psutil

        self._proc = psutil.Process()
        self.before, self.anon_before = self._sample()
        self.peak, self.anon_peak = self.before, self.anon_before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> tuple[int, int]:
        m = self._proc.memory_info()
        return m.rss, m.rss - m.shared

    def _update(self) -> None:
        rss, anon = self._sample()
        self.peak, self.anon_peak = max(self.peak, rss), max(self.anon_peak, anon)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self._update()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._update()


def _release_memory() -> None:
    """Return freed heap pages to the OS so the next call's RSS baseline is not lowered by the previous one."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def evict_page_cache(path: str) -> int:
    """Drop the page cache of every file under ``path`` (``POSIX_FADV_DONTNEED``: clean, unmapped pages go; no root
    needed), so the next read comes from storage, as after a restart on other machines. Returns the bytes evicted."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def _box(offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, shape))


def central_save(job: Any, path: str) -> int:
    """Collective: gather every distinct chunk to rank 0 (gloo/NCCL send-recv), assemble full tensors, write one
    safetensors file (fsynced, like tenplex's writer) plus a JSON of the non-tensor state. Returns bytes written."""
    import torch
    import torch.distributed as dist

    from tenplex_megatron.execute.collective import all_gather_json
    from tenplex_megatron.integrations.megatron_core.optimizer import optimizer_state_json
    from tenplex_megatron.integrations.megatron_core.sharded import describe_job
    from tenplex_megatron.storage.safetensors_io import write_safetensors

    rank, world = dist.get_rank(), dist.get_world_size()
    tensors, chunks = describe_job(job)
    mine = [[c.chunk.key, list(c.chunk.offsets), list(c.chunk.shape), list(c.chunk.flat) if c.chunk.flat else None,
             c.data.numel() * c.data.element_size()] for c in chunks]
    gathered = all_gather_json({"chunks": mine, "tensors": {k: [list(m.global_shape), m.dtype] for k, m in tensors.items()}})
    owner: dict[str, tuple[int, int]] = {}
    for r, g in enumerate(gathered):
        for i, c in enumerate(g["chunks"]):
            owner.setdefault(json.dumps(c[:4]), (r, i))

    def sent_by(r: int) -> list[int]:
        return [i for i, c in enumerate(gathered[r]["chunks"]) if owner[json.dumps(c[:4])] == (r, i)]

    size = 0
    if rank != 0:
        idx = sent_by(rank)
        if idx:
            dist.send(torch.cat([chunks[i].data.detach().reshape(-1).view(torch.uint8) for i in idx]), 0)
    else:
        meta = {k: v for g in gathered for k, v in g["tensors"].items()}
        full = {k: torch.empty(shape, dtype=getattr(torch, dt)) for k, (shape, dt) in meta.items()}
        staging: dict[str, torch.Tensor] = {}
        for r in range(world):
            idx = sent_by(r)
            if not idx:
                continue
            if r == 0:
                pieces = [chunks[i].data.detach().reshape(-1).cpu() for i in idx]
            else:
                nbytes = [gathered[r]["chunks"][i][4] for i in idx]
                buf = torch.empty(sum(nbytes), dtype=torch.uint8, device=chunks[0].data.device)
                dist.recv(buf, r)
                buf = buf.cpu()
                pieces = [p.view(full[gathered[r]["chunks"][i][0]].dtype) for i, p in zip(idx, buf.split(nbytes))]
            for i, piece in zip(idx, pieces):
                key, offsets, shape, flat, _ = gathered[r]["chunks"][i]
                if flat is None:
                    full[key][_box(offsets, shape)].copy_(piece.view(shape))
                else:
                    sid = json.dumps([key, offsets, shape])
                    if sid not in staging:
                        staging[sid] = torch.empty(math.prod(shape), dtype=piece.dtype)
                    staging[sid][flat[0] : flat[1]] = piece
        for sid, flat_box in staging.items():
            key, offsets, shape = json.loads(sid)
            full[key][_box(offsets, shape)].copy_(flat_box.view(shape))
        staging.clear()
        os.makedirs(path, exist_ok=True)
        size, _ = write_safetensors(os.path.join(path, "central.safetensors"), full)
        with open(os.path.join(path, "central.json"), "w") as f:
            json.dump({"iteration": job.iteration, "consumed_samples": job.consumed_samples,
                       "optimizer": optimizer_state_json(job.optimizer), "scheduler": job.scheduler.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
    dist.barrier()
    return size


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32"}


def _read_whole_safetensors(path: str) -> dict[str, Any]:
    """Read the whole file into memory (not a lazy mmap: the baseline fetches everything) and view its tensors."""
    import torch

    n = os.path.getsize(path)
    raw = torch.empty(n, dtype=torch.uint8)
    view = memoryview(raw.numpy())
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < n:
            k = f.readinto(view[got:])
            if not k:
                raise OSError(f"{path}: short read at byte {got} of {n}")
            got += k
    hlen = int.from_bytes(bytes(view[:8]), "little")
    header = json.loads(bytes(view[8 : 8 + hlen]))
    out = {}
    for key, e in header.items():
        if key == "__metadata__":
            continue
        dtype = getattr(torch, _ST_DTYPES[e["dtype"]])
        b, end = (8 + hlen + x for x in e["data_offsets"])
        part = raw[b:end]
        if b % dtype.itemsize:
            part = part.clone()  # unaligned: a reinterpreting view needs an aligned offset
        out[key] = part.view(dtype).view(e["shape"])
    return out


def central_load(job: Any, path: str) -> int:
    """Collective: every rank reads the whole central file and copies its own chunks out of it. Returns bytes read."""
    import torch

    from tenplex_megatron.integrations.megatron_core.optimizer import allocate_state, restore_optimizer_state
    from tenplex_megatron.integrations.megatron_core.sharded import describe_job

    allocate_state(job.optimizer)
    file = os.path.join(path, "central.safetensors")
    full = _read_whole_safetensors(file)
    with open(os.path.join(path, "central.json")) as f:
        side = json.load(f)
    tensors, chunks = describe_job(job)
    with torch.no_grad():
        for lc in chunks:
            c = lc.chunk
            src = full[c.key]
            if tuple(src.shape) != tuple(tensors[c.key].global_shape):
                raise ValueError(f"{c.key}: central file has shape {tuple(src.shape)}, job needs "
                                 f"{tuple(tensors[c.key].global_shape)}")
            region = src[_box(c.offsets, c.shape)].reshape(-1)
            if c.flat is not None:
                region = region[c.flat[0] : c.flat[1]]
            lc.data.copy_(region.view(lc.data.shape))
    del full
    restore_optimizer_state(job.optimizer, side["optimizer"])
    job.scheduler.load_state_dict(side["scheduler"])
    job.iteration, job.consumed_samples = int(side["iteration"]), int(side["consumed_samples"])
    return os.path.getsize(file)


# physical limits, timed in the load job like the loads: a sequential read from storage (page cache evicted first),
# the same read and an mmap copy from a warm page cache, and a memory-to-memory copy of the same bytes
CEILINGS = ("read_cold", "read_readinto", "read_mmap", "memory_copy")


def _split(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous byte ranges covering ``[0, total)``, as equal as possible."""
    cuts = [total * i // parts for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)]


def ceiling_op(kind: str, path: str, rank: int, world: int) -> tuple[Any, int]:
    """Set up (untimed) this rank's share of a physical-limit operation on the checkpoint files under ``path``.

    The files, back to back, are cut into ``world`` contiguous shares; rank r takes share r, into a
    preallocated, pre-faulted buffer: ``read_readinto`` reads it sequentially with ``readinto``, ``read_mmap``
    copies it out of a fresh read-only ``mmap`` (tenplex's access path), ``memory_copy`` copies the same bytes
    (read beforehand) from memory to memory. Returns the operation to time and its byte count.
    """
    import numpy as np

    segments, total = [], 0  # (file, its first byte in the concatenation, size)
    for f in sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs):
        n = os.path.getsize(f)
        segments.append((f, total, n))
        total += n
    lo, hi = _split(total, world)[rank]
    buf = np.ones(hi - lo, dtype=np.uint8)  # written once: its pages are faulted in before timing
    view = memoryview(buf)

    def parts() -> list[tuple[str, int, int, int]]:  # (file, first byte in it, count, first byte in buf)
        return [(f, max(lo, start) - start, min(hi, start + n) - max(lo, start), max(lo, start) - lo)
                for f, start, n in segments if max(lo, start) < min(hi, start + n)]

    def readinto() -> None:
        for f, off, count, at in parts():
            with open(f, "rb", buffering=0) as fh:
                fh.seek(off)
                done = 0
                while done < count:
                    k = fh.readinto(view[at + done : at + count])
                    if not k:
                        raise OSError(f"{f}: short read")
                    done += k

    def mapped() -> None:
        for f, off, count, at in parts():
            with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                src = np.frombuffer(mm, dtype=np.uint8)
                np.copyto(buf[at : at + count], src[off : off + count])
                del src  # the map cannot close while a view of it lives

    if kind in ("read_readinto", "read_cold"):  # the caller evicts the page cache first for read_cold
        return readinto, hi - lo
    if kind == "read_mmap":
        return mapped, hi - lo
    readinto()
    dst = np.zeros_like(buf)
    dst.fill(1)
    return (lambda: np.copyto(dst, buf)), hi - lo


def _zero_state(job: Any) -> None:
    """Wipe weights, optimizer state and position so that the check after a load sees only what it loaded."""
    import torch

    from tenplex_megatron.integrations.megatron_core.sharded import sub_optimizers, unwrap

    with torch.no_grad():
        for p in unwrap(job.model[0]).parameters():
            p.zero_()
        for opt in sub_optimizers(job.optimizer):
            for group in opt.optimizer.param_groups:
                group["lr"] = 0.0
            for st in opt.optimizer.state.values():
                for t in st.values():
                    if torch.is_tensor(t):
                        t.zero_()
    job.scheduler.num_steps = 0
    job.iteration = job.consumed_samples = 0


def _eval_loss(job: Any, start: int) -> float:
    """Forward-only global-batch mean LM loss on the synthetic batch at global sample ``start``."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tenplex_megatron.training.gpt import make_forward_step, mean_lm_loss

    with torch.no_grad():
        losses = get_forward_backward_func()(
            forward_step_func=make_forward_step(), data_iterator=_data(job, start), model=job.model,
            num_microbatches=job.num_microbatches, seq_length=job.spec.seq_length,
            micro_batch_size=job.micro_batch_size, forward_only=True,
        )
    return mean_lm_loss(losses)


def _data(job: Any, start: int) -> Any:
    from megatron.core import parallel_state

    from tenplex_megatron.training.synthetic_data import microbatches

    return microbatches(start, job.global_batch_size, job.micro_batch_size, job.layout.dp,
                        parallel_state.get_data_parallel_rank(), job.spec.seq_length, job.spec.vocab_size, job.spec.seed)


def _check(job: Any) -> dict[str, Any]:
    """Position after the load, then the loss of training step 2 and a forward pass after it (uses the Adam moments)."""
    from tenplex_megatron.training.gpt import train_step

    g = job.global_batch_size
    out = {"iteration": job.iteration, "consumed_samples": job.consumed_samples}
    out["loss_step2"] = train_step(job, _data(job, g))
    out["loss_after_step2"] = _eval_loss(job, 2 * g)
    return out


def worker(a: argparse.Namespace) -> None:
    import resource

    import torch

    from tenplex_megatron.execute.collective import all_gather_json
    from tenplex_megatron.integrations.megatron_core.adapter import load_job, save_job
    from tenplex_megatron.integrations.megatron_core.optimizer import allocate_state
    from tenplex_megatron.integrations.megatron_core.sharded import describe_job
    from tenplex_megatron.plan.layout import ParallelLayout
    from tenplex_megatron.training import gpt, mcore_dist_ckpt

    gpt.init_distributed()
    spec = gpt.GPTSpec.from_json(json.loads(a.spec))
    layout = ParallelLayout(*a.layout)
    job = gpt.build_job(spec, layout, use_distributed_optimizer=True, micro_batch_size=1,
                        global_batch_size=a.gbs, padded_vocab=a.padded)
    rank = torch.distributed.get_rank()
    systems = list(a.run_systems)
    if a.phase == "load" and any(s.startswith("tenplex") for s in systems):
        systems += CEILINGS  # rotated with the loads: same processes, same timing, same page cache
    out: dict[str, Any] = {"phase": a.phase, "layout": list(a.layout), "world": torch.distributed.get_world_size(),
                           "reps": {s: [] for s in systems}}
    if a.phase == "save":  # (described only once the optimizer state exists: describing creates its entries)
        out["loss_step1"] = gpt.train_step(job, _data(job, 0))
        tensors, own = describe_job(job)  # the rank's own shard: every tensor chunk it holds (weights, main, moments)
        out["own_bytes"] = all_gather_json(sum(lc.data.numel() * lc.data.element_size() for lc in own))
        del own
        numel = all_gather_json({k: math.prod(m.global_shape) for k, m in tensors.items() if not k.startswith("optimizer.")})
        out["params"] = sum({k: v for d in numel for k, v in d.items()}.values())
    if a.phase == "load":  # the optimizer state exists and its pages are touched before any timed load, so no
        allocate_state(job.optimizer)  # system is charged with first-touching the state every load fills
        _zero_state(job)
    last = a.reps - 1
    for rep in range(a.reps):
        order = systems[rep % len(systems):] + systems[: rep % len(systems)]
        for system in order:
            if system in CEILINGS:
                files = os.path.join(a.dir, "tenplex", f"rep{last}")
                op, share = ceiling_op(system, files, rank, out["world"])
                if system == "read_cold":
                    evict_page_cache(files)
                torch.distributed.barrier()
                t0 = time.perf_counter()
                op()
                torch.distributed.barrier()
                seconds = time.perf_counter() - t0
                out["reps"][system].append(all_gather_json({"seconds": seconds, "bytes": share}))
                del op
                _release_memory()
                continue
            base = system.removesuffix("_cold")
            source = os.path.join(a.dir, base.split("_")[0], f"rep{last}")
            if a.phase == "load" and rep == last:
                _zero_state(job)
            _release_memory()
            if system != base:
                evict_page_cache(source)
            torch.distributed.barrier()
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                nbytes: int | None = None
                extra: dict[str, int] = {}
                if a.phase == "save":
                    target = os.path.join(a.dir, system, f"rep{rep}")
                    if system == "tenplex":
                        nbytes = save_job(job, target).bytes_written
                    elif system == "mcore":
                        mcore_dist_ckpt.save_checkpoint(job, target, check=False)  # as stock megatron-core
                    else:
                        nbytes = central_save(job, target)
                else:
                    if base.startswith("tenplex"):
                        res = load_job(job, source, verify=base == "tenplex")
                        nbytes = res.bytes_verified + res.bytes_unverified  # read from storage: checked blocks + rest
                        extra = {"needed": res.bytes_read, "verified": res.bytes_verified}
                    elif base == "mcore":
                        mcore_dist_ckpt.load_checkpoint(job, source)
                    else:
                        nbytes = central_load(job, source)
                torch.distributed.barrier()
                seconds = time.perf_counter() - t0
            out["reps"][system].append(all_gather_json(
                {"seconds": seconds, "rss_before": mem.before, "rss_peak": mem.peak, "anon_before": mem.anon_before,
                 "anon_peak": mem.anon_peak, "bytes": nbytes, **extra}))
            if a.phase == "save" and rep > 0 and rank == 0:  # keep one copy per system on disk
                shutil.rmtree(os.path.join(a.dir, system, f"rep{rep - 1}"), ignore_errors=True)
            if a.phase == "load" and rep == last:
                out.setdefault("check", {})[system] = _check(job)
    if a.phase == "save":
        out["check"] = {"ref": {"loss_step2": gpt.train_step(job, _data(job, job.global_batch_size)),
                                "loss_after_step2": _eval_loss(job, 2 * job.global_batch_size)}}
    out["ru_maxrss"] = all_gather_json(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if rank == 0:
        with open(a.result, "w") as f:
            json.dump(out, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------------------------- driver


def launch(nproc: int, args: list[str], timeout: float) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           os.path.abspath(__file__), "--worker", *args]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"bench: worker timed out after {timeout:.0f} s: {' '.join(args)}") from None
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-2000:] + p.stderr[-6000:])
        raise SystemExit(f"bench: worker failed: {' '.join(args)}")


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def summarize(reps: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Median over repetitions of the max over ranks; memory: the worst repetition of each rank."""
    times = [max(r["seconds"] for r in rep) for rep in reps]
    world = len(reps[0])
    peak = [max(rep[k]["rss_peak"] for rep in reps) for k in range(world)]
    growth = [max(rep[k]["rss_peak"] - rep[k]["rss_before"] for rep in reps) for k in range(world)]
    anon = [max(rep[k].get("anon_peak", 0) - rep[k].get("anon_before", 0) for rep in reps) for k in range(world)]
    nbytes = [r["bytes"] for r in reps[-1]]
    out = {
        "seconds": statistics.median(times), "seconds_all": times,
        "rss_peak": max(peak), "rss_peak_per_rank": peak, "anon_growth": max(anon), "anon_growth_per_rank": anon,
        "rss_growth": max(growth), "rss_growth_per_rank": growth,
        "bytes": sum(nbytes) if all(b is not None for b in nbytes) else None,
    }
    for key in ("needed", "verified"):  # tenplex loads: bytes copied into the job, bytes checksum-verified
        if all(key in r for r in reps[-1]):
            out[f"bytes_{key}"] = sum(r[key] for r in reps[-1])
    return out


def run_one(model: str, name: str, a: argparse.Namespace) -> dict[str, Any]:
    from tenplex_megatron.plan.layout import padded_vocab_size
    from tenplex_megatron.plan.sim.gpt_catalogue import load_model
    from tenplex_megatron.training.gpt import GPTSpec

    src, dst = TRANSITIONS[name]
    d = load_model(model)
    seq = min(a.seq, d.seq_length)
    spec = GPTSpec(num_layers=d.num_layers, hidden_size=d.hidden_size, num_attention_heads=d.num_attention_heads,
                   ffn_hidden_size=d.ffn_hidden_size, seq_length=seq, max_position_embeddings=seq,
                   vocab_size=d.vocab_size, make_vocab_size_divisible_by=128, swiglu=d.swiglu,
                   hidden_dropout=0.0, attention_dropout=0.0)
    # One padded vocabulary for A and B (divisible by both TPs): the loss check compares like with like.
    padded = padded_vocab_size(d.vocab_size, 128, math.lcm(src[0], dst[0]))
    gbs = 2 * math.lcm(src[2], dst[2])  # the same global batch at A and B, one sample per micro-batch
    scratch = tempfile.mkdtemp(prefix=f"bench_{model}_{name}_", dir=a.workdir)
    common = ["--model", model, "--spec", json.dumps(spec.to_json()), "--padded", str(padded), "--gbs", str(gbs),
              "--reps", str(a.reps), "--dir", scratch]
    row: dict[str, Any] = {"model": model, "transition": name, "from": src, "to": dst, "seq_length": seq,
                           "padded_vocab": padded, "global_batch_size": gbs, "reps": a.reps}
    phases = {}
    try:
        load_systems = (LOAD_SYSTEMS if a.cache != "cold" else ()) + (COLD_LOAD_SYSTEMS if a.cache != "warm" else ())
        for phase, layout, systems in (("save", src, SAVE_SYSTEMS), ("load", dst, load_systems)):
            systems = [s for s in systems if s.split("_")[0] in a.systems]
            result = os.path.join(scratch, f"{phase}.json")
            t0 = time.perf_counter()
            launch(math.prod(layout), [*common, "--phase", phase, "--layout", *map(str, layout), "--result", result,
                                       "--run-systems", *systems], a.timeout)
            with open(result) as f:
                phases[phase] = json.load(f)
            row[f"{phase}_launch_seconds"] = time.perf_counter() - t0
            for s, reps in phases[phase]["reps"].items():
                if s in CEILINGS:  # bandwidth: all ranks' bytes over the median of the max over ranks
                    times = [max(r["seconds"] for r in rep) for rep in reps]
                    row[s] = {"seconds": statistics.median(times), "seconds_all": times,
                              "bytes": sum(r["bytes"] for r in reps[-1])}
                    row[s]["GBps"] = row[s]["bytes"] / row[s]["seconds"] / 1e9
                else:
                    row[f"{s}_{phase}"] = summarize(reps)
        row["params"] = phases["save"]["params"]
        row["own_bytes"] = {"save": phases["save"]["own_bytes"]}  # per rank at A: the state it holds
        row["ru_maxrss"] = {p: phases[p]["ru_maxrss"] for p in phases}
        for s in SAVE_SYSTEMS:
            if f"{s}_save" in row:
                row[f"{s}_save"]["bytes"] = dir_bytes(os.path.join(scratch, s, f"rep{a.reps - 1}"))
        ref = phases["save"]["check"]["ref"]
        row["check"] = {"ref": ref}
        for s, got in phases["load"].get("check", {}).items():
            diffs = [abs(got[k] - ref[k]) / abs(ref[k]) for k in ref]
            worst = math.inf if any(math.isnan(x) for x in diffs) else max(diffs)  # max() would skip a NaN
            ok = got["iteration"] == 1 and got["consumed_samples"] == gbs and worst <= CHECK_RTOL
            row["check"][s] = {**got, "max_rel_diff": worst, "ok": ok}
        if all(c in row for c in CEILINGS):
            row.update({"raw_read_GBps": row["read_cold"]["GBps"],
                        "warm_read_GBps": max(row["read_readinto"]["GBps"], row["read_mmap"]["GBps"]),
                        "readinto_GBps": row["read_readinto"]["GBps"], "mmap_copy_GBps": row["read_mmap"]["GBps"],
                        "memory_copy_GBps": row["memory_copy"]["GBps"], "ceiling_workers": math.prod(dst)})
    finally:
        if not a.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    return row


def _save_peak_over_own(r: dict[str, Any], system: str) -> float | None:
    """Worst rank's (own shard + RSS growth during the save) / own shard: issue #4 asks at most 1.25 for tenplex."""
    x, own = r.get(f"{system}_save"), r.get("own_bytes", {}).get("save")
    if not x or not own:
        return None
    return max((o + g) / o for o, g in zip(own, x["rss_growth_per_rank"]) if o)


def _effective_gbps(x: dict[str, Any]) -> float:
    """A load's effective bandwidth: bytes delivered into the job's tensors (all ranks) per second of load."""
    return x.get("bytes_needed", x["bytes"]) / x["seconds"] / 1e9


def print_row(r: dict[str, Any]) -> None:
    mb = 1e6
    print(f"\n{r['model']} ({r['params'] / 1e6:.1f}M params, seq {r['seq_length']}, padded vocab {r['padded_vocab']})"
          f"  {r['transition']}: (tp,pp,dp) {tuple(r['from'])} -> {tuple(r['to'])}, median of {r['reps']}")
    print(f"  {'':22} {'time s':>8} {'min-max s':>13} {'peak RSS MB/rank':>18} {'RSS growth MB':>14} "
          f"{'anon growth MB':>14} {'bytes MB':>10} {'verified MB':>11}  check")
    for op, systems in (("save", SAVE_SYSTEMS), ("load", LOAD_SYSTEMS + COLD_LOAD_SYSTEMS)):
        for s in systems:
            x = r.get(f"{s}_{op}")
            if x is None:
                continue
            b = f"{x['bytes'] / mb:10.1f}" if x["bytes"] is not None else f"{'-':>10}"
            v = f"{x['bytes_verified'] / mb:11.1f}" if "bytes_verified" in x else f"{'-':>11}"
            chk = ""
            if op == "load" and s in r["check"]:
                c = r["check"][s]
                chk = f"{'ok' if c['ok'] else 'MISMATCH'} (rel {c['max_rel_diff']:.1e})"
            lo, hi = min(x["seconds_all"]), max(x["seconds_all"])
            peaks = "/".join(f"{p / mb:.0f}" for p in x["rss_peak_per_rank"])
            anon = f"{x['anon_growth'] / mb:14.1f}" if "anon_growth" in x else f"{'-':>14}"
            print(f"  {s + ' ' + op:22} {x['seconds']:8.2f} {lo:6.2f}-{hi:<6.2f} {peaks:>18} "
                  f"{x['rss_growth'] / mb:14.1f} {anon} {b} {v}  {chk}")
    print("  bytes (all ranks): save = on disk; load = read from storage (tenplex: the checksum blocks it verified, "
          "plus what it copied unverified; central: the whole file on every rank); *_cold: page cache evicted first;\n"
          "  RSS growth counts the page-cache pages of mapped files (tenplex loads through mmap), anon growth does not")
    for s in ("tenplex", "mcore"):
        if (frac := _save_peak_over_own(r, s)) is not None:
            print(f"  {s} save: peak memory (own shard + RSS growth) = {frac:.3f}x the rank's own shard "
                  f"(worst rank; own shards {'/'.join(f'{b / mb:.0f}' for b in r['own_bytes']['save'])} MB)")
    for s in ("tenplex", "tenplex_noverify"):
        x = r.get(f"{s}_load")
        if x and x.get("bytes_needed") and x["bytes"] is not None:
            print(f"  {s}: read {x['bytes'] / mb:.1f} MB for {x['bytes_needed'] / mb:.1f} MB of destination shards "
                  f"({x['bytes'] / x['bytes_needed']:.3f}x), {x.get('bytes_verified', 0) / mb:.1f} MB checksum-verified")
    if r.get("memory_copy_GBps"):
        workers = r.get("ceiling_workers", 1)
        print(f"  physical limits ({workers} rank(s), each its share, timed like the loads): sequential read of the "
              f"checkpoint files from storage (page cache evicted) {r['raw_read_GBps']:.2f} GB/s, from the page cache "
              f"{r['warm_read_GBps']:.2f} GB/s (readinto {r['readinto_GBps']:.2f}, mmap copy {r['mmap_copy_GBps']:.2f}), "
              f"memory copy of those bytes {r['memory_copy_GBps']:.2f} GB/s")
        names = {"raw_read": "of the read from storage", "memory_copy": "of the memory copy"}
        for s, _, ref, peer in BANDWIDTH_LIMITS:
            if (x := r.get(f"{s}_load")) and x.get("bytes"):
                eff = _effective_gbps(x)
                print(f"  {s} load: {eff:.2f} GB/s of destination shards = {eff / r[ref]:.0%} {names[peer]}", flush=True)


def ratio_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for r in report["runs"]:
        t = f"{r['model']}:{r['transition']}"

        def add(metric: str, mine: str, peer: str, field: str, r: dict[str, Any] = r, t: str = t) -> None:
            a, b = r.get(mine), r.get(peer)
            if a is None or b is None or not a.get(field) or not b.get(field):
                return
            lines.append(f"RATIO {metric} {t} tenplex/{peer.split('_')[0]} = {a[field] / b[field]:.2f}")

        for peer in ("mcore", "central"):
            add("save_time", "tenplex_save", f"{peer}_save", "seconds")
            add("load_time", "tenplex_load", f"{peer}_load", "seconds")
            add("load_time_noverify", "tenplex_noverify_load", f"{peer}_load", "seconds")
            add("load_time_cold", "tenplex_cold_load", f"{peer}_cold_load", "seconds")
            add("save_peak_rss", "tenplex_save", f"{peer}_save", "rss_peak")
            add("load_peak_rss", "tenplex_load", f"{peer}_load", "rss_peak")
            add("save_rss_growth", "tenplex_save", f"{peer}_save", "rss_growth")
            add("load_rss_growth", "tenplex_load", f"{peer}_load", "rss_growth")
            add("save_anon_growth", "tenplex_save", f"{peer}_save", "anon_growth")
            add("load_anon_growth", "tenplex_load", f"{peer}_load", "anon_growth")
            add("disk_bytes", "tenplex_save", f"{peer}_save", "bytes")
        add("bytes_read", "tenplex_load", "central_load", "bytes")
        if (frac := _save_peak_over_own(r, "tenplex")) is not None:  # issue #4: at most 1.25
            lines.append(f"RATIO save_peak_mem {t} tenplex/own_shard = {frac:.2f}")
        for s, metric in (("tenplex", "bytes_read"), ("tenplex_noverify", "bytes_read_noverify")):
            x = r.get(f"{s}_load")
            if x and x.get("bytes_needed") and x["bytes"] is not None:  # issue #4: at most 1.05
                lines.append(f"RATIO {metric} {t} tenplex/destination = {x['bytes'] / x['bytes_needed']:.2f}")
        if r.get("memory_copy_GBps"):  # issue #4: at least 0.70 of the raw read
            for s, metric, ref, peer in BANDWIDTH_LIMITS:
                if (x := r.get(f"{s}_load")) and x.get("bytes"):
                    lines.append(f"RATIO {metric} {t} tenplex/{peer} = {_effective_gbps(x) / r[ref]:.2f}")
    return lines


def plot(report: dict[str, Any], path: str) -> None:
    try:
        matplotlib = require("matplotlib", "bench", needed_by="the benchmark's plot")
    except MissingExtraError as e:
        print(f"({e}: no plot)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = report["runs"]
    labels = [f"{r['model']}\n{r['transition']}" for r in runs]
    panels = (("save", SAVE_SYSTEMS, "seconds", "save at A (s)"),
              ("load", LOAD_SYSTEMS, "seconds", "load + re-shard at B, page cache warm (s)"),
              ("load", COLD_LOAD_SYSTEMS, "seconds", "load + re-shard at B, from storage (s)"),
              ("save", SAVE_SYSTEMS, "rss_growth", "save: RSS growth, worst rank (MB)"),
              ("load", LOAD_SYSTEMS, "anon_growth", "load: memory allocated, worst rank (MB)"),
              ("load", LOAD_SYSTEMS, "bytes", "load: bytes read, all ranks (MB)"))
    colors = {"tenplex": "tab:blue", "tenplex_noverify": "lightskyblue", "mcore": "tab:orange", "central": "tab:green"}
    fig, grid = plt.subplots(2, 3, figsize=(max(13, 4.5 * len(runs) * 1.2), 7.5))
    for ax, (op, systems, field, title) in zip(grid.ravel(), panels):
        systems = [s for s in systems if any(r.get(f"{s}_{op}", {}).get(field) is not None for r in runs)]
        w = 0.8 / max(len(systems), 1)
        scale = 1 if field == "seconds" else 1e6
        low = math.inf
        for i, s in enumerate(systems):
            vals = [max((r.get(f"{s}_{op}", {}).get(field) or 0) / scale, 1e-3) for r in runs]
            low = min([low, *vals])
            xs = [x + i * w for x in range(len(runs))]
            ax.bar(xs, vals, w, label=s, color=colors[s.removesuffix("_cold")])
            for x, v in zip(xs, vals):
                ax.annotate(f"{v:.2f}" if v < 10 else f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=7)
        ax.set_xticks([x + w * (len(systems) - 1) / 2 for x in range(len(runs))], labels, fontsize=8)
        ax.set_yscale("log")
        if low < math.inf:
            ax.set_ylim(bottom=low / 3)
        ax.set_title(title, fontsize=10)
        if systems:
            ax.legend(fontsize=7)
    fig.suptitle(f"median of {runs[0]['reps'] if runs else 0}, {report['machine']['cpus']} CPUs"
                 f"{', GPU' if report['machine']['gpu'] else ', no GPU'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "gpt3-125m"], help="names in tenplex_megatron/plan/sim/models.json")
    ap.add_argument("--transitions", nargs="+", default=["tp2-dp2", "dp2-tp2"], choices=sorted(TRANSITIONS))
    ap.add_argument("--systems", nargs="+", default=["tenplex", "mcore", "central"], choices=["tenplex", "mcore", "central"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128, help="sequence length cap (shorter than GPT-3's 2048 for CPU speed)")
    ap.add_argument("--quick", action="store_true",
                    help="gpt3-125m, dp2-tp2 (saved at DP=2, loaded at TP=2), 3 repetitions")
    ap.add_argument("--cache", choices=["warm", "cold", "both"], default="both",
                    help="loads with the checkpoint in the page cache, after evicting it (read from storage), or both")
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "bench_reshard.json"), help="JSON report (PNG next to it)")
    ap.add_argument("--workdir", default=None, help="where checkpoints are written (default: the system temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per torchrun launch")
    ap.add_argument("--report", metavar="JSON", help="print the table, ratios and plot of an earlier run's JSON; measure nothing")
    w = ap.add_argument_group("worker (internal)")
    w.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    w.add_argument("--phase", choices=["save", "load"], help=argparse.SUPPRESS)
    w.add_argument("--model", help=argparse.SUPPRESS)
    w.add_argument("--spec", help=argparse.SUPPRESS)
    w.add_argument("--padded", type=int, help=argparse.SUPPRESS)
    w.add_argument("--gbs", type=int, help=argparse.SUPPRESS)
    w.add_argument("--layout", type=int, nargs=3, help=argparse.SUPPRESS)
    w.add_argument("--dir", help=argparse.SUPPRESS)
    w.add_argument("--result", help=argparse.SUPPRESS)
    w.add_argument("--run-systems", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return 0
    if a.reps < 1:
        ap.error("--reps must be at least 1")
    if a.report:
        with open(a.report) as f:
            report = json.load(f)
        for row in report["runs"]:
            print_row(row)
        print()
        print("\n".join(ratio_lines(report)))
        plot(report, os.path.splitext(a.out)[0] + ".png")
        return 0
    if a.quick:
        a.models, a.transitions, a.reps = ["gpt3-125m"], ["dp2-tp2"], 3
    if a.workdir:
        os.makedirs(a.workdir, exist_ok=True)
    import torch

    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
                    "gpu": torch.cuda.is_available(), "load_average": os.getloadavg()},
        "command": sys.argv,
        "runs": [],
    }
    t0 = time.perf_counter()
    for model in a.models:
        for name in a.transitions:
            row = run_one(model, name, a)
            report["runs"].append(row)
            print_row(row)
    report["wall_seconds"] = time.perf_counter() - t0
    report["machine"]["load_average_end"] = os.getloadavg()
    print()
    for line in ratio_lines(report):
        print(line)
    out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(out_dir, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"json: {a.out}  (wall {report['wall_seconds']:.0f} s)")
    plot(report, os.path.splitext(a.out)[0] + ".png")
    bad = [f"{r['model']}:{r['transition']}:{s}" for r in report["runs"] for s, c in r["check"].items()
           if s != "ref" and not c["ok"]]
    if bad:
        print(f"CHECK FAILED (state after load differs from the state saved): {', '.join(bad)}")
        if any(b.endswith(":mcore") for b in bad):
            print("  (megatron-core 0.16.1's fully_reshardable save is wrong for parameters after a grad buffer's first "
                  "bucket, e.g. the word embedding at PP>1: NVIDIA/Megatron-LM#5077; see integrations/mcore_dist_ckpt.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
