"""Megatron-LM's own ``pretrain_gpt.py`` (the patch, ``--tenplex``) in the fault benchmark: its process restart and
its in-place rows (``python -m benchmarks.faults --megatron-lm DIR``, a core_v0.15-0.17 checkout: the in-process
restart needs nvidia-resiliency-ext 0.4.1, which core_v0.18+ refuse).

4 ranks at TP2 x DP2 (the opt-in suite's tiny GPT, CPU and gloo, or the GPUs where present), a snapshot into host
memory every iteration; a rank SIGKILLed while it writes its snapshot of iteration 3 (``TENPLEX_FAULT``, once):

* ``mlm-restart@rank3``: under torchrun's agent (``--max-restarts 1``): every worker restarted (new processes,
  imports), loading from host memory at TP2 x DP2; the process restart the in-place rows are compared with;
* ``mlm-inprocess@rank3`` / ``mlm-inprocess@rank0``: under the in-process launcher with ``--inprocess-restart``: the
  survivors continue in their own processes at TP1 x DP2 (a ``--tenplex-layout`` table).

The seconds run from the fault to the first iteration Megatron-LM logs after it (its own timestamps).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import sysconfig
from collections.abc import Callable

from benchmarks.kit.fault_rows import Row, RunDir, inplace_timeouts, survivors
from benchmarks.kit.mlm_checkout import mlm_checkout, mlm_patched_copy, mlm_release
from tenplex_megatron.storage import directory
from tenplex_megatron.storage.verify_ckpt import verify_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNNER = os.path.join(ROOT, "tests", "megatron_lm", "run_megatron_lm.py")
ITERS = 8
FAULT_AT = 3  # the victim dies writing its snapshot of this iteration
TIMEOUT = 600
INPROCESS_TIMEOUT = 10  # --tenplex-inprocess-timeout
MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--make-vocab-size-divisible-by", "16", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--transformer-impl", "local", "--no-persist-layer-norm", "--use-distributed-optimizer",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--deterministic-mode",
    "--no-gradient-accumulation-fusion",
]
#: 4 ranks TP2 x DP2; 2 ranks (after a loss in place) TP1 x DP2 with micro-batch 1: the same global batch
LAYOUTS = {"4": {"tp": 2, "pp": 1, "dp": 2, "micro_batch_size": 2},
           "2": {"tp": 1, "pp": 1, "dp": 2, "micro_batch_size": 1}}
STAMP_RE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/")
SAVED_RE = re.compile(r"> tenplex: (?:saved iteration (\d+) to |persisted \S*iter_(\d+))")
LOADED_RE = re.compile(r"> tenplex: loaded iteration \d+ from host memory.*?(\d+) bytes read from durable storage")
NAMES = ("mlm-restart@rank3", "mlm-inprocess@rank3", "mlm-inprocess@rank0")
RESTART = "SIGKILL rank 3, Megatron-LM process restart"


def setup(given: str | None, root: str) -> tuple[str, str, list[str]]:
    """The patched copy of the checkout's ``pretrain_gpt.py`` under ``root``, its environment's extra path and its
    vocabulary flag; exits naming what is missing."""
    checkout, why = mlm_checkout(given, dict(os.environ))
    if checkout is None:
        raise SystemExit(f"bench_faults: the Megatron-LM rows: {why}")
    release = mlm_release(checkout)
    script = mlm_patched_copy(checkout, release, os.path.join(root, "mlm-script"))
    if script is None:
        raise SystemExit(f"bench_faults: the Megatron-LM rows: no patch in patches/ for {checkout} ({release})")
    return script, checkout, ["--vocab-size", "96" if release >= (0, 18) else "95"]


def _env(checkout: str) -> tuple[dict[str, str], bool]:
    import torch

    cpu = not torch.cuda.is_available()
    path = os.pathsep.join([os.path.dirname(sys.executable), sysconfig.get_config_var("BINDIR") or "",
                            os.environ.get("PATH", "")])
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([checkout, ROOT]), PATH=path, OMP_NUM_THREADS="1",
             PYTHONUNBUFFERED="1", CUBLAS_WORKSPACE_CONFIG=":4096:8", NCCL_ALGO="Ring", CUDA_DEVICE_MAX_CONNECTIONS="1")
    if cpu:
        e["TORCH_COMPILE_DISABLE"] = "1"  # jit_fuser is torch.compile: its warm-up costs ~40 s a launch on a CPU
    return e, cpu


def _stamps(log: str) -> list[tuple[float, int]]:
    """(epoch seconds, iteration) of every iteration line Megatron-LM logged (its local-time stamps)."""
    return [(datetime.datetime.fromisoformat(ts).timestamp(), int(it)) for ts, it in STAMP_RE.findall(log)]


def _run(run: RunDir, mlm: tuple[str, str, list[str]], victim: int, in_place: bool) -> tuple[str, float | None]:
    """One launch through the fault; its log and when the fault fired (None: never)."""
    script, checkout, vocab = mlm
    env, cpu = _env(checkout)
    once = os.path.join(run.root, "fault-fired")
    env.update(TENPLEX_FAULT=f"memory.write@{victim}#{FAULT_AT}", TENPLEX_FAULT_ONCE=once)
    table = os.path.join(run.root, "layouts.json")
    with open(table, "w") as f:
        json.dump({"version": 1, "layouts": LAYOUTS}, f)
    ckpt = os.path.join(run.root, "ckpt")
    flags = [*MODEL, *vocab, "--train-iters", str(ITERS), "--tenplex", "--tenplex-layout", table, "--save", ckpt,
             "--load", ckpt, "--save-interval", "1", "--tenplex-memory", os.path.join(run.root, "mem"),
             *(["--distributed-backend", "gloo"] if cpu else [])]
    if in_place:
        from benchmarks.kit.agents import free_port

        port = free_port()  # the launcher serves the job's store there and NVRx's at port + 1
        cmd = [sys.executable, "-m", "tenplex_megatron.frontdoor.launch", "--nproc-per-node", "4", "--master-port",
               str(port), "--timeout", str(TIMEOUT), RUNNER, script, *flags, "--inprocess-restart",
               "--tenplex-inprocess-timeout", str(INPROCESS_TIMEOUT)]
    else:  # a store of its own per restart round: the last round's gloo addresses are not read back
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "--max-restarts", "1", "--monitor-interval", "0.5", RUNNER, script, *flags]
    log = os.path.join(run.root, "job.log")
    with open(log, "w") as out:
        try:
            rc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT + 60).returncode
        except subprocess.TimeoutExpired:
            rc = None
    text = open(log).read()
    if rc != 0:
        raise SystemExit(f"bench_faults: Megatron-LM, rank {victim} lost: the launch ended with {rc}\n{text[-4000:]}")
    return text, (os.path.getmtime(once) if os.path.exists(once) else None)


def _row(run: RunDir, fault: str, log: str, t_fault: float | None, note: str, in_place: bool, victim: int) -> Row:
    reported = {int(a or b) for a, b in SAVED_RE.findall(log)}
    ckpt = os.path.join(run.root, "ckpt")
    whole = {it for it in directory.committed_iterations(ckpt)
             if verify_checkpoint(os.path.join(ckpt, directory.iter_dir_name(it)), workers=1).ok}
    lost = len(reported - whole)
    stamps = _stamps(log)
    if {it for _, it in stamps} != set(range(1, ITERS + 1)):
        note += "; training did not reach its last iteration"
    after = [(t, it) for t, it in stamps if t_fault is not None and t > t_fault]
    if t_fault is None or not after:
        return Row(fault, lost, None, None, None, note + ("; the fault never fired" if t_fault is None else
                                                          "; nothing ran after the fault"), in_place=in_place)
    resumed = after[0][1] - 1
    loads = LOADED_RE.findall(log)
    mb = float(loads[-1]) / 1e6 if loads else None
    kept, ended = survivors(log, {victim}) if in_place else (None, ())
    if in_place:
        also = f"; also ended by NVRx (stuck in a collective): rank {', '.join(map(str, ended))}" if ended else ""
        note = (f"survivors' processes {'kept' if kept else 'NOT kept'}{also}; {inplace_timeouts(INPROCESS_TIMEOUT)}; "
                f"{note}")
    return Row(fault, lost, max(0, FAULT_AT - resumed - 1), mb, after[0][0] - t_fault, note, in_place=in_place,
               survivors_kept=kept, survivors_ended=ended, iterations_lost=max(0, FAULT_AT - resumed))


def restart(mlm: tuple[str, str, list[str]]) -> Callable[[RunDir], Row]:
    def go(run: RunDir) -> Row:
        log, fired = _run(run, mlm, 3, in_place=False)
        return _row(run, RESTART, log, fired, "4 workers restarted by torchrun's agent, TP2 x DP2 from host memory",
                    in_place=False, victim=3)
    return go


def in_place(mlm: tuple[str, str, list[str]], victim: int) -> Callable[[RunDir], Row]:
    def go(run: RunDir) -> Row:
        log, fired = _run(run, mlm, victim, in_place=True)
        return _row(run, f"SIGKILL rank {victim}, Megatron-LM in place (NVRx)", log, fired, "TP1 x DP2 after",
                    in_place=True, victim=victim)
    return go


def faults(mlm: tuple[str, str, list[str]]) -> dict[str, Callable[[RunDir], Row]]:
    """The Megatron-LM rows by name (:data:`NAMES`)."""
    return {NAMES[0]: restart(mlm), NAMES[1]: in_place(mlm, 3), NAMES[2]: in_place(mlm, 0)}
