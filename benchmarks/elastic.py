#!/usr/bin/env python
"""Replay a GPU-allocation trace with torchrun's elastic agents and compare layout policies on it.

    python -m benchmarks.elastic --trace configs/traces/shrink_grow.json [--time-scale 0.5] [--out r.json]
    python -m benchmarks.elastic --quick        # tiny model, configs/traces/quick.json: the smoke test's run

Every node of the trace is a torchrun agent on this machine (``--nnodes 1:MAX --rdzv-backend c10d``) with
``gpus_per_node`` worker processes (CPU over gloo, or the GPUs where present). A shrink SIGKILLs the newest
nodes (agents and workers, no notice: the survivors detect the failure and restart from the newest
checkpoint); a grow starts agents (the running ones SIGTERM their workers, which save the current iteration,
and everyone restarts at the new world size). The same trace, model and target iteration run once per policy:

* ``tenplex``: ``--tenplex-layout auto`` (or ``measure`` with ``--tenplex-layout measure``): the layout chosen for
  every world size;
* ``dp_only``: the Tenplex paper's baseline: the model-parallel degree (TP x PP) of the table's layout at the
  start stays fixed and only DP scales; at a GPU count that is not a multiple of TP x PP the job runs on the
  largest multiple (none: it waits); ``--dp-only-mp TP,PP`` fixes another;
* ``table``: ``--tenplex-layout FILE.json``: a fixed user table (``--table``; by default one that keeps PP=2
  wherever the world size is even);
* ``inprocess``: ``tenplex``'s layout choice with ``--tenplex-inprocess`` and ``--tenplex-memory``, one in-process
  launcher per node (``benchmarks/kit/inplace.py``): a lost node's process group is SIGKILLed and the survivors
  continue in their own processes (NVRx); a grow is a planned stop (SIGTERM: every rank saves) and a new launch on
  all nodes, since NVRx's in-process restart only shrinks.

Reported per policy: the wall time to reach the target iteration, samples per second over time, each change's
breakdown (detect, rendezvous and spawn, imports and process group, build, plan and re-shard, first step;
parsed from the trainer's timeline lines and the workers' lifetimes) and the largest relative loss deviation
from an uninterrupted run's (the loss curves in a PNG). ``RATIO time_to_target <trace> tenplex/<peer>``
lines (below 1: tenplex reached the target sooner) and ``RATIO samples_per_s ...`` (above 1: tenplex faster); with
both restart and in place in the run, ``RATIO time_to_target <trace> inprocess/tenplex`` and ``RATIO
shrink_to_first_iteration <trace> inprocess/tenplex`` (a lost node to the first iteration after it, summed over the
trace's shrinks).
Then the simulator (``plan/simulate.py``), fed each policy's measured iteration times and restart costs
(``benchmarks/kit/elastic_sim.py``), predicts its time to target: ``RATIO sim_over_measured <trace> <policy>``.
``--memory-budget GB`` gives every policy ``--tenplex-memory-budget`` (the layouts that fit it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from benchmarks.kit import plots
from benchmarks.kit.agents import KEEP_ALIVE_ATTEMPTS, Cluster, rdzv_conf
from benchmarks.kit.elastic_analysis import (
    PHASES,
    Change,
    breakdown,
    loss_deviation,
    repeated_iterations,
    throughput,
    timelines,
)
from benchmarks.kit.elastic_sim import predict
from benchmarks.kit.inplace import InplaceCluster
from benchmarks.kit.launch import ROOT, torchrun, write_json
from benchmarks.kit.report import Column, Table, machine, num, ratio_key, ratio_line
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.layout_files import LAYOUT_TIMES_FILE, load_layout_table, read_layout_times
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims
from tenplex_megatron.plan.trace import Trace, load_trace

PRETRAIN = os.path.join(ROOT, "scripts", "pretrain_gpt.py")
POLICIES = ("tenplex", "dp_only", "table", "inprocess")
INPROCESS = ["--tenplex-inprocess", "--tenplex-inprocess-timeout", "30"]  # the inprocess policy's (memory: per node)
COMMON = ["--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--tenplex", "--log-interval", "10",
          "--make-vocab-size-divisible-by", "16"]
# name: (layers, hidden, heads, seq, vocab, global batch)
MODELS = {"tiny": (2, 64, 4, 32, 96, 8), "small": (4, 256, 8, 128, 1024, 16), "six": (6, 384, 6, 128, 1024, 12)}
COLORS = {"tenplex": "tab:blue", "dp_only": "tab:orange", "table": "tab:green", "inprocess": "tab:red"}


def model_flags(name: str) -> list[str]:
    layers, hidden, heads, seq, vocab, gbs = MODELS[name]
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--vocab-size", str(vocab),
            "--global-batch-size", str(gbs), *COMMON]


def dims(name: str) -> GPTDims:
    layers, hidden, heads, seq, vocab, _ = MODELS[name]
    return GPTDims(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=vocab,
                   seq_length=seq, bf16=False)  # as the trainer describes itself for its layout choice (fp32 here)


def default_table(trace: Trace, model: str, path: str) -> str:
    """A user's table: PP=2 wherever the world size is even (TP stays 1: one GPU per node here), micro-batch 2."""
    layers, *_, gbs = MODELS[model]
    rows = {}
    for w in sorted({e.gpus for e in trace.events}):
        pp = 2 if w % 2 == 0 and layers % 2 == 0 else 1
        dp = w // pp
        mbs = 2 if gbs % (dp * 2) == 0 else 1
        rows[str(w)] = {"tp": 1, "pp": pp, "dp": dp, "micro_batch_size": mbs}
    write_json(path, {"version": 1, "layouts": rows}, indent=1)
    return path


