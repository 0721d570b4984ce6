"""DeepSpeed ZeRO re-sharding benchmark: DeepSpeed's own route against tenplex, in one run, same machine and files.

A GPT-2-shaped model (``--model``; ``--quick`` picks a small one) is trained for
one step at the source DP size (so Adam moments exist), then re-sharded to the
destination DP size. Measured:

save, at the source DP size (``--reps`` repetitions each, order rotating):
  ds_save        DeepSpeed's ``engine.save_checkpoint`` (``latest`` + ``global_stepN/``; torch.save, no fsync);
  ds_save+fsync  the same, plus fsync of every file it wrote (tenplex's save fsyncs; this is the like-for-like);
  tenplex        ``tenplex_megatron.integrations.deepspeed.save_checkpoint`` (fsyncs every file, atomic commit).
re-shard to the destination DP size:
  (a) ds_universal    DeepSpeed's route: ``ds_to_universal`` (its ``main()`` run in one process, ``--reps``
                      times; interpreter start-up and imports are reported apart) then a universal load
                      (``{"checkpoint": {"load_universal": true}}``, ``engine.load_checkpoint(D, tag=...)``);
  (b) tenplex_direct  ``tds.load_checkpoint`` straight from DeepSpeed's own files, no conversion;
  (c) tenplex         ``tds.load_checkpoint`` from the tenplex checkpoint.

Each load method runs in its own torchrun launch (so its peak RSS is its own)
and loads ``--reps`` times into one engine; before every repetition after the
first the engine's fp32 master and Adam moments are zeroed, so each
repetition has to load them again. Times are taken in the workers with
``time.perf_counter`` between ``dist.barrier()`` calls; a repetition's time is
the max over ranks, the table shows the median. Peak RSS is sampled every
5 ms with psutil on every rank (for the conversion: the sum over its process
tree, pool workers included).

Correctness, checked inside the bench: after the last load of each method, the
full fp32 master weights and Adam ``exp_avg``/``exp_avg_sq`` of every
parameter (DeepSpeed's own ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state``) are hashed on rank 0; (a), (b) and (c) must
agree bit for bit, and with the state at save time. Anything else exits 1
with ``CORRECTNESS FAILED`` (the JSON is still written).

Output: a table, ``RATIO <metric> <transition> tenplex/<peer> = X.XX`` lines
(below 1: tenplex is better), JSON (``--json``) and a PNG bar chart (``--png``).
The machine this was written on has 2 shared CPU cores: timings are noisy.

    python scripts/bench_deepspeed.py --quick                  # small GPT-2 shape, ZeRO-2, DP 2 -> 1
    python scripts/bench_deepspeed.py                          # gpt2-124m, ZeRO-2, DP 2 -> 1
    python scripts/bench_deepspeed.py --stage 3 --from 2 --to 4 --model gpt2-350m
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tenplex_megatron._optional import MissingExtraError, require  # noqa: E402

# GPT-2 shapes: layers, hidden, heads, vocabulary, sequence length, position table.
MODELS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1024, "seq": 32, "n_positions": 32},
    "mini": {"n_layer": 4, "n_embd": 256, "n_head": 8, "vocab_size": 50257, "seq": 128, "n_positions": 1024},
    "gpt2-124m": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "seq": 128, "n_positions": 1024},
    "gpt2-350m": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "vocab_size": 50257, "seq": 128, "n_positions": 1024},
}
QUICK_MODEL = "mini"
TRANSITIONS = {(2, 1), (1, 2), (2, 4)}
GLOBAL_BATCH = 4  # divisible by every DP size above: micro-batch = 4 / DP, one micro-batch per step
LOAD_METHODS = ("ds_universal", "tenplex_direct", "tenplex")
STATE_KINDS = ("fp32", "exp_avg", "exp_avg_sq")
MiB = 1024 * 1024


# ----------------------------------------------------------------------------------------------- measuring


class PeakRSS:
    """Peak RSS during a block, sampled every 5 ms by a thread: this process, or (``tree``) it plus its children."""

    def __init__(self, tree: bool = False) -> None:
        import psutil

        self._proc = psutil.Process()
        self._tree = tree
        self.before = self.peak = self._rss()

    def _rss(self) -> int:
        total = self._proc.memory_info().rss
        if self._tree:
            for child in self._proc.children(recursive=True):
                try:
                    total += child.memory_info().rss
                except Exception:  # noqa: BLE001 - a pool worker may exit between listing and reading
                    pass
        return total

    def __enter__(self) -> PeakRSS:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())


def io_chars() -> tuple[int, int]:
    """(read_chars, write_chars) of this process, reaped children included (Linux /proc/self/io)."""
    import psutil

    io = psutil.Process().io_counters()
    return int(getattr(io, "read_chars", io.read_bytes)), int(getattr(io, "write_chars", io.write_bytes))


def dir_bytes(path: str) -> tuple[int, int]:
    """(bytes, files) under ``path``."""
    total = files = 0
    for base, _, names in os.walk(path):
        for n in names:
            total += os.path.getsize(os.path.join(base, n))
            files += 1
    return total, files


# ----------------------------------------------------------------------------------------------- worker


def _build_engine(model: str, stage: int, universal: bool = False) -> Any:
    """A DeepSpeed engine over a GPT-2 of shape ``model`` (seeded: every engine starts from the same weights)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = MODELS[model]
    torch.manual_seed(1234)
    cfg = GPT2Config(n_layer=shape["n_layer"], n_embd=shape["n_embd"], n_head=shape["n_head"],
                     vocab_size=shape["vocab_size"], n_positions=shape["n_positions"],
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    net = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    dp = dist.get_world_size()
    conf: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 5}},
        "steps_per_print": 10**9,
    }
    if universal:
        conf["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=conf)
    return engine


def _train_step(engine: Any, model: str, step: int) -> float:
    """One global batch of random tokens, this rank's contiguous share; returns this rank's loss."""
    import torch
    import torch.distributed as dist

    seq, vocab = MODELS[model]["seq"], MODELS[model]["vocab_size"]
    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=g)
    dp, r = dist.get_world_size(), dist.get_rank()
    x = tokens[r * GLOBAL_BATCH // dp:(r + 1) * GLOBAL_BATCH // dp]
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return float(loss)


def _state_digest(engine: Any) -> tuple[dict[str, str], dict[str, float]]:
    """Hash of every parameter's full fp32 master and Adam moments (collective; the result is rank 0's).

    Also the sum of absolute values per kind, so a state of zeros (nothing loaded, or nothing trained) shows.
    """
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    digests: dict[str, str] = {}
    sums = dict.fromkeys(STATE_KINDS, 0.0)
    for name, p in engine.module.named_parameters():
        full = {"fp32": safe_get_full_fp32_param(p)}
        for k in ("exp_avg", "exp_avg_sq"):
            full[k] = safe_get_full_optimizer_state(p, k)
        if dist.get_rank() != 0:
            continue
        for k, t in full.items():
            if t is None:
                digests[f"{k}.{name}"] = "MISSING"
                continue
            t = t.detach().contiguous().cpu()
            h = hashlib.blake2b(t.numpy().tobytes(), digest_size=16).hexdigest()
            digests[f"{k}.{name}"] = f"{list(t.shape)}:{t.dtype}:{h}"
            sums[k] += float(t.double().abs().sum())
    return digests, sums


def _zero_state(engine: Any) -> None:
    """Zero the fp32 master partitions and Adam moments, so the next load must fill them again."""
    import torch

    inner = engine.optimizer.optimizer
    with torch.no_grad():
        for flat, st in inner.state.items():
            flat.zero_()
            for k in ("exp_avg", "exp_avg_sq"):
                if isinstance(st.get(k), torch.Tensor):
                    st[k].zero_()


def _timed(fn: Callable[[], Any]) -> tuple[float, Any, dict[str, int]]:
    """Run ``fn`` between barriers; (seconds on this rank, its result, RSS and read()/write() bytes)."""
    import torch.distributed as dist

    dist.barrier()
    r0, w0 = io_chars()
    with PeakRSS() as m:
        t0 = time.perf_counter()
        out = fn()
        dist.barrier()
        dt = time.perf_counter() - t0
    r1, w1 = io_chars()
    return dt, out, {"rss_before": m.before, "rss_peak": m.peak, "rchar": r1 - r0, "wchar": w1 - w0}


def _fsync_tree(path: str) -> None:
    for base, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(base, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _worker_save(a: argparse.Namespace) -> dict[str, Any]:
    """At the source DP size: train one step, then save ``reps`` times with DeepSpeed and with tenplex."""
    import torch.distributed as dist

    from tenplex_megatron.integrations import deepspeed as tds

    r = dist.get_rank()
    engine = _build_engine(a.model, a.stage)
    loss = _train_step(engine, a.model, 1)
    digest, sums = _state_digest(engine)
    reps: dict[str, list[dict[str, Any]]] = {"ds_save": [], "ds_save_fsync": [], "tenplex": []}
    for i in range(a.reps):
        order = ["ds", "tenplex"] if i % 2 == 0 else ["tenplex", "ds"]
        for system in order:
            path = os.path.join(a.workdir, system if i == 0 else f"{system}_rep{i}")
            if system == "ds":
                dt, _, rec = _timed(lambda path=path: engine.save_checkpoint(path))
                dt_sync, _, _ = _timed(lambda path=path: _fsync_tree(path) if r == 0 else None)
                size, files = dir_bytes(path) if r == 0 else (0, 0)
                reps["ds_save"].append({"seconds": dt, **rec, "dir_bytes": size, "files": files})
                reps["ds_save_fsync"].append({"seconds": dt + dt_sync, "fsync_seconds": dt_sync})
            else:
                dt, res, rec = _timed(lambda path=path: tds.save_checkpoint(engine, path))
                size, files = dir_bytes(path) if r == 0 else (0, 0)
                reps["tenplex"].append({"seconds": dt, **rec, "dir_bytes": size, "files": files,
                                        "bytes_written": res.bytes_written, "total_bytes": res.total_bytes,
                                        "own_seconds": res.seconds})
            dist.barrier()
            if i > 0 and r == 0:  # only repetition 0's checkpoints are loaded; keep the disk small
                shutil.rmtree(path)
            dist.barrier()
    return {"loss": loss, "global_steps": int(engine.global_steps), "digest": digest, "sums": sums, "reps": reps,
            "params": sum(p.numel() for p in engine.module.parameters())}


def _worker_load(a: argparse.Namespace) -> dict[str, Any]:
    """At the destination DP size: load ``reps`` times by one method into one engine, then hash the state."""
    from tenplex_megatron.integrations import deepspeed as tds

    engine = _build_engine(a.model, a.stage, universal=a.method == "ds_universal")
    ds_dir, tp_dir = os.path.join(a.workdir, "ds"), os.path.join(a.workdir, "tenplex")

    def load() -> dict[str, Any]:
        if a.method == "ds_universal":
            path, _ = engine.load_checkpoint(ds_dir, tag=a.universal_tag)
            if path is None:
                raise RuntimeError(f"DeepSpeed's universal load found nothing at {ds_dir}/{a.universal_tag}")
            return {}
        res = tds.load_checkpoint(engine, ds_dir if a.method == "tenplex_direct" else tp_dir)
        if (res.source_format == "deepspeed") != (a.method == "tenplex_direct"):
            raise RuntimeError(f"{a.method}: LoadResult.source_format={res.source_format}")
        return {"bytes_read": res.bytes_read, "own_seconds": res.seconds}

    reps = []
    for i in range(a.reps):
        if i > 0:
            _zero_state(engine)
        dt, out, rec = _timed(load)
        reps.append({"seconds": dt, **rec, **out})
    digest, sums = _state_digest(engine)
    return {"global_steps": int(engine.global_steps), "digest": digest, "sums": sums, "reps": reps}


def _worker_convert(a: argparse.Namespace) -> dict[str, Any]:
    """DeepSpeed's ``ds_to_universal``, its ``main()`` run ``reps`` times in this one process (no torchrun)."""
    import psutil

    startup = time.time() - psutil.Process().create_time()
    t0 = time.perf_counter()
    from deepspeed.checkpoint import ds_to_universal as d2u

    import_s = time.perf_counter() - t0
    args = argparse.Namespace(input_folder=a.input, output_folder=a.output, num_extract_workers=a.workers,
                              num_merge_workers=a.merge_workers, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    reps = []
    for _ in range(a.reps):
        if os.path.exists(a.output):
            shutil.rmtree(a.output)
        r0, w0 = io_chars()
        with PeakRSS(tree=True) as m:
            t = time.perf_counter()
            d2u.main(args)
            dt = time.perf_counter() - t
        r1, w1 = io_chars()
        reps.append({"seconds": dt, "rss_before": m.before, "rss_peak": m.peak, "rchar": r1 - r0, "wchar": w1 - w0})
    size, files = dir_bytes(a.output)
    return {"startup_s": startup + import_s, "reps": reps, "dir_bytes": size, "files": files}


def worker(argv: list[str]) -> None:
    """Hidden subcommand ``_worker {save,load,convert}``: one phase; rank 0 writes the JSON ``--out``."""
    ap = argparse.ArgumentParser(prog="bench_deepspeed.py _worker")
    ap.add_argument("phase", choices=["save", "load", "convert"])
    ap.add_argument("--model", choices=sorted(MODELS))
    ap.add_argument("--stage", type=int)
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument("--workdir")
    ap.add_argument("--method", choices=LOAD_METHODS)
    ap.add_argument("--universal-tag")
    ap.add_argument("--input")
    ap.add_argument("--output")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--merge-workers", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.phase == "convert":
        result = _worker_convert(a)
        with open(a.out, "w") as f:
            json.dump(result, f)
        return
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # CPU: skip compiling a shared-memory comm op
    deepspeed.init_distributed(dist_backend="gloo")
    result = _worker_save(a) if a.phase == "save" else _worker_load(a)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, result["reps"])
    if dist.get_rank() == 0:
        result["reps"] = per_rank  # [rank][...]
        with open(a.out, "w") as f:
            json.dump(result, f)
    dist.barrier()


# ----------------------------------------------------------------------------------------------- orchestration


def _run(cmd: list[str], log: str, timeout: float) -> None:
    """Run a child with OMP_NUM_THREADS=1; its output goes to ``log``; a failure prints the log's tail and exits."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    if rc != 0:
        with open(log) as f:
            tail = f.read()[-6000:]
        sys.exit(f"{' '.join(cmd[:8])} ... failed (exit {rc}); log {log}:\n{tail}")


def _torchrun(nproc: int, argv: list[str], log: str, timeout: float) -> None:
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
          os.path.abspath(__file__), "_worker", *argv], log, timeout)


def _read(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _per_rep(reps_by_rank: list[list[dict[str, Any]]], key: str, how: Callable[[list[float]], float]) -> list[float]:
    """For each repetition, ``how`` over ranks of ``key``."""
    return [how([rank[i][key] for rank in reps_by_rank]) for i in range(len(reps_by_rank[0]))]


def _summary(times: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "reps_s": times}


def _peak(reps_by_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Peak RSS per rank over all repetitions, and its growth over the RSS before the first one."""
    peaks = [max(r["rss_peak"] for r in rank) for rank in reps_by_rank]
    growth = [max(r["rss_peak"] for r in rank) - rank[0]["rss_before"] for rank in reps_by_rank]
    return {"peak_rss_per_rank": peaks, "peak_rss_max": max(peaks), "rss_growth_per_rank": growth,
            "rss_growth_max": max(growth)}


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf") if a else 1.0


def summarize(cfg: dict[str, Any], save: dict[str, Any], conv: dict[str, Any],
              loads: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Medians, bytes, peaks, the correctness checks and the ratios, from the workers' JSON."""
    s_reps = save["reps"]  # [rank]{system: [rep]}
    by = {sys_: [rank[sys_] for rank in s_reps] for sys_ in s_reps[0]}
    r0 = s_reps[0]
    save_out = {
        "ds_save": {**_summary(_per_rep(by["ds_save"], "seconds", max)), **_peak(by["ds_save"]),
                    "bytes_written": r0["ds_save"][0]["dir_bytes"], "files": r0["ds_save"][0]["files"]},
        "ds_save_fsync": {**_summary(_per_rep(by["ds_save_fsync"], "seconds", max)),
                          "bytes_written": r0["ds_save"][0]["dir_bytes"]},
        "tenplex": {**_summary(_per_rep(by["tenplex"], "seconds", max)), **_peak(by["tenplex"]),
                    "bytes_written": r0["tenplex"][0]["dir_bytes"], "files": r0["tenplex"][0]["files"],
                    "total_bytes_reported": r0["tenplex"][0]["total_bytes"],
                    "bytes_written_per_rank": [rank["tenplex"][0]["bytes_written"] for rank in s_reps]},
    }
    conv_times = [r["seconds"] for r in conv["reps"]]
    conv_out = {**_summary(conv_times), "startup_s": conv["startup_s"], "disk_bytes": conv["dir_bytes"],
                "files": conv["files"], "bytes_written": max(r["wchar"] for r in conv["reps"]),
                "bytes_read": max(r["rchar"] for r in conv["reps"]),
                "peak_rss_tree": max(r["rss_peak"] for r in conv["reps"]), "workers": cfg["convert_workers"]}
    load_out: dict[str, Any] = {}
    for m, res in loads.items():
        reps = res["reps"]
        read_key = "rchar" if m == "ds_universal" else "bytes_read"
        load_out[m] = {**_summary(_per_rep(reps, "seconds", max)), **_peak(reps),
                       "bytes_read": int(statistics.median(_per_rep(reps, read_key, sum))),
                       "bytes_read_measure": "read() syscalls, all ranks" if m == "ds_universal"
                       else "tenplex LoadResult.bytes_read, all ranks",
                       "global_steps": res["global_steps"]}
    ds_route = conv_out["median_s"] + load_out["ds_universal"]["median_s"]
    ds_route_peak = max(conv_out["peak_rss_tree"], load_out["ds_universal"]["peak_rss_max"])
    reshard = {
        "ds_universal": {"seconds": ds_route, "seconds_with_startup": ds_route + conv_out["startup_s"],
                         "extra_disk_bytes": conv_out["disk_bytes"], "extra_bytes_written": conv_out["bytes_written"],
                         "bytes_read": conv_out["bytes_read"] + load_out["ds_universal"]["bytes_read"],
                         "peak_rss": ds_route_peak},
        "tenplex_direct": {"seconds": load_out["tenplex_direct"]["median_s"], "extra_disk_bytes": 0,
                           "extra_bytes_written": 0, "bytes_read": load_out["tenplex_direct"]["bytes_read"],
                           "peak_rss": load_out["tenplex_direct"]["peak_rss_max"]},
        "tenplex": {"seconds": load_out["tenplex"]["median_s"], "extra_disk_bytes": 0, "extra_bytes_written": 0,
                    "bytes_read": load_out["tenplex"]["bytes_read"], "peak_rss": load_out["tenplex"]["peak_rss_max"]},
    }

    # correctness
    ref = loads["ds_universal"]["digest"]
    problems: list[str] = []
    for m in LOAD_METHODS:
        d = loads[m]["digest"]
        if not d:
            problems.append(f"{m}: no state digests")
        for other, want in (("ds_universal", ref), ("state at save", save["digest"])):
            if other == m:
                continue
            bad = sorted(k for k in set(want) | set(d) if want.get(k) != d.get(k))
            if bad:
                problems.append(f"{m} vs {other}: {len(bad)} of {len(want)} tensors differ, e.g. {bad[:3]}")
        if loads[m]["global_steps"] != save["global_steps"]:
            problems.append(f"{m}: global_steps {loads[m]['global_steps']} != {save['global_steps']} at save")
        if missing := [k for k, v in d.items() if v == "MISSING"]:
            problems.append(f"{m}: no state for {missing[:3]}")
    if not all(save["sums"][k] > 0 for k in STATE_KINDS):
        problems.append(f"state at save has an all-zero kind: {save['sums']} (nothing to re-shard?)")
    checks = {"passed": not problems, "problems": problems, "tensors_compared": len(ref),
              "compared": "blake2b of every parameter's full fp32 master, exp_avg, exp_avg_sq "
                          "(safe_get_full_fp32_param / safe_get_full_optimizer_state), bit-exact",
              "routes": list(LOAD_METHODS) + ["state at save"]}

    tr = cfg["transition"]
    ratios = {
        f"save_time {tr} tenplex/ds_save": _ratio(save_out["tenplex"]["median_s"], save_out["ds_save"]["median_s"]),
        f"save_time {tr} tenplex/ds_save_fsync": _ratio(save_out["tenplex"]["median_s"],
                                                        save_out["ds_save_fsync"]["median_s"]),
        f"save_bytes {tr} tenplex/ds_save": _ratio(save_out["tenplex"]["bytes_written"],
                                                   save_out["ds_save"]["bytes_written"]),
    }
    for m in ("tenplex_direct", "tenplex"):
        ratios[f"reshard_time {tr} {m}/ds_universal"] = _ratio(reshard[m]["seconds"], ds_route)
    for m in ("tenplex_direct", "tenplex"):
        ratios[f"load_time {tr} {m}/ds_universal_load"] = _ratio(load_out[m]["median_s"],
                                                                 load_out["ds_universal"]["median_s"])
    ratios[f"disk_bytes {tr} tenplex_direct/ds_universal"] = _ratio(0, conv_out["disk_bytes"])
    ratios[f"write_bytes {tr} tenplex_direct/ds_universal"] = _ratio(0, conv_out["bytes_written"])
    ratios[f"read_bytes {tr} tenplex_direct/ds_universal"] = _ratio(reshard["tenplex_direct"]["bytes_read"],
                                                                    reshard["ds_universal"]["bytes_read"])
    for m in ("tenplex_direct", "tenplex"):
        ratios[f"peak_rss {tr} {m}/ds_universal"] = _ratio(reshard[m]["peak_rss"], ds_route_peak)
    return {"config": cfg, "save": save_out, "convert": conv_out, "load": load_out, "reshard": reshard,
            "checks": checks, "ratios": ratios}


def _mib(b: float) -> str:
    return f"{b / MiB:9.1f}"


def table(res: dict[str, Any]) -> str:
    """The human-readable table."""
    c = res["config"]
    rows = [f"DeepSpeed re-sharding bench: {c['model']} ({c['params'] / 1e6:.1f}M params), ZeRO-{c['stage']}, "
            f"DP {c['src_dp']} -> {c['dst_dp']}, {c['reps']} reps (median; min-max), {c['cpus']} CPU cores, "
            "OMP_NUM_THREADS=1; shared machine: timings are noisy",
            f"{'phase':<10} {'system':<44} {'median s':>9} {'min-max s':>15} {'written MiB':>11} "
            f"{'read MiB':>9} {'peak RSS MiB':>12}"]

    def row(phase: str, name: str, d: dict[str, Any], written: float | None = None, read: float | None = None,
            rss: float | None = None) -> None:
        w = _mib(written) if written is not None else f"{'':>9}"
        rd = _mib(read) if read is not None else f"{'':>9}"
        pk = _mib(rss) if rss is not None else f"{'':>9}"
        rng = f"{d['min_s']:.2f}-{d['max_s']:.2f}" if "min_s" in d else ""
        rows.append(f"{phase:<10} {name:<44} {d['median_s']:9.2f} {rng:>15} {w:>11} {rd:>9} {pk:>12}")

    s = res["save"]
    row("save", "ds_save (engine.save_checkpoint)", s["ds_save"], s["ds_save"]["bytes_written"],
        rss=s["ds_save"]["peak_rss_max"])
    row("save", "ds_save + fsync of its files", s["ds_save_fsync"], s["ds_save"]["bytes_written"])
    row("save", "tenplex (fsync + atomic commit)", s["tenplex"], s["tenplex"]["bytes_written"],
        rss=s["tenplex"]["peak_rss_max"])
    cv, ld = res["convert"], res["load"]
    row("re-shard", f"(a) ds_to_universal ({cv['workers']} workers)", cv, cv["bytes_written"], cv["bytes_read"],
        cv["peak_rss_tree"])
    row("re-shard", "(a) universal load", ld["ds_universal"], read=ld["ds_universal"]["bytes_read"],
        rss=ld["ds_universal"]["peak_rss_max"])
    rs = res["reshard"]["ds_universal"]
    row("re-shard", "(a) ds_universal = convert + load", {"median_s": rs["seconds"]}, cv["bytes_written"],
        rs["bytes_read"], rs["peak_rss"])
    row("re-shard", "(b) tenplex_direct (DeepSpeed files)", ld["tenplex_direct"], 0,
        ld["tenplex_direct"]["bytes_read"], ld["tenplex_direct"]["peak_rss_max"])
    row("re-shard", "(c) tenplex (tenplex checkpoint)", ld["tenplex"], 0, ld["tenplex"]["bytes_read"],
        ld["tenplex"]["peak_rss_max"])
    rows.append(f"ds_to_universal: interpreter start + import {cv['startup_s']:.1f} s more when run as "
                f"`python -m` (not in the times above); it leaves {cv['disk_bytes'] / MiB:.1f} MiB in "
                f"{cv['files']} files on disk and wrote {cv['bytes_written'] / MiB:.1f} MiB in all (temp folder "
                "included). Read MiB for the universal load: read() syscalls; for tenplex: its own count "
                "(memory-mapped). Peak RSS: max over ranks (conversion: its process tree).")
    ck = res["checks"]
    rows.append(f"correctness: {'PASSED' if ck['passed'] else 'FAILED'}: {ck['tensors_compared']} tensors "
                f"(fp32 master, exp_avg, exp_avg_sq of every parameter) bit-identical across (a), (b), (c) "
                f"and the state at save" if ck["passed"] else
                "correctness: FAILED: " + "; ".join(ck["problems"]))
    return "\n".join(rows)


def plot(res: dict[str, Any], path: str) -> None:
    """Three bar panels: times, bytes, peak RSS (MissingExtraError without matplotlib)."""
    matplotlib = require("matplotlib", "bench", needed_by="the benchmark's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, cv, ld, rs = res["save"], res["convert"], res["load"], res["reshard"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    c = res["config"]
    fig.suptitle(f"{c['model']} ZeRO-{c['stage']} DP {c['src_dp']}->{c['dst_dp']} "
                 f"({c['cpus']} shared CPU cores; median of {c['reps']})")
    ax = axes[0]
    labels = ["ds_save", "ds_save\n+fsync", "tenplex\nsave", "ds_universal\n(convert+load)", "tenplex\ndirect",
              "tenplex"]
    bottoms = [s["ds_save"]["median_s"], s["ds_save_fsync"]["median_s"], s["tenplex"]["median_s"],
               cv["median_s"], ld["tenplex_direct"]["median_s"], ld["tenplex"]["median_s"]]
    colors = ["tab:gray", "tab:gray", "tab:blue", "tab:orange", "tab:blue", "tab:green"]
    ax.bar(labels, bottoms, color=colors)
    ax.bar(labels[3], ld["ds_universal"]["median_s"], bottom=cv["median_s"], color="tab:red",
           label="universal load (on top of conversion)")
    ax.axvline(2.5, color="k", lw=0.5)
    ax.set_ylabel("seconds")
    ax.set_title("save | re-shard time")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax = axes[1]
    labels = ["ds save\nwritten", "tenplex\nsave\nwritten", "convert\nwritten", "convert\nleft on\ndisk",
              "ds_universal\nread", "tenplex\ndirect\nread", "tenplex\nread"]
    vals = [s["ds_save"]["bytes_written"], s["tenplex"]["bytes_written"], cv["bytes_written"], cv["disk_bytes"],
            rs["ds_universal"]["bytes_read"], ld["tenplex_direct"]["bytes_read"], ld["tenplex"]["bytes_read"]]
    ax.bar(labels, [v / MiB for v in vals],
           color=["tab:gray", "tab:blue", "tab:orange", "tab:orange", "tab:orange", "tab:blue", "tab:green"])
    ax.set_ylabel("MiB")
    ax.set_title("bytes")
    ax.tick_params(axis="x", labelsize=7)
    ax = axes[2]
    labels = ["ds_save", "tenplex\nsave", "ds_to_universal\n(tree)", "universal\nload", "tenplex\ndirect",
              "tenplex"]
    vals = [s["ds_save"]["peak_rss_max"], s["tenplex"]["peak_rss_max"], cv["peak_rss_tree"],
            ld["ds_universal"]["peak_rss_max"], ld["tenplex_direct"]["peak_rss_max"], ld["tenplex"]["peak_rss_max"]]
    ax.bar(labels, [v / MiB for v in vals],
           color=["tab:gray", "tab:blue", "tab:orange", "tab:red", "tab:blue", "tab:green"])
    ax.set_ylabel("MiB (max over ranks)")
    ax.set_title("peak RSS")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Orchestrate: save at the source DP size, convert, load three ways at the destination, report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default=None,
                    help=f"GPT-2 shape (default gpt2-124m; {QUICK_MODEL} with --quick)")
    ap.add_argument("--quick", action="store_true", help=f"the {QUICK_MODEL} shape: a few minutes on 2 CPU cores")
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], default=2)
    ap.add_argument("--from", dest="src", type=int, default=2)
    ap.add_argument("--to", dest="dst", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every timed save, conversion and load (>= 3)")
    ap.add_argument("--convert-workers", type=int, default=None,
                    help="ds_to_universal extract and merge workers (default: DeepSpeed's 4/2, capped at the CPU count)")
    ap.add_argument("--json", default=os.path.join(ROOT, "out", "bench_deepspeed.json"))
    ap.add_argument("--png", default=os.path.join(ROOT, "out", "bench_deepspeed.png"))
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--keep-workdir", action="store_true")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    a = ap.parse_args(argv)
    require("deepspeed", "deepspeed", needed_by="scripts/bench_deepspeed.py")
    require("transformers", "hf", needed_by="scripts/bench_deepspeed.py (its GPT-2 model)")
    if (a.src, a.dst) not in TRANSITIONS:
        ap.error(f"--from {a.src} --to {a.dst}: supported transitions are {sorted(TRANSITIONS)}")
    if a.reps < 3:
        ap.error("--reps must be at least 3 (the table shows medians)")
    model = a.model or (QUICK_MODEL if a.quick else "gpt2-124m")
    cpus = os.cpu_count() or 1
    extract_w = a.convert_workers or min(4, cpus)
    merge_w = a.convert_workers or min(2, cpus)
    transition = f"zero{a.stage}-dp{a.src}to{a.dst}"
    workdir = a.workdir or tempfile.mkdtemp(prefix="bench_ds_")
    os.makedirs(workdir, exist_ok=True)
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    t_start = time.perf_counter()
    common = ["--model", model, "--stage", str(a.stage), "--reps", str(a.reps), "--workdir", workdir]
    try:
        print(f"[bench] {transition} {model}: training 1 step and saving at DP {a.src} ...", flush=True)
        _torchrun(a.src, ["save", *common, "--out", f"{workdir}/save.json"], f"{logs}/save.log", a.timeout)
        save = _read(f"{workdir}/save.json")
        tag = f"global_step{save['global_steps']}"
        print(f"[bench] ds_to_universal x{a.reps} ...", flush=True)
        _run([sys.executable, os.path.abspath(__file__), "_worker", "convert", "--reps", str(a.reps),
              "--input", f"{workdir}/ds/{tag}", "--output", f"{workdir}/ds/{tag}_universal",
              "--workers", str(extract_w), "--merge-workers", str(merge_w), "--out", f"{workdir}/convert.json"],
             f"{logs}/convert.log", a.timeout)
        conv = _read(f"{workdir}/convert.json")
        loads = {}
        for m in LOAD_METHODS:
            print(f"[bench] load {m} at DP {a.dst} x{a.reps} ...", flush=True)
            _torchrun(a.dst, ["load", *common, "--method", m, "--universal-tag", f"{tag}_universal",
                              "--out", f"{workdir}/load_{m}.json"], f"{logs}/load_{m}.log", a.timeout)
            loads[m] = _read(f"{workdir}/load_{m}.json")
    finally:
        if not a.keep_workdir and a.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    cfg = {"model": model, "shape": MODELS[model], "params": save["params"], "stage": a.stage, "src_dp": a.src,
           "dst_dp": a.dst, "transition": transition, "reps": a.reps, "global_batch": GLOBAL_BATCH,
           "convert_workers": f"{extract_w}/{merge_w}", "cpus": cpus, "omp_num_threads": 1,
           "workdir": workdir if (a.keep_workdir or a.workdir) else None}
    res = summarize(cfg, save, conv, loads)
    res["wall_s"] = time.perf_counter() - t_start
    print(table(res))
    for name, v in res["ratios"].items():
        print(f"RATIO {name} = {v:.2f}")
    for path in (a.json, a.png):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
    try:
        plot(res, a.png)
        print(f"[bench] wrote {a.json} and {a.png} in {res['wall_s']:.0f} s")
    except MissingExtraError as e:
        print(f"[bench] wrote {a.json} ({e}: no PNG) in {res['wall_s']:.0f} s")
    if not res["checks"]["passed"]:
        print("CORRECTNESS FAILED: " + "; ".join(res["checks"]["problems"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker(sys.argv[2:])
    else:
        sys.exit(main())
