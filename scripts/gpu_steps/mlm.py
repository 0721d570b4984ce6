"""The GPU check's ``mlm`` step: Megatron-LM's own ``pretrain_gpt.py`` (a copy patched with ``patches/``,
``--tenplex``, bf16, the distributed optimizer, ``--transformer-impl local``) saves a TP2 checkpoint on the CPU
(CUDA hidden, 2 gloo ranks, run through ``tests/megatron_lm/run_megatron_lm.py``), resumed at world size 1 on the
device and on the CPU: losses of steps 4-6 equal within bf16 tolerance. The checkout is found as
``benchmarks/kit/mlm_checkout.py`` says; without one the step reports skip."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import Any

from benchmarks.kit.mlm_checkout import mlm_checkout, mlm_patched_copy, mlm_release
from scripts.gpu_steps.cells import sci, secs, why_text
from scripts.gpu_steps.launch import ROOT, Clock, Launch, child_env, log_path, run_all, visible_device
from scripts.gpu_steps.losses import SAVED_AT, TOLERANCE, TRAIN_ITERS, max_rel

MLM_RUNNER = os.path.join(ROOT, "tests", "megatron_lm", "run_megatron_lm.py")
MLM_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", str(TRAIN_ITERS), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--make-vocab-size-divisible-by",
    "16", "--hidden-dropout", "0", "--attention-dropout", "0", "--transformer-impl", "local",
    "--no-persist-layer-norm", "--use-distributed-optimizer", "--log-interval", "1", "--eval-iters", "0",
    "--eval-interval", "1000", "--deterministic-mode", "--no-gradient-accumulation-fusion", "--bf16", "--tenplex",
    "--no-masked-softmax-fusion",  # with bf16 Megatron-LM picks a fused CUDA softmax kernel the CPU lacks
]
MLM_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+\d+ \|.*?lm loss: ([0-9.E+-]+)")


def mlm_losses(log: str, release: tuple[int, int]) -> dict[int, float]:
    """Each iteration's own loss from a launch's log. From core_v0.16 the second line of a launch prints the mean
    of its first two iterations (Megatron-LM's training_log): undone here, as the opt-in suite does."""
    lines = [(int(m.group(1)), float(m.group(2))) for m in MLM_LINE.finditer(log)]
    out = dict(lines)
    if len(lines) >= 2 and release >= (0, 16):
        (_, l1), (second, mean) = lines[0], lines[1]
        out[second] = 2 * mean - l1
    return out


def step_mlm(opts: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """Megatron-LM's patched script saves TP2 on the CPU; resumed at world size 1 on the device and on the CPU."""
    t0 = time.monotonic()
    checkout, why = mlm_checkout(opts.megatron_lm, dict(os.environ))
    if checkout is None:
        return {"status": "skip", "why": why}
    release = mlm_release(checkout)
    base = os.path.join(opts.work, "mlm")
    script_dir = os.path.join(base, "script")
    if mlm_patched_copy(checkout, release, script_dir) is None:
        return {"status": "skip", "why": f"no patch in patches/ for megatron-core {release} ({checkout})"}
    limit = clock.limit("mlm")
    vocab = ["--vocab-size", "96" if release >= (0, 18) else "95"]  # NullTokenizer's EOD: 96 rows either way
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])

    def env(hide_cuda: bool) -> dict[str, str]:
        e = child_env(opts.site, hide_cuda)
        e.update(PYTHONPATH=os.pathsep.join([checkout, e["PYTHONPATH"]]), PATH=path, CUBLAS_WORKSPACE_CONFIG=":4096:8",
                 NCCL_ALGO="Ring", CUDA_DEVICE_MAX_CONNECTIONS="1")
        if hide_cuda:
            e["TORCH_COMPILE_DISABLE"] = "1"
        elif not opts.cpu_dry_run:
            e["CUDA_VISIBLE_DEVICES"] = visible_device(opts.device, e.get("CUDA_VISIBLE_DEVICES"))
        return e

    def launch(nproc: int, flags: list[str], on_cpu: bool, name: str) -> Launch:
        backend = ["--distributed-backend", "gloo"] if on_cpu or opts.cpu_dry_run else []
        return Launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                       MLM_RUNNER, os.path.join(script_dir, "pretrain_gpt.py"), *MLM_FLAGS, *vocab, *backend,
                       *flags], env(on_cpu or opts.cpu_dry_run), log_path(opts.work, f"mlm-{name}"))

    ckpt = os.path.join(base, "ckpt")
    make = launch(2, ["--tensor-model-parallel-size", "2", "--save", ckpt, "--save-interval", str(SAVED_AT),
                      "--exit-interval", str(SAVED_AT)], True, "make")
    run_all([make], limit)
    out: dict[str, Any] = {"checkout": checkout, "release": list(release), "from": "tp2pp1dp1", "to": "tp1pp1dp1",
                           "dtype": "bf16", "make_rc": make.rc}
    steps = list(range(SAVED_AT + 1, TRAIN_ITERS + 1))
    losses: dict[str, dict[int, float]] = {}
    if make.rc == 0:
        resumed = {w: launch(1, ["--tensor-model-parallel-size", "1", "--load", ckpt], w == "cpu", w)
                   for w in ("cpu", "device")}
        run_all(list(resumed.values()), max(1.0, limit - (time.monotonic() - t0)))
        for w, la in resumed.items():
            out[f"{w}_rc"] = la.rc
            with open(la.log) as f:
                losses[w] = mlm_losses(f.read(), release)
    cpu, dev = losses.get("cpu", {}), losses.get("device", {})
    out.update(steps=steps, tolerance=TOLERANCE["bf16"], cpu_losses=[cpu.get(s) for s in steps],
               device_losses=[dev.get(s) for s in steps], device_vs_cpu=max_rel(dev, cpu, steps))
    rcs = [out.get(k) for k in ("make_rc", "cpu_rc", "device_rc")]
    why_not = [w for w, bad in (
        ("a launch failed", any(rc != 0 for rc in rcs)),
        ("losses missing", out["device_vs_cpu"] is None),
        (f"device loss differs from the CPU's by more than {TOLERANCE['bf16']:g}",
         (out["device_vs_cpu"] or 0) > TOLERANCE["bf16"])) if bad]
    out["status"] = "timeout" if 124 in rcs else "fail" if why_not else "pass"
    if why_not:
        out["why"] = "; ".join(why_not)
    out["seconds"] = time.monotonic() - t0
    return out


def rows(m: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Megatron-LM's line of the table."""
    rows: list[tuple[str, str, str, str]] = []
    figs = (f"Megatron-LM's pretrain_gpt.py ({m['checkout']}), {m['from']} (CPU) -> {m['to']} on the device, "
            f"{m['dtype']}: loss steps {m['steps'][0]}-{m['steps'][-1]} max rel diff vs CPU "
            f"{sci(m.get('device_vs_cpu'))} (tol {m['tolerance']:g})") if "steps" in m else "-"
    rows.append(("Megatron-LM resume", m["status"], secs(m), figs + why_text(m) if figs != "-" else why_text(m).strip(" ()")
                 or "-"))
    return rows
