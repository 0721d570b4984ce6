"""A real local Slurm (``scripts/slurm/start.sh``: munged, slurmctld, two slurmd nodes on this machine) and the batch
scripts of ``docs/slurm.md``, as the Slurm tests and ``benchmarks.slurm`` use them: the cluster started and
stopped, a documented script taken from the page with only its paths and sizes changed, submitted with ``sbatch``,
its job's state followed through ``scontrol`` and its log read back (iterations, losses, the start-up timeline)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START = os.path.join(ROOT, "scripts", "slurm", "start.sh")
STOP = os.path.join(ROOT, "scripts", "slurm", "stop.sh")
PAGE = os.path.join(ROOT, "docs", "slurm.md")
TRAINER = os.path.join(ROOT, "scripts", "pretrain_gpt.py")
SCRIPT_MARK = re.compile(r"<!-- slurm-script: (\S+) -->\n```bash\n(.*?)\n```", re.S)
SIZES_BLOCK = "# the job's paths and sizes"
ITERATION = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \|.*?learning rate: (\S+) \|.*?lm loss: (\S+) \|", re.M)
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED")


class SlurmError(RuntimeError):
    """The local Slurm could not be started, or a job did not do what was waited for (the log's tail attached)."""


def cluster_up() -> bool:
    """Whether a Slurm answers with idle or allocated nodes (``sinfo``)."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(s.strip() in ("idle", "alloc", "mix") for s in out.splitlines())


def start_cluster(timeout: float = 600) -> str:
    """Start the local Slurm (installing its packages where missing); its output, or SlurmError with it."""
    try:
        p = subprocess.run(["bash", START], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise SlurmError(f"{START} did not finish in {timeout:.0f} s: {e.stdout or ''}{e.stderr or ''}") from None
    if p.returncode != 0:
        raise SlurmError(f"{START} failed (exit {p.returncode}):\n{p.stdout}{p.stderr}")
    return p.stdout


def stop_cluster() -> None:
    """Stop what ``start.sh`` started (jobs cancelled first)."""
    subprocess.run(["bash", STOP], capture_output=True, text=True, timeout=300)


def page_scripts(page: str = PAGE) -> dict[str, str]:
    """The batch scripts of ``docs/slurm.md`` by name: each fenced ``bash`` block under a ``slurm-script`` mark."""
    with open(page, encoding="utf-8") as f:
        return {name: body + "\n" for name, body in SCRIPT_MARK.findall(f.read())}


def substitute(script: str, assignments: Mapping[str, str], flags: Mapping[str, str]) -> str:
    """``script`` with only its paths and sizes changed, each where the page has it, exactly once: in the block
    ``# the job's paths and sizes`` the value of each variable of ``assignments`` (the line's comment dropped), and
    in that block's assignments the value after each flag of ``flags``. SlurmError where one is missing."""
    head, mark, rest = script.partition(SIZES_BLOCK + "\n")
    block, sep, tail = rest.partition("\n\n")
    if not mark or not sep:
        raise SlurmError(f"the script has no block {SIZES_BLOCK!r} ending in an empty line")
    lines = block.splitlines()
    for name, value in assignments.items():
        hits = [i for i, line in enumerate(lines) if line.startswith(f"{name}=")]
        if len(hits) != 1:
            raise SlurmError(f"{SIZES_BLOCK}: {name}= found {len(hits)} times, not once")
        lines[hits[0]] = f"{name}={shlex.quote(value)}"
    text = "\n".join(lines)
    for flag, value in flags.items():
        found = re.findall(rf"{re.escape(flag)} \S+", text)
        if len(found) != 1:
            raise SlurmError(f"{SIZES_BLOCK}: {flag} found {len(found)} times, not once")
        text = re.sub(rf"{re.escape(flag)} [^\s\"]+", f"{flag} {value}", text)
    return head + mark + text + sep + tail


def trainer_args(script: str) -> list[str]:
    """The trainer's arguments in a batch script's launch line (the words after ``.../pretrain_gpt.py`` to the end
    of the command), as bash expands them with the script's paths and sizes: what a run without Slurm is given."""
    block = script.partition(SIZES_BLOCK + "\n")[2].partition("\n\n")[0]
    m = re.search(r'"\$TENPLEX/scripts/pretrain_gpt\.py"((?:[^\n]*\\\n)*[^\n]*)', script)
    if m is None:
        raise SlurmError("the script's launch line names no $TENPLEX/scripts/pretrain_gpt.py")
    p = subprocess.run(["bash", "-c", f"{block}\nprintf '%s\\n' {m.group(1)}"], capture_output=True, text=True,
                       timeout=30, env={"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin"})
    if p.returncode != 0:
        raise SlurmError(f"bash could not expand the launch line: {p.stderr}")
    return p.stdout.splitlines()


def job_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """What ``sbatch`` passes its job (Slurm's default ``--export=ALL``): this Python's ``bin`` first on ``PATH``
    (its ``python`` and ``torchrun``), the checkout importable, one thread per rank; no ``SLURM_*`` of a caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "/usr/bin:/bin"),
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "site")]), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def sbatch(script: str, cwd: str, *options: str, env: Mapping[str, str] | None = None) -> str:
    """Submit the batch script file ``script`` from ``cwd`` (its ``%j`` output file lands there); the job id."""
    p = subprocess.run(["sbatch", "--parsable", *options, script], cwd=cwd, capture_output=True, text=True,
                       env=dict(env or job_env()), timeout=60)
    if p.returncode != 0:
        raise SlurmError(f"sbatch {' '.join(options)} {script} failed: {p.stdout}{p.stderr}")
    return p.stdout.strip().split(";")[0]


def job(job_id: str) -> dict[str, str]:
    """``scontrol show job``'s fields of ``job_id`` (JobState, Restarts, NumNodes, ExitCode...)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                         timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for(job_id: str, done: str, timeout: float, log: str | None = None, poll: float = 0.2) -> dict[str, str]:
    """Wait until ``job_id``'s state is ``done`` (``ENDED``: any end); its fields, or SlurmError with the log's
    tail."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = job(job_id)
        state = info.get("JobState", "")
        if state == done or (done == "ENDED" and state in ENDED):
            return info
        time.sleep(poll)
    raise SlurmError(f"job {job_id}: not {done} after {timeout:.0f} s ({job(job_id).get('JobState')}); "
                     f"{log}:\n{tail(log)}")


def wait_for_text(path: str, pattern: str, timeout: float, job_id: str = "") -> re.Match[str]:
    """Wait until the job log ``path`` matches ``pattern``; the match, or SlurmError with the log's tail."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = re.search(pattern, read(path), re.M)
        if m:
            return m
        time.sleep(0.1)
    raise SlurmError(f"job {job_id}: {pattern!r} not in {path} after {timeout:.0f} s "
                     f"({job(job_id).get('JobState') if job_id else ''}):\n{tail(path)}")


def read(path: str | None) -> str:
    """A job log's text ('' before Slurm writes it)."""
    try:
        with open(path or "", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def tail(path: str | None, chars: int = 6000) -> str:
    return read(path)[-chars:]


def iterations(log: str) -> dict[int, tuple[float, float]]:
    """Iteration -> (learning rate, loss) from the trainer's iteration lines in a job log; SlurmError where one
    iteration is logged twice with different values."""
    out: dict[int, tuple[float, float]] = {}
    for it, lr, loss in ITERATION.findall(log):
        got = (float(lr), float(loss))
        if out.setdefault(int(it), got) != got:
            raise SlurmError(f"iteration {it} logged twice: {out[int(it)]} and {got}")
    return out


def timelines(log: str) -> list[dict[str, float]]:
    """The trainer's start-up timelines (``process_start``, ``process_group``, ``first_iteration``) in a log."""
    return [json.loads(m) for m in re.findall(r"> tenplex-megatron: timeline (\{.*\})", log)]
