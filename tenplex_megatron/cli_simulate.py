"""``python -m tenplex_megatron simulate``: replay a GPU-allocation trace on paper for several layout policies.

Prints per policy the time to the target iteration, mean samples/s, restarts, redone iterations, idle GPU-hours and
the layouts used, whether iteration times were measured (``--times``) or modelled, and ``RATIO`` lines of the first
policy against each other; optionally a versioned JSON report and a PNG. The simulation itself is
``plan/simulate.py`` (pure, no torch); this module only parses flags and prints.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, replace
from typing import Any

from tenplex_megatron._optional import require
from tenplex_megatron.cli_options import add_job_options, distributed_optimizer
from tenplex_megatron.errors import TenplexError
from tenplex_megatron.plan.autolayout import Hardware
from tenplex_megatron.plan.layout import LayoutError
from tenplex_megatron.plan.layout_files import load_layout_table, read_layout_times
from tenplex_megatron.plan.sim.gpt_catalogue import load_model
from tenplex_megatron.plan.simulate import (
    POLICY_KINDS,
    RESULT_VERSION,
    SHRINK_MODES,
    Costs,
    Job,
    Policy,
    PolicyResult,
    SimulationError,
    Simulator,
    regroup_trace,
    repeat_trace,
    scale_trace,
    throughput_series,
    truncate_trace,
)
from tenplex_megatron.plan.trace import Trace, TraceError, load_trace


class SimulateError(TenplexError, RuntimeError):
    """A bad flag or input file of ``simulate``: the CLI prints it without a traceback, exit status 2."""


def _mp(text: str) -> tuple[int, int]:
    try:
        tp, pp = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TP,PP (e.g. 2,4), got {text!r}") from None
    if tp < 1 or pp < 1:
        raise argparse.ArgumentTypeError(f"TP and PP must be >= 1, got {text!r}")
    return tp, pp


def _target_at(text: str) -> tuple[str, float]:
    name, sep, minutes = text.partition("=")
    try:
        value = float(minutes)
    except ValueError:
        value = -1.0
    if not sep or value <= 0:
        raise argparse.ArgumentTypeError(f"expected POLICY=MINUTES (e.g. table=298), got {text!r}")
    return name, value


def add_parser(sub: Any) -> None:
    """The ``simulate`` subcommand and its flags."""
    s = sub.add_parser("simulate", help="replay a GPU-allocation trace on paper: each policy's layouts, restarts "
                                        "and time to a target iteration (no GPU, no torch)")
    s.add_argument("--trace", required=True, help="configs/traces/NAME.json")
    add_job_options(s, required=("model", "global_batch_size"))
    s.add_argument("--model-catalogue", default=None, help="a models.json of your own (default: the packaged one)")
    s.add_argument("--policies", default="auto,dp_only",
                   help=f"comma-separated, first is compared with the others: {', '.join(POLICY_KINDS)} (default "
                        "auto,dp_only)")
    s.add_argument("--table", default=None, help="the table policy's layout file (--tenplex-layout FILE.json)")
    s.add_argument("--dp-only-mp", type=_mp, default=None,
                   help="dp_only's fixed TP,PP (default: the table's, else auto's, layout at the first allocation)")
    s.add_argument("--times", default=None,
                   help="measured seconds per iteration (tenplex_layout_times.json); otherwise modelled")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--target-iteration", type=int, help="the iteration to reach")
    g.add_argument("--target-at", type=_target_at, metavar="POLICY=MINUTES",
                   help="the target is the iteration POLICY reaches after MINUTES (e.g. to compare with a paper's time)")
    s.add_argument("--time-scale", type=float, default=1.0, help="seconds per trace time unit (60: minutes)")
    s.add_argument("--repeat", type=int, default=1, help="play the trace this many times in a row (needs its end)")
    s.add_argument("--clock", choices=["launch", "first-iteration"], default="launch",
                   help="the trace's t=0: the launch, or the job's first iteration")
    s.add_argument("--intra-node-gbps", type=float, default=Hardware().intra_node_bandwidth / 1e9,
                   help="GB/s within a node for the throughput model")
    s.add_argument("--inter-node-gbps", type=float, default=Hardware().inter_node_bandwidth / 1e9,
                   help="GB/s between nodes for the throughput model")
    s.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    c = Costs()
    s.add_argument("--start-s", type=float, default=c.start_s, help="launch to first iteration, load excluded")
    s.add_argument("--restart-s", type=float, default=c.restart_s,
                   help="old workers gone to first iteration, re-shard excluded")
    s.add_argument("--detect-failure-s", type=float, default=c.detect_failure_s)
    s.add_argument("--detect-notice-s", type=float, default=c.detect_notice_s)
    s.add_argument("--storage-gbps", type=float, default=c.storage_bandwidth / 1e9,
                   help="GB/s per rank reading (and writing) its own node's checkpoint bytes")
    s.add_argument("--network-gbps", type=float, default=c.network_bandwidth / 1e9,
                   help="GB/s per rank reading other nodes' bytes")
    s.add_argument("--save-every", type=int, default=c.save_every, help="iterations between periodic saves")
    s.add_argument("--save-s", type=float, default=None, help="seconds per save (default: state bytes / storage)")
    s.add_argument("--measure-trial-s", type=float, default=c.measure_trial_s)
    s.add_argument("--shrink", choices=SHRINK_MODES, default=c.shrink,
                   help="a smaller allocation is a lost node (failure: work since the last save redone) or a planned "
                        "change (notice: save first)")
    s.add_argument("--exact-bytes-max-gpus", type=int, default=c.exact_bytes_max_gpus,
                   help="plan re-shards exactly up to this world size; beyond, the busiest rank's state bytes")
    s.add_argument("--window", type=float, default=None, help="seconds per samples/s window (default: 1/50 of the run)")
    s.add_argument("--out", default=None, help="the report as JSON")
    s.add_argument("--plot", default=None, help="PNG of samples/s over time (needs matplotlib)")
    s.set_defaults(fn=cmd_simulate)


def _policies(args: argparse.Namespace, sim: Simulator, trace: Trace) -> list[Policy]:
    kinds = [k for k in args.policies.split(",") if k]
    bad = sorted(set(kinds) - set(POLICY_KINDS))
    if bad or not kinds or len(set(kinds)) != len(kinds):
        raise SimulateError(f"--policies: give distinct kinds among {', '.join(POLICY_KINDS)}, got {args.policies!r}")
    table = None
    if args.table:
        try:
            table = load_layout_table(args.table, sim.job.dims, gpus_per_node=sim.gpus_per_node,
                                      global_batch_size=sim.job.global_batch_size)
        except LayoutError as e:
            raise SimulateError(str(e)) from None
    elif "table" in kinds:
        raise SimulateError("--policies table needs --table FILE.json")
    mp = args.dp_only_mp
    if "dp_only" in kinds and mp is None:
        base = Policy("table", "table", table) if table else Policy("auto", "auto")
        first = sim.choose(base, trace.events[0].gpus)
        if first is None:
            raise SimulateError(f"dp_only: no {base.kind} layout at the first allocation ({trace.events[0].gpus} GPUs) "
                                "to take TP x PP from: give --dp-only-mp TP,PP")
        mp = (first.layout.tp, first.layout.pp)
    return [Policy(k, k, table if k == "table" else None, mp if k == "dp_only" else None) for k in kinds]


def _trace(args: argparse.Namespace) -> Trace:
    try:
        trace = load_trace(args.trace)
    except TraceError as e:
        raise SimulateError(str(e)) from None
    trace = scale_trace(trace, args.time_scale)
    if args.gpus_per_node:
        trace = regroup_trace(trace, args.gpus_per_node)
    if args.repeat > 1:
        trace = repeat_trace(trace, args.repeat)
    return trace


def cmd_simulate(args: argparse.Namespace) -> int:
    """Simulate every policy on the trace; print the table and RATIO lines; write JSON and PNG when asked."""
    try:
        dims = load_model(args.model, args.model_catalogue)
    except KeyError as e:
        raise SimulateError(str(e).strip("'\"")) from None
    try:
        trace = _trace(args)
        hw = Hardware(flops_per_gpu=args.tflops_per_gpu * 1e12, intra_node_bandwidth=args.intra_node_gbps * 1e9,
                      inter_node_bandwidth=args.inter_node_gbps * 1e9)
        costs = Costs(args.start_s, args.restart_s, args.detect_failure_s, args.detect_notice_s,
                      args.storage_gbps * 1e9, args.network_gbps * 1e9, args.save_every, args.save_s,
                      args.measure_trial_s, args.shrink, args.exact_bytes_max_gpus)
        times = read_layout_times(args.times) if args.times else None
        job = Job(dims, args.global_batch_size, args.target_iteration or 1, memory_gb=args.memory_gb,
                  distributed_optimizer=distributed_optimizer(args),
                  make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, hardware=hw)
        sim = Simulator(job, costs, trace.gpus_per_node, times)
        policies = _policies(args, sim, trace)
        first_iteration = args.clock == "first-iteration"
        if args.target_at:
            name, minutes = args.target_at
            chosen = [p for p in policies if p.name == name]
            if not chosen:
                raise SimulateError(f"--target-at {name}: not among --policies {args.policies}")
            probe = Simulator(replace(job, target_iteration=2**62), costs, trace.gpus_per_node, times)
            done = probe.run(truncate_trace(trace, minutes * 60), chosen[0],
                             first_iteration_clock=first_iteration).iterations
            if done < 1:
                raise SimulateError(f"--target-at: {name} completes no iteration in {minutes:g} minutes")
            sim = Simulator(replace(job, target_iteration=done), costs, trace.gpus_per_node, times)
        results = [sim.run(trace, p, first_iteration_clock=first_iteration) for p in policies]
    except (SimulationError, LayoutError, OSError, ValueError) as e:
        raise SimulateError(str(e)) from None
    _print(args, trace, sim, results)
    if args.out:
        doc = {"version": RESULT_VERSION, "trace": trace.name, "model": args.model,
               "gpus": [e.gpus for e in trace.events], "target_iteration": sim.job.target_iteration,
               "global_batch_size": args.global_batch_size, "times": "measured" if args.times else "modelled",
               "costs": asdict(costs), "policies": [r.to_json() for r in results]}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"report: {args.out}")
    if args.plot:
        _plot(args.plot, trace, results, args.window)
    return 0


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "not reached"
    return f"{s:.1f} s" if s < 600 else f"{s / 60:.1f} min" if s < 3 * 86400 else f"{s / 86400:.2f} d"


def _print(args: argparse.Namespace, trace: Trace, sim: Simulator, results: list[PolicyResult]) -> None:
    gpus = sorted({e.gpus for e in trace.events})
    print(f"simulate     trace {trace.name}: {len(trace.events)} allocations, {gpus[0]}-{gpus[-1]} GPUs "
          f"({trace.gpus_per_node} per node); model {args.model}, global batch {args.global_batch_size}, target "
          f"iteration {sim.job.target_iteration}")
    for r in results:
        how = "modelled" if r.modelled_times else "measured"
        print(f"{r.policy:<10} to target {_fmt_s(r.time_to_target):>12}  samples/s "
              f"{r.samples_per_s or 0:>10.1f}  restarts {r.restarts:>4}  redone it. {r.redone_iterations:>6}  idle "
              f"GPU-h {r.idle_gpu_hours:>10.1f}  iteration times {how}"
              + ("  (some re-shard bytes estimated)" if r.estimated_bytes else ""))
        print(f"{'':<10} layouts: {' '.join(r.layouts) or '-'}")
    mine = results[0]
    for peer in results[1:]:
        if mine.time_to_target and peer.time_to_target:
            print(f"RATIO sim_time_to_target {trace.name} {mine.policy}/{peer.policy} = "
                  f"{mine.time_to_target / peer.time_to_target:.2f}")
            print(f"RATIO sim_samples_per_s {trace.name} {mine.policy}/{peer.policy} = "
                  f"{(mine.samples_per_s or 0) / (peer.samples_per_s or 1):.2f}")


def _plot(path: str, trace: Trace, results: list[PolicyResult], window: float | None) -> None:
    matplotlib = require("matplotlib", "bench", needed_by="simulate --plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max((r.time_to_target or 0.0) for r in results) or (trace.end or trace.events[-1].t)
    w = window or max(end / 50, 1e-3)
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    unit, div = ("min", 60.0) if end > 1200 else ("s", 1.0)
    for r in results:
        series = throughput_series(r, w)
        a.step([t / div for t, _ in series], [v for _, v in series], where="post", label=r.policy)
    ev = [(e.t, e.gpus) for e in trace.events if e.t <= end]
    b.step([t / div for t, _ in ev] + [end / div], [g for _, g in ev] + [ev[-1][1]], where="post", color="k")
    for r in results:
        if r.time_to_target:
            for ax in (a, b):
                ax.axvline(r.time_to_target / div, ls=":", lw=0.8)
    a.set_ylabel("samples/s (simulated)")
    a.set_title(f"{trace.name}: simulated throughput (dotted: target reached)")
    a.legend(fontsize=8)
    b.set_ylabel("GPUs allocated")
    b.set_xlabel(unit)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"plot: {path}")