def nodes_for(policy: str, gpus: int, gpus_per_node: int, mp: int) -> int:
    """Nodes the policy runs on with ``gpus`` GPUs: all, or (dp_only) the most whose GPUs are a multiple of TP x PP."""
    nodes = gpus // gpus_per_node
    if policy != "dp_only":
        return nodes
    while nodes and (nodes * gpus_per_node) % mp:
        nodes -= 1
    return nodes


def replay(policy: str, trace: Trace, flags: list[str], work: str, scale: float, target: int, mp: int,
           timeout: float, from_first_iteration: bool, keep_alive_attempts: int = KEEP_ALIVE_ATTEMPTS,
           ) -> dict[str, Any]:
    """Run one policy through the trace until the target iteration; what happened, for the report."""
    ckpt, log = os.path.join(work, f"{policy}.ckpt"), os.path.join(work, f"{policy}.metrics.jsonl")
    shutil.rmtree(ckpt, ignore_errors=True)  # a reused --workdir: start afresh
    for name in os.listdir(work):  # its agents' logs and its metrics
        if name.startswith(f"{policy}.node") or name == f"{policy}.metrics.jsonl":
            os.unlink(os.path.join(work, name))
        elif name.startswith(f"{policy}.mem"):  # the inprocess policy's nodes' memory
            shutil.rmtree(os.path.join(work, name))
    kind = InplaceCluster if policy == "inprocess" else Cluster
    cluster = kind(policy, PRETRAIN, [*flags, "--save", ckpt, "--load", ckpt, "--tenplex-metrics", log],
                   max_nodes=max(e.nodes for e in trace.events), nproc=trace.gpus_per_node, log_dir=work,
                   rdzv_conf=rdzv_conf(keep_alive_attempts))
    changes: list[Change] = []
    nodes, pending, reached = 0, list(trace.events), None
    t0 = time.time()
    clock = 0.0 if from_first_iteration else t0  # the trace's t=0: the launch, or the job's first iteration
    try:
        while True:
            now = time.time() - clock if clock else 0.0
            while pending and pending[0].t * scale <= now and reached is None and (clock or not changes):
                want = nodes_for(policy, pending.pop(0).gpus, trace.gpus_per_node, mp)
                if want != nodes:
                    changes.append(Change(time.time(), nodes, want))
                    cluster.set_nodes(want)
                    nodes = want
            cluster.poll()
            if cluster.failures:
                raise SystemExit(f"bench_elastic: {policy}: {'; '.join(cluster.failures)} (logs in {work})")
            if reached is None and os.path.exists(log):
                with open(log) as f:
                    tail = [x for x in f.readlines()[-2:] if x.endswith("\n")][-1:]  # whole lines only
                if tail and json.loads(tail[0])["iteration"] >= target:
                    reached = json.loads(tail[0])["time"]
                if tail and not clock:
                    clock = json.loads(tail[0])["time"]
            if reached is not None and cluster.done:
                break
            if trace.end is not None and now > trace.end * scale and reached is None:
                break  # the allocation is gone before the target
            if time.time() - t0 > timeout:
                raise SystemExit(f"bench_elastic: {policy}: not done after {timeout:.0f} s (logs in {work})")
            time.sleep(0.2)
    finally:
        cluster.stop()
    with open(log) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    texts = []
    for name in sorted(os.listdir(work)):
        if name.startswith(f"{policy}.node"):
            with open(os.path.join(work, name)) as f:
                texts.append(f.read())
    lines = timelines(texts)
    spans = list(cluster.workers.values())
    times_file = os.path.join(ckpt, LAYOUT_TIMES_FILE)  # --tenplex-layout measure's trials
    measured = {str(w): t for w, t in read_layout_times(times_file).items()} if os.path.exists(times_file) else {}
    return {"policy": policy, "t0": t0, "starts": [x["process_start"] for x in lines], "layout_times": measured, "time_to_target": None if reached is None else reached - t0,
            "iterations": max((m["iteration"] for m in metrics), default=0), "metrics": metrics,
            "repeated": repeated_iterations(metrics),
            "layouts": sorted({",".join(f"{k}={v}" for k, v in m["layout"].items()) for m in metrics}),
            "changes": [{"t": c.t - t0, "before": c.before, "after": c.after,
                         "breakdown": breakdown(c, spans, lines, changes[i + 1].t if i + 1 < len(changes) else None)
                         if c.after else None} for i, c in enumerate(changes)]}


