"""The GPU check's ``resume`` step: tiny GPT checkpoints saved on the CPU (CUDA hidden, 2 gloo ranks, the reference
trainer) at TP2, PP2, DP2 and TP2 bf16, resumed at world size 1 on the device and on the CPU: losses of steps 4-6
equal within fp32/bf16 tolerance, and the state re-saved right after the load byte-identical."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

from scripts.gpu_steps.cells import sci, secs, why_text
from scripts.gpu_steps.launch import ROOT, Clock, Launch, child_env, log_path, run_all, visible_device
from scripts.gpu_steps.losses import CPU_RESUME_TOLERANCE, SAVED_AT, TOLERANCE, TRAIN_ITERS, max_rel, read_losses

PRETRAIN = os.path.join(ROOT, "scripts", "pretrain_gpt.py")

# The resume check's model: the CPU suite's tiny GPT (tests/harness.py TINY_GPT, 96-token vocabulary: padded the
# same at TP1 and TP2), 6 steps, saved at step 3.
TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--make-vocab-size-divisible-by", "16", "--vocab-size", "96", "--swiglu",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4",
    "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--mock-data", "--tenplex", "--log-interval", "1", "--train-iters", "6",
]


@dataclass(frozen=True)
class Case:
    """A checkpoint the resume check makes on the CPU with two ranks (tp x pp x dp = 2), and its flags."""

    tp: int
    pp: int
    flags: tuple[str, ...] = ()

    @property
    def dtype(self) -> str:
        return "bf16" if "--bf16" in self.flags else "fp32"

    def layout(self) -> str:
        return f"tp{self.tp}pp{self.pp}dp{2 // (self.tp * self.pp)}"


CASES = {
    "tp2": Case(2, 1),
    "pp2": Case(1, 2),
    "dp2": Case(1, 1, ("--use-distributed-optimizer",)),
    "tp2-bf16": Case(2, 1, ("--bf16", "--use-distributed-optimizer")),
}


def torchrun(nproc: int, flags: list[str], env: dict[str, str], log: str) -> Launch:
    """A standalone torchrun launch of the reference trainer (fresh interpreters, as a user would start it)."""
    return Launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                   PRETRAIN, *flags], env, log)


def tree_digests(root: str) -> dict[str, str]:
    """sha256 of every ``*.safetensors`` file under ``root``, by its path relative to ``root``."""
    out = {}
    for base, _, names in os.walk(root):
        for n in sorted(names):
            if n.endswith(".safetensors"):
                path = os.path.join(base, n)
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    while chunk := f.read(8 << 20):
                        h.update(chunk)
                out[os.path.relpath(path, root)] = h.hexdigest()
    return out


LOADED = re.compile(r"> tenplex: loaded iteration (\d+) from .*?: layout (\S+) -> (\S+), (\d+) tensors, "
                    r"([\d.]+) MB read on rank 0 in ([\d.]+) s")


def step_resume(opts: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """Make each case's checkpoint on the CPU, then resume it at world size 1 on the device and on the CPU."""
    t0 = time.monotonic()
    limit = clock.limit("resume")
    cpu_env, dev_env = child_env(opts.site, True), child_env(opts.site, opts.cpu_dry_run)
    if not opts.cpu_dry_run:  # the trainer's rank 0 takes CUDA device 0: make that the one asked for
        dev_env["CUDA_VISIBLE_DEVICES"] = visible_device(opts.device, dev_env.get("CUDA_VISIBLE_DEVICES"))
    base = os.path.join(opts.work, "resume")
    cases = {name: CASES[name] for name in opts.cases}
    for name in cases:
        os.makedirs(os.path.join(base, name), exist_ok=True)  # the trainer appends its metrics there
    make = {name: torchrun(2, [*TINY_GPT, *c.flags, "--tensor-model-parallel-size", str(c.tp),
                               "--pipeline-model-parallel-size", str(c.pp), "--save", f"{base}/{name}/ckpt",
                               "--save-interval", str(SAVED_AT), "--tenplex-metrics", f"{base}/{name}/ref.jsonl"],
                           cpu_env, log_path(opts.work, f"resume-{name}-make"))
            for name, c in cases.items()}
    run_all(list(make.values()), limit)
    resumed: dict[str, dict[str, Launch]] = {}
    for name, c in cases.items():
        if make[name].rc != 0:
            continue
        ckpt = f"{base}/{name}/ckpt/iter_{SAVED_AT:07d}"
        resumed[name] = {where: torchrun(1, [*TINY_GPT, *c.flags, "--load", ckpt,
                                             "--tenplex-resave", f"{base}/{name}/resave-{where}",
                                             "--tenplex-metrics", f"{base}/{name}/{where}.jsonl"],
                                         env, log_path(opts.work, f"resume-{name}-{where}"))
                         for where, env in (("cpu", cpu_env), ("device", dev_env))}
    run_all([launch for pair in resumed.values() for launch in pair.values()], max(1.0, limit - (time.monotonic() - t0)))
    steps = list(range(SAVED_AT + 1, TRAIN_ITERS + 1))
    out: dict[str, Any] = {"cases": {}, "steps": steps, "tolerance": TOLERANCE,
                           "cpu_resume_tolerance": CPU_RESUME_TOLERANCE}
    for name, c in cases.items():
        row: dict[str, Any] = {"from": c.layout(), "to": "tp1pp1dp1", "dtype": c.dtype, "make_rc": make[name].rc}
        pair = resumed.get(name, {})
        for where, launch in pair.items():
            row[f"{where}_rc"] = launch.rc
        ref, cpu, dev = (read_losses(f"{base}/{name}/{w}.jsonl") for w in ("ref", "cpu", "device"))
        row.update(ref_losses=[ref.get(s) for s in steps], cpu_losses=[cpu.get(s) for s in steps],
                   device_losses=[dev.get(s) for s in steps],
                   device_vs_cpu=max_rel(dev, cpu, steps), cpu_vs_uninterrupted=max_rel(cpu, ref, steps))
        if pair:
            with open(pair["device"].log) as f:
                m = LOADED.search(f.read())
            if m:
                row.update(loaded_iteration=int(m.group(1)), loaded_mb=float(m.group(5)),
                           load_seconds=float(m.group(6)))
            a, b = (tree_digests(f"{base}/{name}/resave-{w}") for w in ("cpu", "device"))
            row.update(resave_files=len(a), resave_identical=bool(a) and a == b)
        tol = TOLERANCE[c.dtype]
        why = [w for w, bad in (
            ("a launch failed", any(row.get(k) != 0 for k in ("make_rc", "cpu_rc", "device_rc"))),
            ("losses missing", row["device_vs_cpu"] is None or row["cpu_vs_uninterrupted"] is None),
            (f"device loss differs from the CPU's by more than {tol:g}", (row["device_vs_cpu"] or 0) > tol),
            (f"CPU resume differs from the uninterrupted run by more than {CPU_RESUME_TOLERANCE[c.dtype]:g}",
             (row["cpu_vs_uninterrupted"] or 0) > CPU_RESUME_TOLERANCE[c.dtype]),
            ("re-saved state differs", not row.get("resave_identical")),
            ("did not load iteration 3", row.get("loaded_iteration") != SAVED_AT)) if bad]
        row["status"] = "pass" if not why else "fail"
        if why:
            row["why"] = "; ".join(why)
        out["cases"][name] = row
    timed_out = any(launch.rc == 124 for launch in [*make.values(), *(x for p in resumed.values() for x in p.values())])
    statuses = [r["status"] for r in out["cases"].values()]
    out["status"] = "timeout" if timed_out else "pass" if statuses and all(s == "pass" for s in statuses) else "fail"
    out["seconds"] = time.monotonic() - t0
    return out


def rows(r: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The resume step's lines of the table: each case, then the step."""
    rows: list[tuple[str, str, str, str]] = []
    for name, c in r.get("cases", {}).items():
        rows.append((f"resume {name}: {c['from']} (CPU) -> {c['to']} on the device", c["status"], "-",
                     f"{c['dtype']}: loss steps {r['steps'][0]}-{r['steps'][-1]} max rel diff vs CPU "
                     f"{sci(c.get('device_vs_cpu'))} (tol {TOLERANCE[c['dtype']]:g}); CPU resume vs "
                     f"uninterrupted {sci(c.get('cpu_vs_uninterrupted'))}; re-saved state identical: "
                     f"{c.get('resave_identical')}; load {c.get('load_seconds', '-')} s" + why_text(c)))
    rows.append(("resume step", r["status"], secs(r), f"{len(r.get('cases', {}))} case(s)" + why_text(r)))
    return rows
