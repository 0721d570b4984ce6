"""The launcher of jobs that survive losing ranks in place (``--tenplex-inprocess``): one node's ranks, with the
job's stores served outside every rank.

    python -m tenplex_megatron.frontdoor.launch --nproc-per-node 4 scripts/pretrain_gpt.py ... --tenplex-inprocess
    # several nodes: one launcher per node, the first one serving the stores
    python -m tenplex_megatron.frontdoor.launch --nnodes 2 --node-rank R --master-addr NODE0 --nproc-per-node 4 ...

With ``--reform`` the job re-forms in place on plan, without NVRx (``training/reform.py``): a launcher started
later with ``--join`` (against node 0's stores) adds its ranks at the next iteration boundary, and SIGTERM to a
launcher other than node 0's makes the job continue without its ranks (they exit 0 there; they ignore SIGTERM
themselves, so that Slurm's, which reaches every process of an srun step, leaves the job too); SIGTERM to node 0's
launcher, which serves the stores, stops the whole job on notice as without ``--reform``.

    python -m tenplex_megatron.frontdoor.launch --reform --nproc-per-node 2 scripts/pretrain_gpt.py ... --tenplex-memory M0
    python -m tenplex_megatron.frontdoor.launch --join --node-rank 1 --master-addr NODE0 --nproc-per-node 2 ...

The first node's launcher (``--node-rank 0``) serves two TCP stores: the job's, on ``--master-port`` (every
restart's process group is made on a prefix of it), and NVIDIA Resiliency Extension's, on the next port. Every
launcher starts its node's ranks (global ranks from ``node-rank x nproc-per-node``) with torchrun's environment
variables plus ``TENPLEX_INPROCESS_STORE`` and, unlike torchrun, lets the others run on when one exits: NVRx's
wrapper in each rank decides who continues. The ranks take the job's checkpoint leases in their launcher's name
(it outlives every rank: ``frontdoor/inprocess_lease.py``); a rank that exits 3, fenced because another job took a
directory over, ends the job on its node: the node's other ranks are ended too. It prints its own and each rank's
process id at the start and each rank's exit status at the end, and exits 0 when every rank that exited on its own
exited 0 and at least one did (ranks ended by a signal are the faults the job survived), else with the first
failure's status. The stores live as long as the first node's launcher: the job continues in place after losing
any rank or any other node. ``srun``-ed one per node (docs/slurm.md), its ``--nnodes``, ``--node-rank`` and
``--master-addr`` are checked against the Slurm step at its start (``frontdoor/slurm.py``: one line, exit 2).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

from tenplex_megatron.frontdoor import slurm
from tenplex_megatron.frontdoor.inprocess import NVRX_STORE_OFFSET, STORE_ENV
from tenplex_megatron.frontdoor.lease_flags import FENCED_EXIT
from tenplex_megatron.frontdoor.membership import LEAVES_ENV, REFORM_ENV, Membership, member_id


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tenplex_megatron.frontdoor.launch", description=__doc__.split("\n\n")[0].replace("\n", " "),
                                allow_abbrev=False)
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks to start on this node")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (one launcher each; the same on every node)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (0: the one serving the stores)")
    p.add_argument("--master-addr", default="127.0.0.1", help="the first node's address (where the stores are)")
    p.add_argument("--master-port", type=int, default=29500, help="the job's store (NVRx's store: the next port)")
    p.add_argument("--timeout", type=float, default=None, help="end every rank still running after this many seconds")
    p.add_argument("--reform", action="store_true",
                   help="re-form in place on plan, without NVRx: newcomers join (--join), and SIGTERM to a launcher "
                        "makes the job continue without its ranks (they exit 0 at the next iteration boundary)")
    p.add_argument("--join", action="store_true",
                   help="join a running --reform job (its stores at --master-addr:--master-port): this node's ranks "
                        "register and train from the next re-form on")
    p.add_argument("script", help="the training script (run with this interpreter)")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.nproc_per_node < 1:
        p.error(f"--nproc-per-node must be >= 1, got {a.nproc_per_node}")
    a.reform = a.reform or a.join
    if not a.join and (a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes):
        p.error(f"--node-rank must be in [0, --nnodes) and --nnodes >= 1, got --node-rank {a.node_rank} --nnodes "
                f"{a.nnodes}")
    try:  # in an srun step: the options against the allocation (a rendezvous that never forms, otherwise)
        problems = slurm.inplace_problems(os.environ, a.nnodes, a.node_rank, a.master_addr, a.join)
    except slurm.SlurmLaunchError as e:
        problems = [str(e)]
    if problems:
        p.error("; ".join(problems))
    return a


def serve_stores(addr: str, port: int) -> list[object]:
    """The job's store and NVRx's, served by this process for as long as it lives."""
    import torch.distributed as dist

    return [dist.TCPStore(addr, p, None, True, timeout=timedelta(seconds=300), wait_for_workers=False,
                          use_libuv=True) for p in (port, port + NVRX_STORE_OFFSET)]


def rank_env(a: argparse.Namespace, local: int) -> dict[str, str]:
    """torchrun's variables for this node's ``local``-th rank, plus where the stores are."""
    n = a.nproc_per_node
    env = dict(os.environ)
    env.setdefault("TORCH_CPP_LOG_LEVEL", "error")  # NVRx polls its store with short waits: each a c10d warning
    return dict(env, RANK=str(a.node_rank * n + local), LOCAL_RANK=str(local), WORLD_SIZE=str(a.nnodes * n),
                LOCAL_WORLD_SIZE=str(n), GROUP_RANK=str(a.node_rank), MASTER_ADDR=a.master_addr,
                MASTER_PORT=str(a.master_port), **{STORE_ENV: f"{a.master_addr}:{a.master_port}"},
                **({REFORM_ENV: "join" if a.join else "run"} if a.reform else {}),
                **({LEAVES_ENV: "1"} if leaves_on_sigterm(a) else {}))


def leaves_on_sigterm(a: argparse.Namespace) -> bool:
    """``--reform`` on a node that does not serve the stores: SIGTERM means this node's ranks leave the job."""
    return a.reform and (a.join or a.node_rank != 0)


