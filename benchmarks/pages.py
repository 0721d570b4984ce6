"""What the memory directory's page size costs: the file operations of a snapshot, a replica and a restart, timed
in each directory given (a tmpfs with 4 KiB pages such as /dev/shm, one mounted with ``huge=within_size``, a
disk filesystem's page cache).

    python -m benchmarks.pages --dirs /dev/shm /mnt/hshm /tmp --mb 743 --reps 3

Per directory, median of ``--reps``, each a fresh file of ``--mb`` MB:
  write_fresh       the file sized, then written with one ``write`` from memory (a snapshot into fresh pages)
  write_over        the same over the file's existing pages (a snapshot over a retired one's spare)
  map_write         written through a writable map over existing pages (a replica received over a spare)
  map_write_pop     the same, the map populated writable first (``MADV_POPULATE_WRITE``: what the helper does)
  map_crc           a CRC-32 pass over a read-only map of the file (what a restart's verified read costs)
  unmap             that map's unmap
  unlink            the file's unlink (freeing its pages)
  persist_direct    copied to ``--durable`` with ``O_DIRECT`` from its map (the helper's durable copy)
  persist_sendfile  the same with ``sendfile`` through the page cache (the buffered fallback)
Each row: wall seconds and the CPU seconds of this process. Prints ``RATIO <op>_cpu <mb>mb <fs>/<first fs> = X``
lines (CPU seconds, below 1: cheaper than in the first directory; a directory is named by its filesystem:
``tmpfs``, ``tmpfs-huge``, ``ext4``), ``RATIO persist_cpu <mb>mb_from_<fs> direct/sendfile`` and writes JSON
(``--out``).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from benchmarks.kit.launch import ROOT
from benchmarks.kit.report import ratio_key, ratio_line
from tenplex_megatron.memory.direct_copy import copy_direct
from tenplex_megatron.memory.mounts import mount_of
from tenplex_megatron.storage.checksum import crc32

MADV_POPULATE_WRITE = 23  # linux/mman.h
OPS = ("write_fresh", "write_over", "map_write", "map_write_pop", "map_crc", "unmap", "unlink", "persist_direct",
       "persist_sendfile")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(fn: Callable[[], object]) -> dict[str, float]:
    c0, t0 = _cpu(), time.perf_counter()
    fn()
    return {"seconds": time.perf_counter() - t0, "cpu": _cpu() - c0}


def _write(path: str, data: np.ndarray, fresh: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if fresh else 0), 0o644)
    try:
        if fresh:
            os.ftruncate(fd, data.nbytes)  # sized first: a huge=within_size tmpfs then gives it 2 MiB pages
        view, done = memoryview(data).cast("B"), 0
        while done < data.nbytes:
            done += os.pwrite(fd, view[done:], done)
    finally:
        os.close(fd)


def _map_write(path: str, data: np.ndarray, populate: bool) -> None:
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), data.nbytes)
    if populate:
        try:
            mm.madvise(MADV_POPULATE_WRITE)
        except (OSError, ValueError):  # kernels before 5.14: write faults then
            pass
    np.frombuffer(mm, dtype=np.uint8)[:] = data
    mm.close()


def _copy_sendfile(src: str, dst: str) -> None:
    size = os.path.getsize(src)
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        done = 0
        while done < size:
            done += os.sendfile(fo.fileno(), fi.fileno(), done, size - done)
        os.fsync(fo.fileno())


def labels(dirs: list[str]) -> list[str]:
    """A short name for each directory: its filesystem, ``-huge`` for a tmpfs with huge pages (``tmpfs``,
    ``tmpfs-huge``, ``ext4``), numbered where two share one."""
    names = []
    for d in dirs:
        _, kind, options = mount_of(d)
        huge = kind == "tmpfs" and any(o in ("huge=always", "huge=within_size") for o in options)
        names.append(f"{kind or 'unknown'}{'-huge' if huge else ''}")
    return [f"{n}{names[:i].count(n) + 1}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def one_rep(where: str, durable: str, data: np.ndarray) -> dict[str, dict[str, float]]:
    """Every operation once, in ``where``, over a file of ``data``'s size."""
    path = os.path.join(where, f"bench_pages_{os.getpid()}.bin")
    out: dict[str, dict[str, float]] = {}
    try:
        out["write_fresh"] = _timed(lambda: _write(path, data, fresh=True))
        out["write_over"] = _timed(lambda: _write(path, data, fresh=False))
        out["map_write"] = _timed(lambda: _map_write(path, data, populate=False))
        out["map_write_pop"] = _timed(lambda: _map_write(path, data, populate=True))
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        crc: list[int] = []
        out["map_crc"] = _timed(lambda: crc.append(crc32(memoryview(mm))))
        out["unmap"] = _timed(mm.close)
        if crc[0] != crc32(memoryview(data).cast("B")):
            raise RuntimeError(f"{path}: the file's CRC-32 differs from the data written")
        dst = os.path.join(durable, "copy.bin")
        got: list[int | None] = []
        out["persist_direct"] = _timed(lambda: got.append(copy_direct(path, dst)))
        if got[0] is None:  # the durable filesystem refuses O_DIRECT
            del out["persist_direct"]
        out["persist_sendfile"] = _timed(lambda: _copy_sendfile(path, dst))
        os.unlink(dst)
        out["unlink"] = _timed(lambda: os.unlink(path))
    finally:
        for p in (path, os.path.join(durable, "copy.bin")):
            if os.path.exists(p):
                os.unlink(p)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dirs", nargs="+", default=["/dev/shm", tempfile.gettempdir()],
                    help="directories to measure in (the first is the reference of the RATIO lines)")
    ap.add_argument("--mb", type=int, default=743, help="file size in MB (743: a GPT-3 125M rank's own file)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--durable", default=tempfile.gettempdir(), help="where the durable copies go (a disk)")
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "bench_pages.json"))
    a = ap.parse_args(argv)
    for d in (*a.dirs, a.durable):
        if not os.path.isdir(d):
            ap.error(f"{d}: not a directory")
    data = np.random.default_rng(0).integers(0, 256, a.mb << 20, dtype=np.uint8)
    report: dict[str, object] = {"command": sys.argv, "mb": a.mb, "reps": a.reps, "durable": a.durable, "dirs": {}}
    rows: dict[str, dict[str, dict[str, float]]] = {}
    durable = tempfile.mkdtemp(prefix="bench_pages_", dir=a.durable)  # never the file measured, whatever --dirs
    try:
        per_dir = {d: [one_rep(d, durable, data) for _ in range(a.reps)] for d in a.dirs}
    finally:
        os.rmdir(durable)
    for d, reps in per_dir.items():
        rows[d] = {op: {k: statistics.median(r[op][k] for r in reps) for k in ("seconds", "cpu")}
                   for op in OPS if op in reps[0]}
    report["dirs"] = rows
    print(f"{a.mb} MB per file, median of {a.reps}; wall s / CPU-s of this process; durable copies to {a.durable}")
    print(f"{'op':<18}" + "".join(f"{d[-22:]:>24}" for d in a.dirs))
    for op in OPS:
        cells = [rows[d].get(op) for d in a.dirs]
        print(f"{op:<18}" + "".join(f"{'-':>24}" if c is None else f"{c['seconds']:>11.3f} /{c['cpu']:>7.3f} CPU"
                                      for c in cells))
    names = labels(a.dirs)
    report["labels"] = dict(zip(a.dirs, names))
    print("  " + ", ".join(f"{n}: {d}" for d, n in zip(a.dirs, names)))
    ref, target = a.dirs[0], f"{a.mb}mb"
    for d, name in zip(a.dirs[1:], names[1:]):  # CPU seconds against the first directory's
        for op in OPS:
            if op in rows[d] and op in rows[ref] and rows[ref][op]["cpu"] > 0:
                print(ratio_line(ratio_key(f"{op}_cpu", target, name, names[0]),
                                 rows[d][op]["cpu"] / rows[ref][op]["cpu"]))
    for d, name in zip(a.dirs, names):  # the helper's durable copy against the buffered one
        pd, ps = rows[d].get("persist_direct"), rows[d]["persist_sendfile"]
        if pd and ps["cpu"] > 0:
            print(ratio_line(ratio_key("persist_cpu", f"{target}_from_{name}", "direct", "sendfile"),
                             pd["cpu"] / ps["cpu"]))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"json: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
