"""Host-memory checkpoint benchmark: tenplex's memory snapshots against its synchronous save and megatron-core.

Two torchrun launches per model, each of 2 ranks; each rank is a node with a
memory directory of its own (``--memdir``/mem_<rank>, /dev/shm by default):

save phase, layout A (DP 2), after one training step, repetitions round-robin:
  memcpy          a plain memory copy of the rank's shard (every chunk it holds) into fresh memory: the floor
  snapshot        tenplex's memory snapshot (``--tenplex-memory``, K=2): the blocking part only (the stall), in
                  the steady state (each snapshot writes over the pages of a retired one); the job's first
                  two snapshots (fresh pages, the helper processes started) are measured before, apart
  tenplex_sync    tenplex's synchronous save to durable storage (``--workdir``)
  mcore_async     megatron-core dist_checkpointing ``async_sharded_save`` (torch_dist, fully parallel): its
                  stall (the call + scheduling) and its total (until the background write is finalized)
then the training-step slowdown: the steps begun while a snapshot's replication and durable copy run in the
helper processes (until they are done), the same for replication alone (the snapshots between two durable
copies with ``--tenplex-persist-interval`` above 1; with ``--replication-rate``, a window with replication
capped at that rate, and the durable copy; and one with ``--tenplex-replication-rate auto``, paced by the time
since the window before's snapshot, and the durable copy): each kind of window ``--windows`` times
(default ``--reps``), round-robin, each right after one step alone, its slowdown the mean step in its windows
over the mean of those steps alone (so a drift of the machine's speed does not count; each window's ratio is
printed: the spread). Then ``--steps`` steps right after megatron-core's async save; ``--steps`` steps alone
before the windows and ``--steps`` after are the baseline for that one (their spread is printed: the noise a
slowdown is read against). Then the final state is saved by every system.

load phase, layout B (TP 2):
  memory_live     first, every repetition: restart with every node alive (the job restarts at a new layout,
                  the GPU count changed): each rank memory-maps what its own node holds (K=2 on 2 nodes:
                  everything), nothing received, nothing read from durable storage
then node 1 is lost: its rank deletes its own node's snapshots (no rank touches another node's memory
directory), and the rest, repetitions round-robin:
  memory          restart from the newest snapshot complete in live memory (node 0: mmap; node 1's rank:
                  received over gloo from node 0's)
  durable         tenplex load of the durable checkpoint (page cache warm); ``durable_cold``: evicted first
                  (POSIX_FADV_DONTNEED on every file; ``mincore`` then counts the bytes still cached)
  mcore           megatron-core load (warm); ``mcore_cold``: evicted first
Each load is checked (state zeroed before the last repetition; one more training step and a forward pass
must reproduce the save phase's losses within 1e-4), and the bytes read from durable storage are counted.
Two restart figures per system: the load alone (plan, read, re-shard, restore: what the source changes) and
the whole restart: the load phase's process start to model and optimizer built (torchrun, imports, process
group: measured once, the same for every source) + that load + the first training step after it.

Prints a table and ``RATIO <metric> <model> tenplex/<peer> = X.XX`` lines (below 1: tenplex is better) and
writes JSON (--out). Each rank of a phase is ``benchmarks/memory_worker.py``; the measuring (timed call between
barriers, max over ranks, median) is benchmarks/kit/.

    python -m benchmarks.memory --quick                 # the tiny model, 1 repetition: checks it end to end
    python -m benchmarks.memory --models gpt3-125m --reps 3 --steps 3 --replication-rate 25
    python -m benchmarks.memory --models gpt3-350m --reps 2 --restart-only   # the restarts alone: less memory
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.kit import launch, stats
from benchmarks.kit.launch import ROOT
from benchmarks.kit.report import machine, ratio_key, ratio_line
from tenplex_megatron.plan.layout import padded_vocab_size
from tenplex_megatron.plan.sim.gpt_catalogue import load_model

LAYOUT_A, LAYOUT_B = (1, 1, 2), (2, 1, 1)
SAVE_SYSTEMS = ("memcpy", "snapshot", "tenplex_sync", "mcore_async")
LOAD_SYSTEMS = ("memory_live", "memory", "durable", "durable_cold", "mcore", "mcore_cold")
LIVE = ("memory_live",)  # measured before node 1 is lost
RESTART_ONLY = ("memory_live", "durable", "durable_cold")  # --restart-only: the restarts alone, at a lower peak memory
CHECK_RTOL = 1e-4
WORKER = "benchmarks.memory_worker"  # one rank of a phase, started under torchrun


def _out_dir(out: str) -> str:
    """The directory of ``--out``, made if missing (profiles are written there before the JSON)."""
    d = os.path.dirname(os.path.abspath(out))
    os.makedirs(d, exist_ok=True)
    return d


def _window_kind(st: list[dict[str, Any]], kind: int) -> dict[str, Any]:
    """One kind of slowdown window over its repetitions (``st``: each rank's steps record). ``slowdown``: the mean
    step in the windows over the mean of the steps alone right before them (each step: mean over ranks);
    ``slowdowns``: that ratio per repetition, the spread."""
    reps = list(zip(*([w for w in r["windows"] if w["kind"] == kind] for r in st)))  # [rep][rank]
    during = [[statistics.mean(ts) for ts in zip(*(w["during"] for w in rep))] for rep in reps]
    before = [statistics.mean(t for w in rep for t in w["before"]) for rep in reps]
    first = reps[0][0]
    return {"rate": first["rate"], "pace": first.get("pace", 0.0), "persist": first["persist"],
            "during": statistics.mean(t for d in during for t in d), "before": statistics.mean(before),
            "slowdown": statistics.mean(t for d in during for t in d) / statistics.mean(before),
            "slowdowns": [statistics.mean(d) / b for d, b in zip(during, before)],
            "steps": [len(d) for d in during], "finished": all(w["finished"] for rep in reps for w in rep),
            "since_last_snapshot": [min(w.get("since_last_snapshot") or 0.0 for w in rep) for rep in reps],
            "background": max(w["background"] for rep in reps for w in rep),
            "helper_cpu": statistics.mean(sum(w["helper_cpu"] for w in rep) for rep in reps)}


def _median_max(reps: list[list[dict[str, Any]]], key: str) -> float:
    return statistics.median(max(r[key] for r in rep) for rep in reps)


def run_one(model: str, a: argparse.Namespace) -> dict[str, Any]:
    d = load_model(model)
    seq = min(a.seq, d.seq_length)
    spec = {"num_layers": d.num_layers, "hidden_size": d.hidden_size, "num_attention_heads": d.num_attention_heads,
            "ffn_hidden_size": d.ffn_hidden_size, "seq_length": seq, "max_position_embeddings": seq,
            "vocab_size": d.vocab_size, "make_vocab_size_divisible_by": 128, "swiglu": d.swiglu,
            "hidden_dropout": 0.0, "attention_dropout": 0.0}
    padded = padded_vocab_size(d.vocab_size, 128, 2)
    gbs = 4
    profile = ["--profile", a.profile, "--profile-dir", _out_dir(a.out)] if a.profile else []  # a bad --out: no
    scratch = tempfile.mkdtemp(prefix=f"bench_memory_{model}_", dir=a.workdir)  # temporary directory left behind
    memdir = tempfile.mkdtemp(prefix=f"bench_memory_{model}_", dir=a.memdir)
    common = ["--spec", json.dumps(spec), "--padded", str(padded), "--gbs", str(gbs), "--reps", str(a.reps),
              "--windows", str(a.windows or a.reps),
              "--dir", scratch, "--memdir", memdir, "--steps", str(a.steps), "--replication-rate", str(a.replication_rate),
              *(["--restart-only"] if a.restart_only else []), *profile]
    row: dict[str, Any] = {"model": model, "seq_length": seq, "reps": a.reps, "from": LAYOUT_A, "to": LAYOUT_B}
    try:
        phases = {}
        for phase, layout in (("save", LAYOUT_A), ("load", LAYOUT_B)):
            result = os.path.join(scratch, f"{phase}.json")
            launch.torchrun(2, WORKER, [*common, "--phase", phase, "--layout", *map(str, layout),
                                    "--result", result, "--t-launch", repr(time.time())],
                            os.path.join(scratch, f"{phase}.log"), a.timeout)
            phases[phase] = launch.read_json(result)
        save, load = phases["save"], phases["load"]
        row["own_bytes"] = save["own_bytes"]
        for s, reps in save["reps"].items():
            row[s] = {"seconds": stats.summarize(reps).median, "seconds_all": stats.per_rep(reps, "seconds")}
            if s == "mcore_async":
                row[s]["total"] = _median_max(reps, "total")
            if s == "snapshot":  # the stall's parts: median over repetitions of the slowest rank's
                row[s]["phases"] = {k: statistics.median(max(x["phases"][k] for x in rep) for rep in reps)
                                    for k in reps[0][0]["phases"]}
        row["startup"], row["first_step"] = load["startup"], load["first_step"]
        for s, reps in load["reps"].items():
            cached = [x["cached_before"] for rep in reps for x in rep if x["cached_before"] is not None]
            row[s] = {"seconds": stats.summarize(reps).median, "seconds_all": stats.per_rep(reps, "seconds"),
                      "from_durable": stats.total(reps, "from_durable"), "received": stats.total(reps, "received"),
                      "cached_before": max(cached) if cached else None}
            row[s]["whole"] = row["startup"] + row[s]["seconds"] + row["first_step"]
        st = save.get("steps")
        if st:
            windows = [_window_kind(st, k) for k in sorted({w["kind"] for w in st[0]["windows"]})]
            per_step = [statistics.mean(xs) for xs in zip(*(r["alone"] for r in st))]  # each step, mean over ranks
            row["steps"] = {"alone": statistics.mean(x for r in st for x in r["alone"]),
                            "alone_range": [min(per_step), max(per_step)],
                            "during": windows[0]["during"], "windows": windows,
                            "during_mcore": statistics.mean(x for r in st for x in r["during_mcore"])}
        else:
            row["steps"] = None
        ref = save["ref"]
        row["check"] = {}
        for s, got in load["check"].items():
            worst = max(abs(got[k] - ref[k]) / abs(ref[k]) for k in ref)
            row["check"][s] = {"max_rel_diff": worst, "ok": got["iteration"] == save["iteration"] and worst <= CHECK_RTOL}
    finally:
        if not a.keep:
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.rmtree(memdir, ignore_errors=True)
    return row


def print_row(r: dict[str, Any]) -> None:
    own = "/".join(f"{b / 1e6:.0f}" for b in r["own_bytes"])
    print(f"\n{r['model']} (seq {r['seq_length']}): saved at (tp,pp,dp) {tuple(r['from'])}, loaded at "
          f"{tuple(r['to'])} with every node alive (memory_live)"
          f"{', then after node 1 lost its memory' if 'memory' in r else ''}; median of {r['reps']}; own shards "
          f"{own} MB per rank")
    for s in (s for s in SAVE_SYSTEMS if s in r):
        x = r[s]
        extra = f"  (total until written: {x['total']:.3f} s)" if "total" in x else ""
        if "phases" in x:
            extra = "  (" + ", ".join(f"{k} {v:.3f}" for k, v in x["phases"].items()) + ")"
        print(f"  {'save ' + s:<22} blocking {x['seconds']:8.3f} s{extra}")
    if "snapshot_first" in r:
        first = ", ".join(f"{x:.3f}" for x in r["snapshot_first"]["seconds_all"])
        print(f"  {'':<22} (a job's first two snapshots, fresh tmpfs pages and the helpers' start: {first} s)")
    st = r["steps"] or {}
    if st:
        lo, hi = st["alone_range"]
        print(f"  step time alone {st['alone']:.3f} s ({lo:.3f}-{hi:.3f} s; before and after the windows below); after "
              f"megatron-core's async save {st['during_mcore']:.3f} s")
        for w in st["windows"]:
            rate = (f"capped at {w['rate']:g} MB/s" if w["rate"] else
                    f"auto: paced to {w['pace']:g} of the time since the last snapshot" if w["pace"] else "unlimited")
            what = "and durable copy run" if w["persist"] else "runs (no durable copy)"
            each = ", ".join(f"{x:.2f}x" for x in w["slowdowns"])
            print(f"  step time while a snapshot's replication ({rate}) {what} in the helper processes "
                  f"{w['during']:.3f} s against {w['before']:.3f} s for the step alone before each window: "
                  f"{w['slowdown']:.2f}x ({len(w['steps'])} windows: {each}; steps {'/'.join(map(str, w['steps']))}, "
                  f"{'finished within them' if w['finished'] else 'still running after them'}); background work up to "
                  f"{w['background']:.2f} s wall, {w['helper_cpu']:.2f} CPU-s a window in the helpers (all nodes)")
    print(f"  restart = process start to model built {r['startup']:.3f} s (the same for every source) + load + "
          f"first step {r['first_step']:.3f} s; warm: the checkpoint's pages in the page cache; cold: evicted "
          "(POSIX_FADV_DONTNEED, then mincore: bytes still cached)")
    for s in (s for s in LOAD_SYSTEMS if s in r):
        x = r[s]
        fd = "-" if x["from_durable"] is None else f"{x['from_durable'] / 1e6:.1f} MB"
        c = r["check"].get(s, {})
        cache = "" if x["cached_before"] is None else f" (cached before: {x['cached_before'] / 1e6:.1f} MB)"
        print(f"  {'restart ' + s:<22} load {x['seconds']:8.3f} s  whole {x['whole']:8.3f} s  read from durable "
              f"storage {fd:>10}, received from peers {(x['received'] or 0) / 1e6:.1f} MB  "
              f"{'ok' if c.get('ok') else 'MISMATCH'} (rel {c.get('max_rel_diff', float('nan')):.1e}){cache}")


def ratio_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for r in report["runs"]:
        m = r["model"]

        def add(metric: str, a: float, b: float, peer: str, m: str = m) -> None:
            if b:
                lines.append(ratio_line(ratio_key(metric, m, "tenplex", peer), a / b))

        if "snapshot" in r:  # not with --restart-only
            snap = r["snapshot"]["seconds"]
            add("save_stall", snap, r["memcpy"]["seconds"], "memcpy")  # issue #13: at most 1.5
            add("save_stall", snap, r["tenplex_sync"]["seconds"], "tenplex_sync")
            add("save_stall", snap, r["mcore_async"]["seconds"], "mcore_async")
            add("save_stall", snap, r["mcore_async"]["total"], "mcore_async_total")
            for i, w in enumerate(r["steps"]["windows"]):  # each against the steps alone right before its windows
                metric = ("step_slowdown" if i == 0 else  # unlimited + durable copy; issue #13: at most 1.05
                          "step_slowdown_capped" if w["rate"] else "step_slowdown_auto" if w["pace"] else
                          "step_slowdown_replication_only")
                add(metric, w["during"], w["before"], "alone")
            add("step_slowdown", r["steps"]["during"], r["steps"]["during_mcore"], "mcore_async")
        # issue #13: memory 3x faster than durable; restart_*_live: every node alive, restart_*: node 1 lost
        for mine, suffix in (("memory_live", "_live"), ("memory", "")):
            for peer in ("durable", "durable_cold", "mcore", "mcore_cold"):
                if mine in r and peer in r:
                    add(f"restart_load{suffix}", r[mine]["seconds"], r[peer]["seconds"], peer)
                    add(f"restart_whole{suffix}", r[mine]["whole"], r[peer]["whole"], peer)
        if "memory" in r:
            lines.append(f"BYTES from_durable_after_node_loss {m} memory = {r['memory']['from_durable']} "
                         f"durable = {r['durable']['from_durable']}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt3-125m", "gpt3-350m"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="training steps timed alone (twice) and after megatron-core's "
                    "async save; the snapshot windows run until their background work is done (at least 1, at most 8x)")
    ap.add_argument("--windows", type=int, default=0, metavar="N",
                    help="slowdown windows of each kind (default --reps); more of them narrow the step-time noise")
    ap.add_argument("--replication-rate", type=float, default=0.0, metavar="MB/s",
                    help="also measure the step slowdown with replication capped at this rate "
                    "(--tenplex-replication-rate)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="the tiny model, 1 repetition, 2 steps (a smoke run)")
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "bench_memory.json"))
    ap.add_argument("--workdir", default=None, help="durable storage (default: the system temp dir)")
    ap.add_argument("--memdir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="where the nodes' memory directories go (default /dev/shm)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--restart-only", action="store_true",
                    help="only the restart rows with every node alive (memory_live, durable, durable_cold): one "
                         "snapshot and one durable save, no save rows, no step slowdown, no node loss, no "
                         "megatron-core (a lower peak memory, for a model the whole comparison does not fit)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--profile", choices=("snapshot", *LOAD_SYSTEMS), default=None,
                    help="cProfile the last repetition of that save or restart: profile_<system>_rank<r>.pstats beside --out")
    a = ap.parse_args()
    if a.quick:
        a.models, a.reps, a.steps = ["tiny"], 1, 2
    for d in (a.workdir, a.memdir):
        if d:
            os.makedirs(d, exist_ok=True)
    report: dict[str, Any] = {"machine": machine(), "command": sys.argv, "runs": []}
    t0 = time.perf_counter()
    for model in a.models:
        row = run_one(model, a)
        report["runs"].append(row)
        print_row(row)
    report["wall_seconds"] = time.perf_counter() - t0
    print()
    for line in ratio_lines(report):
        print(line)
    launch.write_json(a.out, report, indent=1)
    print(f"json: {a.out}  (wall {report['wall_seconds']:.0f} s)")
    bad = [f"{r['model']}:{s}" for r in report["runs"] for s, c in r["check"].items() if not c["ok"]]
    if bad:
        print(f"CHECK FAILED (state after load differs from the state saved): {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
