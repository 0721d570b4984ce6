"""DeepSpeed ZeRO re-sharding benchmark: DeepSpeed's own route against tenplex, in one run, same machine and files.

A GPT-2-shaped model (``--model``; ``--quick`` picks a small one) is trained for
one step at the source DP size (so Adam moments exist), then re-sharded to the
destination DP size. Measured:

save, at the source DP size (``--reps`` repetitions each, order rotating):
  ds_save        DeepSpeed's ``engine.save_checkpoint`` (``latest`` + ``global_stepN/``; torch.save, no fsync);
  ds_save+fsync  the same, plus fsync of every file it wrote (tenplex's save fsyncs; this is the like-for-like);
  tenplex        ``tenplex_megatron.deepspeed.save_checkpoint`` (fsyncs every file, atomic commit; the run's
                 one ``checkpointer``, as a training loop passes it: each directory claimed at its save);
  tenplex_memory ``tds.save_snapshot``: the stall of a host-memory snapshot (each source rank a node with a
                 memory directory under ``--memdir``, K=2), in the steady state: each writes over the pages of a
                 retired one (the job's first two, on fresh pages, are timed before and reported apart); its
                 replication to the other node runs after the timed call and is waited for before the next save.
re-shard to the destination DP size:
  (a) ds_universal    DeepSpeed's route: ``ds_to_universal`` (its ``main()`` run in one process, ``--reps``
                      times; interpreter start-up and imports are reported apart) then a universal load
                      (``{"checkpoint": {"load_universal": true}}``, ``engine.load_checkpoint(D, tag=...)``);
  (b) tenplex_direct  ``tds.load_checkpoint`` straight from DeepSpeed's own files, no conversion;
  (c) tenplex         ``tds.load_checkpoint`` from the tenplex checkpoint;
  (d) tenplex_memory  ``tds.load_latest`` from the snapshot in the nodes' memory (destination rank r on source
                      node ``r * src // dst``: each node holds every rank file, nothing received, no durable read).

Each load method runs in its own torchrun launch (so its peak RSS is its own)
and loads ``--reps`` times into one engine; before every repetition after the
first the engine's fp32 master and Adam moments are zeroed, so each
repetition has to load them again. Every call is measured as in
benchmarks/reshard.py (benchmarks/kit/measure.py and stats.py): freed heap returned
to the OS, then timed with ``time.perf_counter`` between ``dist.barrier()``
calls; a repetition's time is the max over ranks, the table shows the median.
Peak RSS is sampled every 5 ms with psutil on every rank (for the conversion:
the sum over its process tree, pool workers included); its growth is per call
(peak less the RSS just before that call). Bytes read: for DeepSpeed's loads
its read() calls; for tenplex's loads (memory-mapped, not in read()) what they
read from storage: the checksum blocks verified plus what was copied
unverified (for DeepSpeed's own files, which carry no checksums: the bytes
copied), as benchmarks/reshard.py counts them.

Correctness, checked inside the bench: after the last load of each method, the
full fp32 master weights and Adam ``exp_avg``/``exp_avg_sq`` of every
parameter (DeepSpeed's own ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state``) are hashed on rank 0; (a), (b) and (c) must
agree bit for bit, and with the state at save time; tenplex's loads must
report the saved step, DP size and ZeRO stage (``LoadResult.iteration``,
``.source_layout``) and read DeepSpeed's files as such (``.source_format``).
Anything else exits 1 with ``CORRECTNESS FAILED`` (the JSON is still written).

Output: a table, ``RATIO <metric> <transition> tenplex/<peer> = X.XX`` lines
(below 1: tenplex is better), JSON (``--json``) and a PNG bar chart (``--png``).

    python -m benchmarks.deepspeed --quick                  # small GPT-2 shape, ZeRO-2, DP 2 -> 1
    python -m benchmarks.deepspeed                          # gpt2-124m, ZeRO-2, DP 2 -> 1
    python -m benchmarks.deepspeed --stage 3 --from 2 --to 4 --model gpt2-350m
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.kit import launch, plots, stats
from benchmarks.kit.disk import dir_size, fsync_tree
from benchmarks.kit.launch import ROOT
from benchmarks.kit.report import Column, Table, ratio_key, ratio_line

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
LOAD_METHODS = ("ds_universal", "tenplex_direct", "tenplex", "tenplex_memory")
MiB = 1024 * 1024


# ----------------------------------------------------------------------------------------------- worker


def _worker_save(a: argparse.Namespace) -> dict[str, Any]:
    """At the source DP size: train one step, then save ``reps`` times with DeepSpeed and with tenplex."""
    import torch.distributed as dist

    from benchmarks.kit import ds_engine
    from benchmarks.kit.measure import gathered, rotated, timed
    from tenplex_megatron import deepspeed as tds
    from tenplex_megatron.memory import background

    r = dist.get_rank()
    shape = MODELS[a.model]
    engine = ds_engine.build(shape, a.stage, GLOBAL_BATCH)
    loss = ds_engine.train_step(engine, shape, GLOBAL_BATCH, 1)
    digest, sums = ds_engine.state_digest(engine)
    tier = tds.open_memory(_node_dir(a, r, a.src), None, job=a.workdir)  # each rank a node; no durable copy
    ckpt = tds.open_checkpointer()  # the run's leases, as a training loop holds them (released at the end)
    reps: dict[str, list[Any]] = {"ds_save": [], "ds_save_fsync": [], "tenplex": [], "tenplex_memory": []}
    first = []  # a job's first two snapshots write fresh tmpfs pages; later ones write over a retired one's
    for _ in range(2):
        first.append(gathered(timed(lambda: tds.save_snapshot(engine, tier))[1]))
        background.drain(tier.tier)
    for i in range(a.reps):
        for system in rotated(["ds", "tenplex", "memory"], i):
            if system == "memory":
                res, rec = timed(lambda: tds.save_snapshot(engine, tier))
                background.drain(tier.tier)  # its replication, before the next save is timed
                reps["tenplex_memory"].append(gathered({**rec, "bytes_written": res.bytes_written}))
                continue
            path = os.path.join(a.workdir, system if i == 0 else f"{system}_rep{i}")
            if system == "ds":
                _, rec = timed(lambda path=path: engine.save_checkpoint(path))
                _, sync = timed(lambda path=path: fsync_tree(path) if r == 0 else None)
                size, files = dir_size(path) if r == 0 else (0, 0)
                reps["ds_save"].append(gathered({**rec, "dir_bytes": size, "files": files}))
                reps["ds_save_fsync"].append(gathered({"seconds": rec["seconds"] + sync["seconds"],
                                                       "fsync_seconds": sync["seconds"]}))
            else:
                res, rec = timed(lambda path=path: tds.save_checkpoint(engine, path, checkpointer=ckpt))
                size, files = dir_size(path) if r == 0 else (0, 0)
                reps["tenplex"].append(gathered({**rec, "dir_bytes": size, "files": files,
                                                 "bytes_written": res.bytes_written, "total_bytes": res.total_bytes,
                                                 "own_seconds": res.seconds}))
            dist.barrier()
            if i > 0 and r == 0:  # only repetition 0's checkpoints are loaded; keep the disk small
                shutil.rmtree(path)
            dist.barrier()
    ckpt.close()
    tds.finish_memory(tier, over=False)  # the snapshot whole on every node: what a restart finds
    return {"loss": loss, "global_steps": int(engine.global_steps), "digest": digest, "sums": sums, "reps": reps,
            "first_snapshots": first, "params": sum(p.numel() for p in engine.module.parameters())}


def _node_dir(a: argparse.Namespace, rank: int, ranks: int) -> str:
    """The memory directory of ``rank`` of ``ranks``: source rank r is node r; a destination rank the source node
    ``rank * src // ranks`` (nodes keep their memory across the restart)."""
    return os.path.join(a.memdir, f"mem_{rank * a.src // ranks}")