def start_layout(run: dict[str, Any]) -> tuple[int, int]:
    """(TP, PP) of a policy's first iteration: the initial weights depend on them (not on DP)."""
    first = min(run["metrics"], key=lambda m: m["time"])["layout"]
    return first["tp"], first["pp"]


def references(runs: list[dict[str, Any]], flags: list[str], work: str, timeout: float) -> dict[tuple[int, int],
                                                                                                  dict[int, float]]:
    """An uninterrupted run per starting (TP, PP) among the policies, on TP x PP processes: losses by iteration."""
    out = {}
    for tp, pp in sorted({start_layout(r) for r in runs}):
        log = os.path.join(work, f"reference.tp{tp}pp{pp}.metrics.jsonl")
        t0 = time.time()
        torchrun(tp * pp, PRETRAIN, [*flags, "--tenplex-layout", "auto", "--tensor-model-parallel-size", str(tp),
                                     "--pipeline-model-parallel-size", str(pp), "--tenplex-metrics", log],
                 os.path.join(work, f"reference.tp{tp}pp{pp}.log"), timeout)
        with open(log) as f:
            out[(tp, pp)] = {m["iteration"]: m["loss"] for m in map(json.loads, filter(str.strip, f))}
        print(f"uninterrupted reference at TP={tp}, PP={pp}: {time.time() - t0:.1f} s", flush=True)
    return out


def shrink_seconds(run: dict[str, Any]) -> float | None:
    """Seconds from each lost node to the first iteration after it, summed over the trace's shrinks (None: one had
    no breakdown)."""
    totals = [(c["breakdown"] or {}).get("total") for c in run["changes"] if 0 < c["after"] < c["before"]]
    return sum(totals) if totals and None not in totals else None


