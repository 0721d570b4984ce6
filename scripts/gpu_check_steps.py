"""The torch-side steps of ``scripts/gpu_check.py``: parallel and staged load and save against the direct path, and a host-memory
snapshot file written from device tensors through the pinned ring, each checked byte for byte, with timings.

Run by the driver in its own process (a step that crashes, or hangs past its time, costs only itself):

    python scripts/gpu_check_steps.py identity --device cuda:0 --model gpt3-125m --out identity.json
    python scripts/gpu_check_steps.py snapshot --device cuda:0 --model gpt3-350m --out snapshot.json

``identity``: one destination rank's share of a GPT state (``benchmarks.gpu_reshard.write_share``: bf16 weights,
fp32 main weights, Adam moments, real writer and block CRCs, rank 0 of TP4 from TP2 and of PP2 from TP2) is
loaded into tensors on the device through staging buffers (``TENPLEX_STAGING=copy``, budgets from a few
hundred bytes per buffer to the default) and per piece (``direct``), and per piece into CPU tensors (the
reference); every load must give the same bytes. The loaded device tensors are then saved
(``write_safetensors``) through the ring and directly; the files must equal the one written from the CPU
copies, checksums included. ``snapshot``: the same share on the device written as a host-memory rank file
(``memory/shm_write.write_tensors``, into /dev/shm when it has room) through the pinned ring (``auto``) and by
``.to("cpu")`` (``direct``), against the CPU's file. GB/s are bytes over the best of ``--reps`` timed runs.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks.gpu_reshard import Share, parse_device, tenplex_load, write_share
from tenplex_megatron.memory import shm_write
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.storage.safetensors_io import BLOCK_BYTES, write_safetensors

GB = 1e9
#: staging budgets (TENPLEX_STAGING_MB): three buffers of ~200 bytes (pieces split into many boxes), of 1 MB
#: (each buffer reused hundreds of times on a GB share, its events guarding every reuse), the default 256 MB
BUDGETS = ("0.0006", "3", "256")
MAX_BATCHES = 20_000  # a budget whose buffers would go round more often than this for a share is left out


def budgets_for(nbytes: int) -> list[str]:
    """The :data:`BUDGETS` that fill at most :data:`MAX_BATCHES` buffers with ``nbytes`` (the smallest only for a
    small share: a GB through 200-byte buffers would take minutes; ``tests/gpu`` covers it on small tensors)."""
    return [mb for mb in BUDGETS if nbytes / max(64.0, float(mb) * (1 << 20) / 3) <= MAX_BATCHES]
TRANSITIONS = (("2,1,1", "4,1,1"), ("2,1,1", "1,2,1"))


@contextlib.contextmanager
def staging_env(mode: str | None = None, mb: str | None = None) -> Iterator[None]:
    """``TENPLEX_STAGING`` / ``TENPLEX_STAGING_MB`` for the block (None: unset), then as they were."""
    old = {k: os.environ.get(k) for k in ("TENPLEX_STAGING", "TENPLEX_STAGING_MB")}
    for k, v in (("TENPLEX_STAGING", mode), ("TENPLEX_STAGING_MB", mb)):
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def sync(device: torch.device) -> None:
    """Wait for the device (nothing on the CPU): timings and comparisons see finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """The shortest of ``reps`` timed runs of ``fn`` (after one untimed run), the device synchronised around each."""
    fn()
    times = []
    for _ in range(max(1, reps)):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two lists of tensors hold the same bytes (compared on the CPU)."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x.cpu().view(torch.uint8), y.cpu().view(torch.uint8)) for x, y in zip(a, b))


def file_digest(path: str) -> str:
    """sha256 of a file, read in 16 MB pieces (files of GBs are compared without holding two in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def share_tensors(share: Share, loaded: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The loaded destination chunks by a name that says which chunk each is (what a rank file holds)."""
    return {f"{c.key}@{','.join(map(str, c.offsets))}": t for c, t in zip(share.plan.chunks, loaded)}


def check_identity(device: torch.device, model: str, work: str, reps: int = 2) -> dict[str, Any]:
    """Staged and direct loads into ``device`` against the CPU reference, then staged and direct saves from
    ``device`` against the CPU's file; returns the figures and ``ok``."""
    out: dict[str, Any] = {"device": str(device), "model": model, "loads": [], "saves": []}
    ok = True
    for src, dst in TRANSITIONS:
        root = tempfile.mkdtemp(prefix="identity-", dir=work)
        try:
            share = write_share(root, model, ParallelLayout(*map(int, src.split(","))),
                                ParallelLayout(*map(int, dst.split(","))), 0)
            ref = tenplex_load(share, torch.device("cpu"), "direct")()
            budgets = budgets_for(share.dst_bytes)
            row: dict[str, Any] = {"transition": f"{src}->{dst}", "dst_bytes": share.dst_bytes,
                                   "pieces": len(share.plan.pieces), "budgets_mb": budgets}
            direct = tenplex_load(share, device, "direct")
            row["direct_identical"] = same_bytes(ref, direct())
            row["direct_gbps"] = share.dst_bytes / best_seconds(direct, device, reps) / GB
            for mb in budgets:
                with staging_env(None, mb):
                    for name, mode in (("staged", "copy"), ("parallel", "parallel")):
                        load = tenplex_load(share, device, mode)
                        row[f"{name}_{mb}mb_identical"] = same_bytes(ref, load())
                        if mb == budgets[-1]:
                            row[f"{name}_gbps"] = share.dst_bytes / best_seconds(load, device, reps) / GB
            ok &= all(v for k, v in row.items() if k.endswith("_identical"))
            out["loads"].append(row)
            if src == TRANSITIONS[0][0] and dst == TRANSITIONS[0][1]:  # the saves: from the first share
                with staging_env("copy", BUDGETS[-1]):
                    on_device = share_tensors(share, tenplex_load(share, device, "copy")())
                out["saves"] = check_saves(device, on_device, share_tensors(share, ref), work, reps)
                ok &= all(r["identical"] for r in out["saves"])
                del on_device
            del ref
        finally:
            shutil.rmtree(root, ignore_errors=True)
    out["ok"] = ok
    return out