def _worker_load(a: argparse.Namespace) -> dict[str, Any]:
    """At the destination DP size: load ``reps`` times by one method into one engine, then hash the state."""
    import torch.distributed as dist

    from benchmarks.kit import ds_engine
    from benchmarks.kit.measure import gathered, timed
    from tenplex_megatron import deepspeed as tds
    from tenplex_megatron.memory.restart import MemoryLoadResult

    engine = ds_engine.build(MODELS[a.model], a.stage, GLOBAL_BATCH, universal=a.method == "ds_universal")
    ds_dir, tp_dir = os.path.join(a.workdir, "ds"), os.path.join(a.workdir, "tenplex")
    loaded: dict[str, Any] = {}
    tier = None
    if a.method == "tenplex_memory":
        tier = tds.open_memory(_node_dir(a, dist.get_rank(), dist.get_world_size()), None, job=a.workdir)

    def load() -> dict[str, Any]:
        if tier is not None:
            mres = tds.load_latest(engine, tier, None)
            if not isinstance(mres, MemoryLoadResult):
                raise RuntimeError(f"{a.memdir}: no snapshot in the nodes' memory")
            got = mres.result
            loaded.update(iteration=got.iteration, source_layout=got.source_layout, source_format=got.source_format)
            return {"bytes_read": got.bytes_fetched, "bytes_needed": got.bytes_read,
                    "own_seconds": got.seconds, "received": mres.bytes_received,
                    "from_durable": mres.bytes_from_durable}
        if a.method == "ds_universal":
            path, _ = engine.load_checkpoint(ds_dir, tag=a.universal_tag)
            if path is None:
                raise RuntimeError(f"DeepSpeed's universal load found nothing at {ds_dir}/{a.universal_tag}")
            return {}
        res = tds.load_checkpoint(engine, ds_dir if a.method == "tenplex_direct" else tp_dir)
        loaded.update(iteration=res.iteration, source_layout=res.source_layout, source_format=res.source_format)
        # read out of the files (checked here, by a peer of the host, or not at all); next to what was copied
        return {"bytes_read": res.bytes_fetched, "bytes_needed": res.bytes_read,
                "own_seconds": res.seconds}

    reps = []
    for i in range(a.reps):
        if i > 0:
            ds_engine.zero_state(engine)
        out, rec = timed(load)
        reps.append(gathered({**rec, "bytes_read": rec["rchar"], **out}))
    digest, sums = ds_engine.state_digest(engine)
    if tier is not None:
        tds.finish_memory(tier, over=False)
    return {"global_steps": int(engine.global_steps), "digest": digest, "sums": sums, "reps": reps, **loaded}