def exit_status(codes: list[int | None]) -> int:
    """0 when every rank that exited on its own exited 0 and one did; else the first failure's status."""
    failed = [c for c in codes if c is not None and c > 0]
    if failed:
        return failed[0]
    return 0 if any(c == 0 for c in codes) else 1


def job_store(a: argparse.Namespace) -> object:
    """A client of the job's store (node 0's launcher serves it)."""
    import torch.distributed as dist

    return dist.TCPStore(a.master_addr, a.master_port, None, False, timeout=timedelta(seconds=60),
                         wait_for_workers=False, use_libuv=True)


def notice_leave(a: argparse.Namespace, procs: list[subprocess.Popen]) -> None:
    """``--reform``: this node's running ranks leave the job at its next iteration boundary (a notice in the job's
    store)."""
    ids = [member_id(p.pid) for p in procs if p.poll() is None]
    Membership(job_store(a)).notice_leave(ids)
    print(f"> tenplex launch: SIGTERM: ranks {' '.join(ids)} leave the job at its next iteration boundary", flush=True)


def _end_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()


def watch(a: argparse.Namespace, procs: list[subprocess.Popen], first: int, notices: list[int]) -> None:
    """Until every rank exited: end them at ``--timeout`` or when one is fenced; with ``--reform``, a SIGTERM
    recorded in ``notices`` is turned into a leave notice (once)."""
    deadline = None if a.timeout is None else time.monotonic() + a.timeout
    noticed = False
    while any(p.poll() is None for p in procs):
        if deadline is not None and time.monotonic() > deadline:
            print(f"> tenplex launch: --timeout {a.timeout:g} s reached: ending the ranks left", flush=True)
            return _end_all(procs)
        fenced = [first + r for r, p in enumerate(procs) if p.poll() == FENCED_EXIT]
        if fenced:
            print(f"> tenplex launch: rank {fenced[0]} exited {FENCED_EXIT} (fenced: another job owns a checkpoint "
                  "directory): ending the ranks left", flush=True)
            return _end_all(procs)
        if notices and not noticed:
            noticed = True
            notice_leave(a, procs)
        time.sleep(0.2)
    return None


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    stores = serve_stores(a.master_addr, a.master_port) if a.node_rank == 0 and not a.join else []
    first = a.node_rank * a.nproc_per_node
    if leaves_on_sigterm(a):  # the ranks inherit it: Slurm's SIGTERM reaches every process of a step, and here it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # means that this node leaves (the notice: this launcher's)
    procs = [subprocess.Popen([sys.executable, a.script, *a.script_args], env=rank_env(a, r))
             for r in range(a.nproc_per_node)]
    print(f"> tenplex launch: ranks started, pids {' '.join(f'{first + r}:{p.pid}' for r, p in enumerate(procs))}; "
          f"stores on {a.master_addr}:{a.master_port} and :{a.master_port + NVRX_STORE_OFFSET}"
          f"{'' if stores else ' (served by node 0)'}; launcher pid {os.getpid()}"
          f"{' (joining)' if a.join else ''}", flush=True)
    notices: list[int] = []
    serving = bool(stores)
    if a.reform:  # a leave by command (tenplex-megatron leave --node-rank R) finds this node's ranks by it
        Membership(stores[0] if serving else job_store(a)).name_node(a.node_rank, [member_id(p.pid) for p in procs],
                                                                     serving)

    def forward(sig: int, _f: object) -> None:
        if sig == signal.SIGTERM and a.reform and not serving and not notices:  # node 0 serves the stores: the
            notices.append(sig)  # job stops on notice; another node's ranks leave (the notice written by the loop)
            return
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        watch(a, procs, first, notices)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    codes = [p.wait() for p in procs]
    print(f"> tenplex launch: exit statuses {' '.join(f'{first + r}:{c}' for r, c in enumerate(codes))}", flush=True)
    del stores
    return exit_status(codes)


if __name__ == "__main__":
    sys.exit(main())
