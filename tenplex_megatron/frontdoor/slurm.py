"""Slurm at a job's start: a launch or a global batch that disagrees with the allocation is one line naming the Slurm
variable or the flag, before training starts, instead of a rendezvous that waits for nodes that never come.

Two callers, the same pure functions over an environment mapping:

- the reference trainer's start-up (``training/pretrain.py``), what reaches a worker: torchrun formed fewer or more
  nodes than the srun step launched torchruns (``--nnodes``), and a global batch no layout of the allocation holds
  (a requeue or resubmission at another node count);
- ``python -m tenplex_megatron.frontdoor.slurm torchrun ARGS...`` (torchrun's command line, checked, then run as
  given), what torchrun itself would wait on for minutes before any worker starts: ``--nnodes`` against the step's
  node count, ``--node-rank`` against the node's ``SLURM_NODEID`` (expanded in the batch shell it is 0 everywhere),
  and a head node (``--master-addr``, ``--rdzv-endpoint``) that does not resolve. Its torchrun agent ignores
  SIGTERM (Slurm's notice reaches every process of the step): the workers save on it and exit 0, and so does the
  agent, with no 30-s grace of torch's to cut a long save short.
- the in-place launcher (``frontdoor/launch.py``) srun-ed one per node: the same ``--nnodes``, ``--node-rank`` and
  head-node checks (:func:`inplace_problems`), in an srun step only.

Without ``SLURM_JOB_ID`` nothing is checked.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tenplex_megatron.errors import TenplexError

PROG = "python -m tenplex_megatron.frontdoor.slurm"
HEAD_HINT = 'take it from scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1'
#: torchrun's options that take no value (every other option of torchrun's takes one)
TORCHRUN_SWITCHES = frozenset({"--standalone", "--run-path", "--run_path", "--no-python", "--no_python",
                               "--virtual-local-rank", "--virtual_local_rank", "-h", "--help"})
TORCHRUN_MODULE = frozenset({"-m", "--module"})  # the next word is the training module: torchrun's own options end
#: the torchrun options read here, by each spelling torchrun accepts
TORCHRUN_READ = MappingProxyType({
    "--nnodes": "nnodes", "--node-rank": "node_rank", "--node_rank": "node_rank",
    "--master-addr": "master_addr", "--master_addr": "master_addr",
    "--rdzv-endpoint": "rdzv_endpoint", "--rdzv_endpoint": "rdzv_endpoint",
    "--rdzv-backend": "rdzv_backend", "--rdzv_backend": "rdzv_backend",
    "--max-restarts": "max_restarts", "--max_restarts": "max_restarts",
    "--signals-to-handle": "signals", "--signals_to_handle": "signals"})
#: the signals torchrun's agent handles when it leaves SIGTERM to its workers (torch's default list, less SIGTERM)
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"
#: set for a worker whose agent was started ignoring SIGTERM: the worker takes SIGTERM's default back
#: (``engine/orphan.py``), so only the agent ignores it
SIGTERM_ENV = "TENPLEX_AGENT_IGNORES_SIGTERM"


class SlurmLaunchError(TenplexError, ValueError):
    """A Slurm variable that is not what Slurm sets (a number that is not one), named with its value."""


@dataclass(frozen=True)
class Allocation:
    """What Slurm says about this process's allocation and step (``SLURM_*``)."""

    job_id: str
    nodes: int  # SLURM_NNODES: the step's nodes inside srun, the job's in the batch script
    node_id: int  # SLURM_NODEID: this node's index among them
    task: int  # SLURM_PROCID: this task's rank in the step
    step_tasks: int | None  # SLURM_STEP_NUM_TASKS: the tasks (here: torchruns) of this srun step; None outside srun
    nodelist: str  # SLURM_JOB_NODELIST
    restart_count: int  # SLURM_RESTART_COUNT: 0, then 1, 2... for each requeue of the same job

    @property
    def launchers(self) -> int:
        """How many launchers (torchruns) the step started: one per task in an srun step, else one per node."""
        return self.step_tasks if self.step_tasks is not None else self.nodes

    def where(self) -> str:
        """The allocation in a few words for an error line."""
        return f"Slurm job {self.job_id} (SLURM_NNODES={self.nodes}, SLURM_JOB_NODELIST={self.nodelist})"