def _worker_convert(a: argparse.Namespace) -> dict[str, Any]:
    """DeepSpeed's ``ds_to_universal``, its ``main()`` run ``reps`` times in this one process (no torchrun)."""
    import psutil

    startup = time.time() - psutil.Process().create_time()
    t0 = time.perf_counter()
    from deepspeed.checkpoint import ds_to_universal as d2u

    import_s = time.perf_counter() - t0
    from benchmarks.kit.measure import gathered, timed

    args = argparse.Namespace(input_folder=a.input, output_folder=a.output, num_extract_workers=a.workers,
                              num_merge_workers=a.merge_workers, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    reps = []
    for _ in range(a.reps):
        if os.path.exists(a.output):
            shutil.rmtree(a.output)
        _, rec = timed(lambda: d2u.main(args), tree=True)
        reps.append(gathered(rec))  # one process: one "rank"
    size, files = dir_size(a.output)
    return {"startup_s": startup + import_s, "reps": reps, "dir_bytes": size, "files": files}


def worker(argv: list[str]) -> None:
    """Hidden subcommand ``_worker {save,load,convert}``: one phase; rank 0 writes the JSON ``--out``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.deepspeed _worker")
    ap.add_argument("phase", choices=["save", "load", "convert"])
    ap.add_argument("--model", choices=sorted(MODELS))
    ap.add_argument("--stage", type=int)
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument("--workdir")
    ap.add_argument("--memdir")
    ap.add_argument("--src", type=int)
    ap.add_argument("--method", choices=LOAD_METHODS)
    ap.add_argument("--universal-tag")
    ap.add_argument("--input")
    ap.add_argument("--output")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--merge-workers", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.phase == "convert":
        launch.write_json(a.out, _worker_convert(a))
        return
    # here, not at the top: the driver and --help must not import DeepSpeed and transformers
    import torch.distributed as dist

    from benchmarks.kit import ds_engine

    ds_engine.init_distributed()
    result = _worker_save(a) if a.phase == "save" else _worker_load(a)
    if dist.get_rank() == 0:
        launch.write_json(a.out, result)
    dist.barrier()


# ----------------------------------------------------------------------------------------------- summary


def _times(times: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "reps_s": times}


def _timed_summary(reps: stats.Reps) -> dict[str, Any]:
    """Median/min/max of the max over ranks, and each rank's peak RSS and RSS growth (:mod:`benchmarks.kit.stats`)."""
    s = stats.summarize(reps)
    return {**_times(s.times), "peak_rss_per_rank": s.rss_peak_per_rank, "peak_rss_max": max(s.rss_peak_per_rank),
            "rss_growth_per_rank": s.rss_growth_per_rank, "rss_growth_max": max(s.rss_growth_per_rank)}


def summarize(cfg: dict[str, Any], save: dict[str, Any], conv: dict[str, Any],
              loads: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Medians, bytes, peaks, the correctness checks and the ratios, from the workers' JSON."""
    sv = save["reps"]  # {system: [rep][rank]}
    first = {k: v[0][0] for k, v in sv.items()}  # repetition 0 (the one loaded), rank 0 (it sized the directory)
    save_out = {
        "ds_save": {**_timed_summary(sv["ds_save"]), "bytes_written": first["ds_save"]["dir_bytes"],
                    "files": first["ds_save"]["files"]},
        "ds_save_fsync": {**_times(stats.per_rep(sv["ds_save_fsync"], "seconds")),
                          "bytes_written": first["ds_save"]["dir_bytes"]},
        "tenplex": {**_timed_summary(sv["tenplex"]), "bytes_written": first["tenplex"]["dir_bytes"],
                    "files": first["tenplex"]["files"], "total_bytes_reported": first["tenplex"]["total_bytes"],
                    "bytes_written_per_rank": [r["bytes_written"] for r in sv["tenplex"][0]]},
        "tenplex_memory": {**_timed_summary(sv["tenplex_memory"]),
                           "bytes_written": sum(r["bytes_written"] for r in sv["tenplex_memory"][0]),
                           "first_two_s": stats.per_rep(save["first_snapshots"], "seconds")},
    }
    cs = stats.summarize(conv["reps"])
    conv_out = {**_times(cs.times), "startup_s": conv["startup_s"], "disk_bytes": conv["dir_bytes"],
                "files": conv["files"], "bytes_written": max(stats.per_rep(conv["reps"], "wchar")),
                "bytes_read": max(stats.per_rep(conv["reps"], "rchar")),
                "peak_rss_tree": max(cs.rss_peak_per_rank), "workers": cfg["convert_workers"]}
    load_out: dict[str, Any] = {}
    for m, res in loads.items():
        load_out[m] = {**_timed_summary(res["reps"]), "bytes_read": stats.total(res["reps"], "bytes_read"),
                       "bytes_read_measure": "read() syscalls, all ranks" if m == "ds_universal"
                       else "tenplex: checksum blocks verified + bytes copied unverified, all ranks",
                       "global_steps": res["global_steps"]}
        if m != "ds_universal":
            load_out[m]["bytes_needed"] = stats.total(res["reps"], "bytes_needed")
    ds_route = conv_out["median_s"] + load_out["ds_universal"]["median_s"]
    ds_route_peak = max(conv_out["peak_rss_tree"], load_out["ds_universal"]["peak_rss_max"])
    reshard = {
        "ds_universal": {"seconds": ds_route, "seconds_with_startup": ds_route + conv_out["startup_s"],
                         "extra_disk_bytes": conv_out["disk_bytes"], "extra_bytes_written": conv_out["bytes_written"],
                         "bytes_read": conv_out["bytes_read"] + load_out["ds_universal"]["bytes_read"],
                         "peak_rss": ds_route_peak},
        **{m: {"seconds": load_out[m]["median_s"], "extra_disk_bytes": 0, "extra_bytes_written": 0,
               "bytes_read": load_out[m]["bytes_read"], "peak_rss": load_out[m]["peak_rss_max"]}
           for m in ("tenplex_direct", "tenplex", "tenplex_memory")},
    }
    checks = _checks(cfg, save, loads)
    tr = cfg["transition"]
    ratios = {
        ratio_key("save_time", tr, "tenplex", "ds_save"): stats.ratio(save_out["tenplex"]["median_s"],
                                                                      save_out["ds_save"]["median_s"]),
        ratio_key("save_time", tr, "tenplex", "ds_save_fsync"): stats.ratio(save_out["tenplex"]["median_s"],
                                                                            save_out["ds_save_fsync"]["median_s"]),
        ratio_key("save_bytes", tr, "tenplex", "ds_save"): stats.ratio(save_out["tenplex"]["bytes_written"],
                                                                       save_out["ds_save"]["bytes_written"]),
    }
    for peer in ("ds_save", "tenplex"):  # the snapshot's stall against DeepSpeed's save and tenplex's durable one
        ratios[ratio_key("save_time", tr, "tenplex_memory", peer)] = stats.ratio(
            save_out["tenplex_memory"]["median_s"], save_out[peer]["median_s"])
    for m in ("tenplex_direct", "tenplex", "tenplex_memory"):
        ratios[ratio_key("reshard_time", tr, m, "ds_universal")] = stats.ratio(reshard[m]["seconds"], ds_route)
    for m in ("tenplex_direct", "tenplex", "tenplex_memory"):
        ratios[ratio_key("load_time", tr, m, "ds_universal_load")] = stats.ratio(
            load_out[m]["median_s"], load_out["ds_universal"]["median_s"])
    ratios[ratio_key("load_time", tr, "tenplex_memory", "tenplex")] = stats.ratio(
        load_out["tenplex_memory"]["median_s"], load_out["tenplex"]["median_s"])
    ratios[ratio_key("disk_bytes", tr, "tenplex_direct", "ds_universal")] = stats.ratio(0, conv_out["disk_bytes"])
    ratios[ratio_key("write_bytes", tr, "tenplex_direct", "ds_universal")] = stats.ratio(0, conv_out["bytes_written"])
    ratios[ratio_key("read_bytes", tr, "tenplex_direct", "ds_universal")] = stats.ratio(
        reshard["tenplex_direct"]["bytes_read"], reshard["ds_universal"]["bytes_read"])
    for m in ("tenplex_direct", "tenplex", "tenplex_memory"):
        ratios[ratio_key("peak_rss", tr, m, "ds_universal")] = stats.ratio(reshard[m]["peak_rss"], ds_route_peak)
    return {"config": cfg, "save": save_out, "convert": conv_out, "load": load_out, "reshard": reshard,
            "checks": checks, "ratios": ratios}


def _checks(cfg: dict[str, Any], save: dict[str, Any], loads: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every route's state bit-identical to the others' and to the state at save; tenplex's LoadResult right."""
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
        if m == "ds_universal":
            continue
        got = loads[m]
        want_format = "deepspeed" if m == "tenplex_direct" else "tenplex"  # a snapshot is a tenplex checkpoint
        if got.get("source_format") != want_format:
            problems.append(f"{m}: LoadResult.source_format={got.get('source_format')!r}, expected {want_format!r}")
        if got.get("iteration") != save["global_steps"]:
            problems.append(f"{m}: LoadResult.iteration={got.get('iteration')} != {save['global_steps']} at save")
        lay = got.get("source_layout") or {}
        if (lay.get("dp"), lay.get("zero_stage")) != (cfg["src_dp"], cfg["stage"]):
            problems.append(f"{m}: LoadResult.source_layout={lay}, saved at DP {cfg['src_dp']} ZeRO-{cfg['stage']}")
    if not all(v > 0 for v in save["sums"].values()):  # per kind: fp32, exp_avg, exp_avg_sq
        problems.append(f"state at save has an all-zero kind: {save['sums']} (nothing to re-shard?)")
    return {"passed": not problems, "problems": problems, "tensors_compared": len(ref),
            "compared": "blake2b of every parameter's full fp32 master, exp_avg, exp_avg_sq "
                        "(safe_get_full_fp32_param / safe_get_full_optimizer_state), bit-exact",
            "routes": list(LOAD_METHODS) + ["state at save"]}


# ----------------------------------------------------------------------------------------------- report


TABLE = Table([Column("phase", 10, "<"), Column("system", 44, "<"), Column("median s", 9), Column("min-max s", 15),
               Column("written MiB", 11), Column("read MiB", 9), Column("peak RSS MiB", 12)])


def table(res: dict[str, Any]) -> str:
    """The human-readable table."""
    c = res["config"]
    rows = [f"DeepSpeed re-sharding bench: {c['model']} ({c['params'] / 1e6:.1f}M params), ZeRO-{c['stage']}, "
            f"DP {c['src_dp']} -> {c['dst_dp']}, {c['reps']} reps (median; min-max), {c['cpus']} CPU cores, "
            "OMP_NUM_THREADS=1; shared machine: timings are noisy", TABLE.header()]

    def row(phase: str, name: str, d: dict[str, Any], written: float | None = None, read: float | None = None,
            rss: float | None = None) -> None:
        rng = f"{d['min_s']:.2f}-{d['max_s']:.2f}" if "min_s" in d else ""
        mib = [f"{b / MiB:.1f}" if b is not None else "" for b in (written, read, rss)]
        rows.append(TABLE.row(phase, name, f"{d['median_s']:.2f}", rng, *mib))

    s = res["save"]
    row("save", "ds_save (engine.save_checkpoint)", s["ds_save"], s["ds_save"]["bytes_written"],
        rss=s["ds_save"]["peak_rss_max"])
    row("save", "ds_save + fsync of its files", s["ds_save_fsync"], s["ds_save"]["bytes_written"])
    row("save", "tenplex (fsync + atomic commit)", s["tenplex"], s["tenplex"]["bytes_written"],
        rss=s["tenplex"]["peak_rss_max"])
    row("save", "tenplex_memory (snapshot: the stall)", s["tenplex_memory"], s["tenplex_memory"]["bytes_written"],
        rss=s["tenplex_memory"]["peak_rss_max"])
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
    row("re-shard", "(d) tenplex_memory (nodes' memory)", ld["tenplex_memory"], 0, ld["tenplex_memory"]["bytes_read"],
        ld["tenplex_memory"]["peak_rss_max"])
    rows.append(f"ds_to_universal: interpreter start + import {cv['startup_s']:.1f} s more when run as "
                f"`python -m` (not in the times above); it leaves {cv['disk_bytes'] / MiB:.1f} MiB in "
                f"{cv['files']} files on disk and wrote {cv['bytes_written'] / MiB:.1f} MiB in all (temp folder "
                "included). Read MiB for the universal load: read() syscalls; for tenplex: what it read from "
                "storage (memory-mapped; checksum blocks verified + bytes copied unverified; (d): from the nodes' "
                "memory, /dev/shm). Written MiB for the snapshot: into memory, all ranks (the job's first two "
                f"snapshots, on fresh pages: {', '.join(f'{x:.2f}' for x in s['tenplex_memory']['first_two_s'])} s). "
                "Peak RSS: max over ranks (conversion: its process tree).")
    ck = res["checks"]
    rows.append(f"correctness: {'PASSED' if ck['passed'] else 'FAILED'}: {ck['tensors_compared']} tensors "
                f"(fp32 master, exp_avg, exp_avg_sq of every parameter) bit-identical across (a), (b), (c), (d) "
                f"and the state at save" if ck["passed"] else
                "correctness: FAILED: " + "; ".join(ck["problems"]))
    return "\n".join(rows)


def plot(res: dict[str, Any], path: str) -> bool:
    """Three bar panels: times, bytes, peak RSS; False when matplotlib is missing (no PNG)."""
    plt = plots.pyplot()
    if plt is None:
        return False
    s, cv, ld, rs = res["save"], res["convert"], res["load"], res["reshard"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    c = res["config"]
    fig.suptitle(f"{c['model']} ZeRO-{c['stage']} DP {c['src_dp']}->{c['dst_dp']} "
                 f"({c['cpus']} shared CPU cores; median of {c['reps']})")
    ax = axes[0]
    labels = ["ds_save", "ds_save\n+fsync", "tenplex\nsave", "tenplex\nsnapshot", "ds_universal\n(convert+load)",
              "tenplex\ndirect", "tenplex", "tenplex\nmemory"]
    bottoms = [s["ds_save"]["median_s"], s["ds_save_fsync"]["median_s"], s["tenplex"]["median_s"],
               s["tenplex_memory"]["median_s"], cv["median_s"], ld["tenplex_direct"]["median_s"],
               ld["tenplex"]["median_s"], ld["tenplex_memory"]["median_s"]]
    plots.bars(ax, labels, bottoms, ["tab:gray", "tab:gray", "tab:blue", "tab:purple", "tab:orange", "tab:blue",
                                     "tab:green", "tab:purple"], "save | re-shard time", "seconds", labelsize=7)
    ax.bar(labels[4], ld["ds_universal"]["median_s"], bottom=cv["median_s"], color="tab:red",
           label="universal load (on top of conversion)")
    ax.axvline(3.5, color="k", lw=0.5)
    ax.legend(fontsize=8)
    labels = ["ds save\nwritten", "tenplex\nsave\nwritten", "convert\nwritten", "convert\nleft on\ndisk",
              "ds_universal\nread", "tenplex\ndirect\nread", "tenplex\nread"]
    vals = [s["ds_save"]["bytes_written"], s["tenplex"]["bytes_written"], cv["bytes_written"], cv["disk_bytes"],
            rs["ds_universal"]["bytes_read"], ld["tenplex_direct"]["bytes_read"], ld["tenplex"]["bytes_read"]]
    plots.bars(axes[1], labels, [v / MiB for v in vals],
               ["tab:gray", "tab:blue", "tab:orange", "tab:orange", "tab:orange", "tab:blue", "tab:green"],
               "bytes", "MiB", labelsize=7)
    labels = ["ds_save", "tenplex\nsave", "ds_to_universal\n(tree)", "universal\nload", "tenplex\ndirect",
              "tenplex"]
    vals = [s["ds_save"]["peak_rss_max"], s["tenplex"]["peak_rss_max"], cv["peak_rss_tree"],
            ld["ds_universal"]["peak_rss_max"], ld["tenplex_direct"]["peak_rss_max"], ld["tenplex"]["peak_rss_max"]]
    plots.bars(axes[2], labels, [v / MiB for v in vals],
               ["tab:gray", "tab:blue", "tab:orange", "tab:red", "tab:blue", "tab:green"],
               "peak RSS", "MiB (max over ranks)")
    plots.save(plt, fig, path)
    return True


# ----------------------------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    """Orchestrate: save at the source DP size, convert, load three ways at the destination, report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default=None,
                    help=f"GPT-2 shape (default gpt2-124m; {QUICK_MODEL} with --quick)")
    ap.add_argument("--quick", action="store_true", help=f"the {QUICK_MODEL} shape (the smoke test's)")
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
    ap.add_argument("--memdir", default="/dev/shm",
                    help="where the nodes' memory directories go (a temporary directory inside; default /dev/shm)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    a = ap.parse_args(argv)
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
    t_start = time.perf_counter()
    memdir = tempfile.mkdtemp(prefix="bench_ds_mem_", dir=a.memdir)
    common = ["--model", model, "--stage", str(a.stage), "--reps", str(a.reps), "--workdir", workdir,
              "--memdir", memdir, "--src", str(a.src)]
    try:
        print(f"[bench] {transition} {model}: training 1 step and saving at DP {a.src} ...", flush=True)
        launch.torchrun(a.src, __spec__.name, ["_worker", "save", *common, "--out", f"{workdir}/save.json"],
                        f"{logs}/save.log", a.timeout)
        save = launch.read_json(f"{workdir}/save.json")
        tag = f"global_step{save['global_steps']}"
        print(f"[bench] ds_to_universal x{a.reps} ...", flush=True)
        launch.run([sys.executable, "-m", __spec__.name, "_worker", "convert", "--reps", str(a.reps),
                    "--input", f"{workdir}/ds/{tag}", "--output", f"{workdir}/ds/{tag}_universal",
                    "--workers", str(extract_w), "--merge-workers", str(merge_w), "--out", f"{workdir}/convert.json"],
                   f"{logs}/convert.log", a.timeout)
        conv = launch.read_json(f"{workdir}/convert.json")
        loads = {}
        for m in LOAD_METHODS:
            print(f"[bench] load {m} at DP {a.dst} x{a.reps} ...", flush=True)
            launch.torchrun(a.dst, __spec__.name, ["_worker", "load", *common, "--method", m, "--universal-tag",
                                              f"{tag}_universal", "--out", f"{workdir}/load_{m}.json"],
                            f"{logs}/load_{m}.log", a.timeout)
            loads[m] = launch.read_json(f"{workdir}/load_{m}.json")
    finally:
        shutil.rmtree(memdir, ignore_errors=True)
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
        print(ratio_line(name, v))
    launch.write_json(a.json, res, indent=1)
    os.makedirs(os.path.dirname(os.path.abspath(a.png)), exist_ok=True)
    if plot(res, a.png):
        print(f"[bench] wrote {a.json} and {a.png} in {res['wall_s']:.0f} s")
    else:
        print(f"[bench] wrote {a.json} (matplotlib missing: no PNG) in {res['wall_s']:.0f} s")
    if not res["checks"]["passed"]:
        print("CORRECTNESS FAILED: " + "; ".join(res["checks"]["problems"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker(sys.argv[2:])
    else:
        sys.exit(main())