def check_saves(device: torch.device, on_device: dict[str, torch.Tensor], on_cpu: dict[str, torch.Tensor],
                work: str, reps: int) -> list[dict[str, Any]]:
    """``write_safetensors`` of the device tensors through the ring (each budget) and directly, against the file
    written from the CPU copies: same bytes, same block CRCs."""
    nbytes = sum(t.numel() * t.element_size() for t in on_device.values())
    ref_path = os.path.join(work, "save-cpu.safetensors")
    with staging_env("direct"):
        _, ref_sums = write_safetensors(ref_path, on_cpu)
    ref_digest = file_digest(ref_path)
    rows = []
    try:
        budgets = budgets_for(nbytes)
        for mode, mb in [(m, mb) for mb in budgets for m in ("copy", "parallel")] + [("direct", None)]:
            path = os.path.join(work, f"save-{mode}.safetensors")
            with staging_env(mode, mb):
                _, sums = write_safetensors(path, on_device)
                row: dict[str, Any] = {"mode": mode, "staging_mb": mb, "bytes": nbytes,
                                       "identical": sums == ref_sums and file_digest(path) == ref_digest}
                if mb in (None, budgets[-1]):
                    row["gbps"] = nbytes / best_seconds(lambda p=path: write_safetensors(p, on_device), device, reps) / GB
            os.remove(path)
            rows.append(row)
    finally:
        os.remove(ref_path)
    return rows


def snapshot_dir(work: str, nbytes: int) -> str:
    """/dev/shm when it is writable and has room for three files of ``nbytes`` (a host-memory tier's place),
    else ``work`` (the figures then include the disk's page cache)."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 3 * nbytes + (1 << 30):
        return tempfile.mkdtemp(prefix="tenplex-gpu-check-", dir=shm)
    return tempfile.mkdtemp(prefix="snapshot-", dir=work)


def check_snapshot(device: torch.device, model: str, work: str, reps: int = 2) -> dict[str, Any]:
    """A host-memory rank file written from ``device`` tensors through the pinned ring and directly, against the
    file written from their CPU copies; returns the figures and ``ok``."""
    root = tempfile.mkdtemp(prefix="snapshot-share-", dir=work)
    try:
        share = write_share(root, model, ParallelLayout(2, 1, 1), ParallelLayout(4, 1, 1), 0)
        with staging_env("copy"):
            on_device = share_tensors(share, tenplex_load(share, device, "copy")())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    on_cpu = {k: t.cpu() for k, t in on_device.items()}
    nbytes = sum(t.numel() * t.element_size() for t in on_cpu.values())
    where = snapshot_dir(work, nbytes)
    out: dict[str, Any] = {"device": str(device), "model": model, "bytes": nbytes, "dir": where, "rows": []}
    try:
        ref_path = os.path.join(where, "cpu.safetensors")
        with staging_env("auto"):
            ref = shm_write.write_tensors(ref_path, on_cpu, BLOCK_BYTES)
        ref_digest = file_digest(ref_path)
        for mode in ("auto", "copy", "direct"):  # auto: writer threads; copy: the pinned ring on one thread
            path = os.path.join(where, f"{mode}.safetensors")
            with staging_env(mode):
                got = shm_write.write_tensors(path, on_device, BLOCK_BYTES)
                secs = best_seconds(lambda p=path: shm_write.write_tensors(p, on_device, BLOCK_BYTES, reuse=True),
                                    device, reps)
            out["rows"].append({"mode": mode, "identical": got == ref and file_digest(path) == ref_digest,
                                "gbps": nbytes / secs / GB})
            os.remove(path)
        with staging_env("auto"):
            secs = best_seconds(lambda: shm_write.write_tensors(ref_path, on_cpu, BLOCK_BYTES, reuse=True),
                                torch.device("cpu"), reps)
        out["cpu_tensors_gbps"] = nbytes / secs / GB
    finally:
        shutil.rmtree(where, ignore_errors=True)
    out["ok"] = all(r["identical"] for r in out["rows"])
    return out


def main(argv: list[str] | None = None) -> int:
    """One step on one device; its figures to ``--out``; 0 when every comparison held."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["identity", "snapshot"])
    ap.add_argument("--device", type=parse_device, default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="default on a GPU: gpt3-125m (identity: 0.46 GB per load, a dozen "
                    "loads), gpt3-350m (snapshot: 1.27 GB); on the CPU: tiny")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--work", default=None, help="where to write the files (default: a temporary directory)")
    ap.add_argument("--out", required=True, help="write the figures here (JSON)")
    args = ap.parse_args(argv)
    device = args.device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            ap.error(f"--device {device}: torch {torch.__version__} sees no CUDA device here")
        torch.cuda.set_device(device)
    model = args.model or ("tiny" if device.type == "cpu" else "gpt3-125m" if args.step == "identity" else "gpt3-350m")
    work = tempfile.mkdtemp(prefix="gpu-check-", dir=args.work)
    try:
        run = check_identity if args.step == "identity" else check_snapshot
        result = run(device, model, work, args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