def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    """``env[name]`` as an integer (``default`` where unset), refused naming the variable where it is not one."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SlurmLaunchError(f"{name}={raw!r} is not a number (Slurm sets it to one)") from None


def allocation(env: Mapping[str, str]) -> Allocation | None:
    """This process's Slurm allocation; None outside Slurm (no ``SLURM_JOB_ID``)."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    nodes = _int(env, "SLURM_NNODES", None) or _int(env, "SLURM_JOB_NUM_NODES", 1) or 1
    in_step = env.get("SLURM_STEP_ID") not in (None, "", "batch", "extern")
    return Allocation(job, nodes, _int(env, "SLURM_NODEID", 0) or 0, _int(env, "SLURM_PROCID", 0) or 0,
                      _int(env, "SLURM_STEP_NUM_TASKS", None) if in_step else None,
                      env.get("SLURM_JOB_NODELIST", "?"), _int(env, "SLURM_RESTART_COUNT", 0) or 0)


def _launchers_text(alloc: Allocation, who: str = "torchrun") -> str:
    """The step's launchers, named by the variable a batch script passes as ``--nnodes``."""
    if alloc.launchers == alloc.nodes:
        return f"SLURM_NNODES={alloc.nodes} node(s), one {who} each"
    return f"SLURM_STEP_NUM_TASKS={alloc.launchers} {who}s on SLURM_NNODES={alloc.nodes} node(s)"


def nnodes_problem(alloc: Allocation, nnodes: str, who: str = "torchrun") -> str | None:
    """``who``'s ``--nnodes`` (``N`` or ``MIN:MAX``) against the launchers the allocation runs; None when they
    agree."""
    lo, _, hi = str(nnodes).partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        return f"{who} --nnodes {nnodes!r} is not N or MIN:MAX"
    if low <= alloc.launchers <= high:
        return None
    return (f"{who} --nnodes {nnodes} disagrees with {alloc.where()}: {_launchers_text(alloc, who)}; pass "
            '--nnodes "$SLURM_NNODES" (a node count the batch script hard-codes waits for nodes that never come)')


def node_rank_problem(alloc: Allocation, node_rank: str, who: str = "torchrun") -> str | None:
    """``who``'s static ``--node-rank`` against this task's rank in the step (``SLURM_NODEID`` at one per node)."""
    try:
        rank = int(node_rank)
    except ValueError:
        return f"{who} --node-rank {node_rank!r} is not a number"
    if rank == alloc.task:
        return None
    return (f"{who} --node-rank {rank} on the node of SLURM_NODEID={alloc.node_id} (task SLURM_PROCID="
            f"{alloc.task} of {alloc.where()}): pass --node-rank \"$SLURM_NODEID\" expanded on each node, inside "
            "the srun step (srun bash -c '... --node-rank \"$SLURM_NODEID\" ...'), not in the batch shell")


def head_problem(flag: str, host: str, resolve: Callable[[str], Any] | None = None,
                 who: str = "torchrun") -> str | None:
    """A head node (``--master-addr``, ``--rdzv-endpoint``'s host) that does not resolve; None when it does."""
    try:
        (resolve or _resolve)(host)
    except (OSError, UnicodeError) as e:
        return f"{who} {flag} {host!r}: the head node does not resolve ({e}); {HEAD_HINT}"
    return None


