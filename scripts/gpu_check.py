"""The GPU check (issue #33): everything the plugin does on a CUDA device, in one command, with one report.

Run through ``scripts/gpu_check.sh`` (which says what the machine needs); each step runs in its own process
group with its own time limit, so a crash or a hang costs only that step, and the whole check stays within
``--budget`` seconds (default 530: under 9 minutes, so a 10-minute command limit leaves time to copy the report):

  wheels    the wheels carried in ``.whl/`` installed into a private directory (pip ``--no-index``, or unzipped
            where there is no pip): only those the system lacks or has older; nothing from the network
  env       python, torch, CUDA, the GPU, megatron-core and the carried packages as the steps will import them
  pytest    ``pytest -m gpu tests/gpu`` with the system's torch
  identity  staged load and save on the device byte-identical to the direct path and the CPU (``gpu_check_steps.py``)
  snapshot  a host-memory rank file written from device tensors through the pinned ring, byte-identical
  resume    tiny GPT checkpoints saved on the CPU (CUDA hidden, 2 gloo ranks, the reference trainer) at TP2, PP2,
            DP2 and TP2 bf16, resumed at world size 1 on the device and on the CPU: losses of steps 4-6 equal
            within fp32/bf16 tolerance, and the state re-saved right after the load byte-identical
  bench     ``python -m benchmarks.gpu_reshard --device cuda:0`` at GPT-3 1.3B and 2.7B (2.7B without megatron-core's
            dist_checkpointing when the time left would not hold it)
  mlm       Megatron-LM's own ``pretrain_gpt.py`` (a copy patched with ``patches/``, ``--tenplex``, bf16, the
            distributed optimizer, ``--transformer-impl local``) saves a TP2 checkpoint on the CPU (CUDA hidden, 2
            gloo ranks, run through ``tests/megatron_lm/run_megatron_lm.py``), resumed at world size 1 on the device
            and on the CPU: losses of steps 4-6 equal within bf16 tolerance. Needs a Megatron-LM checkout
            (``--megatron-lm DIR``, else MEGATRON_LM_PATH, else ``.mlm/``): its ``pretrain_gpt.py`` and the modules
            beside it, ``megatron/training`` and ``megatron/legacy``; without one the step reports skip

Writes ``gpu_check.json`` (every figure), ``gpu_check.md`` (the table) and ``gpu_check.log`` (each step's
command and the end of its output) to OUTDIR. ``--cpu-dry-run``: the same steps on the CPU with CUDA hidden
from every process (tiny sizes, nothing installed), to exercise the plumbing where there is no GPU; its
figures are not GPU figures and its report says so. Exit status 0 when every step passed (a dry run: when
none failed).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.metadata
import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from xml.etree import ElementTree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(ROOT, "scripts", "pretrain_gpt.py")
WHEEL_LIST = os.path.join(ROOT, "scripts", "gpu_wheels.txt")
REPORT_VERSION = 1
JSON_NAME, TABLE_NAME, LOG_NAME = "gpu_check.json", "gpu_check.md", "gpu_check.log"
STEPS = ("wheels", "env", "pytest", "identity", "snapshot", "resume", "bench", "mlm")
#: the distributions the steps import besides torch: without one of them a step fails at its first import
NEEDED = ("megatron-core", "numpy", "packaging", "psutil", "pytest")
MODELS = ("gpt3-1.3b", "gpt3-2.7b")
#: each step's own limit in seconds (the bench gets what is left; mlm, after it, at most 180 s of what the bench left);
#: a step also never runs past the budget
STEP_LIMIT = {"env": 60, "pytest": 180, "identity": 150, "snapshot": 100, "resume": 200, "mlm": 180}
REPORT_RESERVE = 10.0  # seconds kept for writing the report
LOG_TAIL = 12_000  # characters of each step's output kept in gpu_check.log

# The resume check's model: the CPU suite's tiny GPT (tests/harness.py TINY_GPT, 96-token vocabulary: padded the
# same at TP1 and TP2), 6 steps, saved at step 3.
TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--make-vocab-size-divisible-by", "16", "--vocab-size", "96", "--swiglu",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4",
    "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--mock-data", "--tenplex", "--log-interval", "1", "--train-iters", "6",
]
SAVED_AT, TRAIN_ITERS = 3, 6
#: max relative difference of a loss on the device from the CPU's at the same step (fp32: kernels differ in
#: rounding only; bf16: 8-bit mantissas), and of the CPU's resumed run from the uninterrupted one (only the
#: reduction order changes with the layout: the CPU suite's oracle is 2e-6 for fp32; bf16 was seen at 6e-6)
TOLERANCE = {"fp32": 5e-4, "bf16": 2e-2}
CPU_RESUME_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3}


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


# ---------------------------------------------------------------------------------------------------- wheels


def read_wheel_list(path: str = WHEEL_LIST) -> dict[str, str]:
    """``name==version`` lines of ``scripts/gpu_wheels.txt`` (comments and blank lines skipped), by name."""
    pins: dict[str, str] = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, _, version = line.partition("==")
                if not version:
                    raise ValueError(f"{path}: {line!r} is not pinned as name==version")
                pins[canonical(name)] = version.strip()
    return pins


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(filename: str) -> tuple[str, str]:
    """(name, version) from a wheel's file name (``name-version-...-tags.whl``)."""
    parts = os.path.basename(filename).split("-")
    if len(parts) < 5 or not filename.endswith(".whl"):
        raise ValueError(f"{filename}: not a wheel file name")
    return canonical(parts[0]), parts[1]


