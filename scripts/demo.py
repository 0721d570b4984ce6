"""The demo: a GPT job loses a GPU and gets it back, and its loss curve does not notice.

1. an uninterrupted reference: 2 processes at TP=2 for all steps;
2. the elastic job, all with --tenplex: 2 processes at TP=2, then "a GPU is
   lost": 1 process resumes at TP=1, then the GPU is back: 2 processes at PP=2.

It prints what each restart re-sharded (tensors, bytes, time), the per-step
losses beside the reference, and writes the curves to out/demo_loss.png.
Runs on a CPU-only laptop (gloo) in about two minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

from tenplex_megatron._optional import MissingExtraError, require

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--vocab-size", "250", "--make-vocab-size-divisible-by", "64", "--swiglu",
    "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "3e-3", "--min-lr", "3e-4",
    "--lr-warmup-iters", "3", "--lr-decay-style", "cosine", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--use-distributed-optimizer", "--mock-data", "--tenplex", "--log-interval", "1",
]
PHASES = [  # (name, processes, tp, pp): each runs --steps-per-phase steps
    ("2 GPUs, TP=2", 2, 2, 1),
    ("1 GPU lost: TP=1", 1, 1, 1),
    ("GPU back: PP=2", 2, 1, 2),
]


def run(nproc: int, tp: int, pp: int, args: list[str]) -> tuple[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *MODEL,
           "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *args]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0 or "tenplex-megatron: done" not in p.stdout:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-5000:])
        raise SystemExit(f"demo: a training run failed (exit {p.returncode})")
    return p.stdout, time.perf_counter() - t0


def losses(path: str) -> dict[int, float]:
    with open(path) as f:
        return {m["iteration"]: m["loss"] for m in map(json.loads, f)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "demo"))
    ap.add_argument("--steps-per-phase", type=int, default=10, help="training steps before each change (at least 4)")
    args = ap.parse_args()
    if args.steps_per_phase < 4:
        ap.error("--steps-per-phase must be at least 4 (the learning-rate warm-up is 3 steps)")
    out = args.out
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    phases = [(*p, args.steps_per_phase * (i + 1)) for i, p in enumerate(PHASES)]  # ... and run until iteration
    total = phases[-1][4]
    print(f"== reference: 2 processes at TP=2, {total} steps, never interrupted")
    _, secs = run(2, 2, 1, ["--train-iters", str(total), "--tenplex-metrics", f"{out}/reference.jsonl"])
    print(f"   done in {secs:.0f} s")
    ckpt = f"{out}/ckpt"
    reshards = []
    for name, nproc, tp, pp, until in phases:
        print(f"== elastic job: {name} ({nproc} process{'es' if nproc > 1 else ''}) until step {until}")
        log, secs = run(nproc, tp, pp, ["--train-iters", str(total), "--exit-interval", str(until), "--save", ckpt,
                                        "--load", ckpt, "--tenplex-metrics", f"{out}/elastic.jsonl"])
        for line in log.splitlines():
            if line.startswith("> tenplex"):
                print("   " + line)
            m = re.match(r"> tenplex: loaded iteration (\d+) .*layout (\S+) -> (\S+), (\d+) tensors, ([\d.]+) MB .* in ([\d.]+) s", line)
            if m:
                reshards.append(m.groups())
        print(f"   phase done in {secs:.0f} s")
    ref, ela = losses(f"{out}/reference.jsonl"), losses(f"{out}/elastic.jsonl")
    print("\n== what was re-sharded")
    print(f"   {'at step':>7}  {'from':<16} {'to':<16} {'tensors':>7} {'MB read (rank 0)':>17} {'load s':>7}")
    for it, src, dst, n, mb, s in reshards:
        print(f"   {it:>7}  {src:<16} {dst:<16} {n:>7} {mb:>17} {s:>7}")
    print("\n== per-step loss: elastic job vs uninterrupted reference")
    print(f"   {'step':>4}  {'layout':<18} {'elastic':>12} {'reference':>12} {'|diff|':>9}")
    worst = 0.0
    for it in sorted(ref):
        phase = next(p for p in phases if it <= p[4])
        d = abs(ela[it] - ref[it])
        worst = max(worst, d / abs(ref[it]))
        print(f"   {it:>4}  {phase[0]:<18} {ela[it]:>12.7f} {ref[it]:>12.7f} {d:>9.2e}")
    print(f"\n   largest relative difference: {worst:.2e} (fp32; only the reduction order changes with the layout)")
    plot(ref, ela, phases, f"{out}/../demo_loss.png")
    return 0 if worst < 1e-5 else 1


def plot(ref: dict[int, float], ela: dict[int, float], phases: list[tuple], path: str) -> None:
    try:
        matplotlib = require("matplotlib", "bench", needed_by="the demo's plot")
    except MissingExtraError as e:
        print(f"   ({e}: no plot)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    its = sorted(ref)
    ax.plot(its, [ref[i] for i in its], "k-", lw=3, alpha=0.35, label="uninterrupted, 2 procs TP=2")
    for name, _, _, _, until in phases:
        lo = max([p[4] for p in phases if p[4] < until], default=0)
        seg = [i for i in its if lo < i <= until]
        ax.plot(seg, [ela[i] for i in seg], "o-", ms=3, label=f"tenplex: {name}")
        if lo:
            ax.axvline(lo + 0.5, color="grey", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("lm loss")
    ax.set_title("Elastic GPT training with --tenplex: same loss curve")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.abspath(path), dpi=120)
    print(f"   loss curves written to {os.path.abspath(path)}")


if __name__ == "__main__":
    sys.exit(main())
