"""Re-sharding benchmark: tenplex against megatron-core dist_checkpointing and a centralized baseline, same run.

For each model and transition A -> B it measures, on the same machine and disk:
  tenplex   save at A (every rank writes its own chunks), load-with-reshard at B;
  mcore     megatron-core dist_checkpointing, torch_dist + fully_reshardable, save at A, load at B;
  central   the Tenplex paper's "Central": rank 0 gathers the whole state from A's
            checkpoint, writes one consolidated copy, then every rank at B reads its part of it;
tenplex's load is measured with and without checksum verification (its cost),
plus the raw sequential read bandwidth of the checkpoint files and an in-memory copy of
the same bytes. Times are medians over --reps repetitions (each the max over ranks,
between barriers); peak memory is the largest RSS growth of any rank during the
operation. Output: a table, `RATIO <metric> <transition> tenplex/<peer> = X.XX` lines
(below 1: tenplex is better), a JSON file and a PNG plot.

    python scripts/bench_reshard.py --quick            # tiny + gpt3-125m, one transition, 2 CPU cores
    python scripts/bench_reshard.py --models gpt3-125m gpt3-350m --transitions tp2-dp2 dp2-tp2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TRANSITIONS = {  # name: ((tp, pp, dp) at A, (tp, pp, dp) at B)
    "tp2-dp2": ((2, 1, 1), (1, 1, 2)),
    "dp2-tp2": ((1, 1, 2), (2, 1, 1)),
    "tp2-pp2": ((2, 1, 1), (1, 2, 1)),
    "dp2-dp1": ((1, 1, 2), (1, 1, 1)),
}


# ----------------------------------------------------------------------------------------------- worker


class PeakRSS:
    """Largest RSS growth of this process while the block runs (sampled every 2 ms)."""

    def __enter__(self) -> PeakRSS:
        import psutil

        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self.stop = True
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.base


def worker(a: argparse.Namespace) -> None:
    import torch
    from megatron.core import parallel_state

    from tenplex_megatron.execute.collective import all_gather_json
    from tenplex_megatron.integrations import gpt, mcore_dist_ckpt
    from tenplex_megatron.integrations.checkpoint import load_checkpoint, save_checkpoint
    from tenplex_megatron.integrations.synthetic_data import microbatches
    from tenplex_megatron.plan.gpt_catalogue import load_model
    from tenplex_megatron.plan.layout import ParallelLayout

    gpt.init_distributed()
    d = load_model(a.model)
    spec = gpt.GPTSpec(num_layers=d.num_layers, hidden_size=d.hidden_size, num_attention_heads=d.num_attention_heads,
                       seq_length=a.seq, max_position_embeddings=a.seq, vocab_size=d.vocab_size,
                       make_vocab_size_divisible_by=128, swiglu=d.swiglu, hidden_dropout=0.0, attention_dropout=0.0)
    layout = ParallelLayout(*a.layout)
    job = gpt.build_job(spec, layout, use_distributed_optimizer=True, micro_batch_size=1, global_batch_size=2 * layout.dp)
    rank = torch.distributed.get_rank()
    results = []
    if a.op == "save":
        data = microbatches(0, job.global_batch_size, 1, layout.dp, parallel_state.get_data_parallel_rank(),
                            a.seq, spec.vocab_size, spec.seed)
        gpt.train_step(job, data)  # optimizer state exists
    for rep in range(a.reps):
        torch.distributed.barrier()
        info: dict = {}
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            if a.system == "tenplex" and a.op == "save":
                info["bytes"] = save_checkpoint(job, a.ckpt).bytes_written
            elif a.system == "tenplex" and a.op == "load":
                info["bytes"] = load_checkpoint(job, a.ckpt, verify=not a.no_verify).bytes_read
            elif a.system == "mcore" and a.op == "save":
                target = f"{a.ckpt}/rep{rep}"
                mcore_dist_ckpt.save(job, target)
            elif a.system == "mcore" and a.op == "load":
                mcore_dist_ckpt.load(job, a.ckpt)
            elif a.system == "central" and a.op == "load":
                info.update(central_load(job, a.ckpt, f"{a.scratch}/central"))
            torch.distributed.barrier()
            seconds = time.perf_counter() - t0
        info.update(seconds=seconds, mem=mem.growth)
        results.append(all_gather_json(info))
        if a.system == "mcore" and a.op == "save" and rank == 0 and rep < a.reps - 1:
            shutil.rmtree(f"{a.ckpt}/rep{rep}", ignore_errors=True)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def central_load(job, src_dir: str, central_dir: str) -> dict:
    """Rank 0 gathers every tensor at full size, writes one copy; then every rank loads its part of that copy."""
    import torch

    from tenplex_megatron.execute.executor import SourceFiles, execute_plan
    from tenplex_megatron.integrations.checkpoint import load_checkpoint
    from tenplex_megatron.plan.planner import plan_reshard
    from tenplex_megatron.plan.ptc import PTC, Chunk, Location, StoredChunk
    from tenplex_megatron.storage import layout as L
    from tenplex_megatron.storage.safetensors_io import TORCH_DTYPES, write_safetensors

    rank = torch.distributed.get_rank()
    gathered = 0
    if rank == 0:
        ckpt = L.find_checkpoint(src_dir)
        meta = L.read_metadata(ckpt)
        src = PTC.from_json(meta["ptc"])
        full = [Chunk(k, (0,) * len(t.global_shape), t.global_shape) for k, t in src.tensors.items()]
        plan = plan_reshard(src, src.tensors, {0: full})
        bufs = [torch.empty(c.numel, dtype=TORCH_DTYPES[src.tensors[c.key].dtype]) for c in full]
        files = SourceFiles(ckpt, {k: t.dtype for k, t in src.tensors.items()}, verify=False)
        gathered = execute_plan(plan.ranks[0], plan.sources, files, bufs).bytes_read
        files.close()
        iteration = meta["iteration"]
        os.makedirs(central_dir, exist_ok=True)
        L.prepare_partial(central_dir, iteration)
        name = "central.safetensors"
        size, sums = write_safetensors(os.path.join(L.partial_dir(central_dir, iteration), name),
                                       {c.key: b for c, b in zip(full, bufs)})
        stored = tuple(StoredChunk(c, Location(name, c.key, 0, "", sums[c.key])) for c in full)
        meta = dict(meta, ptc=PTC(src.tensors, stored, meta["layout"]).to_json(), files={name: size})
        L.commit(central_dir, iteration, meta, {name: size})
    torch.distributed.barrier()
    res = load_checkpoint(job, central_dir, verify=False)
    return {"bytes": res.bytes_read + gathered}


# ----------------------------------------------------------------------------------------------- driver


def launch(nproc: int, args: list[str], timeout: float) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           os.path.abspath(__file__), "--worker", *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-2000:] + p.stderr[-6000:])
        raise SystemExit(f"bench: worker failed: {' '.join(args)}")


def measure(system: str, op: str, model: str, layout, ckpt: str, scratch: str, a: argparse.Namespace) -> dict:
    out = os.path.join(scratch, f"{system}_{op}.json")
    args = ["--system", system, "--op", op, "--model", model, "--layout", *map(str, layout), "--ckpt", ckpt,
            "--reps", str(a.reps), "--seq", str(a.seq), "--out", out, "--scratch", scratch]
    if a.no_verify:
        args.append("--no-verify")
    launch(layout[0] * layout[1] * layout[2], args, a.timeout)
    with open(out) as f:
        reps = json.load(f)
    return {
        "seconds": statistics.median(max(r["seconds"] for r in rep) for rep in reps),
        "mem_peak": max(max(r["mem"] for r in rep) for rep in reps),
        "bytes": sum(r.get("bytes", 0) for r in reps[-1]) or None,
    }


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def raw_bandwidth(path: str) -> tuple[float, float]:
    """(sequential file read GB/s, in-memory copy GB/s) over the same bytes."""
    import numpy as np

    files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs if f.endswith(".safetensors")]
    t0 = time.perf_counter()
    blobs = []
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            blobs.append(fh.read())
    read_s = time.perf_counter() - t0
    n = sum(len(b) for b in blobs)
    arr = [np.frombuffer(b, dtype=np.uint8) for b in blobs]
    t0 = time.perf_counter()
    for x in arr:
        x.copy()
    copy_s = time.perf_counter() - t0
    return n / read_s / 1e9, n / copy_s / 1e9


def run(a: argparse.Namespace) -> dict:
    from tenplex_megatron.plan.gpt_catalogue import load_model

    report: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "runs": []}
    for model in a.models:
        d = load_model(model)
        for name in a.transitions:
            src, dst = TRANSITIONS[name]
            scratch = tempfile.mkdtemp(prefix=f"bench_{model}_{name}_", dir=a.workdir)
            row: dict = {"model": model, "transition": name, "from": src, "to": dst,
                         "params": 12 * d.num_layers * d.hidden_size**2 + d.vocab_size * d.hidden_size}
            tck, mck = f"{scratch}/tenplex", f"{scratch}/mcore"
            row["tenplex_save"] = measure("tenplex", "save", model, src, tck, scratch, a)
            row["tenplex_save"]["bytes"] = dir_bytes(tck)
            row["tenplex_load"] = measure("tenplex", "load", model, dst, tck, scratch, a)
            a.no_verify = True
            row["tenplex_load_noverify"] = measure("tenplex", "load", model, dst, tck, scratch, a)
            a.no_verify = False
            row["mcore_save"] = measure("mcore", "save", model, src, mck, scratch, a)
            last = f"{mck}/rep{a.reps - 1}"
            row["mcore_save"]["bytes"] = dir_bytes(last)
            row["mcore_load"] = measure("mcore", "load", model, dst, last, scratch, a)
            row["central_load"] = measure("central", "load", model, dst, tck, scratch, a)
            read_bw, copy_bw = raw_bandwidth(tck)
            tb = row["tenplex_load"]["bytes"] or 0
            row["raw"] = {"read_GBps": read_bw, "copy_GBps": copy_bw,
                          "tenplex_load_GBps": tb / row["tenplex_load"]["seconds"] / 1e9}
            report["runs"].append(row)
            print_row(row)
            if not a.keep:
                shutil.rmtree(scratch, ignore_errors=True)
    return report


def print_row(r: dict) -> None:
    def f(x: dict) -> str:
        b = x.get("bytes")
        return f"{x['seconds']:8.2f} s {x['mem_peak'] / 1e6:9.1f} MB {('%9.1f MB' % (b / 1e6)) if b else '        -   '}"

    print(f"\n{r['model']}  {r['transition']}  {r['from']} -> {r['to']}")
    print(f"  {'':16} {'time':>10} {'peak RSS+':>12} {'bytes':>12}")
    for k in ("tenplex_save", "mcore_save", "tenplex_load", "tenplex_load_noverify", "mcore_load", "central_load"):
        print(f"  {k:16} {f(r[k])}")
    raw = r["raw"]
    print(f"  raw read {raw['read_GBps']:.2f} GB/s, memory copy {raw['copy_GBps']:.2f} GB/s, tenplex load "
          f"{raw['tenplex_load_GBps']:.2f} GB/s = {raw['tenplex_load_GBps'] / raw['read_GBps']:.0%} of raw read, "
          f"{raw['tenplex_load_GBps'] / raw['copy_GBps']:.0%} of memory copy", flush=True)


def ratios(report: dict) -> list[str]:
    lines = []
    for r in report["runs"]:
        t = f"{r['model']}:{r['transition']}"
        lines.append(f"RATIO save_time {t} tenplex/mcore = {r['tenplex_save']['seconds'] / r['mcore_save']['seconds']:.2f}")
        lines.append(f"RATIO load_time {t} tenplex/mcore = {r['tenplex_load']['seconds'] / r['mcore_load']['seconds']:.2f}")
        lines.append(f"RATIO load_time {t} tenplex/central = {r['tenplex_load']['seconds'] / r['central_load']['seconds']:.2f}")
        lines.append(f"RATIO load_time {t} tenplex_verified/tenplex_unverified = "
                     f"{r['tenplex_load']['seconds'] / r['tenplex_load_noverify']['seconds']:.2f}")
        lines.append(f"RATIO save_mem {t} tenplex/mcore = {r['tenplex_save']['mem_peak'] / max(r['mcore_save']['mem_peak'], 1):.2f}")
        lines.append(f"RATIO load_mem {t} tenplex/mcore = {r['tenplex_load']['mem_peak'] / max(r['mcore_load']['mem_peak'], 1):.2f}")
        lines.append(f"RATIO disk_bytes {t} tenplex/mcore = {r['tenplex_save']['bytes'] / r['mcore_save']['bytes']:.2f}")
        if r["central_load"].get("bytes") and r["tenplex_load"].get("bytes"):
            lines.append(f"RATIO bytes_read {t} tenplex/central = {r['tenplex_load']['bytes'] / r['central_load']['bytes']:.2f}")
    return lines


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    runs = report["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{r['model']}\n{r['transition']}" for r in runs]
    x = range(len(runs))
    for ax, op, systems in ((axes[0], "save", ("tenplex", "mcore")), (axes[1], "load", ("tenplex", "mcore", "central"))):
        w = 0.8 / len(systems)
        for i, s in enumerate(systems):
            key = f"{s}_{op}"
            ax.bar([xi + i * w for xi in x], [r[key]["seconds"] for r in runs], w, label=s)
        ax.set_xticks([xi + w * (len(systems) - 1) / 2 for xi in x], labels)
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"{op} ({'at A' if op == 'save' else 'with re-shard at B'})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system"), ap.add_argument("--op"), ap.add_argument("--model", default="tiny")
    ap.add_argument("--layout", type=int, nargs=3), ap.add_argument("--ckpt"), ap.add_argument("--out")
    ap.add_argument("--scratch")
    ap.add_argument("--models", nargs="+", default=["tiny", "gpt3-125m"])
    ap.add_argument("--transitions", nargs="+", default=["tp2-dp2"], choices=sorted(TRANSITIONS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128, help="sequence length (shorter than GPT-3's for CPU speed)")
    ap.add_argument("--quick", action="store_true", help="tiny + gpt3-125m, tp2-dp2, 3 repetitions")
    ap.add_argument("--no-verify", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--json", default=os.path.join(ROOT, "out", "bench_reshard.json"))
    ap.add_argument("--png", default=os.path.join(ROOT, "out", "bench_reshard.png"))
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return 0
    if a.quick:
        a.models, a.transitions, a.reps = ["tiny", "gpt3-125m"], ["tp2-dp2"], 3
    report = run(a)
    print()
    for line in ratios(report):
        print(line)
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"json: {a.json}")
    plot(report, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