def inplace_problems(env: Mapping[str, str], nnodes: int, node_rank: int, master_addr: str, join: bool,
                     resolve: Callable[[str], Any] | None = None) -> list[str]:
    """The in-place launcher's (``frontdoor.launch``) options in an srun step, one line each: ``--nnodes`` and
    ``--node-rank`` against the step (not for ``--join``: a joining step adds nodes), the head node resolvable.
    Outside an srun step (no Slurm, or the batch shell) nothing is checked."""
    alloc = allocation(env)
    if alloc is None or alloc.step_tasks is None:
        return []
    who = "launcher"
    problems = [] if join else [nnodes_problem(alloc, str(nnodes), who), node_rank_problem(alloc, str(node_rank), who)]
    problems.append(head_problem("--master-addr", master_addr, resolve, who))
    return [p for p in problems if p]


def _resolve(host: str) -> Any:
    return socket.getaddrinfo(host, None)


def endpoint_host(endpoint: str) -> str:
    """The host of a ``HOST[:PORT]`` rendezvous endpoint (``[IPv6]:PORT`` too)."""
    if endpoint.startswith("["):
        return endpoint[1:].split("]", 1)[0]
    return endpoint.rsplit(":", 1)[0] if endpoint.count(":") == 1 else endpoint


def torchrun_options(argv: Sequence[str]) -> dict[str, str]:
    """The options of torchrun's command line (``argv``: its words after the program) read here, up to the training
    script or module (what follows is the script's own)."""
    found: dict[str, str] = {}
    i = 0
    while i < len(argv):
        word = argv[i]
        if not word.startswith("-") or word in TORCHRUN_MODULE:
            break
        name, eq, value = word.partition("=")
        if name in TORCHRUN_SWITCHES:
            if name == "--standalone":
                found["standalone"] = "1"
            i += 1
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
            i += 1
        if name in TORCHRUN_READ:
            found[TORCHRUN_READ[name]] = value
        i += 1
    return found


def launch_problems(env: Mapping[str, str], argv: Sequence[str],
                    resolve: Callable[[str], Any] | None = None) -> list[str]:
    """What is wrong with torchrun's command line ``argv`` in this Slurm allocation, one line each (none outside
    Slurm)."""
    alloc = allocation(env)
    if alloc is None:
        return []
    opts = torchrun_options(argv)
    problems = []
    if "nnodes" in opts and "standalone" not in opts:
        problems.append(nnodes_problem(alloc, opts["nnodes"]))
    static = opts.get("rdzv_backend", "static") == "static" and "rdzv_endpoint" not in opts
    if static and "node_rank" in opts and "standalone" not in opts:
        problems.append(node_rank_problem(alloc, opts["node_rank"]))
    if "master_addr" in opts and static:
        problems.append(head_problem("--master-addr", opts["master_addr"], resolve))
    if "rdzv_endpoint" in opts:
        problems.append(head_problem("--rdzv-endpoint", endpoint_host(opts["rdzv_endpoint"]), resolve))
    return [p for p in problems if p]


def worker_problem(env: Mapping[str, str]) -> str | None:
    """In a torchrun worker of a Slurm job's first round: torchrun formed another number of nodes (``--nnodes``) than
    the srun step launched torchruns. Later rounds may have lost a node on purpose (an elastic job): not checked."""
    alloc = allocation(env)
    agents = _int(env, "GROUP_WORLD_SIZE", None)
    if alloc is None or agents is None or alloc.step_tasks is None or _int(env, "TORCHELASTIC_RESTART_COUNT", 0):
        return None
    if agents == alloc.launchers:
        return None
    return (f"torchrun formed {agents} node(s) (--nnodes) but {alloc.where()} runs {_launchers_text(alloc)}: pass "
            '--nnodes "$SLURM_NNODES"')