def version_key(version: str) -> tuple[int, ...]:
    """The leading numeric release parts of a version (enough to order the pinned releases here)."""
    out = []
    for part in version.split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
        if m.group() != part:
            break
    return tuple(out)


def installed_version(name: str) -> str | None:
    """The version of distribution ``name`` this Python would import, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_wheels(wheel_dir: str, target: str, have: Callable[[str], str | None] = installed_version,
                   python: str = sys.executable) -> dict[str, Any]:
    """Install the carried wheels the system lacks (or has older) into ``target``, never from the network.

    With pip: ``pip install --no-index --no-deps --no-compile --target``; without it (or where it refuses), each
    wheel is unzipped into ``target`` (the carried wheels need no scripts or data files installed). The
    system's own newer or equal versions are kept, so torch's own ecosystem stays as it is. Returns what was
    installed, what the system had, and which :data:`NEEDED` distributions are still missing.
    """
    record: dict[str, Any] = {"wheel_dir": wheel_dir, "target": target, "installed": {}, "system": {},
                              "method": None}
    todo = []
    for path in sorted(glob.glob(os.path.join(wheel_dir, "*.whl"))):
        name, version = wheel_name_version(path)
        system = have(name)
        if system is not None and version_key(system) >= version_key(version):
            record["system"][name] = system
            continue
        todo.append(path)
        record["installed"][name] = version
    if todo:
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(target)
        env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
        try:
            p = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                "--target", target, *todo], capture_output=True, text=True, env=env, timeout=300)
            pip_error = None if p.returncode == 0 else (p.stderr.strip() or p.stdout.strip() or "failed")[-1000:]
        except (OSError, subprocess.TimeoutExpired) as e:
            pip_error = f"{type(e).__name__}: {e}"
        if pip_error is None:
            record["method"] = "pip --no-index --target"
        else:  # no pip, or one that refuses (an externally managed Python): a wheel is a zip of the tree to put there
            record["method"] = "unzip (no pip)"
            record["pip_error"] = pip_error
            shutil.rmtree(target, ignore_errors=True)
            os.makedirs(target)
            for path in todo:
                with zipfile.ZipFile(path) as z:
                    z.extractall(target, [n for n in z.namelist() if not n.split("/", 1)[0].endswith(".data")])
    for name in NEEDED:
        if name not in record["installed"] and name not in record["system"] and have(name) is not None:
            record["system"][name] = have(name)
    record["missing"] = [n for n in NEEDED if n not in record["installed"] and n not in record["system"]]
    return record


# ---------------------------------------------------------------------------------------------------- running


@dataclass
class Clock:
    """The check's time budget: seconds left, and each step's limit within it."""

    budget: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start) - REPORT_RESERVE

    def limit(self, step: str) -> float:
        return max(0.0, min(STEP_LIMIT.get(step, math.inf), self.left()))


def child_env(site: str | None, hide_cuda: bool) -> dict[str, str]:
    """The environment of every process a step starts: the carried packages and the checkout first on the path,
    one thread per process, no index for pip, and ``CUDA_VISIBLE_DEVICES=""`` where CUDA must be hidden."""
    env = dict(os.environ)
    path = [p for p in (site, ROOT, env.get("PYTHONPATH")) if p]
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PIP_NO_INDEX="1")
    if hide_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@dataclass
class Launch:
    """One process (group) of a step: its command, environment and log file, and how it ended."""

    cmd: list[str]
    env: dict[str, str]
    log: str
    rc: int | None = None
    seconds: float = 0.0


def run_all(launches: list[Launch], timeout: float) -> None:
    """Run the launches side by side, each in its own session (torchrun's workers included), until they end or
    ``timeout`` seconds pass: then each one still running gets SIGTERM, then SIGKILL, and rc 124."""
    procs = []
    t0 = time.monotonic()
    for launch in launches:
        os.makedirs(os.path.dirname(launch.log), exist_ok=True)
        log = open(launch.log, "w")
        log.write(f"$ {shlex.join(launch.cmd)}\n")
        log.flush()
        procs.append((launch, log, subprocess.Popen(launch.cmd, stdout=log, stderr=subprocess.STDOUT, env=launch.env,
                                                    cwd=ROOT, start_new_session=True)))
    for launch, log, p in procs:
        try:
            launch.rc = p.wait(max(0.1, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            stop(p)
            launch.rc = 124
            log.write(f"\n[gpu_check: stopped after {timeout:.0f} s]\n")
        launch.seconds = time.monotonic() - t0
        log.close()


def stop(p: subprocess.Popen) -> None:
    """End the process group this check started for ``p`` (SIGTERM, 10 s, then SIGKILL)."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


_LOG_SEQ = itertools.count(1)


def log_path(work: str, name: str) -> str:
    """``work/logs/NN-name.log``: numbered in the order the launches are made, the order ``gpu_check.log`` keeps."""
    return os.path.join(work, "logs", f"{next(_LOG_SEQ):02d}-{name}.log")


def python_step(args: list[str], work: str, name: str, site: str | None, hide_cuda: bool,
                timeout: float) -> Launch:
    """Run this Python with ``args`` as step ``name`` (its log in ``work/logs``) and wait for it."""
    launch = Launch([sys.executable, *args], child_env(site, hide_cuda), log_path(work, name))
    run_all([launch], timeout)
    return launch


def status_of(rc: int | None) -> str:
    """A launch's exit status as a step's result (124: stopped on the clock)."""
    return "pass" if rc == 0 else "timeout" if rc == 124 else "fail"


def outcome(launch: Launch) -> dict[str, Any]:
    """A launch's status and seconds, and on failure its output's last line (usually the error) as the why."""
    out: dict[str, Any] = {"status": status_of(launch.rc), "seconds": launch.seconds}
    if launch.rc != 0:
        with open(launch.log, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
        out["why"] = f"exit status {launch.rc}: {lines[-1][:300] if lines else 'no output'}"
    return out


# ---------------------------------------------------------------------------------------------------- steps


ENV_PROBE = r"""
import importlib.metadata as md, json, os, shutil, sys
import torch
out = {"python": sys.version.split()[0], "executable": sys.executable, "torch": torch.__version__,
       "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out.update(gpu=p.name, gpus=torch.cuda.device_count(), capability=f"{p.major}.{p.minor}",
               gpu_memory_gib=round(p.total_memory / 2**30, 1))
for name in ("megatron-core", "numpy", "packaging", "psutil", "isal", "pytest"):
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = None
try:
    import megatron.core
    out["megatron_core_from"] = os.path.dirname(megatron.core.__file__)
except Exception as e:
    out["megatron_core_error"] = f"{type(e).__name__}: {e}"
for where in ("/dev/shm", sys.argv[1]):
    if os.path.isdir(where):
        out[f"free_gib {where}"] = round(shutil.disk_usage(where).free / 2**30, 1)
print("GPU_CHECK_ENV " + json.dumps(out))
"""


def step_env(opts: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """What the steps will run with, probed by the same Python and path they get; no GPU (outside a dry run) or no
    megatron-core fails here, before anything else is tried."""
    launch = python_step(["-c", ENV_PROBE, opts.work], opts.work, "env", opts.site, opts.cpu_dry_run,
                         clock.limit("env"))
    out = outcome(launch)
    with open(launch.log) as f:
        for line in f:
            if line.startswith("GPU_CHECK_ENV "):
                out.update(json.loads(line[len("GPU_CHECK_ENV "):]))
    if out["status"] == "pass" and not opts.cpu_dry_run and not out.get("cuda_available"):
        out.update(status="fail", why="torch sees no CUDA device (use --cpu-dry-run on a machine without one)")
    if out["status"] == "pass" and "megatron_core_error" in out:
        out.update(status="fail", why=f"megatron.core does not import: {out['megatron_core_error']}")
    return out


def parse_junit(path: str) -> dict[str, int]:
    """Counts of a pytest ``--junitxml`` report: tests, failures, errors, skipped (and passed)."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def step_pytest(opts: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """``pytest -m gpu tests/gpu``, counted from its JUnit report: a skipped test fails a GPU run."""
    xml = os.path.join(opts.work, "pytest.xml")
    launch = python_step(["-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider", "--junitxml", xml,
                          "tests/gpu"], opts.work, "pytest", opts.site, opts.cpu_dry_run, clock.limit("pytest"))
    out = outcome(launch)
    if os.path.exists(xml):
        out.update(parse_junit(xml))
        if out["status"] == "pass" and out["skipped"]:  # a skipped GPU test proves nothing
            out["status"] = "skip" if opts.cpu_dry_run and out["passed"] == 0 else "fail"
            out.setdefault("why", f"{out['skipped']} test(s) skipped")
    return out


def step_torch(name: str, opts: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """``identity`` or ``snapshot``: ``gpu_check_steps.py`` in its own process."""
    result = os.path.join(opts.work, f"{name}.json")
    args = [os.path.join(ROOT, "scripts", "gpu_check_steps.py"), name, "--device", opts.device, "--work", opts.work,
            "--out", result]
    launch = python_step(args, opts.work, name, opts.site, opts.cpu_dry_run, clock.limit(name))
    out = outcome(launch)
    if os.path.exists(result):
        with open(result) as f:
            out.update(json.load(f))
    return out


def torchrun(nproc: int, flags: list[str], env: dict[str, str], log: str) -> Launch:
    """A standalone torchrun launch of the reference trainer (fresh interpreters, as a user would start it)."""
    return Launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                   PRETRAIN, *flags], env, log)


def read_losses(path: str) -> dict[int, float]:
    """Loss by iteration from a ``--tenplex-metrics`` file (empty when there is none)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {int(r["iteration"]): float(r["loss"]) for r in map(json.loads, filter(str.strip, f))}


def max_rel(a: dict[int, float], b: dict[int, float], steps: list[int]) -> float | None:
    """The largest relative difference of ``a`` from ``b`` over ``steps`` (None if a step is missing)."""
    if any(s not in a or s not in b for s in steps):
        return None
    return max(abs(a[s] - b[s]) / max(abs(b[s]), 1e-12) for s in steps)


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


def visible_device(device: str, visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` that shows only ``device`` (``cuda:N``), within what ``visible`` already shows."""
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    shown = [d.strip() for d in visible.split(",")] if visible else None
    if shown is None:
        return str(index)
    if index >= len(shown):
        raise ValueError(f"{device}: CUDA_VISIBLE_DEVICES={visible!r} shows {len(shown)} device(s)")
    return shown[index]


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


# The mlm step: Megatron-LM's own script at the opt-in suite's tiny GPT (tests/megatron_lm/test_megatron_lm.py FLAGS),
# bf16, saved at step 3 by TP2 and resumed at TP1 (96 vocabulary rows: no padding at either TP).
MLM_NEEDS = ("pretrain_gpt.py", os.path.join("megatron", "training"), os.path.join("megatron", "legacy"))
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


def mlm_checkout(given: str | None, environ: dict[str, str]) -> tuple[str | None, str | None]:
    """The Megatron-LM checkout the mlm step runs (``--megatron-lm``, else MEGATRON_LM_PATH, else ``.mlm/``), or
    None and why not: the first one named must hold ``pretrain_gpt.py``, ``megatron/training`` and
    ``megatron/legacy``."""
    for where, path in (("--megatron-lm", given), ("MEGATRON_LM_PATH", environ.get("MEGATRON_LM_PATH")),
                        (".mlm/", os.path.join(ROOT, ".mlm"))):
        if not path:
            continue
        if where == ".mlm/" and not os.path.isdir(path):
            break
        missing = [n for n in MLM_NEEDS if not os.path.exists(os.path.join(path, n))]
        if missing:
            return None, f"{where} {path} lacks {', '.join(missing)}"
        return os.path.abspath(path), None
    return None, ("no Megatron-LM checkout: pass --megatron-lm DIR or set MEGATRON_LM_PATH, or carry .mlm/ "
                  "(make gpu-mlm)")


def mlm_release(checkout: str) -> tuple[int, int] | None:
    """megatron-core's release (major, minor) as the checkout's script will import it: the checkout's own
    ``megatron/core`` where it has one, else the installed distribution."""
    info = os.path.join(checkout, "megatron", "core", "package_info.py")
    text = None
    if os.path.isfile(info):
        with open(info) as f:
            found = dict(re.findall(r"^(MAJOR|MINOR)\s*=\s*(\d+)", f.read(), re.M))
        text = f"{found.get('MAJOR')}.{found.get('MINOR')}" if len(found) == 2 else None
    if text is None:
        try:
            text = importlib.metadata.version("megatron-core")
        except importlib.metadata.PackageNotFoundError:
            return None
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def mlm_patched_copy(checkout: str, release: tuple[int, int] | None, script_dir: str) -> str | None:
    """The checkout's top-level scripts copied into ``script_dir`` with our patch for its release applied; the path
    of the copy's ``pretrain_gpt.py``, or None where patches/ has none for that release."""
    patch = os.path.join(ROOT, "patches", f"megatron-lm-core_v{release[0]}.{release[1]}.x.patch") if release else ""
    if not os.path.isfile(patch):
        return None
    os.makedirs(script_dir, exist_ok=True)
    for name in os.listdir(checkout):
        if name.endswith(".py"):
            shutil.copy(os.path.join(checkout, name), script_dir)
    subprocess.run(["git", "apply", patch], cwd=script_dir, check=True)
    return os.path.join(script_dir, "pretrain_gpt.py")


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


#: relative size of each model's share (source files of rank 0 of TP4 from TP2: 1.3B 9.24 GB, 2.7B 18.60 GB)
SIZE_HINT = {"gpt3-1.3b": 9.24, "gpt3-2.7b": 18.60, "tiny": 0.001}


def bench_systems(model: str, systems: list[str], prev: tuple[float, float] | None, left: float,
                  free_gb: float = math.inf) -> tuple[list[str], str | None]:
    """The systems to measure ``model`` with: all, unless megatron-core's would not fit in the ``left`` seconds,
    judged by the last model measured with all of them (``prev``: its seconds and :data:`SIZE_HINT`) scaled by
    size, or its copy of the files (as large as tenplex's) would not fit in ``free_gb`` of disk; then without
    ``mcore`` (its save and loads take the longest), and a note saying why. No systems: not even tenplex's
    files fit."""
    size = SIZE_HINT.get(model, 1.0)
    if size * 1.1 + 1 > free_gb:
        return [], f"{model}: not run (its files need ~{size * 1.1 + 1:.0f} GB of disk, {free_gb:.0f} GB free)"
    if "mcore" not in systems:
        return systems, None
    if 2 * size * 1.1 + 1 > free_gb:
        return [s for s in systems if s != "mcore"], (f"{model}: without mcore (two copies of the files need "
                                                       f"~{2 * size * 1.1 + 1:.0f} GB of disk, {free_gb:.0f} GB free)")
    if prev is None:
        return systems, None
    need = prev[0] * size / prev[1] * 1.15
    if need <= left:
        return systems, None
    return [s for s in systems if s != "mcore"], f"{model}: without mcore (needs ~{need:.0f} s, {left:.0f} s left)"


def step_bench(opts: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """``benchmarks.gpu_reshard`` one model per process (a model that runs out of time costs only itself); the 2.7B
    run keeps megatron-core's system only when the 1.3B run's time, scaled by size, fits in what is left."""
    t0 = time.monotonic()
    models = list(opts.models)
    out: dict[str, Any] = {"models": {}}
    bench_dir = os.path.join(opts.work, "bench")
    os.makedirs(bench_dir, exist_ok=True)
    prev: tuple[float, float] | None = None  # (seconds, SIZE_HINT) of the last model run with every system
    for model in models:
        left = clock.left()
        systems, note = bench_systems(model, list(opts.systems), prev, left,
                                      shutil.disk_usage(bench_dir).free / 1e9)
        if note:
            out.setdefault("notes", []).append(note)
        if left < 30 or not systems:
            out["models"][model] = {"status": "not run", "why": note if not systems else
                                    f"{left:.0f} s left of the budget"}
            continue
        result = os.path.join(opts.work, f"bench-{model}.json")
        launch = python_step(["-m", "benchmarks.gpu_reshard", "--device", opts.device,
                              "--models", model, "--reps", str(opts.reps), "--systems", *systems, "--dir", bench_dir,
                              "--out", result], opts.work, f"bench-{model}", opts.site, opts.cpu_dry_run, left)
        row = outcome(launch)
        row["systems"] = systems
        if os.path.exists(result):
            with open(result) as f:
                data = json.load(f)
            if data["rows"]:
                row.update(data["rows"][0])
                out.setdefault("device_name", data.get("device"))
        errors = [k for k in row if k.endswith("_error")]
        if row["status"] == "pass" and (errors or not all(row.get("identical", {}).values()) or not row.get("identical")):
            row.update(status="fail", why="; ".join([*(f"{k}: {row[k]}" for k in errors),
                                                      *(f"{k}: different bytes" for k, v in
                                                        row.get("identical", {}).items() if not v)]) or "no check")
        if row["status"] == "pass" and systems == list(opts.systems):
            prev = (launch.seconds, float(SIZE_HINT.get(model, 1.0)))
        out["models"][model] = row
    statuses = {r["status"] for r in out["models"].values()}
    out["status"] = next((s for s in ("fail", "timeout", "not run") if s in statuses), "pass" if statuses else "not run")
    out["seconds"] = time.monotonic() - t0
    return out


# ---------------------------------------------------------------------------------------------------- report


def gbps(value: Any) -> str:
    """A GB/s figure for the table (``-``: not measured)."""
    return f"{value:.2f}" if isinstance(value, int | float) else "-"


def sci(value: Any) -> str:
    """A relative difference for the table (``-``: not measured)."""
    return f"{value:.1e}" if isinstance(value, int | float) else "-"


def table_rows(report: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(check, status, seconds, figures) for each line of the table."""
    steps = report["steps"]
    rows: list[tuple[str, str, str, str]] = []

    def secs(d: dict[str, Any]) -> str:
        return f"{d['seconds']:.0f}" if isinstance(d.get("seconds"), int | float) else "-"

    def why(d: dict[str, Any]) -> str:
        return f" ({d['why']})" if d.get("why") else ""

    if "wheels" in steps:
        w = steps["wheels"]
        carried = ", ".join(f"{k} {v}" for k, v in sorted(w.get("installed", {}).items())) or "none"
        system = ", ".join(f"{k} {v}" for k, v in sorted(w.get("system", {}).items())) or "none"
        rows.append(("carried wheels", w["status"], secs(w),
                     f"installed: {carried}; the system's: {system}" + (f"; MISSING: {', '.join(w['missing'])}"
                                                                        if w.get("missing") else "") + why(w)))
    if "env" in steps:
        e = steps["env"]
        rows.append(("environment", e["status"], secs(e),
                     f"Python {e.get('python', '?')}, torch {e.get('torch', '?')} (CUDA {e.get('torch_cuda')}), "
                     f"{e.get('gpu', 'no GPU')}, megatron-core {e.get('megatron-core')}" + why(e)))
    if "pytest" in steps:
        p = steps["pytest"]
        rows.append(("`pytest -m gpu tests/gpu`", p["status"], secs(p),
                     f"{p.get('passed', '-')} passed, {p.get('failures', '-')} failed, {p.get('errors', '-')} errors, "
                     f"{p.get('skipped', '-')} skipped" + why(p)))
    if "identity" in steps:
        d = steps["identity"]
        for r in d.get("loads", []):
            same = [k.split("_")[1] for k, v in r.items() if k.startswith("staged_") and k.endswith("identical") and v]
            rows.append((f"parallel and staged load == direct == CPU, {r['transition']}", "pass" if all(
                v for k, v in r.items() if k.endswith("identical")) else "fail", "-",
                f"{r['dst_bytes'] / 1e9:.3f} GB, {r['pieces']} pieces; identical at {', '.join(same)}; "
                f"parallel {gbps(r.get('parallel_gbps'))} GB/s, staged {gbps(r.get('staged_gbps'))} GB/s, "
                f"direct {gbps(r.get('direct_gbps'))} GB/s"))
        saves = d.get("saves", [])
        if saves:
            best = {r["mode"]: r.get("gbps") for r in saves if r.get("gbps") is not None}
            rows.append(("staged save == CPU file", "pass" if all(r["identical"] for r in saves) else "fail",
                         "-", f"{saves[0]['bytes'] / 1e9:.3f} GB from the device, {len(saves)} ways identical; "
                              f"parallel {gbps(best.get('parallel'))} GB/s, ring {gbps(best.get('copy'))} GB/s, "
                              f"direct {gbps(best.get('direct'))} GB/s"))
        rows.append(("identity step", d["status"], secs(d), f"model {d.get('model', '-')}" + why(d)))
    if "snapshot" in steps:
        s = steps["snapshot"]
        by = {r["mode"]: r for r in s.get("rows", [])}
        rows.append(("snapshot through the pinned ring", s["status"], secs(s),
                     f"{s.get('bytes', 0) / 1e9:.3f} GB into {s.get('dir', '-')}: ring (auto) "
                     f"{gbps(by.get('auto', {}).get('gbps'))} GB/s, .to('cpu') {gbps(by.get('direct', {}).get('gbps'))}"
                     f" GB/s, from CPU tensors {gbps(s.get('cpu_tensors_gbps'))} GB/s; identical: "
                     f"{all(r['identical'] for r in s.get('rows', [])) and bool(s.get('rows'))}" + why(s)))
    if "resume" in steps:
        r = steps["resume"]
        for name, c in r.get("cases", {}).items():
            rows.append((f"resume {name}: {c['from']} (CPU) -> {c['to']} on the device", c["status"], "-",
                         f"{c['dtype']}: loss steps {r['steps'][0]}-{r['steps'][-1]} max rel diff vs CPU "
                         f"{sci(c.get('device_vs_cpu'))} (tol {TOLERANCE[c['dtype']]:g}); CPU resume vs "
                         f"uninterrupted {sci(c.get('cpu_vs_uninterrupted'))}; re-saved state identical: "
                         f"{c.get('resave_identical')}; load {c.get('load_seconds', '-')} s" + why(c)))
        rows.append(("resume step", r["status"], secs(r), f"{len(r.get('cases', {}))} case(s)" + why(r)))
    if "bench" in steps:
        b = steps["bench"]
        for model, m in b.get("models", {}).items():
            if "dst_bytes" not in m:
                rows.append((f"bench {model}", m["status"], secs(m), why(m).strip(" ()") or "-"))
                continue
            limit = min(m.get("parallel_cold_read_gbps", m.get("storage_read_gbps", math.inf)),
                        m.get("h2d_gbps", math.inf))
            which = "parallel" if "parallel_cold_gbps" in m else "staged"
            cold = m.get(f"{which}_cold_gbps")
            figs = (f"{m['transition']}, {m['dst_bytes'] / 1e9:.2f} GB; storage {gbps(m.get('storage_read_gbps'))}, "
                    f"h2d {gbps(m.get('h2d_gbps'))} GB/s; warm/cold GB/s: " + ", ".join(
                        f"{s} {gbps(m.get(f'{s}_warm_gbps'))}/{gbps(m.get(f'{s}_cold_gbps'))}"
                        for s in m.get("systems", [])) +
                    (f"; {which} cold / limit {cold / limit:.2f}" if cold and limit != math.inf else "") +
                    f"; identical: {m.get('identical')}")
            rows.append((f"bench {model}", m["status"], secs(m), figs + why(m)))
        for note in b.get("notes", []):
            rows.append(("bench note", "-", "-", note))
    if "mlm" in steps:
        m = steps["mlm"]
        figs = (f"Megatron-LM's pretrain_gpt.py ({m['checkout']}), {m['from']} (CPU) -> {m['to']} on the device, "
                f"{m['dtype']}: loss steps {m['steps'][0]}-{m['steps'][-1]} max rel diff vs CPU "
                f"{sci(m.get('device_vs_cpu'))} (tol {m['tolerance']:g})") if "steps" in m else "-"
        rows.append(("Megatron-LM resume", m["status"], secs(m), figs + why(m) if figs != "-" else why(m).strip(" ()")
                     or "-"))
    return rows


def render_table(report: dict[str, Any]) -> str:
    """The markdown report: what ran where, then one line per check."""
    env = report["steps"].get("env", {})
    head = [f"# tenplex-megatron GPU check ({report['mode']})", ""]
    if report["mode"] != "gpu":
        head += ["**A dry run on the CPU (CUDA hidden): plumbing only, these are not GPU figures.**", ""]
    head += [f"Device {report['device']} ({env.get('gpu', 'no GPU')}); torch {env.get('torch', '?')}; "
             f"{report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget; result: "
             f"**{'PASS' if report['ok'] else 'FAIL'}**", "", "| check | result | s | figures |", "|---|---|---|---|"]
    body = [f"| {c} | {s} | {t} | {f.replace('|', '/')} |" for c, s, t, f in table_rows(report)]
    return "\n".join(head + body) + "\n"


def write_report(report: dict[str, Any], outdir: str, work: str | None = None) -> list[str]:
    """``gpu_check.json``, ``gpu_check.md`` and (with ``work``) ``gpu_check.log`` in ``outdir``; their paths."""
    os.makedirs(outdir, exist_ok=True)
    paths = [os.path.join(outdir, n) for n in (JSON_NAME, TABLE_NAME)]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(paths[1], "w") as f:
        f.write(render_table(report))
    if work is not None:
        paths.append(os.path.join(outdir, LOG_NAME))
        with open(paths[2], "w") as f:
            for log in sorted(glob.glob(os.path.join(work, "logs", "*.log"))):
                with open(log, errors="replace") as g:
                    text = g.read()
                cut = text if len(text) <= LOG_TAIL else text[:400] + "\n[...]\n" + text[-LOG_TAIL:]
                f.write(f"===== {os.path.basename(log)} ({len(text)} characters)\n{cut}\n")
    return paths


# ---------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, with the defaults that depend on the mode filled in (the device always with an index)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", nargs="?", default=os.path.join(ROOT, "out", "gpu-check"),
                    help="where the report goes (default out/gpu-check)")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the steps on the CPU, CUDA hidden, tiny sizes")
    ap.add_argument("--device", default=None, help="default cuda:0 (cpu in a dry run)")
    ap.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--models", nargs="+", default=None, help=f"bench models (default {' '.join(MODELS)}; dry run: tiny)")
    ap.add_argument("--systems", nargs="+", default=None, help="bench systems (default parallel staged direct mcore; "
                    "dry run: parallel staged direct)")
    ap.add_argument("--megatron-lm", default=None, help="the Megatron-LM checkout of the mlm step (default: "
                    "MEGATRON_LM_PATH, else .mlm/)")
    ap.add_argument("--reps", type=int, default=1, help="bench repetitions per system")
    ap.add_argument("--budget", type=float, default=530.0, help="seconds for the whole check (default 530)")
    ap.add_argument("--wheels", default=os.path.join(ROOT, ".whl"), help="the carried wheels (default .whl/)")
    ap.add_argument("--install-wheels", action="store_true", help="install the carried wheels in a dry run too "
                    "(a GPU run always does): a CPU Python with only torch then meets the steps as a GPU one would")
    ap.add_argument("--work", default=None, help="scratch directory (default: a new one under the temp directory)")
    opts = ap.parse_args(argv)
    opts.device = opts.device or ("cpu" if opts.cpu_dry_run else "cuda:0")
    if opts.device == "cuda":
        opts.device = "cuda:0"  # an explicit index for every CUDA call
    opts.models = opts.models or (["tiny"] if opts.cpu_dry_run else list(MODELS))
    opts.systems = opts.systems or (["parallel", "staged", "direct"] if opts.cpu_dry_run
                                    else ["parallel", "staged", "direct", "mcore"])
    return opts


def main(argv: list[str] | None = None) -> int:
    """Run the chosen steps in order within the budget, always write the report; 0 when the check passed."""
    opts = parse_args(argv)
    clock = Clock(opts.budget)
    own_work = opts.work is None
    opts.work = tempfile.mkdtemp(prefix="tenplex-gpu-check-") if own_work else opts.work
    os.makedirs(opts.work, exist_ok=True)
    opts.site = None
    report: dict[str, Any] = {"version": REPORT_VERSION, "mode": "cpu-dry-run" if opts.cpu_dry_run else "gpu",
                              "device": opts.device, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "budget_s": opts.budget, "argv": sys.argv[1:] if argv is None else argv, "steps": {}}
    steps: dict[str, Callable[[argparse.Namespace, Clock], dict[str, Any]]] = {
        "env": step_env, "pytest": step_pytest, "identity": lambda o, c: step_torch("identity", o, c),
        "snapshot": lambda o, c: step_torch("snapshot", o, c), "resume": step_resume, "mlm": step_mlm,
        "bench": step_bench}
    try:
        for name in STEPS:
            if name not in opts.steps:
                continue
            t0 = time.monotonic()
            if name != "wheels" and clock.left() < 5:
                result = {"status": "not run", "why": "the budget is spent"}
            else:
                try:
                    result = wheels_step(opts) if name == "wheels" else steps[name](opts, clock)
                except Exception as e:  # the check's own failure: reported, the next steps still run
                    result = {"status": "fail", "why": f"{type(e).__name__}: {e}"}
            result.setdefault("seconds", time.monotonic() - t0)
            report["steps"][name] = result
            print(f"gpu_check: {name}: {result['status']} ({result['seconds']:.0f} s)"
                  + (f": {result['why']}" if result.get("why") else ""), flush=True)
            if name in ("wheels", "env") and result["status"] == "fail":
                break  # nothing after it can run
    finally:
        bad = {"fail", "timeout"} if opts.cpu_dry_run else {"fail", "timeout", "skip", "not run"}
        report["seconds"] = time.monotonic() - clock.start
        report["ok"] = bool(report["steps"]) and not any(s["status"] in bad for s in report["steps"].values()) and \
            all(n in report["steps"] for n in opts.steps)
        paths = write_report(report, opts.outdir, opts.work)
        if own_work:
            shutil.rmtree(opts.work, ignore_errors=True)
    print(open(paths[1]).read(), end="")
    print(f"gpu_check: {'PASS' if report['ok'] else 'FAIL'}; report in {', '.join(paths)}")
    return 0 if report["ok"] else 1


def wheels_step(opts: argparse.Namespace) -> dict[str, Any]:
    """Install the carried wheels (not in a dry run: it uses this Python's own packages) and put them first on
    every step's path."""
    if opts.cpu_dry_run and not opts.install_wheels:
        return {"status": "skip", "why": "a dry run uses this Python's own packages (unless --install-wheels)"}
    target = os.path.join(opts.work, "site")
    result = install_wheels(opts.wheels, target)
    if result["installed"]:
        opts.site = target
    result["status"] = "fail" if result["missing"] else "pass"
    if result["missing"]:
        result["why"] = (f"missing {', '.join(result['missing'])}: carry their wheels in {opts.wheels} "
                         "(see scripts/gpu_check.sh)")
    return result


if __name__ == "__main__":
    sys.exit(main())
