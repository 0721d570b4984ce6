"""Test support: launch scripts/pretrain_gpt.py under torchrun and read checkpoints independently.

The checkpoint reader here uses safetensors' own ``safe_open`` and plain
tensor indexing, not the project's planner or executor, so comparisons made
with it are an independent oracle.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psutil
import torch

from tenplex_megatron.storage.safetensors_io import SafetensorsReader, crc32

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(ROOT, "scripts", "pretrain_gpt.py")
# The PYTHONPATH of the processes the tests start: the checkout, and tests/site, whose sitecustomize defers
# megatron-core's torch.compile decorations to their first call (~3 s CPU less per process importing megatron.core);
# then TENPLEX_TEST_NVRX_PATH, where given: another nvidia-resiliency-ext than the venv's, its wheel unpacked with
# what it imports (docs/elastic.md: 0.7.0's pure-Python inprocess on Python 3.11), ahead of site-packages.
NVRX_PATH_ENV = "TENPLEX_TEST_NVRX_PATH"
CHILD_PYTHONPATH = os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "site"),
                                    *filter(None, os.environ.get(NVRX_PATH_ENV, "").split(os.pathsep))])

TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--make-vocab-size-divisible-by", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4",
    "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--mock-data", "--tenplex", "--log-interval", "1",
]


@dataclass(frozen=True)
class Run:
    returncode: int
    log: str


# torchrun's agent, with the script's modules imported once in it: ``--run-path`` (torchrun's own option: each
# worker runs the script with runpy) and ``--start-method fork`` make every rank a fork of that agent instead of a
# fresh interpreter importing torch and megatron-core again (~3 s CPU per rank; most of a tiny test job's cost).
# The workers are still separate processes in one gloo process group under torchrun's elastic agent and c10d
# rendezvous. The plain command line (one interpreter per rank) is what the demo, the benchmarks, the elastic,
# signal, fault and node tests and the installed-wheel test launch.
_FORK_AGENT = ("import runpy, sys, torch.distributed.run as r; a = r.parse_args(sys.argv[1:]); "
               "runpy.run_path(a.training_script, run_name='__preload__'); r.main(sys.argv[1:])")


def torchrun_cmd(nproc: int, script: str, args: list[str], python: str | None = None,
                 rdzv: Sequence[str] = ("--standalone",)) -> list[str]:
    """The command line of a torchrun launch of ``script`` with workers forked from a preloaded agent (``python``:
    another venv's interpreter, e.g. another megatron-core's; default this one; ``rdzv``: the rendezvous flags,
    standalone by default)."""
    script = os.path.abspath(script)
    return [python or sys.executable, "-c", _FORK_AGENT, "--run-path", "--start-method", "fork", "--nproc_per_node",
            str(nproc), *rdzv, script, *args]


def _signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid`` and every process under it now (the tree read at the call)."""
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)


def run_logged(cmd: list[str], env: dict[str, str], timeout: float) -> Run:
    """Run ``cmd``; its log is its stdout, then its stderr. Past ``timeout``: every Python process under it prints
    its threads' stacks into the log (tests/site/sitecustomize.py registers faulthandler on SIGUSR1), then the whole
    tree is killed, so that a hang names where it waits and leaves no rank behind."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_tree(p.pid, signal.SIGUSR1)
            time.sleep(3)  # the stacks written
            _signal_tree(p.pid, signal.SIGKILL)
            p.wait()
            rc = 124
        out.seek(0)
        err.seek(0)
        return Run(rc, out.read() + err.read() + ("\nTIMEOUT" if rc == 124 else ""))


def torchrun(nproc: int, args: list[str], timeout: float = 240, script: str = PRETRAIN,
             python: str | None = None, rdzv: Sequence[str] = ("--standalone",)) -> Run:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=CHILD_PYTHONPATH, PYTHONUNBUFFERED="1")
    return run_logged(torchrun_cmd(nproc, script, args, python, rdzv), env, timeout)


def kill_groups(procs: Sequence[subprocess.Popen]) -> None:
    """SIGKILL the process group of every launcher of ``procs`` still running (started with its own session), and
    reap it: what a test that ran several launchers leaves behind, whatever happened."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def layout_flags(tp: int, pp: int, vpp: int = 1) -> list[str]:
    """Megatron-LM's layout flags; ``vpp`` > 1: the interleaved schedule with that many model chunks per rank."""
    flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    return flags + (["--num-virtual-stages-per-pipeline-rank", str(vpp)] if vpp > 1 else [])


def metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_full_tensors(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a tenplex checkpoint at full (global) size, assembled with safetensors' reader."""
    from safetensors import safe_open

    with open(os.path.join(ckpt_dir, "metadata.json")) as f:
        meta = json.load(f)
    dtypes = {t["key"]: getattr(torch, t["dtype"]) for t in meta["ptc"]["tensors"]}
    full = {t["key"]: torch.full(t["shape"], float("nan"), dtype=torch.float64) for t in meta["ptc"]["tensors"]}
    handles = {}
    for c in meta["ptc"]["chunks"]:
        fname = c["at"]["file"]
        if fname not in handles:
            handles[fname] = safe_open(os.path.join(ckpt_dir, fname), framework="pt")
        data = handles[fname].get_tensor(c["at"]["name"]).to(torch.float64).reshape(-1)
        box = tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["shape"]))
        region = full[c["key"]][box].clone().reshape(-1)
        a, b = c.get("flat", [0, region.numel()])
        assert data.numel() == b - a
        region[a:b] = data
        full[c["key"]][box] = region.reshape(c["shape"])
    return {k: v.to(dtypes[k]) if not torch.isnan(v).any() else v for k, v in full.items()}


def stored_chunks(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Raw stored chunks by (file, name), read with safetensors."""
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(ckpt_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(ckpt_dir, name), framework="pt") as f:
                for k in f.keys():
                    out[f"{name}:{k}"] = f.get_tensor(k)
    return out


def flip(path: str) -> None:
    """Flip one byte of a rank file's last tensor (its data ends the file): a silent corruption."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))


def rewrite_metadata(ckpt_dir: str, edit: Callable[[dict], None]) -> None:
    """Apply ``edit`` to a checkpoint's metadata.json in place (crafting damaged or old-format checkpoints)."""
    path = os.path.join(ckpt_dir, "metadata.json")
    with open(path) as f:
        meta = json.load(f)
    edit(meta)
    with open(path, "w") as f:
        json.dump(meta, f)


def downgrade_to_format_1(ckpt_dir: str) -> None:
    """Rewrite a checkpoint's metadata as format 1 wrote it: one CRC-32 per stored tensor, no block sums."""
    def to_v1(meta: dict) -> None:
        meta["format_version"] = 1
        for c in meta["ptc"]["chunks"]:
            at = c["at"]
            reader = SafetensorsReader(os.path.join(ckpt_dir, at["file"]))
            at["crc32"] = crc32(reader.flat(at["name"]))
            reader.close()
            del at["block_bytes"], at["block_crc32"]

    rewrite_metadata(ckpt_dir, to_v1)


SCENARIO_RUN = os.path.join(ROOT, "tests", "multiproc", "scenario_run.py")


def run_scenarios(nproc: int, tasks: list[dict], workdir: str, timeout: float | None = None) -> dict[str, Run]:
    """Run ``pretrain_gpt.py`` jobs ``[{"name", "flags", "fault"?}, ...]`` in turn in one torchrun launch
    (tests/multiproc/scenario_run.py) and return each job's ``Run`` as its own launch would have given it:
    the exit status (the same on every rank, else 99) and rank 0's output ending in the error it raised.
    A failed or hung launch raises AssertionError with its log."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "tasks.json")
    with open(path, "w") as f:
        json.dump(tasks, f)
    r = torchrun(nproc, [path, workdir], timeout=timeout or 180 + 40 * len(tasks), script=SCENARIO_RUN)
    if r.returncode != 0 or f"task {len(tasks)}/{len(tasks)}" not in r.log:
        ended = []  # a job that failed on some ranks only leaves the others waiting: say which ended where, and how
        for t in tasks:
            for rank in range(nproc):
                p = os.path.join(workdir, f"{t['name']}.rank{rank}.json")
                if os.path.exists(p):
                    with open(p) as f:
                        ended.append(f"{t['name']} rank {rank}: {json.load(f)['error'] or 'ok'}")
        raise AssertionError(f"scenario launch of {len(tasks)} jobs in {workdir} failed; jobs ended: {ended}\n"
                             f"{r.log[-6000:]}")
    out = {}
    for t in tasks:
        ranks = []
        for rank in range(nproc):
            with open(os.path.join(workdir, f"{t['name']}.rank{rank}.json")) as f:
                ranks.append(json.load(f))
        codes = {x["code"] for x in ranks}
        log = ranks[0]["log"] if len(codes) == 1 else "\n".join(f"rank {i}: exit status {x['code']}\n{x['log']}"
                                                                 for i, x in enumerate(ranks))
        out[t["name"]] = Run(codes.pop() if len(codes) == 1 else 99, log)
    return out