def report(runs: list[dict[str, Any]], refs: dict[tuple[int, int], dict[int, float]], trace: Trace, gbs: int,
           window: float) -> list[str]:
    """Print the tables and RATIO lines; return the RATIO lines."""
    t = Table([Column("policy", 9, "<"), Column("to target (s)", 14), Column("samples/s", 10),
               Column("repeated it.", 13), Column("max rel. loss dev.", 19), Column("layouts", 40, "<", "  ")])
    print(t.header())
    for r in runs:
        tt = r["time_to_target"]
        r["samples_per_s"] = None if not tt else r["iterations"] * gbs / tt
        r["reference"] = list(start_layout(r))
        r["loss_deviation"] = loss_deviation(r["metrics"], refs[start_layout(r)])
        r["throughput"] = throughput(r["metrics"], r["t0"], gbs, window)
        print(t.row(r["policy"], num(tt, ".1f"), num(r["samples_per_s"], ".1f"), str(r["repeated"]),
                    f"{r['loss_deviation']:.2e}", " ".join(r["layouts"])))
    print("\nchanges (seconds from the change to the new job's first iteration):")
    c = Table([Column("policy", 9, "<"), Column("at (s)", 7), Column("nodes", 7), *[Column(p, len(p) + 1) for p in
              PHASES], Column("total", 7)])
    print(c.header())
    for r in runs:
        for ch in r["changes"]:
            b = ch["breakdown"] or {}
            print(c.row(r["policy"], f"{ch['t']:.1f}", f"{ch['before']}->{ch['after']}",
                        *[num(b.get(p), ".2f") for p in PHASES], num(b.get("total"), ".2f")))
    out = []
    by = {r["policy"]: r for r in runs}
    mine = by.get("tenplex")
    for peer in (p for p in by if p not in ("tenplex", "inprocess")):
        if mine and mine["time_to_target"] and by[peer]["time_to_target"]:
            out.append(ratio_line(ratio_key("time_to_target", trace.name, "tenplex", peer),
                                  mine["time_to_target"] / by[peer]["time_to_target"]))
            out.append(ratio_line(ratio_key("samples_per_s", trace.name, "tenplex", peer),
                                  mine["samples_per_s"] / by[peer]["samples_per_s"]))
    inplace = by.get("inprocess")
    if mine and inplace:  # in place against the restart, the same trace in the same run
        if mine["time_to_target"] and inplace["time_to_target"]:
            out.append(ratio_line(ratio_key("time_to_target", trace.name, "inprocess", "tenplex"),
                                  inplace["time_to_target"] / mine["time_to_target"]))
        shrinks = [shrink_seconds(r) for r in (inplace, mine)]
        if all(shrinks):
            out.append(ratio_line(ratio_key("shrink_to_first_iteration", trace.name, "inprocess", "tenplex"),
                                  shrinks[0] / shrinks[1]))
    print()
    for line in out:
        print(line)
    return out


def simulated(runs: list[dict[str, Any]], a: argparse.Namespace, trace: Trace, table: str,
              mp: tuple[int, int]) -> list[str]:
    """The simulator's time to target per policy, fed the policy's own measured iteration times and restart costs."""
    *_, gbs = MODELS[a.model]
    t = load_layout_table(table, dims(a.model), gpus_per_node=trace.gpus_per_node, global_batch_size=gbs)
    print("\nsimulated (plan/simulate.py fed each policy's measured iteration times and restart costs):")
    out = []
    for r in runs:
        kind = a.tenplex_layout if r["policy"] in ("tenplex", "inprocess") else r["policy"]
        r["simulated"] = sim = predict(r, kind, trace, dims(a.model), gbs, a.train_iters, a.time_scale,
                                       a.clock == "first-iteration", a.save_interval, t, mp, 16, a.memory_budget,
                                       {int(w): x for w, x in r.get("layout_times", {}).items()})
        print(f"  {r['policy']:<9} simulated {num(sim['time_to_target'], '.1f')} s, measured "
              f"{num(r['time_to_target'], '.1f')} s; layouts {' '.join(sim['layouts'])}; restarts {sim['restarts']}, "
              f"redone {sim['redone_iterations']}")
        if sim["time_to_target"] and r["time_to_target"]:
            out.append(ratio_line(f"sim_over_measured {trace.name} {r['policy']}",
                                  sim["time_to_target"] / r["time_to_target"]))
    for line in out:
        print(line)
    return out


