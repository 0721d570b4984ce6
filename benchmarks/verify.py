"""Throughput of ``python -m tenplex_megatron verify`` against a plain sequential read of the same files.

    python -m benchmarks.verify CKPT [--repeat 3] [--cache warm|cold|both] [--workers 1 2]

Each repeat runs, in an order rotated from one repeat to the next: ``cat`` of
the checkpoint's files into /dev/null, a Python read loop over them (16 MiB
reads), and ``verify`` (every stored chunk read and every block checksum
checked) with each worker count. ``cold`` drops the
files' page cache first (``POSIX_FADV_DONTNEED``: no root needed). Prints the
median GB/s of each and a RATIO line (verify's GB/s over the sequential read's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from tenplex_megatron.storage.verify_ckpt import checkpoints_in, default_workers, verify_checkpoint

BUF = 16 << 20


def files_of(ckpt: str) -> list[str]:
    return sorted(os.path.join(ckpt, n) for n in os.listdir(ckpt) if os.path.isfile(os.path.join(ckpt, n)))


def evict(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_loop(paths: list[str]) -> tuple[int, float]:
    buf = bytearray(BUF)
    t0, n = time.perf_counter(), 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while got := f.readinto(buf):
                n += got
    return n, time.perf_counter() - t0


def cat(paths: list[str]) -> tuple[int, float]:
    t0 = time.perf_counter()
    subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True)
    return sum(os.path.getsize(p) for p in paths), time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cache", choices=["warm", "cold", "both"], default="both")
    ap.add_argument("--workers", type=int, nargs="+", default=None)
    args = ap.parse_args()
    (ckpt,) = checkpoints_in(args.checkpoint, every=False)
    paths = files_of(ckpt)
    workers = args.workers or sorted({1, default_workers()})
    total = sum(os.path.getsize(p) for p in paths)
    print(f"checkpoint {ckpt}: {len(paths)} files, {total / 1e9:.3f} GB; {os.cpu_count()} CPUs, "
          f"{default_workers()} available")
    modes = ["warm", "cold"] if args.cache == "both" else [args.cache]
    for mode in modes:
        rates: dict[str, list[float]] = {}
        if mode == "warm":
            read_loop(paths)  # fill the page cache once
        runs = [("cat", lambda: cat(paths)), ("python read", lambda: read_loop(paths))]
        runs += [(f"verify {w} thr", lambda w=w: _verify(ckpt, w)) for w in workers]
        for i in range(args.repeat):
            for name, fn in runs[i % len(runs):] + runs[: i % len(runs)]:  # rotated: no run always goes first
                if mode == "cold":
                    evict(paths)
                n, s = fn()
                rates.setdefault(name, []).append(n / s / 1e9)
        print(f"\n{mode} page cache, median of {args.repeat} (GB/s; min-max):")
        for name, r in rates.items():
            print(f"  {name:<14} {statistics.median(r):7.2f}   ({min(r):.2f}-{max(r):.2f})")
        seq = max(statistics.median(rates["cat"]), statistics.median(rates["python read"]))
        best = max(statistics.median(r) for k, r in rates.items() if k.startswith("verify"))
        print(f"RATIO verify_vs_sequential_read {mode} = {best / seq:.2f}")
    return 0


def _verify(ckpt: str, workers: int) -> tuple[int, float]:
    r = verify_checkpoint(ckpt, workers)
    if not r.ok:
        raise SystemExit(f"{ckpt}: damaged: {[d.why for d in r.damage][:3]}")
    return r.bytes_checked, r.seconds


if __name__ == "__main__":
    sys.exit(main())