def batch_problem(env: Mapping[str, str], args: Any, choose: Callable[[Any, int, int], Any]) -> str | None:
    """A global batch no layout of this Slurm allocation holds (``args``: the trainer's parsed flags; ``choose(args,
    world, per_node)`` raises TenplexError when no layout holds it), with the node counts that would."""
    alloc = allocation(env)
    if alloc is None:
        return None
    world, per_node = _int(env, "WORLD_SIZE", 1) or 1, _int(env, "LOCAL_WORLD_SIZE", None)
    per_node = per_node or max(world // alloc.nodes, 1)
    reason = _no_layout(args, world, per_node, choose)
    if reason is None:
        return None
    fits = [n for n in range(1, max(2 * alloc.nodes, 8) + 1) if _no_layout(args, n * per_node, per_node, choose) is None]
    return (f"--global-batch-size {args.global_batch_size}: no layout of {alloc.where()} holds it at {per_node} "
            f"process(es) per node (world size {world}): {reason}; node counts that hold it: "
            f"{', '.join(map(str, fits)) or 'none up to ' + str(max(2 * alloc.nodes, 8))}")


def _no_layout(args: Any, world: int, per_node: int, choose: Callable[[Any, int, int], Any]) -> str | None:
    """Why no layout of ``world`` ranks holds ``args``' global batch (the first reason), or None when one does."""
    if getattr(args, "tenplex_layout", None):
        try:
            choose(args, world, per_node)
        except TenplexError as e:  # LayoutError: the first refused candidate stands for the rest
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            return "; ".join(lines[:2])
        return None
    tp, pp = args.tensor_model_parallel_size or 1, args.pipeline_model_parallel_size or 1
    if world % (tp * pp):
        return (f"world size {world} is not divisible by --tensor-model-parallel-size x "
                f"--pipeline-model-parallel-size = {tp} x {pp}")
    dp, mbs = world // (tp * pp), args.micro_batch_size or 1
    if args.global_batch_size % (dp * mbs):
        return f"DP={dp} x --micro-batch-size {mbs} does not divide it"
    return None


def start_problem(env: Mapping[str, str], args: Any, choose: Callable[[Any, int, int], Any]) -> str | None:
    """The reference trainer's start-up check under Slurm (before any process group): one line, or None."""
    return worker_problem(env) or batch_problem(env, args, choose)


def torchrun_words(argv: Sequence[str]) -> list[str] | None:
    """torchrun's own words of a launch command (``torchrun ...`` or ``python -m torch.distributed.run ...``), None
    for another launcher."""
    prog = os.path.basename(argv[0]) if argv else ""
    if prog == "torchrun":
        return list(argv[1:])
    if prog.startswith("python") and list(argv[1:3]) == ["-m", "torch.distributed.run"]:
        return list(argv[3:])
    return None


def leave_sigterm_to_workers(words: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """The environment that makes torchrun's agent ignore SIGTERM and leave it to its workers (empty where that is
    not wanted: restarts asked for, whose stop uses SIGTERM, or signals the user chose). Slurm signals every process
    of a step: an agent that handles SIGTERM shuts its workers down after torch's grace (30 s) and exits 1 with a
    traceback although they saved; ignoring it, the agent exits 0 when they do."""
    opts = torchrun_options(words)
    if opts.get("max_restarts", "0") != "0" or "signals" in opts or "PET_SIGNALS_TO_HANDLE" in env:
        return {}
    return {"PET_SIGNALS_TO_HANDLE": AGENT_SIGNALS, SIGTERM_ENV: "1"}


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """``python -m tenplex_megatron.frontdoor.slurm torchrun ARGS...``: check torchrun's command line against the
    Slurm allocation, then run it as given (exec, its agent leaving SIGTERM to its workers); 2 with one line per
    problem."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if env is None else env
    words = torchrun_words(argv)
    if words is None:
        print(f"usage: {PROG} torchrun [torchrun's options] SCRIPT [its options] (or python -m "
              "torch.distributed.run ...)", file=sys.stderr)
        return 2
    try:
        problems = launch_problems(env, words)
    except SlurmLaunchError as e:
        problems = [str(e)]
    if problems:
        for p in problems:
            print(f"{PROG}: error: {p}", file=sys.stderr)
        return 2
    extra = leave_sigterm_to_workers(words, env)
    if extra:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # kept across exec (a handler would not be)
    sys.stdout.flush()
    os.execvpe(argv[0], argv, {**env, **extra})
    return 0  # not reached: exec replaces this process


if __name__ == "__main__":
    sys.exit(main())