def plot(runs: list[dict[str, Any]], refs: dict[tuple[int, int], dict[int, float]], trace: Trace, path: str) -> None:
    plt = plots.pyplot()
    if plt is None:
        return
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(9, 10))
    for r in runs:
        xs = [x for x, _ in r["throughput"]]
        a.step(xs, [y for _, y in r["throughput"]], where="post", color=COLORS[r["policy"]], label=r["policy"])
        prog = sorted({m["iteration"]: m["loss"] for m in r["metrics"]}.items())
        b.plot([i for i, _ in prog], [x for _, x in prog], color=COLORS[r["policy"]], lw=1, label=r["policy"])
    for (tp, pp), ref in refs.items():
        b.plot(sorted(ref), [ref[i] for i in sorted(ref)], "k--", lw=0.8, label=f"uninterrupted TP={tp} PP={pp}")
        for r in runs:  # the relative deviation from the policy's own reference, on a second axis
            if tuple(r["reference"]) == (tp, pp):
                dev = sorted({m["iteration"]: abs(m["loss"] - ref[m["iteration"]]) / abs(ref[m["iteration"]])
                              for m in r["metrics"]}.items())
                c.semilogy([i for i, _ in dev], [max(d, 1e-12) for _, d in dev], color=COLORS[r["policy"]], lw=0.8,
                           label=r["policy"])
    for r in runs:  # when the allocation changed (seconds from the policy's start)
        for ch in r["changes"][1:]:
            a.axvline(ch["t"], color=COLORS[r["policy"]], lw=0.5, ls=":")
    a.set_xlabel("seconds (dotted: allocation changes)")
    a.set_ylabel("samples/s (new iterations)")
    a.set_title(f"{trace.name}: throughput over time")
    a.legend(fontsize=8)
    b.set_xlabel("iteration")
    b.set_ylabel("lm loss")
    b.set_title("loss curves against the uninterrupted run")
    b.legend(fontsize=8)
    c.set_xlabel("iteration")
    c.set_ylabel("|loss - uninterrupted| / uninterrupted")
    c.set_title(f"relative loss deviation ({trace.name})")
    c.legend(fontsize=8)
    plots.save(plt, fig, path)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=None, help="configs/traces/NAME.json")
    p.add_argument("--quick", action="store_true", help="tiny model, configs/traces/quick.json, 200 iterations")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--table", default=None, help="the table policy's --tenplex-layout FILE.json")
    p.add_argument("--tenplex-layout", choices=["auto", "measure"], default="auto", help="the tenplex policy's")
    p.add_argument("--memory-budget", type=float, default=None,
                   help="GiB per rank for every policy's layout choice (--tenplex-memory-budget)")
    p.add_argument("--dp-only-mp", default=None, help="dp_only's fixed TP,PP (default: the table's at the start)")
    p.add_argument("--train-iters", type=int, default=None, help="the target iteration")
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per trace second")
    p.add_argument("--window", type=float, default=5.0, help="seconds per samples/s window")
    p.add_argument("--clock", choices=["launch", "first-iteration"], default="launch",
                   help="the trace's t=0: the launch, or the job's first iteration (after the first start-up, "
                   "which an oversubscribed CPU can make longer than the trace's first phase)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per policy")
    p.add_argument("--keep-alive-attempts", type=int, default=None,
                   help=f"missed 1-second rendezvous heartbeats before an agent counts as lost (default "
                   f"{KEEP_ALIVE_ATTEMPTS}; --quick: 10, for shared CI cores where a heartbeat can stall)")
    p.add_argument("--out", default=None, help="the report as JSON")
    p.add_argument("--plot", default=None, help="PNG (default: next to --out, or in the work directory)")
    p.add_argument("--workdir", default=None, help="kept (default: a temporary directory, removed)")
    a = p.parse_args(argv)
    if a.quick:
        a.trace = a.trace or os.path.join(ROOT, "configs", "traces", "quick.json")
        a.train_iters = a.train_iters or 200
        a.save_interval = 5
        a.clock = "first-iteration"
        a.keep_alive_attempts = a.keep_alive_attempts or 10
    if not a.trace or not a.train_iters:
        p.error("give --trace and --train-iters (or --quick)")
    policies = [x for x in a.policies.split(",") if x]
    bad = sorted(set(policies) - set(POLICIES))
    if bad:
        p.error(f"--policies: unknown {', '.join(bad)} (known: {', '.join(POLICIES)})")
    trace = load_trace(a.trace)
    work = a.workdir or tempfile.mkdtemp(prefix="bench_elastic_")
    os.makedirs(work, exist_ok=True)
    flags = [*model_flags(a.model), "--train-iters", str(a.train_iters), "--save-interval", str(a.save_interval)]
    if a.memory_budget is not None:
        flags += ["--tenplex-memory-budget", str(a.memory_budget)]
    table = a.table or default_table(trace, a.model, os.path.join(work, "user_table.json"))
    gbs = MODELS[a.model][-1]
    start = load_layout_table(table, dims(a.model), gpus_per_node=trace.gpus_per_node,
                              global_batch_size=gbs).row(trace.events[0].gpus).layout
    if a.dp_only_mp:
        tp, pp = (int(x) for x in a.dp_only_mp.split(","))
        start = ParallelLayout(tp, pp, max(1, trace.events[0].gpus // (tp * pp)))
    print(f"bench_elastic: trace {trace.name} ({' -> '.join(str(e.gpus) for e in trace.events)} GPUs, "
          f"x{a.time_scale:g} time), model {a.model}, target iteration {a.train_iters}, save every "
          f"{a.save_interval}; dp_only keeps TP x PP = {start.tp} x {start.pp}; table {table}; work {work}")
    per_policy = {"tenplex": ["--tenplex-layout", a.tenplex_layout], "table": ["--tenplex-layout", table],
                  "inprocess": ["--tenplex-layout", a.tenplex_layout, *INPROCESS],
                  "dp_only": ["--tenplex-layout", "auto", "--tensor-model-parallel-size", str(start.tp),
                              "--pipeline-model-parallel-size", str(start.pp)]}
    runs = []
    for policy in policies:
        r = replay(policy, trace, [*flags, *per_policy[policy]], work, a.time_scale, a.train_iters,
                   start.tp * start.pp, a.timeout, a.clock == "first-iteration",
                   a.keep_alive_attempts or KEEP_ALIVE_ATTEMPTS)
        print(f"{policy}: iteration {r['iterations']} in {num(r['time_to_target'], '.1f')} s, "
              f"{len(r['changes'])} allocation changes", flush=True)
        runs.append(r)
    refs = references(runs, flags, work, a.timeout)
    print(f"\nmachine: {os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} "
          "(other processes share the cores: compare policies within one run)\n")
    ratios = report(runs, refs, trace, gbs, a.window)
    ratios += simulated(runs, a, trace, table, (start.tp, start.pp))
    png = a.plot or os.path.join(os.path.dirname(os.path.abspath(a.out)) if a.out else (a.workdir or "."),
                                 f"bench_elastic_{trace.name}.png")
    plot(runs, refs, trace, png)
    if a.out:
        for r in runs:
            r["losses"] = [[m["iteration"], m["loss"]] for m in r.pop("metrics")]
        write_json(a.out, {"trace": trace.name, "model": a.model, "target": a.train_iters, "time_scale": a.time_scale,
                           "clock": a.clock, "dp_only_mp": [start.tp, start.pp], "table": table,
                           "references": {f"tp{tp}pp{pp}": sorted(ref.items()) for (tp, pp), ref in refs.items()},
                           "runs": runs, "ratios": ratios, "times_note": "seconds from each policy's launch",
                           "machine": machine()},
                   indent=1)
    if a.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
